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
dtype and thread count, and cached as JSON; `hf-diffspec profile` measures the full grid (`--show` lists the cached
profiles, `--clear` removes them). It is measured with the decoding loop's own cache and masks, so it times what the
loop will pay. A profile measured while other processes took the cores would steer every later call on the machine,
so it is guarded three ways: a measurement whose curve is impossible on a quiet machine (a forward over more tokens
cheaper than one over fewer, or far more than proportionally dearer) is taken again; one taken while other processes
kept the machine busy is used by this process but never cached; and when the loop's steps run `STALE_FACTOR` times
faster than the profile says a bare forward takes, the profile is measured again, once per process, with one log
line. With HF_DIFFSPEC_AUTO_PROFILE=0 nothing is measured automatically: a cached profile is used as it is, and
without one drafts are verified at the drafter's configured length and a warning says how to measure one.
"""

import copy
import functools
import hashlib
import json
import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from .files import atomic_write, cache_dir
from .kv_cache import LinearStates, crop_attention
from .sliding_window import AttentionLayout, full_kv_cache, verify_masks
from .state import SPECULATION_STATE
from .tree import CandidateTree, TreeLayout, tree_forward_inputs
from .verify_attention import verify_attention

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


def _plain_token_ids(config, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` random token ids of the target's vocabulary, none of them a multimodal placeholder (an image token
    would make a `...ForConditionalGeneration` target ask for pixels)."""
    vocab = config.get_text_config().vocab_size
    special = {value for key, value in vars(config).items()
               if isinstance(value, int) and key.endswith(("_token_id", "_token_index")) and 0 <= value < vocab}
    ids = torch.randint(0, vocab, (count,), generator=generator)
    if special:
        ordinary = min(set(range(len(special) + 1)) - special)
        ids[torch.isin(ids, torch.tensor(sorted(special)))] = ordinary
    return ids


@torch.no_grad()
def measure_verify_cost(target, sizes=PROFILE_SIZES, batches=PROFILE_BATCHES, context_length: int = 256,
                        repeats: int = 5) -> dict[int, dict[int, float]]:
    """Median seconds of a target forward over `rows` x n new tokens on top of a cached context of `context_length`
    per row: {rows: {n: seconds}}.

    Each forward is the decoding loop's own verify forward: the loop's cache (`full_kv_cache`), its inputs for chains
    of n tokens with an explicit 4D mask (`tree_forward_inputs`, as trees and ragged rows verify: without a mask the
    model takes its causal fast path, which at 16 rows made a 2-token forward look 1.03x a 1-token one, 1.43x with the
    mask), the window of sliding layers in that mask (`verify_masks`) and the loop's attention functions
    (`verify_attention`). After each forward the cache is put back as it was: attention K/V cropped, linear-attention
    states restored. Sizes are interleaved, in an order that turns every round, so that a drift in the machine's speed
    spreads over all of them; the first round warms up."""
    device, dtype = target.device, target.dtype
    layout = AttentionLayout.of(target.config)
    generator = torch.Generator().manual_seed(0)
    costs = {}
    for rows in batches:
        cache = full_kv_cache(target.config)
        context = _plain_token_ids(target.config, rows * context_length, generator).view(rows, context_length)
        target(context.to(device), cache=cache, use_cache=True)
        states = LinearStates(cache)  # a linear-attention layer's state after the context, put back after each forward
        past_valid = torch.ones(rows, context_length, dtype=torch.bool, device=device)
        roots = torch.full((rows,), context_length, device=device)
        times = {n: [] for n in sizes}
        for round_ in range(repeats + 1):  # the first round warms up
            turn = round_ % len(sizes)
            order = list(sizes[turn:] + sizes[:turn])
            for n in (order if round_ % 2 else order[::-1]):
                trees = [CandidateTree(_plain_token_ids(target.config, n, generator).to(device), list(range(-1, n - 1)))
                         for _ in range(rows)]
                tree_layout = TreeLayout.of(trees, device)
                tokens, mask, positions = tree_forward_inputs(trees, past_valid, roots, dtype, tree_layout,
                                                              past_all_valid=False)
                mask = verify_masks(layout, mask, tree_layout.depths, past_valid, context_length)
                _sync(device)
                start = time.perf_counter()
                with verify_attention(target):
                    target(tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
                _sync(device)
                times[n].append(time.perf_counter() - start)
                crop_attention(cache, n)
                states.restore()
        costs[rows] = {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}
    return costs


class OtherProcessesLoad:
    """How many cores other processes kept busy while the block ran: (busy CPU time of the whole machine - this
    process's CPU time) / wall time, from /proc/stat (Linux); `cores` is None where the machine does not say, or the
    block took under 0.1 s (too short for the kernel's 10 ms accounting)."""

    def __enter__(self):
        self.cores = None
        self._start = (_machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, own, wall = _machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
        if busy is not None and self._start[0] is not None and wall - self._start[2] > 0.1:  # clock ticks: 10 ms
            others = (busy - self._start[0]) - (own - self._start[1])
            self.cores = max(others, 0.0) / (wall - self._start[2])


def _machine_busy_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class ProfileMeasurement:
    """A verify-cost profile as `measure_profile` took it: `costs` ({rows: {n: seconds}}), `others_load` (cores other
    processes kept busy while it was measured; None: unknown), `attempts`, and `problem`: why it should not be cached
    (None: it may)."""

    costs: dict[int, dict[int, float]]
    others_load: float | None
    attempts: int
    problem: str | None


def measure_profile(target, attempts: int = 3, **grid) -> ProfileMeasurement:
    """`measure_verify_cost` until a measurement is plausible (`implausible_costs`) and taken on a quiet machine (other
    processes kept under `MAX_OTHERS_LOAD` cores busy), at most `attempts` times; the last one is returned, with
    the problem that remains."""
    for attempt in range(1, attempts + 1):
        with OtherProcessesLoad() as load:
            costs = measure_verify_cost(target, **grid)
        problem = implausible_costs(costs)
        if problem is None and load.cores is not None and load.cores > MAX_OTHERS_LOAD:
            problem = (f"other processes kept {load.cores:.2f} cores busy while it was measured (at most "
                       f"{MAX_OTHERS_LOAD} allowed)")
        if problem is None:
            break
        if attempt < attempts:
            logger.warning("the verify-cost measurement is disturbed (%s): measuring again", problem)
    return ProfileMeasurement(costs, load.cores, attempt, problem)


def profile_path(target) -> Path:
    return profile_dir() / f"{profile_key(target)}.json"


def save_profile(target, costs: dict[int, dict[int, float]], others_load: float | None = None) -> Path:
    path = profile_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": PROFILE_FORMAT, "key": profile_key(target),
               "model_type": target.config.get_text_config().model_type, "device": str(target.device),
               "dtype": str(target.dtype), "threads": torch.get_num_threads(),
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "others_load_cores": others_load,
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
    every call its own copy of what the last call on the profile kept (`keep`, held in `state.py`): what one call
    observed, the next starts from.

    A step observed is never cheaper than the bare forward the profile timed (it also commits, on a longer context).
    So when steps run over `STALE_FACTOR` times faster than profiled, the profile was measured on a busy machine: the
    cost model of `for_target` then measures it again, once per process (`remeasure`)."""

    def __init__(self, costs: dict[int, dict[int, float]], smoothing: float = 0.1, remeasure=None,
                 path: Path | None = None):
        self.costs = costs
        self.smoothing = smoothing
        self.corrections: dict[int, dict[int, float]] = {}  # rows bucket -> {n: observed / profiled}
        self.observations: dict[tuple[int, int], int] = {}  # (rows bucket, n) -> steps observed
        self.remeasure = remeasure  # called once when live steps disagree with the profile; None: never
        self.path = path  # the profile file whose costs these are (`for_target`), where `keep` hands them back

    def profiled(self, n: int, rows: int = 1) -> float:
        return _interpolate({b: _interpolate(row, n) for b, row in self.costs.items()}, rows)

    def observe(self, n: int, rows: int, seconds: float) -> bool:
        """A decoding step verified `rows` x `n` slots in `seconds` (forward and commit). True when that made the
        profile be measured again."""
        bucket = rows_bucket(rows)
        ratios = self.corrections.setdefault(bucket, {})
        ratio = seconds / self.profiled(n, rows)
        ratios[n] = ratio if n not in ratios else (1 - self.smoothing) * ratios[n] + self.smoothing * ratio
        seen = self.observations[bucket, n] = self.observations.get((bucket, n), 0) + 1
        if self.remeasure is not None and seen >= STALE_AFTER_STEPS and ratios[n] * STALE_FACTOR < 1:
            remeasure, self.remeasure = self.remeasure, None
            self.costs = remeasure(f"steps of {rows} rows x {n} slots take {ratios[n]:.2f}x the profiled time")
            self.corrections, self.observations = {}, {}
            return True
        return False

    @classmethod
    def for_target(cls, target) -> "VerifyCost | None":
        """The profile for this target/device/dtype/threads, for one call: the costs and corrections the last call
        kept (`keep`), else the cached file's, measured once (a few seconds) when missing, unreadable or implausible;
        None when automatic profiling is off (HF_DIFFSPEC_AUTO_PROFILE=0) and none is cached. A measurement taken
        while other processes kept the machine busy, or that cannot be saved, is used by this process but not
        cached: the next process measures again. Calls that need a missing profile at once wait for one
        measurement. The object returned is the call's own (no other call observes into it); it holds the target
        only to measure again, and `SPECULATION_STATE` holds no model."""
        path = profile_path(target)
        with SPECULATION_STATE.measuring(str(path)):
            kept = _kept(path)
            costs = kept[0] if kept else _cached_or_measured(target, path)
            if not kept and costs is not None:  # the file is read (or measured) once per process
                _keep_costs(path, costs)
        if costs is None:
            return None
        remeasure = None
        if os.environ.get("HF_DIFFSPEC_AUTO_PROFILE", "1") != "0" and str(path) not in SPECULATION_STATE.remeasured:
            remeasure = functools.partial(_remeasure_stale, target, path)
        cost = cls(costs, remeasure=remeasure, path=path)
        if kept:
            cost.corrections, cost.observations = kept[1], kept[2]
        return cost

    def keep(self) -> None:
        """Hand this call's costs and corrections back: the next call on this profile starts from them."""
        if self.path is None:
            return
        _keep_costs(self.path, self.costs, self.corrections, self.observations)

    def __call__(self, n: int, rows: int = 1) -> float:
        ratios = self.corrections.get(rows_bucket(rows))
        if not ratios:
            return self.profiled(n, rows)
        return self.profiled(n, rows) * _interpolate(ratios, min(max(n, min(ratios)), max(ratios)))


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _keep_costs(path: Path, costs: dict, corrections: dict | None = None, observations: dict | None = None) -> None:
    """Copies of `costs` and their corrections become what the next call on the profile at `path` starts from."""
    with SPECULATION_STATE.lock:
        SPECULATION_STATE.verify_costs[str(path)] = (_mtime(path), copy.deepcopy(costs),
                                                     copy.deepcopy(corrections or {}), dict(observations or {}))


def _kept(path: Path) -> tuple | None:
    """Copies of (costs, corrections, observations) the last call on the profile at `path` kept, while the file is
    the one they came from."""
    with SPECULATION_STATE.lock:
        kept = SPECULATION_STATE.verify_costs.get(str(path))
        if kept is None or kept[0] != _mtime(path):
            return None
        return copy.deepcopy(kept[1:])


def _cached_or_measured(target, path: Path) -> dict[int, dict[int, float]] | None:
    """The costs of the cached profile at `path`, or measured now when it is missing, unreadable or implausible;
    None when there is none and HF_DIFFSPEC_AUTO_PROFILE=0."""
    automatic = os.environ.get("HF_DIFFSPEC_AUTO_PROFILE", "1") != "0"
    costs, problem = read_profile(path)
    if costs is not None and problem is None:
        return costs
    if not automatic:
        if costs is not None:
            _warn_once(f"the cached verify-cost profile {path} {problem}; HF_DIFFSPEC_AUTO_PROFILE=0 keeps it. "
                       "Re-measure it on a quiet machine: hf-diffspec profile --target ... --dtype ...")
            return costs
        missing = (f"the verify-cost profile {path} {problem}" if problem else
                   f"no verify-cost profile for this target on {target.device} in {target.dtype} "
                   f"({torch.get_num_threads()} threads)")
        _warn_once(f"{missing} and HF_DIFFSPEC_AUTO_PROFILE=0: drafts are verified at a fixed length. Run "
                   "`hf-diffspec profile --target ... --dtype ...` once to measure one.")
        return None
    if problem is not None:
        logger.warning("the cached verify-cost profile %s %s: measuring it again", path, problem)
    else:
        logger.warning("measuring this target's verify cost on %s in %s (%d threads), once; cached in %s",
                       target.device, target.dtype, torch.get_num_threads(), profile_dir())
    return _measure_and_keep(target)


def read_profile(path: Path) -> tuple[dict[int, dict[int, float]] | None, str | None]:
    """The costs of the profile file at `path` (None when there is none, or it is of an older format) and what is
    wrong with them (None: nothing)."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != PROFILE_FORMAT:
            return None, "comes from an older measurement"
        costs = {int(b): {int(n): float(t) for n, t in row.items()} for b, row in data["verify_seconds"].items()}
        if not costs or not all(costs.values()):
            raise ValueError("no costs in it")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as error:
        # cut short (a full disk), written by another program or version, edited by hand
        return None, f"cannot be read ({type(error).__name__}: {error})"
    return costs, implausible_costs(costs)


def _measure_and_keep(target) -> dict[int, dict[int, float]]:
    """Measure the quick profile; cache it unless it is disturbed (then this process alone uses it)."""
    measured = measure_profile(target, **QUICK_PROFILE)
    if measured.problem is None:
        try:
            save_profile(target, measured.costs, measured.others_load)
        except OSError as error:  # a read-only home, a cache path that is a file, a full disk
            logger.warning("the verify-cost profile cannot be cached (%s: %s); used by this process, measured again "
                           "by the next. Set HF_DIFFSPEC_CACHE to a writable folder to keep it.",
                           type(error).__name__, error)
    else:
        logger.warning("the verify-cost profile was measured on a busy machine (%s); used by this process, not "
                       "cached. `hf-diffspec profile` measures one on a quiet machine.", measured.problem)
    return measured.costs


def _remeasure_stale(target, path: Path, why: str) -> dict[int, dict[int, float]]:
    """Live steps disagree with the profile in use (`why`): measure it again, once per process and profile."""
    with SPECULATION_STATE.measuring(str(path)):
        if str(path) in SPECULATION_STATE.remeasured:  # another call measured it meanwhile
            kept = _kept(path)
            if kept:
                return kept[0]
        SPECULATION_STATE.remeasured.add(str(path))
        logger.warning("live steps disagree with the verify-cost profile %s (%s): measuring it again, once", path, why)
        costs = _measure_and_keep(target)
        _keep_costs(path, costs)
        return costs


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


# what a first run measures before speculating (seconds); `hf-diffspec profile` measures the full grid
QUICK_PROFILE = dict(sizes=(1, 2, 4, 8, 16), batches=(1, 4, 16), context_length=128, repeats=3)
ONE_TOKEN_JUMP = 6.0  # a forward over a few tokens at most this many times a one-token one (`implausible_costs`)
MAX_OTHERS_LOAD = 0.25  # cores other processes may keep busy while a profile that gets cached is measured
STALE_FACTOR = 2.0  # live steps this many times faster than profiled: the profile is re-measured
STALE_AFTER_STEPS = 4  # steps observed at one batch size and width before they are compared with the profile


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
