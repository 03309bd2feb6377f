"""The verify-cost model and the optimiser: how long one target forward takes to verify a batch of candidates, and how
many candidate tokens are worth verifying. Pure: measuring, caching and the machine's load are `control_profiles.py`'s.

Speculation pays per step (committed tokens) / (T_draft + T_verify). Each candidate node carries an estimate of the
probability that verification reaches it (products of drafter confidences, or the length head's acceptance
probabilities); the expected number of tokens a row commits when it verifies its n most probable nodes is 1 + the sum
of their probabilities. A batch verifies a rectangle (rows x n slots, shorter rows padded), so one step costs
T_verify(rows, n) whatever each row needs: `best_node_count` picks the n that maximises the batch's expected tokens
per second. At batch 1 with a flat cost curve it verifies long drafts; when verification becomes compute-bound (many
rows, or a slow target) it verifies only the confident heads of the drafts. No hand-set concurrency gate.

Imports: the standard library only (this file travels in `custom_generate/`).
"""

from pathlib import Path

ONE_TOKEN_JUMP = 6.0  # a forward over a few tokens at most this many times a one-token one (`implausible_costs`)
STALE_FACTOR = 2.0  # live steps this many times faster than profiled: the profile is re-measured
STALE_AFTER_STEPS = 4  # steps observed at one batch size and width before they are compared with the profile
# the load follows a step's time at once (other calls and processes come and go); the shape, what one width costs
# against the others, slowly: it is only told apart from a change of load by widths observed at the same load
LOAD_SMOOTHING = 0.5
SHAPE_SMOOTHING = 0.05


def _interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through `points`, flat below the first, linear extrapolation beyond the last."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    last, before = xs[-1], xs[-2]
    return points[last] + (points[last] - points[before]) * (x - last) / (last - before)


def rows_bucket(rows: int) -> int:
    """Batch sizes that share measurements: the next power of two (rows leave a batch one by one as they finish)."""
    return 1 << (rows - 1).bit_length()


class VerifyCost:
    """T_verify(n, rows): seconds of one target forward over `rows` x n tokens, interpolated from a measured profile
    {rows: {n: seconds}} (linear in n, then linear in rows), refined online.

    The profile is measured once, on a short context, without the loop around the forward. What a decoding step
    really costs is observed at every step (`observe`), per batch-size bucket, as two factors on the profile:
    - the load: what slows every forward alike (other processes or calls on the cores, a longer context), smoothed
      over every step whatever its width; the other costs of a step (drafting, the loop) are measured in profiled
      forwards at this load (`loaded`), so that load changes every price in proportion;
    - the shape: per slot count, what the load leaves unexplained, smoothed, interpolated between the slot counts
      observed (flat beyond them).
    Steps of different widths observed at different loads (calls in threads come and go) then move the load, not one
    width's price against the others'. Each call gets its own copy of what the last call on the profile kept
    (`control_profiles.verify_cost_for`): what one call observed, the next starts from.

    A step observed is never cheaper than the bare forward the profile timed (it also commits, on a longer context).
    So when steps run over `STALE_FACTOR` times faster than profiled, the profile was measured on a busy machine: it is
    measured again (`remeasure`, given by `control_profiles.verify_cost_for`)."""

    def __init__(self, costs: dict[int, dict[int, float]], remeasure=None,
                 path: Path | None = None, corrections: dict | None = None, observations: dict | None = None,
                 loads: dict | None = None):
        self.costs = costs
        self.loads: dict[int, float] = loads or {}  # rows bucket -> observed / (profiled x shape)
        self.corrections: dict[int, dict[int, float]] = corrections or {}  # rows bucket -> {n: the shape at n}
        self.observations: dict[tuple[int, int], int] = observations or {}  # (rows bucket, n) -> steps observed
        self.remeasure = remeasure  # called once when live steps disagree with the profile; None: never
        self.path = path  # the profile file whose costs these are, where the call hands them back

    def profiled(self, n: int, rows: int = 1) -> float:
        return _interpolate({b: _interpolate(row, n) for b, row in self.costs.items()}, rows)

    def loaded(self, n: int, rows: int = 1) -> float:
        """The profiled forward at the load observed (the unit of a step's other costs)."""
        return self.profiled(n, rows) * self.loads.get(rows_bucket(rows), 1.0)

    def _shape(self, bucket: int, n: int) -> float:
        shapes = self.corrections.get(bucket)
        if not shapes:
            return 1.0
        return _interpolate(shapes, min(max(n, min(shapes)), max(shapes)))

    def observe(self, n: int, rows: int, seconds: float) -> bool:
        """A decoding step verified `rows` x `n` slots in `seconds` (forward and commit). True when that made the
        profile be measured again."""
        bucket = rows_bucket(rows)
        ratio = seconds / self.profiled(n, rows)
        shape = self._shape(bucket, n)
        load = self.loads.get(bucket)
        load = self.loads[bucket] = ratio / shape if load is None else \
            (1 - LOAD_SMOOTHING) * load + LOAD_SMOOTHING * ratio / shape
        shapes = self.corrections.setdefault(bucket, {})
        shapes[n] = (1 - SHAPE_SMOOTHING) * shape + SHAPE_SMOOTHING * ratio / load
        seen = self.observations[bucket, n] = self.observations.get((bucket, n), 0) + 1
        if self.remeasure is not None and seen >= STALE_AFTER_STEPS and load * shapes[n] * STALE_FACTOR < 1:
            remeasure, self.remeasure = self.remeasure, None
            self.costs = remeasure(f"steps of {rows} rows x {n} slots take {load * shapes[n]:.2f}x the profiled time")
            self.loads, self.corrections, self.observations = {}, {}, {}
            return True
        return False

    def __call__(self, n: int, rows: int = 1) -> float:
        return self.loaded(n, rows) * self._shape(rows_bucket(rows), n)


def best_node_count(reach_rows: list[list[float]], verify_seconds, draft_seconds: float) -> int:
    """How many slots (root included) every row verifies: argmax over n of
    sum over rows of (1 + the first n-1 reach probabilities of the row) / (draft_seconds + verify_seconds(n)).

    `reach_rows`: per row, the reach probabilities of its candidates in decreasing order (ancestors first); a row with
    fewer candidates simply stops contributing. `verify_seconds(n)`: the cost of the batch's forward at n slots."""
    longest = max((len(r) for r in reach_rows), default=0)
    expected = float(len(reach_rows))
    best_n, best_rate = 1, expected / (draft_seconds + verify_seconds(1))
    for i in range(longest):
        expected += sum(r[i] for r in reach_rows if i < len(r))
        rate = expected / (draft_seconds + verify_seconds(i + 2))
        if rate > best_rate:
            best_n, best_rate = i + 2, rate
    return best_n


def implausible_costs(costs: dict[int, dict[int, float]], slack: float = 1.5, dip: float = 0.25) -> str | None:
    """What makes a measured profile impossible on a quiet machine, or None. A forward over more tokens (or more
    rows) costs at least about as much as one over fewer (within `dip`), and at most in proportion to the tokens
    (`slack` x n2/n1): another process that took the cores for part of the measurement breaks one or the other.
    From one token to more, a model may switch kernels (Gated DeltaNet layers: the recurrent rule, then the chunked
    one, 2.8-4x at 16 rows of a tiny Qwen3.5 on a quiet machine): that step may cost up to `ONE_TOKEN_JUMP` times."""
    for rows, row in costs.items():
        sizes = sorted(row)
        for n1, n2 in zip(sizes, sizes[1:]):
            most = max(slack * n2 / n1, ONE_TOKEN_JUMP if n1 == 1 else 0.0)
            if row[n2] > most * row[n1]:
                return (f"has a {n2}-token forward at {row[n2] / row[n1]:.2f}x a {n1}-token one ({rows} rows): more "
                        "than proportionally more")
            if row[n2] < (1 - dip) * row[n1]:
                return (f"has a {n2}-token forward at {row[n2] / row[n1]:.2f}x a {n1}-token one ({rows} rows): "
                        "cheaper than fewer tokens")
    batches = sorted(costs)
    for b1, b2 in zip(batches, batches[1:]):
        for n in set(costs[b1]) & set(costs[b2]):
            if costs[b2][n] < (1 - dip) * costs[b1][n]:
                return f"has {b2} rows x {n} tokens at {costs[b2][n] / costs[b1][n]:.2f}x {b1} rows: cheaper"
    return None
