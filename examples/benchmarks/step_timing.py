"""Where a batched call's time goes, step by step: plain `generate` against one of our methods on the same batch, and
for ours the loop's steps by kind (drafter steps, steps verifying prompt-lookup drafts alone, plain steps) with their
mean rows, time and tokens committed (rows leave the batch as they finish, so kinds chosen late run on fewer).

    python examples/benchmarks/step_timing.py --rows 16 --reps 3 --method tree-lookup [--dtype float32]
        [--prompts-file examples/benchmarks/prompts/unseen_families.jsonl]

Each repetition runs plain `generate` then the method (after one untimed warm-up of each); the gates' measurements
persist across calls, so the first repetition also shows what a first call at this batch size pays for probes.
"""

import argparse
import time

import torch

from hf_diffspec import load_target
from hf_diffspec.bench import Method, build_method_drafters, encode_batches, run_method
from hf_diffspec.prompts import load_prompts, load_prompts_file
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--method", default="tree-lookup", help="a bench method of ours")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per domain, cycled to fill the batch")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts-file", default=None, help="JSONL prompts (as bench --prompts-file) instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    method = build_method_drafters([args.method], target, "smollm2-135m-instruct")[args.method]
    if args.prompts_file:
        prompts = load_prompts_file(args.prompts_file, tokenizer=tokenizer)
    else:
        prompts = load_prompts(n_per_domain=args.prompts, tokenizer=tokenizer)
    inputs = encode_batches(tokenizer, prompts, args.rows, target.device)[0][1]

    steps = []  # the StepRecord of every loop step of the method's call
    record = SpeculationController.record

    def recording(self, step, *rest):
        steps.append(step)
        return record(self, step, *rest)

    SpeculationController.record = recording
    for runner in (Method(), method):
        run_method(target, runner, inputs, 8)
    totals = {"ar": 0.0, args.method: 0.0}
    for rep in range(args.reps):
        for name, runner in (("ar", Method()), (args.method, method)):
            steps.clear()
            start = time.perf_counter()
            run_method(target, runner, inputs, args.max_new_tokens)
            totals[name] += time.perf_counter() - start
        print(f"repetition {rep}: {args.method} against ar over the repetitions so far: "
              f"{totals['ar'] / totals[args.method]:.3f}x")
        for kind in StepKind:
            chosen = [step for step in steps if step.kind is kind]
            if chosen:
                seconds, tokens = sum(s.seconds for s in chosen), sum(s.committed for s in chosen)
                rows = sum(s.rows for s in chosen) / len(chosen)
                print(f"  {kind.value:12s} steps {len(chosen):4d}  {rows:5.1f} rows  "
                      f"{1000 * seconds / len(chosen):6.1f} ms/step  {tokens / len(chosen):5.2f} tokens/step  "
                      f"{tokens / seconds:6.1f} tokens/s")


if __name__ == "__main__":
    main()
