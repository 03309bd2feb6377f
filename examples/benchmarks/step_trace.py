"""Where a decoding step still takes shapes from host values: the aten ops each step dispatches outside the target's
and the drafter's forwards, compared between steps of the same shape (the trees' sizes and the forwards' input
shapes), grouped by the runtime's source line that dispatched them. A step a CUDA graph could capture whole would
dispatch the same ops on the same shapes and scalars at every step of a shape; the lines listed are what differs (a
mask built at the cache's used width, a crop by the accepted count, ...).

    python examples/benchmarks/step_trace.py [--rows 2] [--tokens 32] [--draft-tokens 4] [--cache static|dynamic]
                                             [--ahead]

SmolLM2-135M-Instruct (fp32) with the shipped drafter, greedy, a fixed chain length (every step drafts), on the CPU;
`--ahead`: the next step's drafting pass before the step's read, as on a GPU (`HF_DIFFSPEC_DRAFT_AHEAD=1`). Prints
the steps traced, per shape how many steps dispatched exactly its first step's ops, and per source line how many
steps dispatched other ops, shapes or scalars there than most steps of their shape did.
"""

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_diffspec import load_target
from hf_diffspec.bench import encode_batches
from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime import decoding


class StepTrace(TorchDispatchMode):
    """Every aten op dispatched while no model forward runs: (op, argument shapes and scalars, the runtime's source
    line that dispatched it)."""

    def __init__(self):
        super().__init__()
        self.ops, self.in_forward = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_forward:
            flat, _ = tree_flatten((args, kwargs or {}))
            signature = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else repr(a) for a in flat)
            self.ops.append((str(func), signature, _runtime_line()))
        return out


def _runtime_line() -> str:
    """The innermost frame of the runtime's own code on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "hf_diffspec" in name and "step_trace" not in name:
            return f"{name.split('hf_diffspec/')[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--cache", choices=["static", "dynamic"], default="static")
    parser.add_argument("--ahead", action="store_true", help="draft the next step ahead of the step's read")
    args = parser.parse_args()
    if args.ahead:
        os.environ["HF_DIFFSPEC_DRAFT_AHEAD"] = "1"
    target, tok = load_target("smollm2-135m-instruct", dtype=torch.float32)
    drafter = load_drafter(None, target, "smollm2-135m-instruct", draft_tree_budget=None,
                           prompt_lookup_num_tokens=None)
    inputs = encode_batches(tok, load_prompts(n_per_domain=2, tokenizer=tok), args.rows, target.device)[0][1]

    steps, current, shapes = [], [], []

    def pause(module, args, kwargs):
        if current:
            current[-1].in_forward += 1
            shapes[-1].append(tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                                    if isinstance(t, torch.Tensor)))

    def resume(*_):
        if current:
            current[-1].in_forward -= 1

    for model in (target, drafter):
        model.register_forward_pre_hook(pause, with_kwargs=True)
        model.register_forward_hook(resume)
    step, forward = decoding._step, decoding.TargetVerifier.forward

    def traced_step(call, start):
        trace = StepTrace()
        current.append(trace)
        shapes.append([])
        with trace:
            end = step(call, start)
        current.pop()
        steps.append(trace.ops)
        return end

    def sized_forward(self, trees, *rest):  # the trees' sizes are part of a step's shape
        shapes[-1].append(tuple(len(t) for t in trees))
        return forward(self, trees, *rest)

    decoding._step, decoding.TargetVerifier.forward = traced_step, sized_forward
    extra = dict(cache_implementation="static") if args.cache == "static" else {}
    target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.tokens, do_sample=False,
                    num_assistant_tokens=args.draft_tokens, eos_token_id=None, **extra)
    decoding._step, decoding.TargetVerifier.forward = step, forward

    groups = collections.defaultdict(list)  # per shape, its steps (the first follows the prefill: left out)
    for ops, shape in zip(steps[1:], shapes[1:]):
        groups[tuple(shape)].append(ops)
    print(f"{len(steps) - 1} steps traced ({args.rows} rows, chains of {args.draft_tokens}, {args.cache} cache"
          f"{', drafted ahead' if args.ahead else ''}), {len(groups)} shapes; per shape, steps that dispatched exactly "
          f"its first step's ops: " + ", ".join(f"{sum(ops == group[0] for ops in group)} of {len(group)}"
                                               for group in sorted(groups.values(), key=len, reverse=True)))
    # per source line, the steps whose ops there differ from what most steps of their shape dispatch there
    differing = collections.Counter()
    for group in groups.values():
        by_line = [collections.defaultdict(list) for _ in group]
        for ops, lines in zip(group, by_line):
            for op, signature, line in ops:
                lines[line].append((op, signature))
        for line in set().union(*by_line):
            variants = collections.Counter(tuple(lines[line]) for lines in by_line)
            differing[line] += len(group) - variants.most_common(1)[0][1]
    for line, count in differing.most_common():
        if count:
            print(f"  {line}: {count} of {len(steps) - 1} steps differ from most steps of their shape")


if __name__ == "__main__":
    main()
