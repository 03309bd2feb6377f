#!/usr/bin/env bash
# Export a drafter to the layout vLLM's and SGLang's DFlash loaders read, then print the commands that serve it:
#
#   bash examples/export_vllm.sh                              # the drafter examples/train_and_push.sh trained
#   bash examples/export_vllm.sh DRAFTER_DIR [OUT_DIR]
#
# The export runs offline on a CPU. The commands printed serve it on a GPU; on a CPU, vLLM's CPU build serves it too:
# examples/vllm_round_trip.sh does, in a venv of its own. A drafter that learned its own MASK vector (the shipped
# checkpoints/smollm2-135m-instruct-dflash) goes to vLLM as an unused token of the target (picked with the target's
# tokenizer: EXPORT_TARGET, a built-in name or a folder) plus mask_embedding.pt; SGLang has no place for the vector.
set -euo pipefail
DRAFTER=${1:-runs/train_and_push/drafter}
OUT=${2:-$DRAFTER-vllm}
TARGET=${TARGET:-HuggingFaceTB/SmolLM2-135M-Instruct}  # the drafter's target, as the engine names it
if [ ! -f "$DRAFTER/config.json" ]; then
    echo "no drafter at $DRAFTER: run examples/train_and_push.sh first, or pass a drafter folder" >&2
    exit 2
fi

hf-diffspec export "$DRAFTER" --format vllm --out "$OUT" --target "${EXPORT_TARGET:-smollm2-135m-instruct}"
# the engines verify fixed blocks: the anchor plus block_size - 1 drafts
BLOCK=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['block_size'])" "$OUT/config.json")

cat <<EOF

Serve it with vLLM (GPU):
  vllm serve $TARGET \\
      --speculative-config '{"method": "dflash", "model": "$OUT", "num_speculative_tokens": $((BLOCK - 1))}' \\
      --attention-backend flash_attn
or with SGLang (the same folder, where MASK is a target token: no mask_embedding.pt in it):
  python -m sglang.launch_server --model-path $TARGET --speculative-algorithm DFLASH \\
      --speculative-draft-model-path $OUT --speculative-num-draft-tokens $BLOCK
EOF
