"""Write ShareGPT prompts (first user turns, evaluation prompts removed) to a JSONL file for `hf-diffspec data
generate --source FILE`: the same seeded order `data relabel` uses, so `--skip` gives prompts disjoint from it.

    python examples/sharegpt_prompts.py --skip 16000 --num 4096 --out data/gen_prompts.jsonl
"""

import argparse
import json

from hf_diffspec.prompts import eval_prompt_texts
from hf_diffspec.trainers.data import classify_domain, sharegpt_exchanges

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--num", type=int, required=True)
parser.add_argument("--skip", type=int, default=0)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

exchanges = sharegpt_exchanges(args.seed, eval_prompt_texts())[args.skip : args.skip + args.num]
with open(args.out, "w") as f:
    for record_id, prompt, _ in exchanges:
        f.write(json.dumps({"id": record_id, "prompt": prompt, "domain": classify_domain(prompt)}) + "\n")
print(f"{len(exchanges)} prompts -> {args.out}")
