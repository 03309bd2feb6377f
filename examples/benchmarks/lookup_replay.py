"""Replay prompt lookup offline on the target's own greedy outputs: how many lookup drafts a step would get accepted,
for the choices `hf_diffspec.runtime.drafting_lookup.PromptLookup` makes (which earlier occurrence to copy from, the
longest suffix matched), how acceptance depends on depth, and on the length of the match.

    python examples/benchmarks/lookup_replay.py --prompts 10 --max-new-tokens 256 --outputs /tmp/greedy.json

The greedy outputs are generated once (bf16, plain `generate`) and kept in --outputs; the replay itself takes
seconds. Each step copies up to --tokens drafts, accepts the ones the target's continuation agrees with, and commits
one more (the target's own token), as a lookup-only decoding loop would.
"""

import argparse
import json
from pathlib import Path

import torch

from hf_diffspec.prompts import DOMAINS, load_prompts
from hf_diffspec.targets import load_target


def greedy_outputs(target_name: str, prompts: int, max_new_tokens: int, path: Path) -> list[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    model, tokenizer = load_target(target_name, dtype=torch.bfloat16)
    records = []
    for prompt in load_prompts(DOMAINS, n_per_domain=prompts, tokenizer=tokenizer):
        ids = tokenizer(prompt["text"], return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        records.append({"domain": prompt["domain"], "prompt_length": ids.shape[1], "ids": out[0].tolist()})
        print(f"{prompt['domain']}: {ids.shape[1]} prompt tokens, {out.shape[1] - ids.shape[1]} new", flush=True)
    path.write_text(json.dumps(records))
    return records


def find(ids: list[int], max_ngram: int, tokens: int, most_recent: bool) -> tuple[list[int], int]:
    """The drafts after an earlier occurrence of the longest suffix of `ids` that occurred, and that suffix's length."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        starts = [i for i in range(len(ids) - n) if ids[i : i + n] == suffix]
        if starts:
            start = (starts[-1] if most_recent else starts[0]) + n
            return ids[start : start + tokens], n
    return [], 0


def replay(records: list[dict], max_ngram: int, tokens: int, most_recent: bool) -> dict:
    steps = committed = 0
    per_domain: dict[str, list[int]] = {}
    per_match: dict[int, list[int]] = {}
    trials, hits = [0] * tokens, [0] * tokens
    for record in records:
        ids, position = record["ids"], record["prompt_length"] + 1  # the first new token comes from the prefill
        while position < len(ids):
            drafts, n = find(ids[:position], max_ngram, tokens, most_recent)
            accepted = 0
            while accepted < len(drafts) and position + accepted < len(ids) and ids[position + accepted] == drafts[accepted]:
                accepted += 1
            for d in range(min(accepted + 1, len(drafts))):
                trials[d] += 1
                hits[d] += d < accepted
            for table, key in ((per_domain, record["domain"]), (per_match, n)):
                entry = table.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += accepted
            steps += 1
            committed += accepted + 1
            position += accepted + 1
    return {
        "tokens_per_step": round(committed / steps, 3),
        "per_domain": {k: round(1 + v[1] / v[0], 2) for k, v in per_domain.items()},
        "accepted_per_step_by_match_length": {k: (v[0], round(v[1] / v[0], 2)) for k, v in sorted(per_match.items())},
        "acceptance_given_previous_by_depth": [round(h / t, 2) if t else None for h, t in zip(hits, trials)],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=10, help="most lookup drafts per step")
    parser.add_argument("--outputs", type=Path, default=Path("greedy_outputs.json"))
    args = parser.parse_args()
    records = greedy_outputs(args.target, args.prompts, args.max_new_tokens, args.outputs)
    for most_recent in (False, True):
        for max_ngram in (2, 3, 4):
            result = replay(records, max_ngram, args.tokens, most_recent)
            occurrence = "most recent" if most_recent else "first"
            print(f"{occurrence} occurrence, suffixes up to {max_ngram} tokens: {json.dumps(result)}")


if __name__ == "__main__":
    main()
