"""Does the shipped drafter draft as well from a shorter block? Chains of k drafts verified per step, the drafter run
with its trained block of 16 slots or with 8 or 4 (fewer MASK slots: a cheaper drafter forward at large batch).

    OMP_NUM_THREADS=1 python examples/benchmarks/short_blocks.py PROMPTS_PER_DOMAIN MAX_NEW_TOKENS

Prints tau per method over the held-out prompts (bf16, greedy).
"""

import sys

import torch

from hf_diffspec import load_target
from hf_diffspec.bench import Method, run_benchmark, summarize
from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts


def chain_drafter(target, block_size: int):
    drafter = load_drafter(None, target, "smollm2-135m-instruct", length_head=False, draft_tree_budget=None,
                           prompt_lookup_num_tokens=None)  # the shipped drafter, drafting chains
    drafter.config.block_size = block_size
    return drafter


def main():
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    methods = {f"k{k}_block{b}": Method(chain_drafter(target, b), {"num_assistant_tokens": k})
               for k in (3, 7) for b in (16, 8, 4) if k < b}
    prompts = load_prompts(n_per_domain=int(sys.argv[1]), tokenizer=tok)
    rows = summarize(run_benchmark(target, tok, methods, prompts, int(sys.argv[2]), rounds=1, progress=False))
    for r in rows:
        if r["domain"] == "all":
            print(f"{r['method']}: tau {r['tau']:.3f}")


if __name__ == "__main__":
    main()
