#!/usr/bin/env bash
# The drafter campaign on a CPU machine, in the background, across machines: every stage resumes from what is
# committed (data shards, the campaign's trainer state) and every run extends the same curve.
#
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh data > runs/campaign-data.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh heldout > runs/campaign-heldout.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh features > runs/campaign-features.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_campaign_cpu.sh train > runs/campaign-train.log 2>&1 &
#   bash examples/drafter_campaign_cpu.sh export      # then commit checkpoints/campaign-smollm2
#
# data:    the target's own greedy answers (batched) to the prompts of examples/campaign_prompts.py (ShareGPT's
#          first turns, then the next turn of each conversation answered so far, after the target's own answers),
#          in chunks of $CHUNK prompts not yet answered, one committed shard per chunk (uint16 npz) under
#          data/regen-mix-smollm2: a rerun resumes where the last left.
#          DTYPE (default bfloat16, as the bench decodes) sets the target's dtype; on a CPU without native bf16 (AVX2
#          only) DTYPE=float32 answers ~4x faster (84-89 against ~20 tokens/s for SmolLM2 at 32-96 rows, 2 threads).
#          Each shard's sidecar records its dtype; the features cache and the training labels are fp32 either way.
# heldout: the target's greedy answers, one prompt at a time as the benchmark decodes them, to the held-out prompts
#          (code/math/chat evaluation sets and the unseen families), under data/heldout-smollm2: the sequences the
#          offline acceptance length is measured on. Never trained on.
# features: the target's features and argmax for every training sequence, cached once (fp32, DIR/target-features,
#          not committed: ~11 KiB a token; rebuilt on a new machine, resuming by shard): the train stage then runs no
#          target forward, about half of its step.
# train:   the continuation recipe (below) on the shards written so far (the first $SHARDS of them when set, e.g.
#          SHARDS=8 on a new machine, so that training starts after ~40 minutes of caching features rather than
#          hours; run the features stage beside it for the rest), their features cached first, resumed by step from
#          $RUN/checkpoints on the machine that wrote them (~300 MB a checkpoint, never committed), on the shards it
#          took at its start ($RUN/data: the data stage may go on writing; FEATURES=live: no cache, the target runs in
#          each step, cheaper on a machine that trains less than an epoch), with the offline acceptance length every
#          20 optimizer steps in $RUN/offline_acceptance.jsonl. On a machine without them it continues the committed
#          campaign state ($CAMPAIGN: the drafter the last export left, its step on the cosine and its training
#          tokens; Adam's moments start afresh), else it starts from the shipped drafter. A drafter without a reduced
#          draft vocabulary first gets one of VOCAB tokens (default 16384; 0: the full vocabulary), the most frequent
#          response tokens of the data and of 20,000 ShareGPT answers, same weights (`hf-diffspec convert
#          --reduce-vocab`), kept in $RUN/init: the LM head over 16,384 rows instead of 49,152 makes a step ~2.2x
#          faster (examples/benchmarks/train_step.py) and costs ~0.2% of tau (docs/training-log.md).
# export:  the latest checkpoint of $RUN as the committed campaign state: its weight average in bf16 (~25 MB, a
#          drafter folder that loads like any other), campaign.json (step, training tokens) and the whole curve
#          (offline_acceptance.jsonl: the earlier runs' lines and this run's); written aside, then swapped in.
#          Each export adds ~25 MB to the repository's history: export when the curve has moved or every ~200
#          steps; a machine that keeps $RUN resumes from its own checkpoints without one, but steps on a machine
#          that goes without an export are lost (steps 215-288 were, on 2026-12-04).
#
# Stop a stage with `kill -- -PGID` of its process group (nohup keeps the group of the shell that started it) or
# `kill PID` of its python process; a rerun resumes. Pause it while anything is timed (kill -STOP / -CONT).
#
# THREADS (default 1) caps the threads of each stage, so that stages can share the cores with other work.
set -euo pipefail
STAGE=${1:?usage: drafter_campaign_cpu.sh data|heldout|features|train|export}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
DATA=${DATA:-data/regen-mix-smollm2}
HELDOUT=${HELDOUT:-data/heldout-smollm2}
RUN=${RUN:-runs/campaign}
CAMPAIGN=${CAMPAIGN:-checkpoints/campaign-smollm2}

case "$STAGE" in
data)
    # NUM (default: all) caps the list: every usable ShareGPT first turn (13,822; the first 6,000 were the list until
    # 2026-12-04), then the follow-up turns of the conversations answered so far, each family after its first turns
    NUM=${NUM:-1000000} CHUNK=${CHUNK:-128} GEN_BATCH=${GEN_BATCH:-32} GEN_TOKENS=${GEN_TOKENS:-256}
    DTYPE=${DTYPE:-bfloat16}
    mkdir -p "$DATA"
    # deterministic from the wheel and the shards: rebuilt at every start (prompts.jsonl is not committed), so the
    # turns answered since the last start bring their follow-ups
    python examples/campaign_prompts.py --num "$NUM" --out "$DATA/prompts.jsonl.partial" --exclude-data data/regen-smollm2 \
        --follow-ups "$DATA"
    mv "$DATA/prompts.jsonl.partial" "$DATA/prompts.jsonl"
    python - "$DATA" "$CHUNK" "$GEN_BATCH" "$GEN_TOKENS" "$DTYPE" <<'EOF'
import json
import sys
from pathlib import Path
import torch
from hf_diffspec import load_target
from hf_diffspec.prompts import chat_prompt
from hf_diffspec.trainers.data import record_prompt, write_generated_data

out, chunk, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
max_prompt = 512  # longer prompts leave no room for an answer in a training window
target, tok = load_target("smollm2-135m-instruct", dtype=getattr(torch, sys.argv[5]))
prompts = [json.loads(line) for line in open(f"{out}/prompts.jsonl", encoding="utf-8")]
done = {rid for sidecar in Path(out).glob("shard-*.json") for rid in json.loads(sidecar.read_text())["ids"]}
todo = [p for p in prompts if p["id"] not in done]
fits = [p for p in todo if len(chat_prompt(tok, record_prompt(p), tokenize=True)) <= max_prompt]
print(f"{len(prompts) - len(todo)} of {len(prompts)} prompts answered before, {len(todo) - len(fits)} over "
      f"{max_prompt} tokens, {len(fits)} to go", flush=True)
for start in range(0, len(fits), chunk):  # one shard per chunk: a kill loses at most one chunk
    write_generated_data(target, tok, "smollm2-135m-instruct", out, chunk, max_new_tokens=tokens, batch_size=batch,
                         prompts=fits[start : start + chunk], shard_size=chunk, max_prompt_length=max_prompt)
    print(f"chunk done ({min(start + chunk, len(fits))} of {len(fits)} prompts to go)", flush=True)
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
    # the recipe (issue 29 item 3): 4 sequences x 64 anchors x 8 accumulated = 2,048 blocks per optimizer step,
    # peak lr 1e-4 on one cosine of 2,000 steps across every resume and machine, EMA 0.995, loss over slots 1-8
    TOTAL=2000
    # the shards this run trains on: the first $SHARDS complete ones (default: all written so far), as hard links
    # (the data stage may go on writing); their features are cached first, only those missing (a new machine
    # rebuilds them all, ~4 minutes a shard on one thread: SHARDS bounds that wait, and the features stage can cache
    # the rest beside this run for the next one)
    snapshot=$RUN/data
    rm -rf "$snapshot" && mkdir -p "$snapshot" "$DATA/target-features"
    ln "$DATA/meta.json" "$snapshot/"
    ln -s "$(realpath "$DATA/target-features")" "$snapshot/target-features"
    for sidecar in $(ls "$DATA"/shard-*.json | head -n "${SHARDS:-100000}"); do
        ln "$sidecar" "${sidecar%.json}.npz" "$snapshot/"
    done
    # FEATURES=live runs the target in every step instead: caching costs one target forward per sequence up front
    # (~3 hours for 47 shards on one thread), a live step one per sequence it trains on, so on a machine that trains
    # less than an epoch (~180 steps of 32 sequences) before it goes, live is cheaper
    features=(--cached-features)
    if [ "${FEATURES:-cached}" = live ]; then
        features=()
    else
        hf-diffspec data features "$snapshot" data/regen-smollm2 --drafter checkpoints/smollm2-135m-instruct-dflash \
            --dtype fp32 --features-dtype fp32
    fi
    VOCAB=${VOCAB:-16384}
    init=checkpoints/smollm2-135m-instruct-dflash
    more=(--max_steps "$TOTAL")
    if ls "$RUN"/checkpoints/checkpoint-*/trainer_state.json >/dev/null 2>&1; then
        # this machine's run goes on, to the end of the curve whatever step it started at, from the drafter it
        # started from (its vocabulary is the checkpoints')
        done_before=$(python -c "import sys, torch; from hf_diffspec.trainers.pipeline import last_complete_checkpoint
print(torch.load(last_complete_checkpoint(sys.argv[1]) / 'training_args.bin', weights_only=False).schedule_start)" \
            "$RUN/checkpoints")
        [ -f "$RUN/init/config.json" ] && init=$RUN/init
        more=(--max_steps $((TOTAL - done_before)) --resume)
    else
        if [ -f "$CAMPAIGN/campaign.json" ]; then
            read -r step tokens < <(python -c "import json, sys; c = json.load(open(sys.argv[1]))
print(c['schedule_step'], c['training_tokens'])" "$CAMPAIGN/campaign.json")
            init=$CAMPAIGN
            more=(--max_steps $((TOTAL - step)) --schedule-start "$step" --tokens-seen-start "$tokens")
            # the committed curve is this run's too: its measurements append to it
            mkdir -p "$RUN" && cp "$CAMPAIGN/offline_acceptance.jsonl" "$RUN/offline_acceptance.jsonl"
        fi
        if [ "$VOCAB" != 0 ] && ! grep -q '"draft_vocab_size": [0-9]' "$init/config.json"; then
            # the campaign's draft vocabulary, chosen once: the drafter carries it from then on
            rm -rf "$RUN/init" "$RUN/init.partial"
            hf-diffspec convert "$init" --reduce-vocab "$VOCAB" --data "$DATA" data/regen-smollm2 \
                --sharegpt-responses 20000 --out "$RUN/init.partial"
            mv "$RUN/init.partial" "$RUN/init"
            init=$RUN/init
        fi
    fi
    hf-diffspec train kd --init "$init" "${more[@]}" --data "$snapshot" data/regen-smollm2 \
        --out "$RUN" --batch-size 4 --num-anchors 64 --grad-accum 8 --max-length 512 --lr 1e-4 \
        --schedule-steps "$TOTAL" --warmup_steps 20 --ema-decay 0.995 --loss-depth 8 \
        "${features[@]}" --save_steps 5 --logging_steps 1 --offline-acceptance-steps 20 --offline-acceptance-data "$HELDOUT" \
        --offline-acceptance-sequences 60
    ;;
export)
    python - "$RUN" "$CAMPAIGN" <<'EOF'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.trainers.pipeline import last_complete_checkpoint

run, campaign = Path(sys.argv[1]), Path(sys.argv[2])
checkpoint = last_complete_checkpoint(run / "checkpoints")
if checkpoint is None:
    sys.exit(f"no complete checkpoint under {run}/checkpoints to export")
state = json.loads((checkpoint / "trainer_state.json").read_text())
args = torch.load(checkpoint / "training_args.bin", weights_only=False)
target, _ = load_target("smollm2-135m-instruct", dtype=torch.float32)
drafter = DiffusionDrafter.from_pretrained(checkpoint, target=target)
average = checkpoint / "ema.safetensors"
if average.exists():  # the average is what ships and what the next run continues
    _, unexpected = drafter.load_state_dict(load_file(average), strict=False)
    assert not unexpected, unexpected
aside = campaign.with_name(campaign.name + ".partial")
shutil.rmtree(aside, ignore_errors=True)
drafter.to(torch.bfloat16).save_pretrained(aside)
step = args.schedule_start + state["global_step"]
(aside / "campaign.json").write_text(json.dumps({
    "schedule_step": step, "schedule_steps": args.schedule_steps, "training_tokens": state["num_input_tokens_seen"],
    "from_checkpoint": checkpoint.name, "learning_rate": args.learning_rate, "ema_decay": args.ema_decay}, indent=1))
# the curve: every line measured up to this step (the run's file holds the earlier runs' lines too); a step
# measured twice keeps its last line
lines = {}
for path in (campaign / "offline_acceptance.jsonl", run / "offline_acceptance.jsonl"):
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] <= step:
                lines[record["step"]] = line
(aside / "offline_acceptance.jsonl").write_text("".join(lines[k] + "\n" for k in sorted(lines)))
shutil.rmtree(campaign, ignore_errors=True)
aside.rename(campaign)
print(f"exported step {step} ({state['num_input_tokens_seen']} training tokens) to {campaign}")
EOF
    ;;
*)
    echo "unknown stage $STAGE (data | heldout | features | train | export)" >&2
    exit 2
    ;;
esac
