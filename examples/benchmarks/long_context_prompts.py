"""Write long-context benchmark prompts (a ShareGPT answer of about N tokens to summarise) as JSONL for
`hf-diffspec bench --prompts-file FILE`:

    python examples/benchmarks/long_context_prompts.py --tokens 1024 --num 3 --out long_prompts.jsonl
    hf-diffspec bench --prompts-file long_prompts.jsonl --methods ar,dflash --max-new-tokens 512
"""

import argparse
import json

from hf_diffspec import load_target
from hf_diffspec.prompts import iter_sharegpt

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--num", type=int, default=3)
parser.add_argument("--tokens", type=int, default=1024, help="approximate prompt length in target tokens")
parser.add_argument("--target", default="smollm2-135m-instruct")
args = parser.parse_args()

_, tokenizer = load_target(args.target)
written = 0
with open(args.out, "w") as f:
    for record in iter_sharegpt():
        answers = [t.get("value") or "" for t in record.get("conversations") or [] if t.get("from") == "gpt"]
        document = max(answers, key=len, default="")
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        if len(ids) < args.tokens:
            continue
        text = tokenizer.decode(ids[: args.tokens])
        prompt = f"Here is a document:\n\n{text}\n\nSummarize the document above in a few paragraphs."
        f.write(json.dumps({"id": f"long/{record.get('id')}", "prompt": prompt, "domain": "long"}) + "\n")
        written += 1
        if written == args.num:
            break
print(f"{written} prompts of ~{args.tokens} tokens -> {args.out}")
