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
#     with tiny models).
# overfit: from the shipped drafter, 32 target-regenerated sequences of data/regen-smollm2 (~8k response positions),
#     300 steps of 2 sequences x 64 random anchors (~5 visits of every position; all of a sequence's anchors in one
#     step cost ~7x more in the dense block mask), lr 5e-4; the offline acceptance on those sequences every 100
#     steps, then the decoded dflash-block tau on the same prompts.
# drift: the same short continuation (data/regen-smollm2, 150 steps of 4 x 32 blocks) at lr 2e-4 (the earlier CPU
#     runs) and at 3e-5 with EMA, scored by the offline acceptance on data/heldout-smollm2.
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
    python - "$DIAG/equivalence.json" <<'EOF'
import json, sys
import torch
from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.trainers.offline_acceptance import heldout_prompts, measuring_trainer, offline_acceptance

target, tok = load_target("smollm2-135m-instruct", dtype=torch.float32)
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
report = offline_acceptance(measuring_trainer(drafter, target), drafter, records)
same = [a == b for a, b in zip(report["committed_per_step"], decoded)]
result = {"steps_equal_per_prompt": same, "decoded_tau": sum(map(sum, decoded)) / sum(map(len, decoded)),
          "offline_decode_tau": report["decode_tau"], "offline_tau_all_anchors": report["tau"],
          "decoded": decoded, "offline": report["committed_per_step"]}
json.dump(result, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k not in ("decoded", "offline")}))
EOF
    ;;
overfit)
    python - "$DIAG/overfit-data" <<'EOF'
import sys
from hf_diffspec import load_target
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter

_, tok = load_target("smollm2-135m-instruct")
source = DrafterDataset("data/regen-smollm2", tokenizer=tok)
writer = ShardWriter(sys.argv[1], "smollm2-135m-instruct", tok, source="generated", shard_size=32)
for i in range(32):  # the first 32 regenerated responses (a subset of the shipped drafter's training data)
    if f"overfit/{i}" not in writer.done_ids:
        writer.add(f"overfit/{i}", source.sequences[i].tolist(), source.prompt_lengths[i], source.domains[i])
writer.flush()
EOF
    resume=()
    ls "$DIAG"/overfit/checkpoints/checkpoint-*/trainer_state.json >/dev/null 2>&1 && resume=(--resume)
    hf-diffspec train kd --init "$SHIPPED" --data "$DIAG/overfit-data" --out "$DIAG/overfit" \
        --batch-size 2 --num-anchors 64 --max-length 512 --lr 5e-4 --max_steps 300 --save_steps 25 \
        --logging_steps 5 --offline-acceptance-steps 100 --offline-acceptance-data "$DIAG/overfit-data" \
        --offline-acceptance-sequences 32 "${resume[@]}"
    python - "$DIAG" <<'EOF'
import json, sys
import torch
from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.trainers.data import DrafterDataset

diag = sys.argv[1]
target, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
data = DrafterDataset(f"{diag}/overfit-data", tokenizer=tok)
result = {}
for name, path in [("shipped", "checkpoints/smollm2-135m-instruct-dflash"), ("overfit", f"{diag}/overfit")]:
    drafter = DiffusionDrafter.from_pretrained(path, target=target, length_head=False, draft_tree_budget=None,
                                               prompt_lookup_num_tokens=None)
    committed = steps = same = 0
    for sequence, prompt_length in zip(data.sequences, data.prompt_lengths):  # the training prompts themselves
        prompt = torch.as_tensor(sequence[:prompt_length])[None]
        out = target.generate(prompt, assistant_model=drafter, num_assistant_tokens=15, max_new_tokens=256,
                              do_sample=False, return_dict_in_generate=True)
        per_step = out.speculation_stats.committed_per_step
        committed, steps = committed + sum(per_step), steps + len(per_step)
        same += out.sequences[0].tolist() == sequence.tolist()  # decoded now as the stored (batched) answer?
    result[name] = {"decoded_tau": round(committed / steps, 4), "decoded_as_stored": same, "prompts": len(data)}
    print(name, result[name], flush=True)
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
    hf-diffspec train kd --init "$SHIPPED" --data data/regen-smollm2 --out "$DIAG/drift-$ARM" \
        --batch-size 4 --num-anchors 32 --max-length 512 --max_steps 150 --schedule-steps 150 --save_steps 25 \
        --logging_steps 5 --offline-acceptance-steps 25 --offline-acceptance-data data/heldout-smollm2 \
        --offline-acceptance-sequences 60 "${recipe[@]}" "${resume[@]}"
    ;;
*)
    echo "unknown stage $STAGE (equivalence | overfit | drift)" >&2
    exit 2
    ;;
esac
