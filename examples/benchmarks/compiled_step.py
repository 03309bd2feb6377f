"""Eager against `torch.compile` for the loop's tensor work between two forwards on a CPU: the tree verify inputs
(`tree_forward_inputs`) and greedy acceptance along tree paths, at batch 1 with a best-first tree of 9 nodes."""
import argparse
import time

import torch

from hf_diffspec.runtime.tree import CandidateTree, TreeLayout
from hf_diffspec.runtime.verify_inputs import tree_forward_inputs


def accept(choice, tokens, parents, depths, ancestors):
    rejected = (tokens != choice.gather(1, parents)) & (depths > 0)
    on_path = ~(ancestors & rejected[:, None, :]).any(-1)
    deepest_depth, deepest = torch.where(on_path, depths, -1).max(-1)
    return deepest_depth + 1, deepest


def per_call_us(fn, args, calls):
    for _ in range(50):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--past", type=int, default=300)
    args = parser.parse_args()
    tree = CandidateTree([5, 7, 9, 11, 13, 8, 10, 12, 14], [-1, 0, 1, 2, 3, 0, 5, 6, 7])
    layout = TreeLayout.of([tree], "cpu")
    valid = torch.ones(1, args.past, dtype=torch.bool)
    roots = torch.tensor([args.past])
    choice = torch.randint(0, 512, (1, len(tree)))

    def inputs(valid, roots):
        return tree_forward_inputs([tree], valid, roots, torch.float32, layout, past_all_valid=False)

    cases = {"tree verify inputs": (inputs, (valid, roots)),
             "greedy tree acceptance": (accept, (choice, layout.tokens, layout.parents, layout.depths,
                                                 layout.ancestors))}
    for name, (fn, fn_args) in cases.items():
        compiled = torch.compile(fn, dynamic=False)
        start = time.perf_counter()
        compiled(*fn_args)
        compile_s = time.perf_counter() - start
        eager, fused = per_call_us(fn, fn_args, args.calls), per_call_us(compiled, fn_args, args.calls)
        print(f"{name}: eager {eager:.1f} us, compiled {fused:.1f} us a call (compiled in {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
