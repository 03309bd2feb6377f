"""The speculation gates on simulated steps: what they keep of speculation that pays, and what they cost where
speculation loses.

    python examples/benchmarks/gate_simulation.py [--probe-budget 0.02]

One gate, batch 1: a speculative step commits 1-4 tokens with probabilities 0.6 / 0.2 / 0.1 / 0.1 (1.7 on average)
and costs `spec_cost` plain steps (each time x uniform(0.9, 1.1)); a plain step commits 1 token. For each cost, the
gate's throughput relative to always decoding plainly (3000 tokens, mean over 20 seeds), next to always speculating.
The same for a fresh process's first calls: five calls of 128 tokens, the gate kept across them and sharing its
budget with four others (as the drafter's gates do), mean over 200 seeds; and those calls on text whose acceptance
comes in stretches (40 steps on average) of 2.4 or of 1.25 tokens a speculative step.

A fresh gate (sharing its budget as the drafter's gate after no lookup match does, its siblings having measured
drafter steps at 2.2 tokens) deciding 70 steps, about what the no-match gate decides over the code bench's five
calls, at a speculative step costing 1.43 plain steps: with acceptance as measured there (1 / 2 / 3 / 4 tokens with
probabilities 0.47 / 0.32 / 0.18 / 0.03), with its first 10 speculative steps committing 1 token (where the first
code prompt's answer begins), and where speculation never pays (1.15 tokens), mean over 1,000 seeds.

All gates, 16 rows (`SpeculationGates`: the drafter's, and per prompt-lookup match length the drafter-or-not and
lookups-alone-or-plain ones): 40% of steps have a lookup match (n-gram 1-4, mostly 3); a drafter step costs 3 plain
steps and commits 1.2 tokens a row, a lookup-only step costs 1.8 plain steps and commits `lookup_tokens` a row (each
x uniform(0.7-0.8, 1.2-1.3), times x uniform(0.9, 1.1)), as 16 rows measured on the AVX2 EPYC (docs/results.md).
2,400 steps, mean over 20 seeds: throughput relative to plain decoding, against the best choice (lookup-only steps on
every match if they pay, else plain steps), and the steps of each kind. `--probe-budget`: the share of
decoding time each gate may spend probing the arm that loses (the library's default is 0.02).
"""

import argparse
import random

from hf_diffspec.runtime.control_gates import SpeculationGates, StepKind, StepRecord

ACCEPTED, PROBABILITIES = [1, 2, 3, 4], [0.6, 0.2, 0.1, 0.1]
# text in stretches: acceptance switches between these with probability 1 / stretch each step
FRIENDLY = ([1, 2, 3, 4, 6], [0.35, 0.25, 0.15, 0.15, 0.10])  # 2.4 tokens on average
HOSTILE = ([1, 2, 3], [0.8, 0.15, 0.05])  # 1.25


def throughput(spec_cost: float, seed: int, budget: float, calls: int = 1, tokens: int = 3000,
               gates_sharing: int = 1, stretch: float | None = None) -> float:
    """One gate deciding `calls` calls of `tokens` tokens each, its measurements kept across them, its budget shared
    with `gates_sharing` gates (5: the drafter's, as `SpeculationGates` shares it). `stretch`: acceptance comes in
    stretches of that many steps on average (FRIENDLY, HOSTILE); None: from ACCEPTED every step."""
    rng, gate, seconds, total = random.Random(seed), SpeculationGates(budget).drafter, 0.0, 0
    gate.budget_shared_with = [gate] * gates_sharing
    friendly = rng.random() < 0.5
    for _ in range(calls):
        committed_in_call = 0
        while committed_in_call < tokens:
            speculate = gate.should_speculate(1)
            if stretch is not None and rng.random() < 1 / stretch:
                friendly = not friendly
            accepted = (ACCEPTED, PROBABILITIES) if stretch is None else FRIENDLY if friendly else HOSTILE
            committed = rng.choices(*accepted)[0] if speculate else 1
            took = (spec_cost if speculate else 1.0) * rng.uniform(0.9, 1.1)
            gate.record(speculate, 1, committed, took)
            seconds, committed_in_call = seconds + took, committed_in_call + committed
        total += committed_in_call
    return total / seconds


CODE_NO_MATCH = ([1, 2, 3, 4], [0.47, 0.32, 0.18, 0.03])  # drafter steps without a lookup match, code prompts
NEVER_PAYS = ([1, 2], [0.85, 0.15])  # 1.15 tokens


def fresh_gate_throughput(seed: int, budget: float, accepted=CODE_NO_MATCH, failing_start: int = 0,
                          steps: int = 70, spec_cost: float = 1.43) -> float:
    """A fresh gate deciding `steps` steps, the first `failing_start` of them committing 1 token if speculative."""
    rng, gates = random.Random(seed), SpeculationGates(budget)
    gate, sibling = gates.drafter, gates.drafter_gate(1)
    gate.budget_shared_with = [gate] + [sibling] * 4
    for _ in range(4):
        sibling.record(True, 1, 2.2, 1.6)
    seconds = tokens = 0.0
    for step in range(steps):
        speculate = gate.should_speculate(1)
        committed = (1 if step < failing_start else rng.choices(*accepted)[0]) if speculate else 1
        took = (spec_cost if speculate else 1.0) * rng.uniform(0.9, 1.1)
        gate.record(speculate, 1, committed, took)
        seconds, tokens = seconds + took, tokens + committed
    return tokens / seconds


def batched_throughput(lookup_tokens: float, seed: int, budget: float, rows: int = 16, steps: int = 2400,
                       lookup_cost: float = 1.8) -> tuple[float, dict]:
    rng, gates, seconds, tokens = random.Random(seed), SpeculationGates(budget), 0.0, 0.0
    kinds = dict.fromkeys(StepKind, 0)
    for _ in range(steps):
        ngram = rng.choice([1, 2, 3, 3, 3, 4]) if rng.random() < 0.4 else 0
        kind = gates.decide(rows, ngram)
        if kind is StepKind.DRAFT:
            cost, committed = 3.0, 1.2 * rows * rng.uniform(0.7, 1.3)
        elif kind is StepKind.LOOKUP:
            cost, committed = lookup_cost, lookup_tokens * rows * rng.uniform(0.8, 1.2)
        else:
            cost, committed = 1.0, rows
        cost *= rng.uniform(0.9, 1.1)
        gates.record(StepRecord(kind, rows, ngram, round(committed), cost, slots=1, verify_seconds=cost))
        seconds, tokens, kinds[kind] = seconds + cost, tokens + committed, kinds[kind] + 1
    return tokens / seconds / rows, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe-budget", type=float, default=0.02)
    budget = parser.parse_args().probe_budget
    mean = sum(a * p for a, p in zip(ACCEPTED, PROBABILITIES))
    print("| speculative step cost (plain steps) | always speculating vs plain | gate vs plain |")
    print("|---|---|---|")
    for spec_cost in (1.3, 1.5, 1.7, 2.0, 3.0):
        gate = sum(throughput(spec_cost, seed, budget) for seed in range(20)) / 20
        print(f"| {spec_cost} | {mean / spec_cost:.2f}x | {gate:.3f}x |")

    print("\n| speculative step cost (plain steps) | always speculating vs plain | five 128-token first calls, "
          "gate vs plain (200 seeds) |")
    print("|---|---|---|")
    for spec_cost in (1.2, 1.3, 1.5, 2.0):
        gate = sum(throughput(spec_cost, seed, budget, calls=5, tokens=128, gates_sharing=5)
                   for seed in range(200)) / 200
        print(f"| {spec_cost} | {mean / spec_cost:.2f}x | {gate:.3f}x |")

    print("\n| speculative step cost (plain steps) | always speculating vs plain | the same calls, acceptance in "
          "stretches of 40 steps, gate vs plain (200 seeds) |")
    print("|---|---|---|")
    stretch_mean = (sum(a * p for a, p in zip(*FRIENDLY)) + sum(a * p for a, p in zip(*HOSTILE))) / 2
    for spec_cost in (1.3, 1.5, 1.8, 2.2, 3.0):
        gate = sum(throughput(spec_cost, seed, budget, calls=5, tokens=128, gates_sharing=5, stretch=40)
                   for seed in range(200)) / 200
        print(f"| {spec_cost} | {stretch_mean / spec_cost:.2f}x | {gate:.3f}x |")

    print("\n| 70 steps of a fresh gate, speculative step costing 1.43 plain steps | always speculating vs plain "
          "| gate vs plain (1,000 seeds) |")
    print("|---|---|---|")
    for label, accepted, failing in (("code acceptance", CODE_NO_MATCH, 0),
                                     ("code acceptance, first 10 steps 1 token", CODE_NO_MATCH, 10),
                                     ("speculation never pays", NEVER_PAYS, 0)):
        always = (sum(a * p for a, p in zip(*accepted)) * (70 - failing) + failing) / 70 / 1.43
        gate = sum(fresh_gate_throughput(seed, budget, accepted, failing) for seed in range(1000)) / 1000
        print(f"| {label} | {always:.2f}x | {gate:.3f}x |")

    print("\n| 16 rows: lookup-only tokens a row (cost 1.8) | gates vs plain | best choice vs plain "
          "| drafter / lookup-only / plain steps |")
    print("|---|---|---|---|")
    for lookup_tokens in (1.6, 1.75, 1.9, 2.2):
        runs = [batched_throughput(lookup_tokens, seed, budget) for seed in range(20)]
        rate = sum(r for r, _ in runs) / len(runs)
        counts = " / ".join(f"{sum(k[kind] for _, k in runs) / len(runs):.0f}" for kind in StepKind)
        best = max(1.0, (0.6 + 0.4 * lookup_tokens) / (0.6 + 0.4 * 1.8))
        print(f"| {lookup_tokens} | {rate:.3f}x | {best:.3f}x | {counts} |")


if __name__ == "__main__":
    main()
