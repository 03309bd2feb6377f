"""How many drafts each row verifies per step: one object holds that decision, whatever decides it.

- fixed length: the user set `num_assistant_tokens=k` (transformers' knob) → k drafts every step;
- measured cost model (a verify-cost profile exists for this target, device, dtype and thread count): the number of
  slots that maximises expected committed tokens per second, from reach probabilities (the length head's acceptance
  probabilities when the drafter has one, else the drafter's confidences) and the measured draft and verify times;
- neither: the drafter's configured `num_draft_tokens` (a one-time warning says how to measure a profile).

And whether to speculate at all: unless the length is fixed, each step is either a speculative step or a plain decode
step (the anchor alone, no drafter forward). The policy measures both on this machine, per batch size: tokens
committed per second of whole loop steps. It speculates while that beats plain decoding and otherwise decodes
plainly, probing speculation again now and then (acceptance changes with the text), so rarely that the probes cost at
most ~2% of the decoding time. The measurements outlive one `generate` call (`speculation_gate_for`: one gate per
drafter, target, dtype, thread count and method), so a second call starts from what the first learned instead of
paying for the first measurements again. So a weak drafter, a slow verify (a CPU without native bf16) or a
compute-bound batch never costs more than the probes.

With prompt-lookup drafts (`lookup.py`), steps that have some are gated apart, per length of the suffix they matched,
and `lookup_lengths` sizes them with the same cost model. Without the drafter, such a step verifies them alone or
decodes plainly, gated the same way: the sizing rests on estimates (acceptance so far, the profile's cost of a wider
forward at this context length), and at 16 rows steps of lookup drafts alone were seen to lose to plain steps where
the estimates said they paid (`examples/benchmarks/step_timing.py`).

Every answer is capped by what is left to generate and by the target's context. Losslessness never depends on the
answer: the target alone picks every committed token.
"""

import math
import weakref

import torch

from .cost_model import VerifyCost, best_node_count, rows_bucket


class DraftLengthPolicy:
    """Decides drafts per row. `fixed`: the user's fixed length or None; `verify_cost`: the measured T_verify(n, rows)
    or None; `block_size`: the drafter's block; `default_length`: its configured `num_draft_tokens` (or None);
    `tree_depth`: for D²SD, the deepest tree level; `max_positions`: the target's context; `gate`: the speculation
    gate of steps without prompt-lookup drafts; `lookup_gate(n)`: makes the gate (drafter or not) of steps after an
    n-token lookup match; `lookup_alone_gate(n)`: makes the gate of those steps without the drafter (lookup drafts
    alone, or a plain step)."""

    def __init__(self, block_size: int, default_length: int | None = None, fixed: int | None = None,
                 verify_cost: VerifyCost | None = None, tree_depth: int | None = None,
                 max_positions: int | None = None, gate: "SpeculationGate | None" = None,
                 lookup_gate=None, lookup_alone_gate=None):
        self.block_size = block_size
        self.fixed = fixed
        self.verify_cost = verify_cost if fixed is None else None
        self.default_length = default_length
        self.tree_depth = tree_depth
        self.max_positions = max_positions
        self.draft_seconds: float | None = None  # running estimate of one drafting pass
        self.gate = (gate or SpeculationGate()) if fixed is None else None
        # steps that have prompt-lookup drafts are decided apart, per length of the n-gram they matched (the longer,
        # the likelier they are accepted): drafter or not, measured as above. Without the drafter, the lookup drafts
        # the cost model sized are verified (it sizes them from their measured acceptance and the measured verify
        # cost, to none where they do not pay). `lookup_gate(n)` makes the gate for n-token matches.
        self.lookup_gate = (lookup_gate or (lambda n: SpeculationGate())) if fixed is None else None
        self.lookup_gates: dict[int, SpeculationGate] = {}
        self.lookup_family: list[SpeculationGate] = [self.gate] if self.gate is not None else []
        # without the drafter: lookup drafts alone (the gate's speculative arm) or a plain step
        self.lookup_alone_gate = (lookup_alone_gate or (lambda n: SpeculationGate())) if fixed is None else None
        self.lookup_alone_gates: dict[int, SpeculationGate] = {}
        self.lookup_alone_family: list[SpeculationGate] = []

    def _gate(self, lookup_ngram: int) -> "SpeculationGate | None":
        if self.gate is None or not lookup_ngram:
            return self.gate
        # a batch size new to it starts from what steps without lookup drafts measured there (the drafter's steps
        # against plain ones; without the drafter, the step is at least as good as a plain one), else from
        # what steps after another match length measured: at a large batch nearly every step has lookup drafts,
        # and each gate's own first drafter probe there costs several plain steps
        return self._family_gate(self.lookup_gates, self.lookup_family, self.lookup_gate, lookup_ngram)

    @staticmethod
    def _family_gate(gates: dict, family: list, make, lookup_ngram: int) -> "SpeculationGate":
        """The gate for `lookup_ngram`-token matches in `gates`, made by `make` the first time; a batch size new to
        it starts from the first gate of `family` that measured it."""
        if lookup_ngram not in gates:
            gate = gates[lookup_ngram] = make(lookup_ngram)
            family.append(gate)
            gate.fallbacks = family
        return gates[lookup_ngram]

    def should_speculate(self, rows: int, lookup_ngram: int = 0) -> bool:
        """Draft this step (True), or not (False: the anchors alone, with their prompt-lookup drafts when the step has
        some, found after a `lookup_ngram`-token match)? Always True with a fixed length."""
        gate = self._gate(lookup_ngram)
        return gate is None or gate.should_speculate(rows)

    def _alone_gate(self, lookup_ngram: int) -> "SpeculationGate | None":
        if self.lookup_alone_gate is None:
            return None
        return self._family_gate(self.lookup_alone_gates, self.lookup_alone_family, self.lookup_alone_gate,
                                 lookup_ngram)

    def should_verify_lookups_alone(self, rows: int, lookup_ngram: int) -> bool:
        """A step without the drafter whose rows have prompt-lookup drafts (found after a `lookup_ngram`-token
        match, the longest of the batch): verify them (True), or decode plainly (False)? Always True with a fixed
        length."""
        gate = self._alone_gate(lookup_ngram)
        return gate is None or gate.should_speculate(rows)

    def record_step(self, speculated: bool, rows: int, committed: int, seconds: float, slots: int,
                    verify_seconds: float, lookup_ngram: int = 0, lookups_alone: bool = False) -> None:
        """A whole loop step (draft, verify, commit) of `rows` rows committed `committed` tokens in `seconds`, of
        which `verify_seconds` verified `slots` slots per row; `lookup_ngram`: its rows had prompt-lookup drafts found
        after a match of that many tokens (0: none); `lookups_alone`: a step without the drafter verified them (else,
        without the drafter, it was a plain step)."""
        gate = self._gate(lookup_ngram)
        if gate is not None:
            gate.record(speculated, rows, committed, seconds)
        alone = self._alone_gate(lookup_ngram) if lookup_ngram and not speculated else None
        if alone is not None:
            alone.record(lookups_alone, rows, committed, seconds)
        if self.verify_cost is not None:
            self.verify_cost.observe(slots, rows, verify_seconds)

    @property
    def uses_cost_model(self) -> bool:
        """True when the length is chosen per step from reach probabilities (drafting must provide them)."""
        return self.verify_cost is not None

    def depth_limit(self, root_position: int, remaining: int) -> int:
        """The most drafts a row may verify this step, before drafting: 0 means verify the anchor alone.
        `remaining`: tokens the row may still commit after its anchor."""
        if self.fixed is not None:
            limit = self.fixed
        elif self.tree_depth is not None:
            limit = self.tree_depth
        elif self.verify_cost is not None:
            limit = self.block_size - 1  # the cost model decides how much of the block to verify
        else:
            limit = self.default_length or self.block_size - 1
        limit = min(limit, remaining, self.block_size - 1)
        if self.max_positions is not None:
            limit = min(limit, self.max_positions - 1 - root_position)
        return max(limit, 0)

    def chain_lengths(self, reach_rows: list[list[float]], limits: list[int]) -> list[int]:
        """Drafts per row once drafted: the cost model's best common slot count for the batch (its forward is a
        rectangle), within each row's limit. Without a cost model, the limits themselves."""
        if self.verify_cost is None:
            return limits
        rows = len(limits)
        n = best_node_count([r[:d] for r, d in zip(reach_rows, limits)], lambda n: self.verify_cost(n, rows),
                            self.draft_seconds or 0.0)
        return [min(d, n - 1) for d in limits]

    def tree_node_count(self, reach: list[float], rows: int) -> int:
        """Nodes (root included) of a row's tree to verify, given its candidates' reach probabilities in decreasing
        order; the other rows are assumed to verify as many slots (the batch's forward is a rectangle)."""
        if self.verify_cost is None:
            return len(reach) + 1
        return best_node_count([reach], lambda n: self.verify_cost(n, rows), self.draft_seconds or 0.0)

    def lookup_lengths(self, reach_rows: list[list[float]], rows: int) -> list[int]:
        """How many of each row's prompt-lookup drafts to verify, given their estimated reach probabilities: they cost
        no drafting, only verify slots, and the batch's forward is a rectangle, so one count for every row (none
        when they do not pay: at a large batch a forward over more tokens costs more)."""
        if self.verify_cost is None:
            return [len(r) for r in reach_rows]
        n = best_node_count(reach_rows, lambda n: self.verify_cost(n, rows), 0.0)
        return [min(len(r), n - 1) for r in reach_rows]

    def record_draft_time(self, seconds: float) -> None:
        """One drafting pass took `seconds` (both passes for D²SD); smoothed, it prices the next step's drafts."""
        self.draft_seconds = seconds if self.draft_seconds is None else 0.8 * self.draft_seconds + 0.2 * seconds


class SpeculationGate:
    """Speculative or plain steps, from measured throughput of each (tokens committed per second of loop step), per
    batch size. Unmeasured arms are tried first (speculation, then plain); after that the faster arm is taken.

    An arm's throughput is a ratio of means: smoothed tokens committed per step over smoothed seconds per step (a
    plain mean over an arm's first steps, then an exponential average, so one lucky first step does not decide the
    next dozen: the first speculative step after a prompt often commits twice what the later ones do). One
    speculative step commits 1 token or several by chance, so a per-step rate would stop speculation after a few
    unlucky steps even where it pays on average (simulated: 1.10x instead of 1.27x where 1.31x was there to take).
    While speculation loses, it is probed again only after enough plain steps that probing costs at most
    `probe_budget` of the decoding time: a speculative step that costs `extra` seconds more than plain steps
    committing as many tokens (on average) is followed by extra / (probe_budget x plain step time) plain steps (at
    least 1, at most `max_wait`). A near tie is probed often (each probe costs little), a clear loss rarely. While
    speculation wins, plain decoding is probed the same way: without it, a plain measurement taken once (early, on
    a short context, or while the machine was busy) would keep a losing speculation on for good. Batch
    sizes share measurements within powers of two (rows leave a batch one by one as they finish; measuring 64, 63,
    62 ... rows anew would probe at every departure), and a size met for the first time starts from its
    neighbour's measurements."""

    def __init__(self, probe_budget: float = 0.02, max_wait: int = 256, smoothing: float = 0.1):
        self.probe_budget = probe_budget
        self.max_wait = max_wait
        self.smoothing = smoothing
        self.steps: dict[tuple[int, bool], tuple[float, float]] = {}  # (rows, speculated) -> (tokens, seconds)
        self.samples: dict[tuple[int, bool], int] = {}  # steps measured per arm (0: inherited from a neighbour)
        self.plain_steps_left: dict[int, int] = {}  # while speculation loses: plain steps before the next probe
        self.speculative_steps_left: dict[int, int] = {}  # while it wins: speculative steps before a plain probe
        # a batch size neither this gate nor a neighbouring size has measured starts from the first of `fallbacks`
        # (gates of the same choice under related conditions) that measured it: a new condition pays no probes for
        # what is known
        self.fallbacks: list["SpeculationGate"] = []

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
        self.samples[key] = self.samples.get(key, 0) + 1
        if key in self.steps:
            tokens, took = self.steps[key]
            a = max(self.smoothing, 1 / self.samples[key])
            committed, seconds = (1 - a) * tokens + a * committed, (1 - a) * took + a * seconds
        self.steps[key] = (committed, seconds)
        if (rows, True) not in self.steps or (rows, False) not in self.steps:
            return
        spec_tokens, spec_seconds = self.steps[(rows, True)]
        plain_tokens, plain_seconds = self.steps[(rows, False)]
        spec, plain = spec_tokens / spec_seconds, plain_tokens / plain_seconds
        if spec >= plain:  # speculation wins: a plain step now and then, each costing a budgeted share
            self.plain_steps_left.pop(rows, None)
            if rows not in self.speculative_steps_left:
                extra = plain_seconds - plain_tokens / spec
                self.speculative_steps_left[rows] = self._wait(extra, spec_seconds)
        else:  # it loses: plain steps until a speculative step's extra cost is a budgeted share
            self.speculative_steps_left.pop(rows, None)
            if speculated or rows not in self.plain_steps_left:
                extra = spec_seconds - spec_tokens / plain
                self.plain_steps_left[rows] = self._wait(extra, plain_seconds)

    def _wait(self, extra: float, step_seconds: float) -> int:
        """Steps of the winning arm before a probe of the other that costs `extra` seconds more than the winner
        would take for its tokens: the probes cost `probe_budget` of the decoding time."""
        return min(self.max_wait, max(1, math.ceil(extra / (self.probe_budget * step_seconds))))


_GATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def speculation_gate_for(drafter, target, method: str) -> SpeculationGate:
    """The gate that `drafter` decoding for `target` with `method` keeps across `generate` calls. Its measurements
    hold for one setup only: a new target, dtype, device or thread count gets a new gate."""
    key = (id(target), target.dtype, target.device, torch.get_num_threads(), method)
    gates = _GATES.setdefault(drafter, {})
    if key not in gates:
        gates[key] = SpeculationGate()
    return gates[key]
