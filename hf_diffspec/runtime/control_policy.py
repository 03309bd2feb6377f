"""How many drafts each row verifies per step: one object holds that decision, whatever decides it.

- `FixedLength`: the user set `num_assistant_tokens=k` (transformers' knob) → k drafts every step, every step
  speculative;
- `DraftLengthPolicy`, with a measured cost model (a verify-cost profile exists for this target, device, dtype and
  thread count): the number of slots that maximises expected committed tokens per second, from reach probabilities
  (the length head's acceptance probabilities when the drafter has one, else the drafter's confidences) and the
  measured draft and verify times;
- `DraftLengthPolicy` without one: the drafter's configured `num_draft_tokens` (a one-time warning says how to
  measure a profile).

Each holds the controller that decides each step's kind and how many prompt-lookup drafts it verifies
(`control_speculation.py`; a fixed length always drafts and verifies every lookup draft found). Every answer is capped
by what is left to generate and by the target's context. Losslessness never depends on the answer: the target alone
picks every committed token.

`speculation_policy` builds a call's policy and controller at the loop's start (measuring the verify-cost profile
there the first time a target needs one); the loop hands them to drafting and prompt lookup, and `keep_measurements`
hands what they measured back to the target's memory at the call's end.
"""

import functools

from .control_cost import VerifyCost, best_node_count
from .control_speculation import AlwaysSpeculate, SpeculationController, StepRecord, controller_for, keep_controller
from .control_profiles import drafting_price_for, keep_verify_cost, verify_cost_for


class DraftLengthPolicy:
    """Decides drafts per row from measurements. `block_size`: the drafter's block; `default_length`: its
    configured `num_draft_tokens` (or None); `verify_cost`: the measured T_verify(n, rows) or None; `tree_depth`:
    for draft trees, the deepest tree level; `max_positions`: the target's context; `control`: the speculation
    controller (a fresh one on `verify_cost` by default); `keep(control, verify_cost)`: hands what the call measured
    back at its end (`keep_measurements`; None: they are this call's alone)."""

    def __init__(self, block_size: int, default_length: int | None = None, verify_cost: VerifyCost | None = None,
                 tree_depth: int | None = None, max_positions: int | None = None,
                 control: "SpeculationController | AlwaysSpeculate | None" = None, keep=None):
        self.block_size = block_size
        self.default_length = default_length
        self.verify_cost = verify_cost
        self.tree_depth = tree_depth
        self.max_positions = max_positions
        self.control = control if control is not None else SpeculationController(verify_cost)
        self.keep = keep
        self.draft_seconds: float | None = None  # running estimate of one drafting pass

    @property
    def uses_cost_model(self) -> bool:
        """True when the length is chosen per step from reach probabilities (drafting must provide them)."""
        return self.verify_cost is not None

    def most_drafts(self) -> int:
        """Drafts a row verifies at most, before its length, the block and the context cap them."""
        if self.tree_depth is not None:
            return self.tree_depth
        if self.verify_cost is not None:
            return self.block_size - 1  # the cost model decides how much of the block to verify
        return self.default_length or self.block_size - 1

    def depth_limit(self, root_position: int, remaining: int) -> int:
        """The most drafts a row may verify this step, before drafting: 0 means verify the anchor alone.
        `remaining`: tokens the row may still commit after its anchor."""
        limit = min(self.most_drafts(), remaining, self.block_size - 1)
        if self.max_positions is not None:
            limit = min(limit, self.max_positions - 1 - root_position)
        return max(limit, 0)

    def depth_limits(self, root_positions: list[int], remaining: list[int]) -> list[int]:
        """`depth_limit` of every row."""
        return [self.depth_limit(p, r) for p, r in zip(root_positions, remaining)]

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

    def record_draft_time(self, seconds: float) -> None:
        """One drafting pass took `seconds` (both passes for D²SD); smoothed, it prices the next step's drafts."""
        self.draft_seconds = seconds if self.draft_seconds is None else 0.8 * self.draft_seconds + 0.2 * seconds

    def keep_measurements(self) -> None:
        """At the end of a call: what its controller and cost model measured becomes where the next call starts."""
        if self.keep is not None:
            self.keep(self.control, self.verify_cost)

    def record_step(self, step: StepRecord) -> bool:
        """A step's measured verify time refines the profiled cost model; True when the profile was measured again
        meanwhile (live steps disagreed with it), which took time that belongs to no step."""
        if self.verify_cost is None:
            return False
        return self.verify_cost.observe(step.slots, step.rows, step.verify_seconds)


class FixedLength(DraftLengthPolicy):
    """`length` drafts every step (fewer only where the row's length or the target's context ends them), every step
    speculative: no cost model, no controller."""

    def __init__(self, length: int, block_size: int, max_positions: int | None = None):
        super().__init__(block_size, max_positions=max_positions, control=AlwaysSpeculate())
        self.length = length

    def most_drafts(self) -> int:
        return self.length


def speculation_policy(drafter, target, fixed: int | None = None, method=None, graphs: bool = False, rows: int = 1,
                       horizon: int = 0):
    """The draft-length policy and controller of one call of `drafter` on `target` over `rows` rows, at most `horizon`
    new tokens a row (0: unknown; a first drafter step may cost up to EPSILON of that much plain decoding): `fixed` drafts
    per step when given, else the measured cost model when this machine has a profile for the target (measured now
    the first time; `graphs`: the call's verify forward replays CUDA graphs, and so is the profile's), else the
    drafter's configured length. `method`: the drafting method (its candidate generator class), whose controller
    persists across calls and whose drafting pass is priced before the first one runs."""
    dual = drafter.config.model_type == "dual_diffusion_drafter"
    config = drafter.first.config if dual else drafter.config
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if fixed is not None:
        return FixedLength(fixed, config.block_size, max_positions)
    if method is None:
        raise TypeError("a live policy needs its drafting method: speculation_policy(..., method=<generator class>)")
    # trees (D²SD, best-first) are sized by their node budget and the cost model, not by a chain length
    tree_depth = drafter.config.max_depth if dual else None
    if getattr(config, "draft_tree_budget", None):
        tree_depth = config.block_size - 1
    verify_cost = verify_cost_for(target, graphs=graphs)
    price = None
    if verify_cost is not None:
        price = drafting_price_for(target, drafter, method, rows, lambda: method(
            drafter, target, FixedLength(config.block_size - 1, config.block_size)))
    return DraftLengthPolicy(
        block_size=config.block_size, default_length=config.num_draft_tokens, verify_cost=verify_cost,
        tree_depth=tree_depth, max_positions=max_positions,
        control=controller_for(drafter, target, method.__name__, verify_cost, price, horizon),
        keep=functools.partial(_keep, drafter, target, method.__name__))


def _keep(drafter, target, method: str, control, verify_cost) -> None:
    keep_controller(drafter, target, method, control)
    if verify_cost is not None:
        keep_verify_cost(target, verify_cost)
