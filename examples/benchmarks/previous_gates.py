"""The speculation gates that `hf_diffspec.runtime.control_speculation.SpeculationController` replaced (the runtime's
`control_gates.py` until 2026-12-06), kept as the baseline of `controller_replay.py`. Not used by the library.

Whether a decoding step speculates: measured on this machine, per batch size, and kept across `generate` calls.

Unless the draft length is fixed, each step is a drafter step or a plain decode step (the anchor alone, no drafter
forward). Both are measured as tokens committed per second of whole loop steps: the loop speculates while that beats
plain decoding and otherwise decodes plainly, probing speculation again now and then (acceptance changes with the
text): a near tie often, since such probes cost little and may find it winning again, a clear loss rarely (under 1%
of the decoding time), a probe that costs under a plain step soon after speculation starts losing and then less and
less often while it keeps losing. So a weak drafter, a slow verify (a CPU without native bf16) or a compute-bound
batch never costs more than the probes.

Steps whose rows have prompt-lookup drafts (`drafting_lookup.py`) are gated apart, per length of the suffix they
matched (the longer, the likelier accepted). Without the drafter, such a step verifies its lookup drafts alone or
decodes plainly, gated the same way: the cost model sizes them from estimates (acceptance so far, the profile's cost
of a wider forward at this context length), and at 16 rows steps of lookup drafts alone were seen to lose to plain
steps where the estimates said they paid (`examples/benchmarks/step_timing.py`).

The gates of a drafter, target and setup outlived one call (held on the target), so a second call started from what
the first learned (`controller_replay.py` carries them over the same way).
Losslessness never depends on them: the target alone picks every token.
"""

import math

from hf_diffspec.runtime.control_cost import rows_bucket
from hf_diffspec.runtime.control_speculation import StepKind, StepRecord


class SpeculationGate:
    """Speculative or plain steps, from measured throughput of each (tokens committed per second of loop step), per
    batch size. Unmeasured arms are tried first (speculation, then plain); after that the faster arm is taken.

    An arm's throughput is a ratio of means: smoothed tokens committed per step over smoothed seconds per step (a
    plain mean over an arm's first steps, then an exponential average, so one lucky first step does not decide the
    next dozen: the first speculative step after a prompt often commits twice what the later ones do). One
    speculative step commits 1 token or several by chance, so a per-step rate would stop speculation after a few
    unlucky steps even where it pays on average (simulated: 1.10x instead of 1.27x where 1.31x was there to take).
    While speculation loses, it is probed again after a number of plain steps that grows with the square of what a
    probe costs (`_wait`): a near tie is probed often (each probe costs little, and acceptance comes in stretches,
    so the next may win), a clear loss rarely, and a probe that costs under a plain step within a few steps, backing
    off while such probes lose; a speculative step after more than `stale_after` steps without one weighs a third of
    the arm's measurement rather than a tenth: it measures the stretch of text the loop is in now (`record`; both
    where `SpeculationGates` sets them). While speculation wins, plain decoding is probed too, in proportion
    to its cost, within `probe_budget` of the decoding time shared equally by the gates that probe the same arm
    (`budget_shared_with`): without it, a plain measurement taken once (early, on a short context, or while the
    machine was busy) would keep a losing speculation on for good. Batch
    sizes share measurements within powers of two (rows leave a batch one by one as they finish; measuring 64, 63,
    62 ... rows anew would probe at every departure), and a size met for the first time starts from its
    neighbour's measurements."""

    def __init__(self, probe_budget: float = 0.02, max_wait: int = 256, smoothing: float = 0.1,
                 young_samples: int = 4, young_extra: float = 0.5, speculation_probe_scale: float = 0.004,
                 stale_after: int | None = None, cheap_probe_wait: int | None = None):
        self.probe_budget = probe_budget
        self.max_wait = max_wait
        self.smoothing = smoothing
        self.young_samples = young_samples  # see `_wait`
        self.young_extra = young_extra
        self.speculation_probe_scale = speculation_probe_scale  # see `_wait`
        self.stale_after = stale_after  # see `record` (None: never stale)
        self.cheap_probe_wait = cheap_probe_wait  # see `_wait` (None: cheap probes wait as others do)
        self.steps: dict[tuple[int, bool], tuple[float, float]] = {}  # (rows, speculated) -> (tokens, seconds)
        self.samples: dict[tuple[int, bool], int] = {}  # steps measured per arm (0: inherited from a neighbour)
        self.clock: dict[int, int] = {}  # steps recorded per batch size (counted where `stale_after` is set)
        self.speculated_at: dict[int, int] = {}  # per batch size, `clock` at its latest speculative step
        self.losing_probes: dict[int, int] = {}  # per batch size, speculative probes lost in a row (see `_wait`)
        self.plain_steps_left: dict[int, int] = {}  # while speculation loses: plain steps before the next probe
        self.speculative_steps_left: dict[int, int] = {}  # while it wins: speculative steps before a plain probe
        # a batch size neither this gate nor a neighbouring size has measured starts from the first of `fallbacks`
        # (gates of the same choice under related conditions) that measured it: a new condition pays no probes for
        # what is known
        self.fallbacks: list["SpeculationGate"] = []
        # the gates that decide between the same arms (the drafter's after each match length; lookup drafts alone
        # after each) and share `probe_budget` for their plain probes, an equal part each
        self.budget_shared_with: list["SpeculationGate"] = [self]

    def should_speculate(self, rows: int) -> bool:
        rows = rows_bucket(rows)
        if (rows, True) not in self.steps:
            self._inherit(rows)
        if (rows, True) not in self.steps:
            return True
        if (rows, False) not in self.steps:
            return False
        left = self.plain_steps_left.get(rows, 0)
        if left > 0:
            self.plain_steps_left[rows] = left - 1
            return False
        left = self.speculative_steps_left.get(rows)
        if left is None or left > 0:
            if left is not None:
                self.speculative_steps_left[rows] = left - 1
            return True
        del self.speculative_steps_left[rows]  # a plain probe; the next plain record schedules the one after
        return False

    def _inherit(self, rows: int) -> None:
        """A batch size met for the first time starts from a neighbouring one's measurements (twice as many rows,
        else half as many) and refines them: as rows finish, 64 -> 32 -> 16 ..., a first speculative probe at each
        size cost several plain steps of a large batch for what its neighbour already showed."""
        for near in (2 * rows, rows // 2):
            if (near, True) in self.steps and (near, False) in self.steps:
                self._start_from(self, near, rows)
                return
        for other in self.fallbacks:
            if other is self:
                continue
            if not other.fallbacks and (rows, True) not in other.steps:
                other._inherit(rows)  # a root gate may itself start from its neighbouring size
            if (rows, True) in other.steps and (rows, False) in other.steps:
                self._start_from(other, rows, rows)
                return

    def _start_from(self, other: "SpeculationGate", other_rows: int, rows: int) -> None:
        """Take `other`'s measurements at `other_rows` as this gate's at `rows`, and which arm wins until the next
        probe; this size's first own step of each arm replaces the estimate."""
        for speculated in (True, False):
            self.steps[(rows, speculated)] = other.steps[(other_rows, speculated)]
            self.samples[(rows, speculated)] = 0
        self.plain_steps_left[rows] = other.plain_steps_left.get(other_rows, 0)
        if other_rows in other.speculative_steps_left:
            self.speculative_steps_left[rows] = other.speculative_steps_left[other_rows]

    def record(self, speculated: bool, rows: int, committed: int, seconds: float) -> None:
        rows = rows_bucket(rows)
        key, seconds = (rows, speculated), max(seconds, 1e-9)
        if self.stale_after is not None:
            clock = self.clock[rows] = self.clock.get(rows, 0) + 1
        if speculated and self.stale_after is not None:
            if clock - self.speculated_at.get(rows, clock) > self.stale_after and self.samples.get(key, 0):
                # acceptance comes in stretches: speculation measured before the last `stale_after` steps was
                # measured on another stretch of text, so it counts as 2 steps: this probe weighs a third, and
                # one more follows at once if it loses narrowly (as for a young arm, `_wait`). Weighing a tenth,
                # a probe after a stretch the drafter failed on barely moved the estimate, and on code a fresh
                # process's steps without a lookup match stayed plain for good. Replaced by one probe, the
                # estimate followed its luck (simulated stretches: 1.432x -> 1.407x plain decoding).
                self.samples[key] = min(self.samples[key], 2)
            self.speculated_at[rows] = clock
        self.samples[key] = self.samples.get(key, 0) + 1
        if key in self.steps:
            tokens, took = self.steps[key]
            a = max(self.smoothing, 1 / self.samples[key])
            committed, seconds = (1 - a) * tokens + a * committed, (1 - a) * took + a * seconds
        self.steps[key] = (committed, seconds)
        if (rows, True) not in self.steps or (rows, False) not in self.steps:
            return
        spec_tokens, spec_seconds = self._speculative_estimate(rows)
        plain_tokens, plain_seconds = self.steps[(rows, False)]
        spec, plain = spec_tokens / spec_seconds, plain_tokens / plain_seconds
        if spec >= plain:  # speculation wins: a plain step now and then, each costing a budgeted share
            self.plain_steps_left.pop(rows, None)
            self.losing_probes.pop(rows, None)
            if rows not in self.speculative_steps_left:
                extra = plain_seconds - plain_tokens / spec
                self.speculative_steps_left[rows] = self._wait(extra, spec_seconds, (rows, False))
        else:  # it loses: plain steps until a speculative step's extra cost is a budgeted share
            self.speculative_steps_left.pop(rows, None)
            if speculated or rows not in self.plain_steps_left:
                extra = spec_seconds - spec_tokens / plain
                self.plain_steps_left[rows] = self._wait(extra, plain_seconds, (rows, True))

    def _speculative_estimate(self, rows: int) -> tuple[float, float]:
        """The speculative arm's smoothed (tokens, seconds) per step at `rows`. While it has fewer than
        `young_samples` steps of its own, the steps it lacks count as the mean of the gates sharing its budget that
        have measured as many (the drafter's gates after other match lengths): on code at batch 1, a first drafter
        step without a lookup match that committed 1 token (85 ms against 48 ms plain steps) kept such steps plain
        for the next 70, while drafter steps after 1-token matches committed 2.3 tokens."""
        key = (rows, True)
        tokens, seconds = self.steps[key]
        own = self.samples.get(key, 0)
        if not 0 < own < self.young_samples:
            return tokens, seconds
        grown = [g.steps[key] for g in self.budget_shared_with
                 if g is not self and g.samples.get(key, 0) >= self.young_samples]
        if not grown:
            return tokens, seconds
        lacking = self.young_samples - own
        fill_tokens, fill_seconds = (sum(m[i] for m in grown) / len(grown) for i in (0, 1))
        return ((own * tokens + lacking * fill_tokens) / self.young_samples,
                (own * seconds + lacking * fill_seconds) / self.young_samples)

    def _wait(self, extra: float, step_seconds: float, loser: tuple[int, bool]) -> int:
        """Steps of the winning arm before a probe of the other (`loser`: its key) that costs `extra` seconds more
        than the winner would take for its tokens, `loss` of the winner's steps.

        Plain steps that lose are probed after loss / (budget share) steps: those probes cost the gate's share of
        `probe_budget`. Speculation that loses is probed after loss^2 / `speculation_probe_scale` steps: its probes
        cost scale / loss of the decoding time, a near tie more (a probe losing 0.2 steps: after 10 steps, 2%), a
        clear loss less (2 steps: after 1,000, capped at `max_wait`, 0.8%). Acceptance comes in stretches (a run of
        prose the drafter cannot guess, then a list it can), so the probes that find speculation winning again are
        those of a near tie. Simulated (`gate_simulation.py`, five 128-token calls on stretches of 40 steps with 2.4
        or 1.25 tokens a speculative step), at a speculative step costing 1.3 / 1.5 / 1.8 plain steps: 1.347x /
        1.170x / 1.051x -> 1.432x / 1.246x / 1.071x plain decoding, against waits in proportion to the loss within
        the budget shared by the drafter's gates. At batch 1 on the built-in prompts, interleaved in one process,
        tokens/s rose 1.4% / 7.4% / 4.3% on code / math / chat (docs/results.md).

        Speculation that loses is also probed at the next step while it has fewer than `young_samples` steps of
        its own measured (inherited ones are not its own) and a probe costs under `young_extra` of a plain step.
        Without this, one unlucky speculative step (1 token where 1.7 are usual) kept speculation off for dozens of
        steps of a fresh process's first calls (`gate_simulation.py`, five 128-token calls with fresh gates: 1.18x
        -> 1.23x plain decoding where 1.31x is there to take). A clear loss, such as a drafter step at 16 rows, is
        not probed more for it; plain steps commit one token a row, so one measures them well.

        A probe that costs under one plain step comes after at most `cheap_probe_wait` steps, twice as many after
        each such probe that lost (up to the wait above). On the built-in code prompts the first drafter steps
        without a lookup match fall where the drafter fails (1 token at 1.43 plain steps' time, 1.8 tokens later):
        the gate waited 46 steps after its young probes, and in three of six fresh processes such steps stayed plain
        for the rest of the bench. Simulated (`gate_simulation.py`, a fresh gate deciding 70 steps whose first 10
        commit 1 token a speculative step, with a stale measurement weighing a third, `record`): 1.00x -> 1.13x
        plain decoding; where speculation never pays (1.15 tokens at 1.43 plain steps' time), 0.97x -> 0.95x, and
        0.99x -> 0.98x over 3,000 steps."""
        speculated = loser[1]
        young = speculated and 0 < self.samples.get(loser, 0) < self.young_samples
        if young and extra < self.young_extra * step_seconds:
            return 0
        loss = extra / step_seconds  # what one probe costs, in the winner's steps
        if speculated:
            wait = math.ceil(loss * loss / self.speculation_probe_scale)
            if loss < 1 and self.cheap_probe_wait:  # within `cheap_probe_wait` steps, doubling while probes lose
                lost = self.losing_probes[loser[0]] = self.losing_probes.get(loser[0], 0) + 1
                wait = min(wait, self.cheap_probe_wait << min(lost - 1, 8))
            return min(self.max_wait, max(1, wait))
        budget = self.probe_budget / len(self.budget_shared_with)
        return min(self.max_wait, max(1, math.ceil(loss / budget)))


class SpeculationGates:
    """The gates of one drafter, target and setup, which decide each step's `StepKind`:

    - `drafter`: steps whose rows have no lookup drafts: a drafter step or a plain one;
    - `after_match[n]`: steps after an n-token lookup match: a drafter step (lookup drafts grafted on) or not;
    - `lookups_alone[n]`: those steps without the drafter: the lookup drafts alone, or a plain step.

    A batch size new to a gate after a match starts from what steps without lookup drafts measured there (the
    drafter's steps against plain ones; without the drafter, the step is at least as good as a plain one), else
    from what another match length measured: at a large batch nearly every step has lookup drafts, and each gate's
    own first drafter probe there costs several plain steps.

    Only `drafter` probes cheaply soon and weighs stale measurements less (`SpeculationGate.stale_after`,
    `cheap_probe_wait`): its other arm, a plain step, commits one token whatever the text, so only probes tell it
    when the text has turned predictable. The gates after a match weigh two speculative steps whose yields both swing
    with the text, where a probe that weighs much decides on luck (on the unseen families' other-language prompts,
    with every gate probing so and a probe replacing a stale measurement, eight fresh processes ran 2.45x plain
    decoding on average, the previous gates 2.73x and 2.58x in two series of five and four; docs/results.md)."""

    def __init__(self, probe_budget: float = 0.02):
        self.probe_budget = probe_budget  # each gate's (`SpeculationGate`)
        self.drafter = SpeculationGate(probe_budget, stale_after=5, cheap_probe_wait=8)
        self.after_match: dict[int, SpeculationGate] = {}
        self.lookups_alone: dict[int, SpeculationGate] = {}
        # the gates a new batch size may start from, in the order they were made (see `SpeculationGate.fallbacks`)
        self._drafter_family = [self.drafter]
        self._alone_family: list[SpeculationGate] = []
        self.drafter.budget_shared_with = self._drafter_family

    def drafter_gate(self, lookup_ngram: int) -> SpeculationGate:
        """Drafter step or not, after a `lookup_ngram`-token match (0: no lookup drafts)."""
        if not lookup_ngram:
            return self.drafter
        return self._family_gate(self.after_match, self._drafter_family, lookup_ngram)

    def lookups_alone_gate(self, lookup_ngram: int) -> SpeculationGate:
        """Without the drafter, after a `lookup_ngram`-token match: verify the lookup drafts alone, or not."""
        return self._family_gate(self.lookups_alone, self._alone_family, lookup_ngram)

    def _family_gate(self, gates: dict, family: list, lookup_ngram: int) -> SpeculationGate:
        if lookup_ngram not in gates:
            gate = gates[lookup_ngram] = SpeculationGate(self.probe_budget)
            family.append(gate)
            gate.fallbacks = gate.budget_shared_with = family
        return gates[lookup_ngram]

    def decide(self, rows: int, lookup_ngram: int = 0) -> StepKind:
        """The kind of the next step of `rows` rows whose longest lookup match is `lookup_ngram` tokens (0: none)."""
        if self.drafter_gate(lookup_ngram).should_speculate(rows):
            return StepKind.DRAFT
        if lookup_ngram and self.lookups_alone_gate(lookup_ngram).should_speculate(rows):
            return StepKind.LOOKUP
        return StepKind.PLAIN

    def record(self, step: StepRecord) -> None:
        """Measure a step in the gates that decided it."""
        drafted = step.kind is StepKind.DRAFT
        self.drafter_gate(step.lookup_ngram).record(drafted, step.rows, step.committed, step.seconds)
        if step.lookup_ngram and not drafted:
            self.lookups_alone_gate(step.lookup_ngram).record(step.kind is StepKind.LOOKUP, step.rows,
                                                              step.committed, step.seconds)


class PreviousLookupEstimate:
    """Prompt lookup's acceptance estimate of then (`drafting_lookup.PromptLookup` until 2026-12-06): per match length
    and depth, measured on verified steps only, from a prior of 0.4 for the first draft and 0.8 for each later one
    (two pseudo steps)."""

    def __init__(self, num_tokens: int, prior: tuple[float, float] = (0.4, 0.8), prior_weight: float = 2.0):
        self.num_tokens = num_tokens
        self.prior = [prior[min(d, 1)] for d in range(num_tokens)]
        self.prior_weight = prior_weight
        self.trials: dict[int, list[float]] = {}
        self.hits: dict[int, list[float]] = {}

    def _counts(self, ngram: int) -> tuple[list[float], list[float]]:
        if ngram not in self.trials:
            self.trials[ngram] = [self.prior_weight] * self.num_tokens
            self.hits[ngram] = [p * self.prior_weight for p in self.prior]
        return self.trials[ngram], self.hits[ngram]

    def reach(self, length: int, ngram: int) -> list[float]:
        trials, hits = self._counts(ngram)
        probabilities, reach = [], 1.0
        for d in range(length):
            reach *= hits[d] / trials[d]
            probabilities.append(reach)
        return probabilities

    def record(self, drafts, ngram: int, committed) -> None:
        trials, hits = self._counts(ngram)
        accepted = 0
        for draft, token in zip(drafts, committed):
            if draft != token:
                break
            accepted += 1
        for d in range(min(accepted + 1, len(drafts), len(committed))):
            trials[d] += 1
            hits[d] += d < accepted
