#!/usr/bin/env bash
# The decoding loop on real-shaped random-weight targets (see examples/gpu_check.py); TINY=1: tiny configs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python examples/gpu_check.py "$@"
