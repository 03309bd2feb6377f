"""Whether a decoding step speculates, and with what: one estimator per arm, one decision rule, a stated bound on what
it can lose.

A step is one of three kinds (`StepKind`): the drafter's trees with the rows' prompt-lookup drafts grafted on (DRAFT),
the lookup drafts alone (LOOKUP), or the anchors alone, a plain decode step (PLAIN). Each step takes the kind with the
most expected tokens per second,

    rate(kind) = sum over rows of E[tokens committed] / (overhead(kind) + T_verify(slots, rows)),

where T_verify is the measured cost model (`control_cost.VerifyCost`, at the exact row count: rows enter only there)
and overhead(kind) the measured rest of such a step: the loop's own work (lookup, commit, bookkeeping), the same for
every kind, and for a drafter step its drafting pass (`draft_price` until measured), both in profiled one-token
forwards at the step's rows. The expectations:

- PLAIN: 1 token a row.
- LOOKUP: per row, 1 + the sum of its drafts' reach probabilities, verified as deep as `best_node_count` says pays.
  Acceptance per depth (of draft d, given d - 1 accepted) is estimated per length of the suffix the drafts were found
  after. It is scored with full information: after every step, whatever its kind, each row's lookup drafts are
  compared with what the target committed, so lookup is never probed.
- DRAFT: per row, 1 + the drafts a drafter step accepts (its lookup drafts grafted on), estimated per match length;
  how deep the tree goes is the drafter's own per-node confidence and the cost model's decision (`best_node_count`),
  so the estimate is of what a sized step commits, not per depth. Only drafter steps measure it, so it is the one arm
  explored: each step decides on the larger of its posterior mean and one posterior draw (optimistic Thompson
  sampling; a draw below the mean would only pick an arm that is observed anyway).

Every estimate is a posterior whose prior is the arm's estimate pooled over match lengths, weighing `PRIOR_WEIGHT`
observations (the pooled one's prior: Beta(1, 1) for acceptance per depth, a mean of 1 drafter token accepted).
Observations are discounted by `DISCOUNT` a step (acceptance changes with the text); the drafter's acceptance every
step, observed or not, so a drafter not tried for a while grows uncertain and is tried again.

The bound: a call's decoding time stays within plain decoding's for the tokens it committed plus the larger of EPSILON
x that and one advance, as far as the cost model and the lookup estimates hold. The budget is that allowance less
what the call spent beyond plain decoding, both in plain steps at each step's prices (a load that slows every forward
slows plain decoding alike: the bound is against plain decoding at the same load). The advance lets a call try its
drafter before EPSILON of it has accrued: one plain step, or a drafter step's price beyond one token a row if that is
at most EPSILON of the call's `max_new_tokens` (`horizon`) plain steps. It is not added to what accrues but a floor
under it, so where speculation never pays the tries settle at 1 / (1 + EPSILON) = 0.99x plain decoding, the first
one included. A drafter step is taken only when the budget stays non-negative even if it commits one token a row.
Its price is known before the first one: the loop measures a drafting pass against a verify step once per machine
(`control_profiles.drafting_price_for`). A drafter never seen is tried first where the budget covers its step, as UCB
plays each arm once, and not where it does not (drafting once whatever the price lost 6% of a call at 16 rows, where
one step of a slow drafter cost 14 plain steps). Lookup steps are never tries (lookup is observed after every step,
whatever was verified): they are taken on their estimate alone; where speculation pays the budget grows and never
binds.

What a call learned carries to the next call on the same drafter, target and setup (`control_state.py`), its
observations weighed `CALL_DISCOUNT`. Losslessness never depends on any of it: the target alone picks every token.
"""

import copy
import enum
import random
from dataclasses import dataclass

import torch

from .control_cost import best_node_count
from .control_state import memory_of

EPSILON = 0.01  # the bound above: the drafter's tries may cost at most 1% over plain decoding
DISCOUNT = 0.9  # per step: an observation counts half after 7 steps (acceptance changes with the text)
CALL_DISCOUNT = 0.5  # a new call (another prompt) weighs what earlier calls saw as half
PRIOR_WEIGHT = 2.0  # observations the pooled prior is worth: two steps of a match length decide for it


class StepKind(enum.Enum):
    """What a loop step verifies."""

    DRAFT = "draft"  # the drafter's trees (with the rows' prompt-lookup drafts grafted on)
    LOOKUP = "lookup"  # no drafter forward: the rows' prompt-lookup drafts alone
    PLAIN = "plain"  # no drafts: the anchors alone, a plain decode step


@dataclass(frozen=True)
class StepRecord:
    """One loop step as the controller and the cost model learn from it.

    Args:
        kind: what it verified.
        rows: rows in the batch.
        lookup_ngram: the longest prompt-lookup match among its rows (0: none had lookup drafts).
        committed: tokens committed, all rows together.
        seconds: the whole step (lookup, draft, verify, commit).
        slots: slots verified per row (the width of the target's forward).
        verify_seconds: the target's forward and the commit.
        draft_seconds: the drafter's pass and its trees (0 but in a drafter step).
    """

    kind: StepKind
    rows: int
    lookup_ngram: int
    committed: int
    seconds: float
    slots: int
    verify_seconds: float
    draft_seconds: float = 0.0


class _Counts:
    """Discounted (successes, trials) per key and depth, with the pooled prior described in the module docstring.
    A key's counts are discounted once per step that observes it: what is not observed keeps what was learned."""

    def __init__(self):
        self.hits: dict = {}
        self.trials: dict = {}

    def add_step(self, observations: list[tuple], discount: float | None = None) -> None:
        """One step's observations, (key, depth, successes, trials) each; the keys observed are discounted first
        (by `DISCOUNT` unless `discount` is given)."""
        discount = DISCOUNT if discount is None else discount
        seen = {(k, depth) for key, depth, _, _ in observations for k in (key, None)}
        for entry in seen:
            if entry in self.trials:
                self.hits[entry] *= discount
                self.trials[entry] *= discount
        for key, depth, hit, trial in observations:
            for k in (key, None):  # None: pooled over keys
                self.hits[k, depth] = self.hits.get((k, depth), 0.0) + hit
                self.trials[k, depth] = self.trials.get((k, depth), 0.0) + trial

    def discount(self, factor: float) -> None:
        for table in (self.hits, self.trials):
            for k in table:
                table[k] *= factor

    def mean(self, key, guess: float) -> float:
        """The discounted mean of `key`'s observations (depth 0); `guess` before any."""
        trials = self.trials.get((key, 0), 0.0)
        return self.hits[key, 0] / trials if trials else guess

    def posterior(self, key, depth: int, prior: tuple[float, float]) -> tuple[float, float]:
        """(successes, trials) of `key` at `depth` with the pooled estimate as prior (`prior`: the pooled one's)."""
        pooled_hits = self.hits.get((None, depth), 0.0) + prior[0]
        pooled_trials = self.trials.get((None, depth), 0.0) + prior[1]
        mean = pooled_hits / pooled_trials
        return (self.hits.get((key, depth), 0.0) + PRIOR_WEIGHT * mean,
                self.trials.get((key, depth), 0.0) + PRIOR_WEIGHT)


class SpeculationController:
    """Decides each step's kind and how many lookup drafts it verifies (see the module docstring).

    `verify_cost(n, rows)`: the cost model (None: a flat cost, the mean verify time of the steps seen);
    `draft_price`: what a drafting pass costs, in one-token target forwards, until the call's own drafter steps
    measure it (`controller_for` gives the price measured for the machine); `seed`: of the Thompson draws (they never change output)."""

    def __init__(self, verify_cost=None, draft_price: float = 1.0, seed: int = 0, horizon: int = 0):
        self.verify_cost = verify_cost
        self.draft_price = draft_price
        self.rng = random.Random(seed)
        self.lookup = _Counts()  # per match length and depth: lookup draft d accepted given d - 1 was
        self.drafter = _Counts()  # per match length: drafts a drafter step accepted per row (depth 0)
        # in profiled one-token forwards at the step's rows: each step's time beyond its verify forward and drafting
        # (the loop's own work), and a drafter step's drafting
        self.loop = _Counts()
        self.drafting = _Counts()
        self.slots = _Counts()  # per kind: slots verified
        self.flat_verify = _Counts()  # without a cost model: verify seconds of the steps seen
        # the bound's terms, in plain steps at each step's prices: the advance (None until the call's first decision),
        # the plain steps the committed tokens are worth, and the time spent beyond that
        self.advance: float | None = None
        self.committed_steps = 0.0
        self.spent = 0.0
        self.horizon = horizon  # the call's plain steps if it runs to its length limit (`max_new_tokens`)

    @property
    def budget(self) -> float | None:
        """What the call may still spend beyond plain decoding, in plain steps (None before its first decision)."""
        return None if self.advance is None else max(self.advance, EPSILON * self.committed_steps) - self.spent

    def start_call(self) -> "SpeculationController":
        """A copy for a new call: earlier calls' observations weigh `CALL_DISCOUNT`, the budget starts afresh."""
        call = copy.deepcopy(self)
        for counts in (call.lookup, call.drafter, call.loop, call.drafting, call.slots, call.flat_verify):
            counts.discount(CALL_DISCOUNT)
        call.advance, call.committed_steps, call.spent = None, 0.0, 0.0
        return call

    # ----- costs ----------------------------------------------------------------------------------------------------
    def _verify(self, n: int, rows: int) -> float:
        if self.verify_cost is not None:
            return self.verify_cost(n, rows)
        return self.flat_verify.mean("verify", 1e-3)

    def _unit(self, rows: int) -> float:
        """A one-token forward at `rows` as profiled, at the load live steps showed (`VerifyCost.loaded`): what the
        other costs are measured in, so that they carry over to other row counts, and a load that slows every
        forward raises every price alike (drafting measured on a busy machine does not outprice verifying)."""
        return getattr(self.verify_cost, "loaded", self._verify)(1, rows)

    def _overhead(self, kind: StepKind, rows: int) -> float:
        """The rest of a `kind` step at `rows`: the loop's own work, the same for every kind, and for a drafter step
        the drafting pass (`draft_price` until measured, and again as its measurements fade)."""
        drafting = self.drafting.mean("drafting", self.draft_price) if kind is StepKind.DRAFT else 0.0
        return (self.loop.mean("loop", 0.0) + drafting) * self._unit(rows)

    def _step_cost(self, kind: StepKind, rows: int, slots: float) -> float:
        return self._overhead(kind, rows) + self._verify(slots, rows)

    def _draft_slots(self) -> float:
        return self.slots.mean(StepKind.DRAFT, 4.0)

    # ----- the decision -------------------------------------------------------------------------------------------
    def _lookup_reach(self, ngram: int, length: int, draw: bool) -> list[float]:
        reach, out = 1.0, []
        for d in range(1, length + 1):
            hits, trials = self.lookup.posterior(ngram, d, (1.0, 2.0))
            reach *= self.rng.betavariate(hits, trials - hits) if draw else hits / trials
            out.append(reach)
        return out

    def _drafter_tokens(self, ngram: int, draw: bool) -> float:
        """Drafts a drafter step accepts per row after an `ngram`-token match: the posterior mean, or with `draw`
        the larger of it and a draw (optimistic Thompson sampling: only drafter steps tell what drafter steps
        commit, so only an optimistic draw buys information; plain steps are known, lookup is observed anyway)."""
        accepted, steps = self.drafter.posterior(ngram, 0, (1.0, 1.0))
        mean = accepted / steps
        return max(mean, self.rng.gammavariate(accepted, 1 / steps)) if draw else mean

    def expects_draft(self, rows: int) -> bool:
        """Whether, at its estimates' means, a drafter step commits more per second than a plain one at `rows` rows:
        the loop then drafts the next step ahead (`drafting.draft_ahead`); a probe it would not expect is drafted at
        its own step."""
        draft = rows * (1 + self._drafter_tokens(0, draw=False)) / self._step_cost(StepKind.DRAFT, rows,
                                                                                   self._draft_slots())
        return draft > rows / self._step_cost(StepKind.PLAIN, rows, 1)

    def decide(self, rows: int, ngrams: list[int], lookup_lengths: list[int]) -> tuple[StepKind, int]:
        """The next step's kind, and how many lookup drafts each row verifies in it (its found ones, up to this),
        for `rows` rows whose lookup drafts were found after matches of `ngrams` tokens (0: none), `lookup_lengths`
        deep."""
        cost = lambda n: self._verify(n, rows)  # noqa: E731
        plain_cost = self._step_cost(StepKind.PLAIN, rows, 1)
        reach = [self._lookup_reach(m, k, draw=False) if k else [] for m, k in zip(ngrams, lookup_lengths)]
        lookup_n = best_node_count(reach, cost, self._overhead(StepKind.LOOKUP, rows)) if any(lookup_lengths) else 1
        lookup_tokens = rows + sum(sum(r[: lookup_n - 1]) for r in reach)
        lookup_cost = self._step_cost(StepKind.LOOKUP, rows, lookup_n)
        draft_tokens = sum(1 + self._drafter_tokens(m, draw=True) for m in ngrams)
        draft_cost = self._step_cost(StepKind.DRAFT, rows, self._draft_slots())
        options = [(rows / plain_cost, StepKind.PLAIN, plain_cost), (draft_tokens / draft_cost, StepKind.DRAFT,
                                                                      draft_cost)]
        if lookup_n > 1:
            options.append((lookup_tokens / lookup_cost, StepKind.LOOKUP, lookup_cost))
        beyond = draft_cost / plain_cost - 1  # a drafter step's price beyond one token a row, in plain steps
        if self.advance is None:  # one plain step, or a drafter step's price up to EPSILON of the call
            self.advance = beyond if 1.0 < beyond <= EPSILON * self.horizon else 1.0
        # the bound: even if it commits one token a row, a drafter step must leave the budget non-negative (lookup is
        # observed after every step, so a lookup step is never a try: it is taken on its estimate alone)
        allowance = max(self.advance, EPSILON * (self.committed_steps + 1))
        if allowance - self.spent < beyond:
            options = [option for option in options if option[1] is not StepKind.DRAFT]
        elif not self.drafter.trials:  # never seen, and affordable: tried first, as UCB plays each arm once
            return StepKind.DRAFT, lookup_n - 1
        _, kind, _ = max(options, key=lambda option: option[0])
        return kind, lookup_n - 1 if kind is not StepKind.PLAIN else 0

    # ----- learning -----------------------------------------------------------------------------------------------
    def observe_lookups(self, ngrams: list[int], proposals: list, committed: list) -> None:
        """Full information: each row's lookup drafts found this step (`proposals`, token ids, after an
        `ngrams[r]`-token match), against the tokens the target committed (`committed`, the bonus included),
        whatever the step verified. Draft d is observed when the committed tokens reach it."""
        observations = []
        for ngram, drafts, tokens in zip(ngrams, proposals, committed):
            accepted = 0
            for draft, token in zip(drafts, tokens):
                if draft != token:
                    break
                accepted += 1
            observations += [(ngram, d, float(d <= accepted), 1.0)
                             for d in range(1, min(accepted + 1, len(drafts), len(tokens)) + 1)]
        self.lookup.add_step(observations)

    def record(self, step: StepRecord, ngrams: list[int] | None = None, accepted: list[int] | None = None) -> None:
        """A step's measured times and, for a drafter step, the drafts each row accepted (`accepted`, rows after
        matches of `ngrams` tokens)."""
        unit = self._unit(step.rows)
        self.flat_verify.add_step([("verify", 0, step.verify_seconds, 1.0)])
        loop = max(step.seconds - step.verify_seconds - step.draft_seconds, 0.0)
        self.loop.add_step([("loop", 0, loop / unit, 1.0)])
        self.slots.add_step([(step.kind, 0, float(step.slots), 1.0)])
        # what a drafter step commits fades every step, observed or not: when not observed for a while it grows
        # uncertain, so it is tried again (text that turned predictable is found)
        self.drafter.discount(DISCOUNT)
        if step.kind is StepKind.DRAFT:
            self.drafting.add_step([("drafting", 0, step.draft_seconds / unit, 1.0)])
            if accepted is not None:
                self.drafter.add_step([(m, 0, float(a), 1.0) for m, a in zip(ngrams, accepted)], discount=1.0)
        if self.advance is not None:  # at the cost model's prices for the step, this step's times included, in plain
            # steps at those prices: a load that slows every forward slows plain decoding alike, so a busier moment
            # neither spends nor earns budget
            plain = self._step_cost(StepKind.PLAIN, step.rows, 1)
            self.committed_steps += step.committed / step.rows
            self.spent += self._step_cost(step.kind, step.rows, step.slots) / plain - step.committed / step.rows

class AlwaysSpeculate:
    """The control of a fixed draft length (`num_assistant_tokens`): every step drafts, every lookup draft found is
    verified, nothing is measured."""

    def start_call(self) -> "AlwaysSpeculate":
        return self

    def expects_draft(self, rows: int) -> bool:
        return True

    def decide(self, rows: int, ngrams: list[int], lookup_lengths: list[int]) -> tuple[StepKind, int]:
        return StepKind.DRAFT, max(lookup_lengths, default=0)

    def observe_lookups(self, ngrams, proposals, committed) -> None:
        pass

    def record(self, step: StepRecord, ngrams=None, accepted=None) -> None:
        pass


def _setup(target, method: str) -> tuple:
    return target.dtype, target.device, torch.get_num_threads(), method


def controller_for(drafter, target, method: str, verify_cost, draft_price: float | None = None, horizon: int = 0
                   ) -> SpeculationController:
    """The controller of one call of `drafter` on `target` with `method` (the candidate generator's name): a copy of
    what the last call on the same setup kept (`start_call`), or a fresh one; `keep_controller` hands it back.
    `draft_price`: a drafting pass in one-token verify forwards at the call's rows, as measured
    (`control_profiles.drafting_price_for`); None: guessed as the drafter's layers over the target's. `horizon`: the
    call's `max_new_tokens` (0: unknown)."""
    memory = memory_of(target)
    with memory.lock:
        kept = memory.controllers.get(drafter, {}).get(_setup(target, method))
        call = kept.start_call() if kept is not None else SpeculationController()
    call.verify_cost = verify_cost
    if draft_price is None:
        drafter_layers = sum(d.config.num_hidden_layers for d in _drafters(drafter))
        draft_price = drafter_layers / target.config.get_text_config().num_hidden_layers
    call.draft_price, call.horizon = draft_price, horizon
    return call


def _drafters(drafter) -> list:
    """The drafters a drafting pass runs (both of a dual drafter)."""
    if drafter.config.model_type == "dual_diffusion_drafter":
        return [drafter.first] + ([drafter.vp] if drafter.vp is not None else [])
    return [drafter]


def keep_controller(drafter, target, method: str, controller: SpeculationController) -> None:
    """What a call's controller learned becomes where the next call on this drafter, target and setup starts (its
    cost model stays with the profile: `control_profiles.keep_verify_cost`)."""
    kept = copy.copy(controller)
    kept.verify_cost = None
    memory = memory_of(target)
    with memory.lock:
        memory.controllers.setdefault(drafter, {})[_setup(target, method)] = kept
