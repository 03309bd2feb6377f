#!/usr/bin/env bash
# AdaFlash on the shipped SmolLM2 drafter, as run on a 2-core CPU for the numbers in the README:
# the verify-cost profile, target trajectories, the length head (drafter frozen), on-policy distillation, and the
# batch-size benchmark.
#
#   bash examples/adaflash_smollm2.sh
set -euo pipefail
RUNS=${RUNS:-runs}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dflash}

# 1. Measure T_verify(rows, tokens per row) once for this machine/dtype/threads (about a minute).
hf-diffspec profile --skip-if-busy --dtype bf16
# 2. The target's own greedy answers to ShareGPT prompts not used elsewhere: labels for the length head.
hf-diffspec data generate --source sharegpt --out "$RUNS/traj" --num-samples 384 --max-new-tokens 128 \
    --batch-size 16 --skip 7000
# 3. On-policy distillation: one round decodes 128 prompts with the live speculative system, then trains on them with
#    alpha*CE + (1-alpha)*min(reverse KL, clip); its trajectories also serve as length-head data.
hf-diffspec train opd --init "$DRAFTER" --out "$RUNS/opd" --rounds 1 --samples-per-round 128 \
    --gen-max-new-tokens 128 --skip 6000 --batch-size 4 --num-anchors 64 --max-length 512 --epochs 2 --lr 1e-4
# 4. The length head, everything else frozen; labels = the drafter's own drafts against the target.
hf-diffspec train length-head --init "$DRAFTER" --data "$RUNS/opd/round-0/data" "$RUNS/traj" --out "$RUNS/lenhead" \
    --epochs 3 --batch-size 4 --num-anchors 32 --max-length 512
# 5. Per-domain acceptance before/after OPD (whole blocks verified), and throughput against batch size.
hf-diffspec bench --methods dflash-block --drafter "$DRAFTER" --prompts 10 --json "$RUNS/eval_kd.json"
hf-diffspec bench --methods dflash-block --drafter "$RUNS/opd/round-0/drafter" --prompts 10 --json "$RUNS/eval_opd.json"
hf-diffspec bench --drafter "$RUNS/lenhead" --methods ar,dflash-fixed,dflash-block,dflash,adaflash \
    --batch-sizes 1,4,16 --prompts 6 --json "$RUNS/batch_bench.json" --plot "$RUNS/batch_bench.png"
