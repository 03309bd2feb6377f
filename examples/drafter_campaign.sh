#!/usr/bin/env bash
# One-shot drafter campaign for a single GPU machine without network access: the target's own answers at scale,
# then training from the shipped drafter with held-out tau measured on a schedule, then the benchmark that judges
# drafter quality (dflash-block tau, whole block verified). Everything it needs travels in one bundle.
#
#   bash examples/drafter_campaign.sh bundle campaign.tar    # here (PyPI reachable, or the wheels cached)
#   tar xf campaign.tar && cd campaign && bash examples/drafter_campaign.sh run    # there, offline
#   SCALE=tiny DEVICE=cpu bash examples/drafter_campaign.sh run                      # the same steps, minutes, CPU
#
# The bundle: the repository as committed, the PyPI wheels that hold the target's weights and the data (SmolLM2's
# GGUF, ShareGPT, the held-out prompt sets) and the pure-Python wheels of the libraries this project needs beyond
# PyTorch. SmolLM2-135M's smallest exact form, its Q4_1 GGUF wheel, is 93 MB, so the bundle is about 180 MB.
# Results (drafter, heldout_tau.jsonl, curve PNG and table, bench JSON) are written to $RESULTS (default
# runs/campaign) and copied to $OUT when that is set.
set -euo pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "$MODE" in
bundle)
    out=${2:?usage: drafter_campaign.sh bundle OUT.tar}
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/campaign/cache/wheels" "$stage/campaign/wheels"
    git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$stage/campaign"
    # the wheels the runtime reads data from, fetched into (or found in) this machine's cache, then copied
    python - "$stage/campaign/cache/wheels" <<'EOF'
import shutil, sys
from hf_diffspec import prompts, targets
from hf_diffspec.wheels import fetch_wheel
needed = [prompts._HUMANEVAL[0], prompts._MMATH[0], prompts._MTBENCH[0], prompts._SHAREGPT[0],
          *(req for req, _ in targets.BUILTIN_TARGETS["smollm2-135m-instruct"].parts)]
for requirement in needed:
    shutil.copy(fetch_wheel(requirement), sys.argv[1])
EOF
    # the versions installed here, of the pure-Python libraries a GPU image with PyTorch may lack or hold older
    pins=$(python -m pip freeze | grep -i -E '^(transformers|gguf|peft|accelerate|huggingface.hub|tqdm)==')
    python -m pip download -q --no-deps --only-binary=:all: -d "$stage/campaign/wheels" $pins
    tmp="$out.partial"
    tar -cf "$tmp" -C "$stage" campaign
    mv "$tmp" "$out"  # complete, or not there at all
    du -h "$out"
    ;;
run)
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    [ -d "$ROOT/cache/wheels" ] && export HF_DIFFSPEC_CACHE=${HF_DIFFSPEC_CACHE:-$ROOT/cache}
    if ! python -c "import hf_diffspec" 2>/dev/null; then
        python -m pip install -q --no-index --no-deps "$ROOT"/wheels/*.whl
        python -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT"
    fi
    cd "$ROOT"
    DEVICE=${DEVICE:-cuda}
    RESULTS=${RESULTS:-runs/campaign}
    if [ "${SCALE:-gpu}" = tiny ]; then  # a check of every step on a CPU
        PROMPTS=8 GEN_BATCH=8 GEN_TOKENS=32 TRAIN_MIN=0.5 EVERY=2 BATCH=2 ANCHORS=8 BENCH_PROMPTS=1 BENCH_TOKENS=16
        HELDOUT_PROMPTS=1 HELDOUT_TOKENS=16
    else  # ~10 minutes on one H200: ~3 generating, 6 training, the rest measuring
        PROMPTS=16384 GEN_BATCH=1024 GEN_TOKENS=256 TRAIN_MIN=6 EVERY=200 BATCH=16 ANCHORS=256 BENCH_PROMPTS=10
        BENCH_TOKENS=256 HELDOUT_PROMPTS=2 HELDOUT_TOKENS=96
    fi
    mkdir -p "$RESULTS"
    # 1. the target's own greedy answers to ShareGPT prompts (evaluation prompts left out; ~17k exist)
    python examples/sharegpt_prompts.py --num "$PROMPTS" --out "$RESULTS/prompts.jsonl"
    hf-diffspec data generate --source "$RESULTS/prompts.jsonl" --out "$RESULTS/regenerated" \
        --num-samples "$PROMPTS" --max-new-tokens "$GEN_TOKENS" --batch-size "$GEN_BATCH" --device "$DEVICE"
    # 2. from the shipped drafter, MASK as a target token (so the result also runs in DFlash engines), on those answers
    #    and the committed ones; held-out tau every $EVERY steps
    hf-diffspec train kd --init checkpoints/smollm2-135m-instruct-dflash --mask-token-id auto \
        --data "$RESULTS/regenerated" data/regen-smollm2 --out "$RESULTS/drafter" --device "$DEVICE" \
        --batch-size "$BATCH" --num-anchors "$ANCHORS" --max-length 1024 --lr 4e-4 --epochs 100 \
        --time-budget "$TRAIN_MIN" --save_steps "$EVERY" --heldout-tau-steps "$EVERY" \
        --heldout-tau-prompts "$HELDOUT_PROMPTS" --heldout-tau-max-new-tokens "$HELDOUT_TOKENS"
    # the table is written first; a missing PNG says why and stops nothing
    python examples/benchmarks/plot_heldout_tau.py "$RESULTS/drafter" --labels campaign \
        --out "$RESULTS/heldout_tau.png" > "$RESULTS/heldout_tau.md" || true
    cat "$RESULTS/heldout_tau.md"
    # 3. the judgement: tau with the whole block verified, against plain generate, on the held-out prompts
    hf-diffspec bench --drafter "$RESULTS/drafter" --methods ar,dflash-block,dflash --domains code,math,chat \
        --prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_TOKENS" --device "$DEVICE" --json "$RESULTS/bench.json"
    if [ -n "${OUT:-}" ]; then
        for f in drafter/config.json drafter/model.safetensors drafter/heldout_tau.jsonl heldout_tau.png \
                 heldout_tau.md bench.json; do
            [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT"/
        done
    fi
    ;;
*)
    echo "usage: drafter_campaign.sh bundle OUT.tar | run   (see the comment at the top)" >&2
    exit 2
    ;;
esac
