"""Tree size against speed: best-first trees and chains verifying the same number of nodes every step.

    python examples/benchmarks/tree_size_curve.py --sizes 2,4,8,16 --prompts 1 --max-new-tokens 64 --plot tree_curve.png

For each size n, `chain-n` verifies the anchor and n - 1 drafts in a line and `tree-n` the n most likely nodes of
the best-first tree built from the same drafter pass (both fixed with `num_assistant_tokens`, so neither the cost
model nor the speculation gate changes the size). Interleaved with plain `generate` on the same prompts, warm-up
excluded. The last column is the verify-cost profile's T(1, n) / T(1, 1) on this machine: what n nodes cost against
one token, which decides whether the extra acceptance of a tree pays.
"""

import argparse

import torch

from hf_diffspec import load_target
from hf_diffspec.bench import Method, run_benchmark, summarize
from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime.control_profiles import verify_cost_for

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--target", default="smollm2-135m-instruct")
parser.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
parser.add_argument("--sizes", default="2,4,8,16", help="nodes verified per step, anchor included (>= 2)")
parser.add_argument("--domains", default="code,math,chat")
parser.add_argument("--prompts", type=int, default=1, help="prompts per domain")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--plot", default=None, help="write a PNG of tokens/s and tau against the size here")
args = parser.parse_args()

target, tokenizer = load_target(args.target, dtype=torch.bfloat16)
sizes = [int(s) for s in args.sizes.split(",")]
chain = load_drafter(args.drafter, target, args.target, length_head=False, draft_tree_budget=None)
block = chain.config.block_size
methods = {}
for n in sizes:
    methods[f"chain-{n}"] = Method(chain, {"num_assistant_tokens": n - 1})
    # the budget counts drafted nodes; the anchor (root) is the n-th node, as in the chain
    tree = load_drafter(args.drafter, target, args.target, length_head=False, draft_tree_budget=n - 1)
    methods[f"tree-{n}"] = Method(tree, {"num_assistant_tokens": block - 1})
prompts = load_prompts(args.domains.split(","), n_per_domain=args.prompts, tokenizer=tokenizer)
rows = {r["method"]: r for r in summarize(run_benchmark(target, tokenizer, methods, prompts, args.max_new_tokens))
        if r["domain"] == "all"}
cost = verify_cost_for(target)

print(f"plain generate: {rows['ar']['tokens_per_s']:.1f} tokens/s")
print("| nodes per step | chain tau | chain tokens/s | tree tau | tree tokens/s | tree / chain speed | T(n)/T(1) |")
print("|---|---|---|---|---|---|---|")
for n in sizes:
    c, t = rows[f"chain-{n}"], rows[f"tree-{n}"]
    ratio = f"{cost.profiled(n, 1) / cost.profiled(1, 1):.2f}" if cost is not None else "no profile"
    print(f"| {n} | {c['tau']:.2f} | {c['tokens_per_s']:.1f} | {t['tau']:.2f} | {t['tokens_per_s']:.1f} | "
          f"{t['tokens_per_s'] / c['tokens_per_s']:.2f}x | {ratio} |")

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, tau) = plt.subplots(1, 2, figsize=(8.5, 3.4))
    for kind in ("chain", "tree"):
        speed.plot(sizes, [rows[f"{kind}-{n}"]["tokens_per_s"] for n in sizes], marker="o", label=kind)
        tau.plot(sizes, [rows[f"{kind}-{n}"]["tau"] for n in sizes], marker="o", label=kind)
    speed.axhline(rows["ar"]["tokens_per_s"], color="black", linewidth=0.8, label="plain generate")
    for ax, label in ((speed, "tokens/s"), (tau, "tau (tokens per target forward)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("nodes verified per step")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")
