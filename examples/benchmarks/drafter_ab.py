"""Two drafters side by side: the same benchmark methods of ours with drafter A and drafter B, interleaved in one run
(same prompts, same warm-up, plain `generate` as the common reference), so a small difference between the drafters is
not lost in the machine's drift from one run to the next.

    python examples/benchmarks/drafter_ab.py --a checkpoints/smollm2-135m-instruct-dflash --b DIR \
        --methods dflash,tree-lookup --batch-sizes 1,4 --json ab.json

Methods are reported as `METHOD@a` and `METHOD@b`, with every column `hf-diffspec bench` prints.
"""

import argparse

from hf_diffspec import load_target
from hf_diffspec.bench import (
    build_method_drafters, machine_description, machine_markdown, markdown_table, run_benchmark, summarize, write_json,
)
from hf_diffspec.cli import DTYPES
from hf_diffspec.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="drafter A (folder)")
    parser.add_argument("--b", required=True, help="drafter B (folder)")
    parser.add_argument("--methods", default="dflash,tree-lookup", help="bench methods of ours, comma-separated")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=None, help="as `hf-diffspec bench --rounds`")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target, tok = load_target("smollm2-135m-instruct", dtype=DTYPES[args.dtype])
    machine = machine_description(target)
    print(machine_markdown(machine) + "\n")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = {}
    for label, drafter in (("a", args.a), ("b", args.b)):
        built = build_method_drafters(names, target, "smollm2-135m-instruct", drafter=drafter, tokenizer=tok)
        methods.update({f"{name}@{label}": method for name, method in built.items()})
    prompts = load_prompts(n_per_domain=args.prompts, tokenizer=tok)
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        rows += summarize(run_benchmark(target, tok, methods, prompts, args.max_new_tokens, batch_size=batch_size,
                                        rounds=args.rounds))
    print(markdown_table(rows))
    if args.json:
        write_json(args.json, rows, vars(args), machine)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
