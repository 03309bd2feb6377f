"""A measured cost model: how long one target forward takes to verify a batch of candidates on this machine, and how
many candidate tokens are worth verifying.

Speculation pays per step (committed tokens) / (T_draft + T_verify). Each candidate node carries an estimate of the
probability that verification reaches it (products of drafter confidences, or the length head's acceptance
probabilities); the expected number of tokens a row commits when it verifies its n most probable nodes is 1 + the sum
of their probabilities. A batch verifies a rectangle (rows x n slots, shorter rows padded), so one step costs
T_verify(rows, n) whatever each row needs: `best_node_count` picks the n that maximises the batch's expected tokens
per second. At batch 1 with a flat cost curve it verifies long drafts; when verification becomes compute-bound (many
rows, or a slow target) it verifies only the confident heads of the drafts. No hand-set concurrency gate.

A quick profile (a few points, seconds) is measured automatically the first time a target speculates on a machine,
dtype and thread count, and cached as JSON; `hf-diffspec profile` measures the full grid. With
HF_DIFFSPEC_AUTO_PROFILE=0 and no cached profile, drafts are verified at the drafter's configured length and a
warning says how to measure one.
"""

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .files import atomic_write, cache_dir
from .kv_cache import crop_attention
from .state import SPECULATION_STATE

logger = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PROFILE_BATCHES = (1, 2, 4, 8, 16)
PROFILE_FORMAT = 3  # 1: batch-1 costs only; 2: measured without the loop's 4D mask (neither is read any more)


def profile_key(target) -> str:
    """Identifies what the cost depends on: the target's architecture, its device and dtype, and the thread count."""
    config = target.config.get_text_config().to_json_string(use_diff=False)
    arch = hashlib.sha256(config.encode()).hexdigest()[:12]
    device = str(target.device)
    if target.device.type == "cuda":
        device = torch.cuda.get_device_name(target.device)
    threads = torch.get_num_threads() if target.device.type == "cpu" else 0
    raw = f"{arch}|{device}|{target.dtype}|{threads}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_dir() -> Path:
    return cache_dir() / "profiles"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verify_cost(target, sizes=PROFILE_SIZES, batches=PROFILE_BATCHES, context_length: int = 256,
                        repeats: int = 5) -> dict[int, dict[int, float]]:
    """Median seconds of a target forward over `rows` x n new tokens on top of a cached context of `context_length`
    per row: {rows: {n: seconds}}. With an explicit 4D mask, as the decoding loop verifies (trees, ragged rows):
    without one the model takes its causal fast path, which at 16 rows made a 2-token forward look 1.03x a 1-token
    one (1.43x with the mask, in the profile of the same machine)."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    costs = {}
    for rows in batches:
        cache = DynamicCache(config=target.config)
        target(torch.randint(0, vocab, (rows, context_length), device=device), cache=cache)
        times = {n: [] for n in sizes}
        for _ in range(repeats + 1):  # the first round warms up
            for n in sizes:
                new = torch.randint(0, vocab, (rows, n), device=device)
                positions = torch.arange(context_length, context_length + n, device=device)[None].expand(rows, -1)
                allowed = torch.ones(n, context_length + n, dtype=torch.bool, device=device)
                allowed[:, context_length:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
                mask = torch.zeros(allowed.shape, dtype=target.dtype, device=device)
                mask = mask.masked_fill_(~allowed, torch.finfo(target.dtype).min).expand(rows, 1, -1, -1)
                _sync(device)
                start = time.perf_counter()
                target(new, attention_mask=mask, cache=cache, position_ids=positions)
                _sync(device)
                times[n].append(time.perf_counter() - start)
                crop_attention(cache, n)  # a linear-attention layer's state keeps its size: its timing is unchanged
        costs[rows] = {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}
    return costs


def save_profile(target, costs: dict[int, dict[int, float]]) -> Path:
    path = profile_dir() / f"{profile_key(target)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": PROFILE_FORMAT, "key": profile_key(target),
               "model_type": target.config.get_text_config().model_type, "device": str(target.device),
               "dtype": str(target.dtype), "threads": torch.get_num_threads(),
               "verify_seconds": {str(b): {str(n): t for n, t in row.items()} for b, row in costs.items()}}
    return atomic_write(path, json.dumps(payload, indent=2))


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
    really costs (a longer context, the loop's own work, other load) is observed at every step: `observe` keeps, per
    batch-size bucket and slot count, the smoothed ratio of observed to profiled seconds, and the cost at n is the
    profile times that ratio interpolated between the slot counts observed (flat beyond them). `for_target` hands
    every call the same object for a profile file (held in `state.py`): what one call observed, the next starts
    from."""

    def __init__(self, costs: dict[int, dict[int, float]], smoothing: float = 0.1):
        self.costs = costs
        self.smoothing = smoothing
        self.corrections: dict[int, dict[int, float]] = {}  # rows bucket -> {n: observed / profiled}

    def profiled(self, n: int, rows: int = 1) -> float:
        return _interpolate({b: _interpolate(row, n) for b, row in self.costs.items()}, rows)

    def observe(self, n: int, rows: int, seconds: float) -> None:
        """A decoding step verified `rows` x `n` slots in `seconds` (forward and commit)."""
        ratios = self.corrections.setdefault(rows_bucket(rows), {})
        ratio = seconds / self.profiled(n, rows)
        ratios[n] = ratio if n not in ratios else (1 - self.smoothing) * ratios[n] + self.smoothing * ratio

    @classmethod
    def for_target(cls, target) -> "VerifyCost | None":
        """The profile for this target/device/dtype/threads: loaded from the cache, measured once (a few seconds)
        when missing, or None when automatic profiling is off (HF_DIFFSPEC_AUTO_PROFILE=0) and none is cached."""
        path = profile_dir() / f"{profile_key(target)}.json"
        in_use = SPECULATION_STATE.verify_costs  # one per profile file and mtime: its corrections carry over calls
        if path.is_file() and in_use.get(str(path), (None,))[0] == path.stat().st_mtime_ns:
            return in_use[str(path)][1]
        data = json.loads(path.read_text()) if path.is_file() else None
        if data is not None and data.get("format") != PROFILE_FORMAT:
            _warn_once(f"the verify-cost profile {path} comes from an older measurement; it is re-measured.")
            data = None
        if data is None:
            if os.environ.get("HF_DIFFSPEC_AUTO_PROFILE", "1") == "0":
                _warn_once(f"no verify-cost profile for this target on {target.device} in {target.dtype} "
                           f"({torch.get_num_threads()} threads) and HF_DIFFSPEC_AUTO_PROFILE=0: drafts are verified "
                           "at a fixed length. Run `hf-diffspec profile --target ... --dtype ...` once to measure one.")
                return None
            logger.warning("measuring this target's verify cost on %s in %s (%d threads), once; cached in %s",
                           target.device, target.dtype, torch.get_num_threads(), profile_dir())
            costs = measure_verify_cost(target, **QUICK_PROFILE)
            if not plausible_costs(costs):  # another process took the cores for part of it: once more
                logger.warning("the verify-cost measurement looks disturbed (a forward over more tokens cost far "
                               "more than proportionally more): measuring again")
                costs = measure_verify_cost(target, **QUICK_PROFILE)
                if not plausible_costs(costs):
                    logger.warning("still disturbed; kept. Re-measure on a quiet machine: hf-diffspec profile")
            save_profile(target, costs)
            data = json.loads(path.read_text())
        cost = cls({int(b): {int(n): float(t) for n, t in row.items()} for b, row in data["verify_seconds"].items()})
        in_use[str(path)] = (path.stat().st_mtime_ns, cost)
        return cost

    def __call__(self, n: int, rows: int = 1) -> float:
        ratios = self.corrections.get(rows_bucket(rows))
        if not ratios:
            return self.profiled(n, rows)
        return self.profiled(n, rows) * _interpolate(ratios, min(max(n, min(ratios)), max(ratios)))


def plausible_costs(costs: dict[int, dict[int, float]], slack: float = 1.5) -> bool:
    """False when a forward over n2 > n1 tokens cost more than `slack` x n2/n1 times one over n1 tokens: a forward's
    cost grows at most in proportion to its tokens, so such a curve was disturbed by another process."""
    for row in costs.values():
        sizes = sorted(row)
        for n1, n2 in zip(sizes, sizes[1:]):
            if row[n2] > slack * (n2 / n1) * row[n1]:
                return False
    return True


# what a first run measures before speculating (seconds); `hf-diffspec profile` measures the full grid
QUICK_PROFILE = dict(sizes=(1, 2, 4, 8, 16), batches=(1, 4, 16), context_length=128, repeats=3)


def _warn_once(message: str) -> None:
    if message not in SPECULATION_STATE.warned:
        SPECULATION_STATE.warned.add(message)
        logger.warning(message)


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
