#!/usr/bin/env bash
# Issue 29's diagnostics: is the CPU continuation's lack of progress a recipe problem or a compute limit? Each stage
# runs in the background on a CPU and resumes by step (Trainer checkpoints under runs/diag/...):
#
#   nohup nice -n 19 bash examples/drafter_diagnostics.sh equivalence > runs/diag-equivalence.log 2>&1 &
#   nohup nice -n 19 bash examples/drafter_diagnostics.sh overfit > runs/diag-overfit.log 2>&1 &
#   ARM=high nohup nice -n 19 bash examples/drafter_diagnostics.sh drift > runs/diag-drift-high.log 2>&1 &
#   ARM=low nohup nice -n 19 bash examples/drafter_diagnostics.sh drift > runs/diag-drift-low.log 2>&1 &
#
# equivalence: the real target and the shipped drafter in fp32, on 3 held-out prompts: the offline acceptance length
#     step by step against a dflash-block decode of the same prompts (tests/test_offline_acceptance.py does the same
#     with tiny models), and per prompt how close it is to a numerical flip: the smallest top-2 margin of the
#     target's greedy choices and of the drafts that decided a step, and the generated positions where the training
#     forward's greedy token is not the decoded one (a step can differ only there).
# overfit: from the shipped drafter, SEQUENCES prompts of data/regen-smollm2 (the domains in turn) answered again by
#     the fp32 target (NEW_TOKENS at most, one prompt at a time as a decode writes them, so that the decode below
#     follows the trained text), STEPS steps of BATCH sequences x ANCHORS random anchors at LR, the offline acceptance
#     on those sequences every MEASURE_STEPS steps, then the decoded dflash-block tau of the shipped and the overfit
#     drafter on the same prompts (runs/diag/overfit_decoded_tau.json): well above 3 means the recipe can learn.
#     Defaults: 32 x 256 tokens, 300 steps of 2 x 64 (a GPU or a quiet CPU); on a shared 2-core CPU (25-70 s a
#     step at nice 19): SEQUENCES=6 NEW_TOKENS=192 MAX_LENGTH=256 STEPS=65 SAVE_STEPS=15 MEASURE_STEPS=65.
# drift: the same short continuation (data/regen-smollm2, 150 steps of 4 x 32 blocks) at lr 2e-4 (the earlier CPU
#     runs) and at 3e-5 with EMA, scored by the offline acceptance on data/heldout-smollm2; the target's side of the
#     step read from the features cache (`drafter_campaign_cpu.sh features` writes it).
set -euo pipefail
STAGE=${1:?usage: drafter_diagnostics.sh equivalence|overfit|drift}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
DIAG=${DIAG:-runs/diag}
SHIPPED=checkpoints/smollm2-135m-instruct-dflash
mkdir -p "$DIAG"

case "$STAGE" in
equivalence)
    # DTYPE=bfloat16: the same in bf16, where rounding can flip near ties (the default, fp32, is the exact check)
    DTYPE=${DTYPE:-float32}
    python - "$DIAG/equivalence-$DTYPE.json" "$DTYPE" <<'EOF'
import json, sys
import torch
from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.trainers.offline_acceptance import (heldout_prompts, measuring_trainer, offline_acceptance,
                                                     sequence_inputs)

target, tok = load_target("smollm2-135m-instruct", dtype=getattr(torch, sys.argv[2]))
drafter = DiffusionDrafter.from_pretrained("checkpoints/smollm2-135m-instruct-dflash", target=target,
                                           length_head=False, draft_tree_budget=None, prompt_lookup_num_tokens=None)
records, decoded = [], []
for prompt in heldout_prompts(tok, 1):  # one prompt each of code, math, chat
    inputs = tok([prompt["text"]], return_tensors="pt", add_special_tokens=False)
    out = target.generate(**inputs, assistant_model=drafter, num_assistant_tokens=15, max_new_tokens=128,
                          do_sample=False, return_dict_in_generate=True)
    records.append({"input_ids": out.sequences[0], "prompt_length": inputs["input_ids"].shape[1],
                    "domain": prompt["domain"]})
    decoded.append(out.speculation_stats.committed_per_step)
trainer = measuring_trainer(drafter, target)
report = offline_acceptance(trainer, drafter, records)


def top2_margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


# How close each prompt is to a numerical flip: a step can differ only where the target's greedy choice (decode's
# cached verify vs the training forward over the whole sequence) or a draft deciding a step is a near tie.
prompts = []
for record, offline_steps, decoded_steps in zip(records, report["committed_per_step"], decoded):
    sequence, start = record["input_ids"], record["prompt_length"]
    anchors = [start + sum(decoded_steps[:i]) for i in range(len(decoded_steps))]  # the anchors the decode visited
    with torch.no_grad():
        blocks = trainer.block_forward(drafter, sequence_inputs(sequence, start, anchors, "cpu"))
        target_logits = blocks.target_logits[0, start - 1 : -1]
        draft_margins = torch.cat([top2_margins(drafter.compute_draft_vocab_logits(h)[0])
                                   for h in blocks.hidden[0, :, 1:].split(16)])  # (anchors, block - 1)
    decisive = [float(m) for margins, committed, anchor in zip(draft_margins, decoded_steps, anchors)
                for m in margins[: min(committed, len(sequence) - 1 - anchor)]]  # accepted + first rejected
    differ = next((i for i, (a, b) in enumerate(zip(offline_steps, decoded_steps)) if a != b), None)
    prompts.append({
        "domain": record["domain"], "steps_equal": offline_steps == decoded_steps,
        "first_different_step": differ, "its_anchor": None if differ is None else anchors[differ],
        # generated positions where the whole-sequence forward's greedy token is not the decoded one
        "target_disagreements": (target_logits.argmax(-1) != sequence[start:]).nonzero().flatten().add(start).tolist(),
        "smallest_target_margin": round(float(top2_margins(target_logits).min()), 6),
        "smallest_decisive_draft_margin": round(min(decisive), 6),
    })
result = {"steps_equal_per_prompt": [p["steps_equal"] for p in prompts],
          "decoded_tau": round(sum(map(sum, decoded)) / sum(map(len, decoded)), 4),
          "offline_decode_tau": report["decode_tau"], "offline_tau_all_anchors": report["tau"],
          "unjudged_blocks": report["unjudged_blocks"], "dtype": sys.argv[2], "threads": torch.get_num_threads(),
          "prompts": prompts,
          "decoded": decoded, "offline": report["committed_per_step"]}
json.dump(result, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k not in ("decoded", "offline")}))
EOF
    ;;
overfit)
    # sizes from the environment (the header: the full run's defaults and the reduced run's values)
    export SEQUENCES=${SEQUENCES:-32} NEW_TOKENS=${NEW_TOKENS:-256} MAX_LENGTH=${MAX_LENGTH:-512}
    BATCH=${BATCH:-2} ANCHORS=${ANCHORS:-64} LR=${LR:-5e-4} STEPS=${STEPS:-300} SAVE_STEPS=${SAVE_STEPS:-25}
    MEASURE_STEPS=${MEASURE_STEPS:-50}
    # the target's own fp32 greedy answers, one prompt at a time as the decode below writes them, so that decoding a
    # training prompt follows exactly the trained text (stored bf16 batched answers drift from an fp32 decode)
    python - "$DIAG/overfit-data" <<'EOF'
import os, sys
import torch
from hf_diffspec import load_target
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter

count, new_tokens, max_length = (int(os.environ[k]) for k in ("SEQUENCES", "NEW_TOKENS", "MAX_LENGTH"))
target, tok = load_target("smollm2-135m-instruct", dtype=torch.float32)
source = DrafterDataset("data/regen-smollm2", tokenizer=tok)
by_domain, seen = {}, set()
for sequence, prompt_length, domain in zip(source.sequences, source.prompt_lengths, source.domains):
    prompt = tuple(sequence[:prompt_length].tolist())
    if prompt not in seen and prompt_length + new_tokens <= max_length:  # distinct prompts, never cut by training
        seen.add(prompt)
        by_domain.setdefault(domain, []).append(prompt)
picked = [(d, p) for row in zip(*([(d, p) for p in ps] for d, ps in by_domain.items())) for d, p in row][:count]
writer = ShardWriter(sys.argv[1], "smollm2-135m-instruct", tok, source="generated", shard_size=count)
for i, (domain, prompt) in enumerate(picked):  # the domains in turn
    if f"overfit/{i}" not in writer.done_ids:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        writer.add(f"overfit/{i}", out[0].tolist(), len(prompt), domain)
writer.flush()
EOF
    resume=()
    ls "$DIAG"/overfit/checkpoints/checkpoint-*/trainer_state.json >/dev/null 2>&1 && resume=(--resume)
    hf-diffspec train kd --init "$SHIPPED" --data "$DIAG/overfit-data" --out "$DIAG/overfit" --dtype float32 \
        --batch-size "$BATCH" --num-anchors "$ANCHORS" --max-length "$MAX_LENGTH" --lr "$LR" --max_steps "$STEPS" \
        --save_steps "$SAVE_STEPS" --logging_steps 5 --offline-acceptance-steps "$MEASURE_STEPS" \
        --offline-acceptance-data "$DIAG/overfit-data" --offline-acceptance-sequences "$SEQUENCES" "${resume[@]}"
    # the verdict: dflash-block decodes of the training prompts, shipped vs overfit drafter, in fp32
    python - "$DIAG" <<'EOF'
import json, sys
import torch
from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.trainers.data import DrafterDataset
from hf_diffspec.trainers.offline_acceptance import measuring_trainer, offline_acceptance

diag = sys.argv[1]
target, tok = load_target("smollm2-135m-instruct", dtype=torch.float32)
data = DrafterDataset(f"{diag}/overfit-data", tokenizer=tok)
result = {}
for name, path in [("overfit", f"{diag}/overfit"), ("shipped", "checkpoints/smollm2-135m-instruct-dflash")]:
    drafter = DiffusionDrafter.from_pretrained(path, target=target, length_head=False, draft_tree_budget=None,
                                               prompt_lookup_num_tokens=None).float().eval()
    decoded, same = [], 0
    for sequence, prompt_length in zip(data.sequences, data.prompt_lengths):  # the training prompts themselves
        prompt = torch.as_tensor(sequence[:prompt_length])[None]
        out = target.generate(prompt, assistant_model=drafter, num_assistant_tokens=15,
                              max_new_tokens=len(sequence) - prompt_length, do_sample=False,
                              return_dict_in_generate=True)
        decoded.append(out.speculation_stats.committed_per_step)
        same += out.sequences[0].tolist() == sequence.tolist()
    offline = offline_acceptance(measuring_trainer(drafter, target), drafter, data)
    result[name] = {"decoded_tau": round(sum(map(sum, decoded)) / sum(map(len, decoded)), 4),
                    "decoded_as_stored": same, "prompts": len(data), "offline_decode_tau": offline["decode_tau"],
                    "offline_tau_all_anchors": offline["tau"], "reach": offline["reach"],
                    "steps_equal_decoded": sum(a == b for a, b in zip(offline["committed_per_step"], decoded)),
                    "decoded": decoded}
    print(name, {k: v for k, v in result[name].items() if k != "decoded"}, flush=True)
json.dump(result, open(f"{diag}/overfit_decoded_tau.json", "w"), indent=1)
EOF
    ;;
drift)
    # ARM=high: lr 2e-4, no average (the earlier CPU continuations); ARM=low: lr 3e-5 with an EMA; same data order
    ARM=${ARM:?ARM=high or ARM=low}
    case "$ARM" in
        high) recipe=(--lr 2e-4) ;;
        low) recipe=(--lr 3e-5 --ema-decay 0.99) ;;
        *) echo "ARM is high or low" >&2; exit 2 ;;
    esac
    resume=()
    ls "$DIAG/drift-$ARM"/checkpoints/checkpoint-*/trainer_state.json >/dev/null 2>&1 && resume=(--resume)
    # a shared 2-core CPU (an offline acceptance of 60 sequences takes ~25 min on one busy thread):
    # STEPS=60 MEASURE_STEPS=20 MEASURE_SEQUENCES=30
    STEPS=${STEPS:-150} MEASURE_STEPS=${MEASURE_STEPS:-25} MEASURE_SEQUENCES=${MEASURE_SEQUENCES:-60}
    hf-diffspec train kd --init "$SHIPPED" --data data/regen-smollm2 --out "$DIAG/drift-$ARM" \
        --batch-size 4 --num-anchors 32 --max-length 512 --max_steps "$STEPS" --schedule-steps "$STEPS" \
        --save_steps "$MEASURE_STEPS" --logging_steps 5 --offline-acceptance-steps "$MEASURE_STEPS" \
        --offline-acceptance-data data/heldout-smollm2 --offline-acceptance-sequences "$MEASURE_SEQUENCES" \
        --cached-features "${recipe[@]}" "${resume[@]}"
    ;;
*)
    echo "unknown stage $STAGE (equivalence | overfit | drift)" >&2
    exit 2
    ;;
esac
