#!/usr/bin/env bash
# The one command to run when a GPU is lent: the decoding loop on real-shaped random-weight targets, in sections with
# deadlines, each result appended to --results FILE as it comes (see examples/gpu_check.py); TINY=1: tiny configs on
# the CPU (tests/test_examples.py).
# On a lent device machine, carry .device-wheels (`bash examples/device_slim.sh wheels`): the image's transformers is
# older than this project needs (examples/device_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. examples/device_env.sh
device_env .device-wheels
exec python examples/gpu_check.py "$@"
