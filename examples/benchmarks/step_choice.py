"""How each step's kind is chosen, measured: the speculation controller (the default) against a drafter forward at
every step, on the built-in target and drafter, interleaved per batch and round on one machine; and, per step kind and
prompt-lookup match length, what the controller's steps committed and cost.

    python examples/benchmarks/step_choice.py --domains code --prompts 5 --rows 1 --rounds 2
    python examples/benchmarks/step_choice.py --domains code,math,chat --prompts 6 --rows 16 --max-new-tokens 96

Prints one line per arm (seconds, throughput relative to the controller, steps by kind; with --rows > 1 plain `generate`
too) and the per-kind table of the controller's steps. Time on a quiet machine (docs/benchmarks.md).
"""

import argparse
import collections
import time

import torch

from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind
from hf_diffspec.targets import load_target

TARGET = "smollm2-135m-instruct"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domains", default="code")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per domain")
    parser.add_argument("--rows", type=int, default=1, help="rows decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    target, tok = load_target(TARGET, dtype=torch.bfloat16)
    drafter = load_drafter(None, target, TARGET)
    records = load_prompts(args.domains.split(","), args.prompts, tokenizer=tok)
    tok.padding_side = "left"
    batches = [records[i:i + args.rows] for i in range(0, len(records) - args.rows + 1, args.rows)]
    inputs = [tok([r["text"] for r in b], return_tensors="pt", padding=True, add_special_tokens=False) for b in batches]
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    decide = SpeculationController.decide
    arms = {"controller": decide,
            "draft every step": lambda self, rows, ngrams, lengths: (StepKind.DRAFT, max(lengths, default=0))}
    if args.rows > 1:
        arms["plain generate"] = None
    steps = []
    record = SpeculationController.record

    def run(arm, batch, keep_steps=False):
        if arms[arm] is None:
            start = time.perf_counter()
            target.generate(**batch, **settings)
            return time.perf_counter() - start, (0, 0, 0)
        SpeculationController.decide = arms[arm]
        kept = (lambda self, step, *rest: steps.append(step) or record(self, step, *rest)) if keep_steps else record
        SpeculationController.record = kept
        start = time.perf_counter()
        out = target.generate(**batch, assistant_model=drafter, return_dict_in_generate=True, **settings)
        seconds = time.perf_counter() - start
        stats = out.speculation_stats
        return seconds, (stats.draft_steps, stats.lookup_steps, stats.plain_steps)

    for arm in arms:  # the first call measures the verify-cost profile; both arms start warm
        run(arm, inputs[0])
    totals = {arm: [0.0, [0, 0, 0]] for arm in arms}
    for round_ in range(args.rounds):
        for i, batch in enumerate(inputs):
            order = list(arms) if (i + round_) % 2 == 0 else list(arms)[::-1]
            for arm in order:
                seconds, kinds = run(arm, batch, keep_steps=arm == "controller")
                totals[arm][0] += seconds
                totals[arm][1] = [a + b for a, b in zip(totals[arm][1], kinds)]
    SpeculationController.decide, SpeculationController.record = decide, record
    for arm, (seconds, kinds) in totals.items():
        print(f"{arm}: {seconds:.2f} s, {totals['controller'][0] / seconds:.3f}x the controller's throughput; "
              f"steps with the drafter / lookup drafts alone / plain: {kinds}")
    by_kind = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    for step in steps:
        row = by_kind[step.kind.value, step.lookup_ngram]
        row[0] += 1
        row[1] += step.committed
        row[2] += step.seconds
        row[3] += step.verify_seconds
    print("\n| kind | match length | steps | tokens/step | ms/step | verify ms/step | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for (kind, ngram), (n, committed, seconds, verify) in sorted(by_kind.items()):
        print(f"| {kind} | {ngram} | {n} | {committed / n:.2f} | {1000 * seconds / n:.1f} | {1000 * verify / n:.1f} | "
              f"{committed / seconds:.1f} |")
    print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
