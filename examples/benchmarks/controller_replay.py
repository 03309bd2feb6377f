"""The speculation controller against the previous gates, replayed on recorded greedy decodes
(`hf_diffspec.bench.replay`).

    python -m hf_diffspec.bench.replay record --out runs/replay/traces-shipped.jsonl
    python -m hf_diffspec.bench.replay record --drafter random --out runs/replay/traces-random.jsonl \
        --per-domain 4 --unseen "" --long-prompts 0
    python -m hf_diffspec.bench.replay costs --out runs/replay/costs.json
    python examples/benchmarks/controller_replay.py --traces runs/replay/traces-shipped.jsonl \
        --costs runs/replay/costs.json --split held-out --seeds 200

Per batch size (1 / 4 / 16 / 64 rows) and seed, a call decodes that many traces drawn from the split (with
replacement) to their ends under each controller: fresh, and carried over (after three calls on other traces, as a
process's later `generate` calls are). Reported per controller: throughput against plain decoding of the same traces
(total tokens over total seconds, all seeds), against the per-step oracle (each step the kind that commits the most per
second there, knowing the outcome) and against the best fixed kind (always lookup where found, or always the drafter);
the 1st percentile of the per-call ratio against plain (`--min-tokens`: of calls that long); and lock-in: calls where
a fixed kind beats plain by 5% or more but the controller's second half took only plain steps.

`--draft-scale 10` makes drafting passes ten times dearer and `--no-lookup` drops the lookup drafts: with both,
speculation never pays (the never-pays suite); a random drafter's traces are another.
"""

import argparse
import copy
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from previous_gates import PreviousLookupEstimate, SpeculationGates  # noqa: E402

from hf_diffspec.bench.replay import ReplayCosts, load_traces, positions_of, replay_call  # noqa: E402
from hf_diffspec.runtime.control_cost import best_node_count  # noqa: E402
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind  # noqa: E402


class Fixed:
    """Every step the same kind (LOOKUP: where a row has lookup drafts, else plain), every lookup draft found."""

    def __init__(self, kind: StepKind):
        self.kind = kind

    def start_call(self):
        return self

    def decide(self, rows, ngrams, lengths):
        if self.kind is StepKind.LOOKUP and not any(lengths):
            return StepKind.PLAIN, 0
        return self.kind, max(lengths, default=0)

    def observe_lookups(self, *args):
        pass

    def record(self, *args):
        pass


class PreviousGates:
    """The gates the controller replaced (`previous_gates.py`) with prompt lookup's estimator and sizing of then:
    lookup drafts sized by the cost model from acceptance measured on verified steps only, one gate per match
    length."""

    def __init__(self, costs: ReplayCosts, lookup_tokens: int = 10):
        self.costs = costs
        self.gates = SpeculationGates()
        self.lookup = PreviousLookupEstimate(lookup_tokens)
        self.last = None

    def start_call(self):
        call = copy.copy(self)
        call.gates = copy.deepcopy(self.gates)  # the gates outlive a call; prompt lookup's estimator did not
        call.lookup = PreviousLookupEstimate(self.lookup.num_tokens)
        return call

    def decide(self, rows, ngrams, lengths):
        reach = [self.lookup.reach(k, m) for m, k in zip(ngrams, lengths)]
        k = best_node_count(reach, lambda n: self.costs.verify.profiled(n, rows), 0.0) - 1 if any(lengths) else 0
        ngram = max((m for m, n in zip(ngrams, lengths) if min(n, k)), default=0)
        kind = self.gates.decide(rows, ngram)
        self.last = (kind, k, ngram)
        return kind, k

    def observe_lookups(self, ngrams, proposals, committed):
        kind, k, _ = self.last
        if kind is StepKind.PLAIN or not k:
            return
        for m, drafts, tokens in zip(ngrams, proposals, committed):
            if drafts[:k]:
                self.lookup.record(drafts[:k], m, tokens)

    def record(self, step, ngrams=None, accepted=None):
        self.gates.record(replace(step, lookup_ngram=self.last[2]))


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", required=True)
    parser.add_argument("--costs", required=True)
    parser.add_argument("--split", default="held-out", choices=["held-out", "tuning", "all"])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--draft-scale", type=float, default=1.0)
    parser.add_argument("--no-lookup", action="store_true")
    parser.add_argument("--controllers", default="previous,controller")
    parser.add_argument("--horizon", type=int, default=256,
                        help="the calls' max_new_tokens as the controller is told (the traces were decoded to 256)")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="the percentile column counts only calls that committed at least this many tokens")
    args = parser.parse_args()

    traces = load_traces(args.traces, None if args.split == "all" else args.split)
    pool = [positions_of(t) for t in traces]
    if args.no_lookup:
        pool = [[replace(p, lookup=[], ngram=0, lookup_accepted=0) for p in row] for row in pool]
    import json

    costs = ReplayCosts(json.loads(Path(args.costs).read_text()), scale=args.draft_scale)
    def price(rows: int) -> float:  # a drafting pass in one-token forwards at `rows`, as the loop measures it first
        return costs.draft_seconds(rows) / costs.verify.profiled(1, rows)

    makers = {"previous": lambda rows: PreviousGates(costs),
              "controller": lambda rows: SpeculationController(costs.verify, draft_price=price(rows), horizon=args.horizon)}
    names = args.controllers.split(",")
    print(f"{len(traces)} traces ({args.split}), {args.seeds} seeds, drafting x{args.draft_scale}"
          f"{', no lookup' if args.no_lookup else ''}")
    print("| rows | controller | state | vs plain | vs oracle | vs best fixed | p1 per call vs plain | lock-in |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        totals = {}
        per_call = {}
        locked = {}
        for seed in range(args.seeds):
            rng = random.Random(seed)
            batch = [pool[rng.randrange(len(pool))] for _ in range(rows)]
            warmups = [[pool[rng.randrange(len(pool))] for _ in range(rows)] for _ in range(3)]
            runs = {"plain": Fixed(StepKind.PLAIN), "lookup": Fixed(StepKind.LOOKUP), "draft": Fixed(StepKind.DRAFT)}
            results = {k: replay_call(c, batch, costs, random.Random(seed)) for k, c in runs.items()}
            results["oracle"] = replay_call(Fixed(StepKind.PLAIN), batch, costs, random.Random(seed), oracle=True)
            for name in names:
                fresh = makers[name](rows).start_call()
                results[name, "fresh"] = replay_call(fresh, batch, costs, random.Random(seed))
                carried = makers[name](rows)
                for i, other in enumerate(warmups):
                    call = carried.start_call()
                    replay_call(call, other, costs, random.Random(10_000 + seed * 3 + i))
                    carried = call
                results[name, "carried"] = replay_call(carried.start_call(), batch, costs, random.Random(seed))
            best_fixed = max(results["lookup"].rate, results["draft"].rate)
            for key, result in results.items():
                tokens, seconds = totals.get(key, (0, 0.0))
                totals[key] = (tokens + result.tokens, seconds + result.seconds)
                if result.tokens >= args.min_tokens:
                    per_call.setdefault(key, []).append(result.rate / results["plain"].rate)
                if isinstance(key, tuple):
                    second_half = result.kinds[len(result.kinds) // 2:]
                    lock = best_fixed >= 1.05 * results["plain"].rate and all(k is StepKind.PLAIN for k in second_half)
                    locked[key] = locked.get(key, 0) + lock
            totals.setdefault("best fixed", (0, 0.0))
            t, s = totals["best fixed"]
            best = results["lookup"] if results["lookup"].rate >= results["draft"].rate else results["draft"]
            totals["best fixed"] = (t + best.tokens, s + best.seconds)

        def rate(key):
            return totals[key][0] / totals[key][1]

        plain = rate("plain")
        print(f"| {rows} | plain / lookup / drafter / oracle | | 1.000 / {rate('lookup') / plain:.3f} / "
              f"{rate('draft') / plain:.3f} / {rate('oracle') / plain:.3f} | | | | |")
        for name in names:
            for state in ("fresh", "carried"):
                key = (name, state)
                print(f"| {rows} | {name} | {state} | {rate(key) / plain:.3f} | {rate(key) / rate('oracle'):.3f} | "
                      f"{rate(key) / rate('best fixed'):.3f} | {percentile(per_call[key], 0.01):.3f} | "
                      f"{locked[key] / args.seeds:.1%} |", flush=True)


if __name__ == "__main__":
    main()
