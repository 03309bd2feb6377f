"""The speculation controller's properties (`control_speculation.py`), on simulated steps whose costs are the cost
model's: the budget, regret where acceptance is stationary, the never-pays and always-pays suites, abrupt switches,
lookup scored with full information, memory across calls."""

import random

import pytest

from hf_diffspec.runtime.control_speculation import (CALL_DISCOUNT, EPSILON, SpeculationController, StepKind,
                                                     StepRecord)

PLAIN_SECONDS = 0.04


def verify_cost(n, rows):
    """A flat-ish cost curve: wider forwards cost a little more, more rows more."""
    return PLAIN_SECONDS * (1 + 0.01 * (n - 1)) * (1 + 0.1 * (rows - 1))


class Drafter:
    """A simulated drafter: a drafter step costs `cost` one-token forwards beyond its verify forward (4 slots),
    and each row accepts `accepted(rng)` drafts."""

    def __init__(self, accepted, cost: float):
        self.accepted, self.cost = accepted, cost


def run(controller, drafter_at, steps: int, rows: int = 1, seed: int = 0, lookups=None):
    """Decode `steps` steps; `drafter_at(step)` is the drafter of that step (a switch changes it). `lookups(rng)`:
    per row, (match length, drafts found, drafts that would be accepted), or None for no lookup. Returns the kinds,
    tokens, seconds, the plain decoding time of those tokens and the least budget seen."""
    rng = random.Random(seed)
    kinds, tokens, seconds, least = [], 0, 0.0, float("inf")
    for i in range(steps):
        drafter = drafter_at(i)
        found = [lookups(rng) for _ in range(rows)] if lookups else [(0, 0, 0)] * rows
        ngrams, lengths = [m for m, _, _ in found], [n for _, n, _ in found]
        kind, depth = controller.decide(rows, ngrams, lengths)
        if kind is StepKind.DRAFT:
            accepted = [drafter.accepted(rng) for _ in range(rows)]
            slots, extra = 4, drafter.cost * verify_cost(1, rows)
        elif kind is StepKind.LOOKUP:
            accepted = [min(a, depth) for _, _, a in found]
            slots, extra = 1 + depth, 0.0
        else:
            accepted, slots, extra = [0] * rows, 1, 0.0
        verify = verify_cost(slots, rows)
        committed = rows + sum(accepted)
        if lookups:
            controller.observe_lookups(ngrams, [[1] * n for n in lengths],
                                       [[1] * a + [0] + [1] * 5 for a in (min(x, len_) for (_, len_, x) in found)])
        controller.record(StepRecord(kind, rows, max(ngrams), committed, extra + verify, slots, verify, extra),
                          ngrams, accepted)
        kinds.append(kind)
        tokens, seconds = tokens + committed, seconds + extra + verify
        least = min(least, controller.budget if controller.budget is not None else least)
    return kinds, tokens, seconds, least


def fixed(accepted: float, cost: float) -> Drafter:
    """A drafter accepting `accepted` drafts a row on average (of 4, each accepted with probability accepted / 4)."""
    return Drafter(lambda rng: sum(rng.random() < accepted / 4 for _ in range(4)), cost)


def plain_rate(rows: int) -> float:
    return rows / verify_cost(1, rows)


@pytest.mark.parametrize("seed", range(12))
def test_the_budget_is_never_negative_where_the_cost_model_holds(seed):
    """Whatever the drafter and the batch, a step other than a plain one is taken only when it leaves the budget
    non-negative even if it commits one token a row; with costs as the model says (the drafter's guessed cost is
    its real one), the budget never goes below zero."""
    rng = random.Random(seed)
    cost = rng.uniform(0.1, 3.0)
    drafter = fixed(rng.uniform(0.0, 3.0), cost)
    controller = SpeculationController(verify_cost, draft_price=cost)
    _, _, _, least = run(controller, lambda i: drafter, 400, rows=rng.choice([1, 4, 16]), seed=seed)
    assert least >= -1e-12


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("price", [0.5, 14.0])
def test_where_speculation_never_pays_decoding_stays_within_epsilon_of_plain(rows, price):
    """A drafter accepting 0.1 drafts a row for half a plain step more, or for 14 (a drafter step dearer than the
    bound's EPSILON of a 256-token call): fresh, told the call's length, a call's decoding time stays within plain
    decoding's for its tokens plus the larger of EPSILON x that and the call's advance (one plain step, or the first
    try where it costs at most EPSILON of the call), and over 3,000 steps throughput settles at 1 / (1 + EPSILON) of
    plain decoding's, the first tries included (an advance added to what accrues fails both)."""
    for steps in (256, 3000):
        for seed in range(5):
            controller = SpeculationController(verify_cost, draft_price=price, horizon=steps)
            _, tokens, seconds, _ = run(controller, lambda i: fixed(0.1, price), steps, rows=rows, seed=seed)
            plain = tokens / plain_rate(rows)
            assert controller.advance <= max(1.0, EPSILON * steps)
            assert seconds <= plain + max(EPSILON * plain, controller.advance * verify_cost(1, rows)) + 1e-9
            if steps == 3000:
                assert tokens / seconds >= plain_rate(rows) / (1 + EPSILON) - 1e-9, seed


def test_where_speculation_always_pays_it_drafts_from_the_first_step():
    kinds, tokens, seconds, _ = run(SpeculationController(verify_cost, draft_price=0.3), lambda i: fixed(2.0, 0.3),
                                    200)
    assert kinds[0] is StepKind.DRAFT and kinds[:20].count(StepKind.DRAFT) >= 18
    assert tokens / seconds > 0.95 * 3.0 / (1.3 * verify_cost(4, 1) / verify_cost(1, 1)) * plain_rate(1)


def test_a_drafter_is_tried_only_where_the_budget_covers_its_price():
    """A call's budget starts at its advance: one plain step, or the first try where that costs at most EPSILON of
    the call's plain time (`horizon`, its `max_new_tokens`). A drafter whose step costs 20 plain steps is never tried
    in a call of 40 tokens where nothing earns budget: one try would cost half the call (the never-pays suite at 16 rows lost 6% so). A drafter whose step costs
    3 plain steps and pays is tried at the first step of a call of 256 tokens (never seen, and affordable: played
    first, as UCB plays each arm once), taken from then on, and from the first step of a later call; without the
    advance (horizon unknown) a later call waits for credit."""
    dear = SpeculationController(verify_cost, draft_price=20.0, horizon=40)
    kinds, tokens, seconds, least = run(dear, lambda i: fixed(0.0, 20.0), 40)
    assert kinds == [StepKind.PLAIN] * 40 and least >= 0
    assert seconds <= (1 + EPSILON) * tokens / plain_rate(1) + verify_cost(1, 1) + 1e-9
    for seed in range(5):
        paying = SpeculationController(verify_cost, draft_price=2.0, horizon=256, seed=seed)
        kinds, _, _, least = run(paying, lambda i: fixed(4.0, 2.0), 60, seed=seed)
        assert kinds[0] is StepKind.DRAFT and kinds.count(StepKind.DRAFT) >= 0.9 * len(kinds) and least >= 0
        assert paying.start_call().decide(1, [0], [0])[0] is StepKind.DRAFT
        paying.horizon = 0
        assert paying.start_call().decide(1, [0], [0])[0] is StepKind.PLAIN


def test_a_load_that_lifts_lowers_the_drafters_price_with_the_forwards():
    """Drafter steps timed while other processes held the cores (every forward and the drafting pass 6x slower), then
    the load lifts (plain steps at the profiled time): drafting is priced in forwards at the load it was timed at, so
    a drafter step costs the same number of plain steps as on a quiet machine, not six times as many."""
    from hf_diffspec.runtime.control_cost import VerifyCost

    def price(loads):
        cost = VerifyCost({1: {1: 0.01, 4: 0.012}})
        controller = SpeculationController(cost, draft_price=1.0)
        controller.decide(1, [0], [0])
        for load in loads:
            kind, slots, drafting = (StepKind.DRAFT, 4, 0.01) if load > 1 else (StepKind.PLAIN, 1, 0.0)
            verify = load * cost.profiled(slots)
            cost.observe(slots, 1, verify)
            controller.record(StepRecord(kind, 1, 0, slots, verify + load * drafting, slots, verify, load * drafting),
                              [0], [slots - 1] if kind is StepKind.DRAFT else None)
        return controller._step_cost(StepKind.DRAFT, 1, 4) / controller._step_cost(StepKind.PLAIN, 1, 1)

    quiet = price([1.0] * 3)
    assert price([6.0] * 3 + [1.0] * 12) == pytest.approx(quiet, rel=0.15)


def test_a_busier_moment_neither_spends_nor_earns_budget():
    """A drafter that pays (a step of it costs two plain steps and commits three tokens a row) keeps drafting when the
    machine turns six times busier after its first step: the budget counts plain steps at each step's prices, so a load that
    slows every forward (plain decoding's too) does not outprice the drafter against budget earned at a quieter time."""
    from hf_diffspec.runtime.control_cost import VerifyCost

    cost = VerifyCost({1: {1: 0.01, 4: 0.0101}})
    controller = SpeculationController(cost, draft_price=1.0, horizon=256)
    kinds = []
    for load in [1.0] + [6.0] * 6:
        kind, _ = controller.decide(1, [0], [0])
        kinds.append(kind)
        slots, drafting = (4, 0.01) if kind is StepKind.DRAFT else (1, 0.0)
        verify = load * cost.profiled(slots)
        cost.observe(slots, 1, verify)
        controller.record(StepRecord(kind, 1, 0, 3 if kind is StepKind.DRAFT else 1, verify + load * drafting, slots,
                                     verify, load * drafting), [0], [2] if kind is StepKind.DRAFT else None)
    assert kinds == [StepKind.DRAFT] * 7


@pytest.mark.parametrize("accepted, cost", [(1.5, 0.3), (0.6, 0.3), (0.3, 0.3), (0.1, 0.3), (2.0, 1.0), (0.8, 1.0)])
def test_regret_is_bounded_where_acceptance_is_stationary(accepted, cost):
    """Over 2,000 steps, throughput is within 10% of the better of always drafting and always decoding plainly
    (near ties included), and within 3% where one wins by 20% or more."""
    drafter = fixed(accepted, cost)
    draft_rate = (1 + accepted) / ((1 + cost) * verify_cost(1, 1) + verify_cost(4, 1) - verify_cost(1, 1))
    best = max(draft_rate, plain_rate(1))
    rates = []
    for seed in range(3):
        _, tokens, seconds, _ = run(SpeculationController(verify_cost, draft_price=cost), lambda i: drafter, 2000,
                                    seed=seed)
        rates.append(tokens / seconds)
    clear = max(draft_rate, plain_rate(1)) >= 1.2 * min(draft_rate, plain_rate(1))
    assert sum(rates) / len(rates) >= (0.97 if clear else 0.90) * best


def test_an_abrupt_switch_is_followed():
    """A drafter that paid and stops paying drafts at most 30% of the steps from 50 steps after the switch on (the
    rest of its steps are tries its fading estimate draws, paid from the budget); one that starts paying after a long
    stretch of losing drafts at least 90% of the steps from 50 steps after the switch on."""
    good, bad = fixed(2.0, 0.3), fixed(0.0, 0.3)
    for first, then, least, most in ((good, bad, 0.0, 0.3), (bad, good, 0.9, 1.0)):
        share = 0.0
        for seed in range(5):
            kinds, *_ = run(SpeculationController(verify_cost, draft_price=0.3),
                            lambda i: first if i < 300 else then, 600, seed=seed)
            share += kinds[350:].count(StepKind.DRAFT) / 250 / 5
        assert least <= share <= most


def test_lookup_drafts_are_scored_with_full_information():
    """Steps that verify no lookup draft still measure them (against what the target committed): a controller that
    only ever decoded plainly (after the drafter's first try, which accepted nothing) knows how far the drafts of each
    match length would have gone, and verifies them as soon as they pay."""
    controller = SpeculationController(verify_cost, draft_price=5.0)  # the drafter is far too dear to try again
    controller.drafter.add_step([(0, 0, 0.0, 1.0)])  # its first try (a controller's first step: `decide`)

    def lookups(rng):  # 3-token matches: 4 of 6 drafts right; 1-token matches: none
        return (3, 6, 4) if rng.random() < 0.5 else (1, 6, 0)

    for m, n in ((3, 6), (1, 6)):
        assert controller._lookup_reach(m, n, draw=False)[0] == pytest.approx(0.5)  # the prior: nothing measured
    controller.decide = lambda rows, ngrams, lengths: (StepKind.PLAIN, 0)  # as if every step were plain
    run(controller, lambda i: fixed(0.0, 5.0), 60, lookups=lookups)
    del controller.decide
    assert controller._lookup_reach(3, 6, draw=False)[3] > 0.8 and controller._lookup_reach(1, 6, draw=False)[0] < 0.1
    kind, depth = controller.decide(1, [3], [6])
    assert kind is StepKind.LOOKUP and depth >= 4


def test_lookup_steps_that_pay_are_taken_even_after_the_drafters_tries_spent_the_budget():
    """Lookup is observed after every step, so a lookup step is never a try and the budget does not hold it back.
    At 16 rows on a compute-bound curve (6 slots cost 2.5 plain steps), an untrained drafter's first tries (it
    looks cheap until measured) spend the budget; lookup drafts that are always right are then verified at full
    depth at once. Charged like tries, they waited for credit, one token a row at a time."""
    steep = lambda n, rows: PLAIN_SECONDS * rows * (1 + 0.3 * (n - 1))  # noqa: E731
    controller = SpeculationController(steep, draft_price=0.1)
    kinds = []
    for _ in range(30):
        kind, depth = controller.decide(16, [3] * 16, [5] * 16)
        if kind is StepKind.DRAFT:  # nothing accepted, and drafting costs 3 plain steps
            slots, committed, drafting = 6, 16, 3 * steep(1, 16)
        else:
            slots, committed, drafting = 1 + depth, 16 * (1 + depth), 0.0
        controller.observe_lookups([3] * 16, [[7] * 5] * 16, [[7] * 5 + [8]] * 16)
        verify = steep(slots, 16)
        controller.record(StepRecord(kind, 16, 3, committed, verify + drafting, slots, verify, drafting),
                          [3] * 16, [0] * 16 if kind is StepKind.DRAFT else None)
        kinds.append((kind, depth))
    assert kinds[0][0] is StepKind.DRAFT  # tried first: its guessed cost makes it look worth it
    assert kinds[3:].count((StepKind.LOOKUP, 5)) >= 25, kinds


def test_a_call_starts_from_what_earlier_calls_learned_weighed_less():
    controller = SpeculationController(verify_cost, draft_price=0.3)
    run(controller, lambda i: fixed(2.0, 0.3), 50)
    call = controller.start_call()
    assert call is not controller and call.budget is None
    assert call.drafter.trials[0, 0] == pytest.approx(CALL_DISCOUNT * controller.drafter.trials[0, 0])
    call.drafter.add_step([(0, 0, 1.0, 1.0)])  # the call's own: the kept controller does not see it
    assert call.drafter.trials[0, 0] != pytest.approx(CALL_DISCOUNT * controller.drafter.trials[0, 0])


def test_the_controller_expects_a_drafter_step_where_drafting_pays_at_its_estimates_means():
    """`expects_draft` (whether the loop drafts the next step ahead): after a paying drafter it expects drafter
    steps, after one that costs more than it commits it does not, and asking changes nothing the controller decides
    with (no draw, no budget spent)."""
    paying = SpeculationController(verify_cost, draft_price=0.3)
    run(paying, lambda i: fixed(3.0, 0.3), 200)
    costly = SpeculationController(verify_cost, draft_price=2.0)
    run(costly, lambda i: fixed(0.2, 2.0), 200)
    assert paying.expects_draft(1) and not costly.expects_draft(1)
    state = (paying.budget, paying.rng.getstate())
    assert [paying.expects_draft(rows) for rows in (1, 4, 1)] == [True, True, True]
    assert (paying.budget, paying.rng.getstate()) == state
