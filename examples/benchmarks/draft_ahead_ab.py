"""Drafting ahead, on and off, interleaved in one run: a drafter step runs the next step's drafting pass before the
host reads its outcome, so what the next trees are built from rides on that one read (`drafting.draft_ahead`). It is
on where a read waits for the device (a GPU: one wait less per step); on a CPU a read costs nothing, and what drafting
ahead costs is the passes run for a step that then did not draft (the controller chose a lookup or plain step). This
measures that cost on a CPU (forcing it on with `HF_DIFFSPEC_DRAFT_AHEAD=1`): the same methods, with and without,
same prompts, plain `generate` as the common reference.

    python examples/benchmarks/draft_ahead_ab.py --methods tree-lookup,dflash --batch-sizes 1,16 --seed 7
    python examples/benchmarks/draft_ahead_ab.py --do-sample --temperature 0.6 --top-k 20 --top-p 0.95 --seed 7

Methods are reported as `METHOD` and `METHOD, no draft-ahead`, with every column `hf-diffspec bench` prints.
"""

import argparse

import torch

from hf_diffspec import load_target
from hf_diffspec.bench import (
    build_method_drafters, machine_description, machine_markdown, markdown_table, run_benchmark, summarize, write_json,
)
from hf_diffspec.bench.host_syncs import drafting_ahead
from hf_diffspec.bench.method import Method
from hf_diffspec.cli import DTYPES
from hf_diffspec.prompts import load_prompts


def draft_ahead(on: bool):
    """A `Method.target_patch`: the call drafts ahead (as where a read waits for the device) or at each step (the
    CPU's default)."""
    return lambda target: drafting_ahead(on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="tree-lookup", help="bench methods of ours, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per domain")
    parser.add_argument("--seed", type=int, default=7, help="draws the prompts (0: the built-in first ones)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=None, help="as `hf-diffspec bench --rounds`")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p") if getattr(args, k) is not None}
    sampling = sampling if args.do_sample else None
    torch.manual_seed(args.seed)
    target, tok = load_target("smollm2-135m-instruct", dtype=DTYPES[args.dtype])
    machine = machine_description(target)
    print(machine_markdown(machine) + "\n")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = {}
    for name, method in build_method_drafters(names, target, "smollm2-135m-instruct", tokenizer=tok).items():
        methods[name] = Method(method.drafter, dict(method.generate_kwargs), target_patch=draft_ahead(True))
        methods[f"{name}, no draft-ahead"] = Method(method.drafter, dict(method.generate_kwargs),
                                                    target_patch=draft_ahead(False))
    prompts = load_prompts(n_per_domain=args.prompts, tokenizer=tok, seed=args.seed)
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        rows += summarize(run_benchmark(target, tok, methods, prompts, args.max_new_tokens, batch_size=batch_size,
                                        rounds=args.rounds, sampling=sampling))
    print(markdown_table(rows))
    if args.json:
        write_json(args.json, rows, vars(args), machine)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
