"""The speculation gate on simulated steps: what it keeps of speculation that pays, and what it costs where
speculation loses.

    python examples/benchmarks/gate_simulation.py

A speculative step commits 1-4 tokens with probabilities 0.6 / 0.2 / 0.1 / 0.1 (1.7 on average) and costs
`spec_cost` plain steps (each time x uniform(0.9, 1.1)); a plain step commits 1 token. For each cost, the gate's
throughput relative to always decoding plainly (3000 tokens, mean over 20 seeds), next to always speculating.
"""

import random

from hf_diffspec.runtime.gates import SpeculationGate

ACCEPTED, PROBABILITIES = [1, 2, 3, 4], [0.6, 0.2, 0.1, 0.1]


def throughput(spec_cost: float, seed: int, tokens_wanted: int = 3000) -> float:
    rng, gate, seconds, tokens = random.Random(seed), SpeculationGate(), 0.0, 0
    while tokens < tokens_wanted:
        speculate = gate.should_speculate(1)
        committed = rng.choices(ACCEPTED, PROBABILITIES)[0] if speculate else 1
        took = (spec_cost if speculate else 1.0) * rng.uniform(0.9, 1.1)
        gate.record(speculate, 1, committed, took)
        seconds, tokens = seconds + took, tokens + committed
    return tokens / seconds


mean = sum(a * p for a, p in zip(ACCEPTED, PROBABILITIES))
print("| speculative step cost (plain steps) | always speculating vs plain | gate vs plain |")
print("|---|---|---|")
for spec_cost in (1.3, 1.5, 1.7, 2.0, 3.0):
    gate = sum(throughput(spec_cost, seed) for seed in range(20)) / 20
    print(f"| {spec_cost} | {mean / spec_cost:.2f}x | {gate:.3f}x |")
