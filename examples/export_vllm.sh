#!/usr/bin/env bash
# Export a drafter to the layout vLLM's and SGLang's DFlash loaders read, then print the commands that serve it:
#
#   bash examples/export_vllm.sh                              # the drafter examples/train_and_push.sh trained
#   bash examples/export_vllm.sh DRAFTER_DIR [OUT_DIR]
#
# The export runs offline on a CPU. Serving needs vLLM (or SGLang) and a GPU: the commands are printed, not run.
# The engines embed the MASK as a target token (dflash_config.mask_token_id), so the drafter must have been trained
# with `--mask-token-id ID|auto`, as train_and_push.sh does. The shipped checkpoints/smollm2-135m-instruct-dflash owns
# a learned MASK vector instead, and the export refuses it; convert it first with
#   hf-diffspec train kd --init checkpoints/smollm2-135m-instruct-dflash --mask-token-id auto --data ... --out DIR
set -euo pipefail
DRAFTER=${1:-runs/train_and_push/drafter}
OUT=${2:-$DRAFTER-vllm}
TARGET=${TARGET:-HuggingFaceTB/SmolLM2-135M-Instruct}  # the drafter's target, as the engine names it
if [ ! -f "$DRAFTER/config.json" ]; then
    echo "no drafter at $DRAFTER: run examples/train_and_push.sh first, or pass a drafter folder" >&2
    exit 2
fi

hf-diffspec export "$DRAFTER" --format vllm --out "$OUT"
# the engines verify fixed blocks: the anchor plus block_size - 1 drafts
BLOCK=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['block_size'])" "$OUT/config.json")

cat <<EOF

Serve it with vLLM (GPU):
  vllm serve $TARGET \\
      --speculative-config '{"method": "dflash", "model": "$OUT", "num_speculative_tokens": $((BLOCK - 1))}' \\
      --attention-backend flash_attn
or with SGLang (the same folder):
  python -m sglang.launch_server --model-path $TARGET --speculative-algorithm DFLASH \\
      --speculative-draft-model-path $OUT --speculative-num-draft-tokens $BLOCK
EOF
