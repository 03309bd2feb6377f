#!/usr/bin/env bash
# The drafter campaign on a CPU machine, in the background, across machines: every stage resumes from what is
# committed (data shards, the campaign's trainer state) and every run extends the same curve.
#
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh data > runs/campaign-data.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh heldout > runs/campaign-heldout.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh features > runs/campaign-features.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh train > runs/campaign-train.log 2>&1 &
#
# data:    the target's own greedy answers (batched) to the prompts of examples/campaign_prompts.py, in chunks of
#          $CHUNK prompts, one committed shard per chunk (uint16 npz) under data/regen-mix-smollm2; a rerun skips the
#          ids already written, so it resumes at the first unfinished chunk. DTYPE (default bfloat16, as the bench
#          decodes) sets the target's dtype; on a CPU without native bf16 (AVX2 only) DTYPE=float32 answers ~4x
#          faster (84-89 against ~20 tokens/s for SmolLM2 at 32-96 rows, 2 threads). Each shard's sidecar records its
#          dtype; the features cache and the training labels are fp32 either way.
# heldout: the target's greedy answers, one prompt at a time as the benchmark decodes them, to the held-out prompts
#          (code/math/chat evaluation sets and the unseen families), under data/heldout-smollm2: the sequences the
#          offline acceptance length is measured on. Never trained on.
# features: the target's features and argmax for every training sequence, cached once (fp32, DIR/target-features,
#          not committed: ~11 KiB a token; rebuilt on a new machine, resuming by shard): the train stage then runs no
#          target forward, about half of its step.
# train:   the continuation recipe (below) from the shipped drafter on the shards written so far, resumed by step from
#          $RUN/checkpoints (machine-local: ~300 MB a checkpoint), with the offline acceptance length every 10 optimizer
#          steps in $RUN/offline_acceptance.jsonl. On a machine without those checkpoints it starts again from the
#          shipped drafter on the committed shards: the same recipe, a new curve.
#
# Stop a stage with `kill -- -PGID` of its process group (nohup keeps the group of the shell that started it) or
# `kill PID` of its python process; a rerun resumes. Pause it while anything is timed (kill -STOP / -CONT).
#
# THREADS (default 1) caps the threads of each stage, so that stages can share the cores with other work.
set -euo pipefail
STAGE=${1:?usage: drafter_campaign_cpu.sh data|heldout|features|train}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
DATA=${DATA:-data/regen-mix-smollm2}
HELDOUT=${HELDOUT:-data/heldout-smollm2}

case "$STAGE" in
data)
    NUM=${NUM:-6000} CHUNK=${CHUNK:-128} GEN_BATCH=${GEN_BATCH:-32} GEN_TOKENS=${GEN_TOKENS:-256}
    DTYPE=${DTYPE:-bfloat16}
    mkdir -p "$DATA"
    # deterministic from the wheel: rebuilt on a new machine (prompts.jsonl is not committed)
    [ -f "$DATA/prompts.jsonl" ] || python examples/campaign_prompts.py --num "$NUM" --out "$DATA/prompts.jsonl" \
        --exclude-data data/regen-smollm2
    python - "$DATA" "$CHUNK" "$GEN_BATCH" "$GEN_TOKENS" "$DTYPE" <<'EOF'
import sys
import torch
from hf_diffspec import load_target
from hf_diffspec.prompts import load_prompts_file
from hf_diffspec.trainers.data import write_generated_data

out, chunk, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
target, tok = load_target("smollm2-135m-instruct", dtype=getattr(torch, sys.argv[5]))
prompts = load_prompts_file(f"{out}/prompts.jsonl")
for start in range(0, len(prompts), chunk):  # one shard per chunk: a kill loses at most one chunk
    write_generated_data(target, tok, "smollm2-135m-instruct", out, chunk, max_new_tokens=tokens, batch_size=batch,
                         prompts=prompts[start : start + chunk], shard_size=chunk)
    print(f"chunk {start // chunk} done ({min(start + chunk, len(prompts))} of {len(prompts)} prompts)", flush=True)
EOF
    ;;
heldout)
    PER_DOMAIN=${PER_DOMAIN:-20} GEN_TOKENS=${GEN_TOKENS:-256}
    python - "$HELDOUT" "$PER_DOMAIN" "$GEN_TOKENS" <<'EOF'
import sys
import torch
from hf_diffspec import load_target
from hf_diffspec.prompts import load_prompts_file
from hf_diffspec.trainers.offline_acceptance import heldout_prompts, write_heldout_data

out, per_domain, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
# code, math, chat interleaved: the first 30 sequences are the benchmark's --prompts 10 set
write_heldout_data(target, tok, "smollm2-135m-instruct", out, heldout_prompts(tok, per_domain), tokens)
unseen = load_prompts_file("examples/benchmarks/prompts/unseen_families.jsonl", tokenizer=tok)
write_heldout_data(target, tok, "smollm2-135m-instruct", out.rstrip("/") + "-unseen", unseen, tokens)
EOF
    ;;
features)
    hf-diffspec data features "$DATA" data/regen-smollm2 --drafter checkpoints/smollm2-135m-instruct-dflash \
        --dtype fp32 --features-dtype fp32
    ;;
train)
    RUN=${RUN:-runs/campaign}
    # the recipe (issue 29 item 3): 4 sequences x 64 anchors x 8 accumulated = 2,048 blocks per optimizer step,
    # peak lr 1e-4 on one cosine of 2,000 steps across every resume, EMA 0.995, loss over slots 1-8
    resume=()
    ls "$RUN"/checkpoints/checkpoint-*/trainer_state.json >/dev/null 2>&1 && resume=(--resume)
    hf-diffspec train kd --init checkpoints/smollm2-135m-instruct-dflash --data "$DATA" data/regen-smollm2 \
        --out "$RUN" --batch-size 4 --num-anchors 64 --grad-accum 8 --max-length 512 --lr 1e-4 \
        --schedule-steps 2000 --warmup_steps 20 --max_steps 2000 --ema-decay 0.995 --loss-depth 8 \
        --cached-features --save_steps 5 --logging_steps 1 --offline-acceptance-steps 10 --offline-acceptance-data "$HELDOUT" \
        --offline-acceptance-sequences 60 "${resume[@]}"
    ;;
*)
    echo "unknown stage $STAGE (data | heldout | features | train)" >&2
    exit 2
    ;;
esac
