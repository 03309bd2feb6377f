"""Verify-cost profiles: measuring one (through the loop's own `TargetVerifier`), the machine's load while it is
measured, the file cache, and when to measure again. The model the profile feeds is `control_cost.VerifyCost`.

A quick profile (a few points, seconds) is measured automatically the first time a target speculates on a machine,
dtype and thread count, and cached as JSON; `hf-diffspec profile` measures the full grid (`--show` lists the cached
profiles, `--clear` removes them). It is measured with the decoding loop's own verify step, so it times what the
loop will pay. A profile measured while other processes took the cores would steer every later call on the machine,
so it is guarded three ways: a measurement whose curve is impossible on a quiet machine (a forward over more tokens
cheaper than one over fewer, or far more than proportionally dearer) is taken again; one taken while other processes
kept the machine busy is cached marked as the measuring process's (its targets use it; another process measures
again); and when
the loop's steps run `STALE_FACTOR` times faster than the profile says a bare forward takes, the profile is measured
again, once per target, with one log line. A cached file that cannot be read (cut short, not JSON, another layout)
is reported and measured again; one
that cannot be written is reported, and the profile is used by that target. With HF_DIFFSPEC_AUTO_PROFILE=0 nothing
is measured automatically: a cached profile is used as it is, and without one drafts are verified at the drafter's
configured length and a warning says how to measure one.

`verify_cost_for(target)` is the one way a call, the bench and the CLI obtain a target's profile.
"""

import functools
import hashlib
import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .control_cost import VerifyCost, implausible_costs
from .control_state import MEASURING, memory_of
from .files import atomic_write, cache_dir
from .tree import CandidateTree
from .verifier import TargetVerifier
from .verify_cache import LinearStates

logger = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PROFILE_BATCHES = (1, 2, 4, 8, 16)
PROFILE_FORMAT = 3  # 1: batch-1 costs only; 2: measured without the loop's 4D mask (neither is read any more)


def profile_key(target, graphs: bool = False) -> str:
    """Identifies what the cost depends on: the target's architecture, its device and dtype, the thread count, and
    whether the verify forward replays CUDA graphs (`graphs`: a graphed step launches no kernel from the host)."""
    config = target.config.get_text_config().to_json_string(use_diff=False)
    arch = hashlib.sha256(config.encode()).hexdigest()[:12]
    device = str(target.device)
    if target.device.type == "cuda":
        device = torch.cuda.get_device_name(target.device)
    threads = torch.get_num_threads() if target.device.type == "cpu" else 0
    raw = f"{arch}|{device}|{target.dtype}|{threads}" + ("|graphs" if graphs else "")
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
                        repeats: int = 5, graphs: bool = False) -> dict[int, dict[int, float]]:
    """Median seconds of a target forward over `rows` x n new tokens on top of a cached context of `context_length`
    per row: {rows: {n: seconds}}.

    Each forward is the decoding loop's own verify step (`TargetVerifier.forward`: its cache, inputs, masks,
    attention and recurrent-state recording) over chains of n tokens with an explicit 4D mask, as trees and ragged
    rows verify (without a mask the model takes its causal fast path, which at 16 rows made a 2-token forward look
    1.03x a 1-token one, 1.43x with the mask). After each forward the cache is put back as it was: attention K/V
    cropped, linear-attention states restored. Sizes are interleaved, in an order that turns every round, so that a
    drift in the machine's speed spreads over all of them; the first round warms up (and, with `graphs`, captures
    each width's graph: the forwards are the capture-ready step's, `verify_graphs.py`, replayed as CUDA graphs)."""
    generator = torch.Generator().manual_seed(0)
    return {rows: _measure_rows(target, rows, sizes, context_length, repeats, generator, graphs) for rows in batches}


def _measure_rows(target, rows: int, sizes, context_length: int, repeats: int, generator,
                  graphs: bool = False, fastest: bool = False) -> dict[int, float]:
    device = target.device
    context = _plain_token_ids(target.config, rows * context_length, generator).view(rows, context_length).to(device)
    drafts = [[_plain_token_ids(target.config, n, generator).to(device) for _ in range(rows)]
              for round_ in range(repeats + 1) for n in _size_order(sizes, round_)]
    valid = torch.ones(rows, context_length, dtype=torch.bool, device=device)
    roots = torch.full((rows,), context_length, device=device)
    times = {n: [] for n in sizes}
    static_length = context_length + max(sizes) if graphs else None
    with TargetVerifier(target, static_length=static_length, explicit_masks=True, rows=rows) as verifier:
        verifier.prefill(context, None, None, valid)
        states = LinearStates(verifier.cache)  # a linear layer's state after the context, put back after each forward
        for tokens in drafts:  # the first round warms up
            trees = [CandidateTree(row, list(range(-1, len(row) - 1))) for row in tokens]
            _sync(device)
            start = time.perf_counter()
            verifier.forward(trees, roots)
            _sync(device)
            times[len(tokens[0])].append(time.perf_counter() - start)
            verifier.rewind()
            states.restore()
    if fastest:
        return {n: min(t[1:]) for n, t in times.items()}
    return {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}


def measure_drafting_price(target, generator, rows: int, context_length: int = 32, repeats: int = 6) -> float:
    """What one drafting pass of `generator` (a candidate generator at a fixed length) costs at `rows` rows, in the
    loop's one-token verify steps at those rows (`_measure_rows`, the profile's), timed around them: a ratio that a
    load slowing every forward leaves as it is; the fastest of each, the ones other processes disturbed least. The
    drafter drafts every slot of its block after a random context of `context_length` target features (their values
    do not change the time)."""
    device, block = target.device, generator.block_size
    features = torch.randn(rows, context_length, target.config.get_text_config().hidden_size, device=device,
                           dtype=target.dtype)
    generator.add_context((features,) * (max(generator.drafter.target_feature_layers) + 1), slice(None),
                          torch.arange(context_length, device=device).repeat(rows, 1))
    roots = _plain_token_ids(target.config, rows, torch.Generator().manual_seed(0)).tolist()

    def drafting_pass() -> float:
        _sync(device)
        start = time.perf_counter()
        generator.propose(roots, [context_length] * rows, [block] * rows)
        _sync(device)
        return time.perf_counter() - start

    drafting_pass()  # warms up (the verify steps' first round does too)
    times = [drafting_pass() for _ in range(repeats // 2)]
    verify = _measure_rows(target, rows, (1,), context_length, repeats, torch.Generator().manual_seed(0), fastest=True)
    times += [drafting_pass() for _ in range(repeats - repeats // 2)]
    return min(times) / verify[1]


def drafting_price_for(target, drafter, method, rows: int, make_generator) -> float | None:
    """The drafting price (`measure_drafting_price`, on `make_generator()`) of `drafter`'s architecture with `method`
    at `rows` rows on this machine: kept by the target for the process, cached beside the verify profiles (unless
    other processes kept the machine busy meanwhile), measured the first time (under a second for SmolLM2 at 16
    rows); None where nothing is cached and automatic profiling is off."""
    config = drafter.config.to_json_string(use_diff=False)
    key = hashlib.sha256(f"{config}|{method.__name__}|{profile_key(target)}".encode()).hexdigest()[:16]
    path = profile_dir() / f"drafting-{key}.json"
    memory = memory_of(target)
    with MEASURING:
        prices = memory.drafting_prices.get(key)
        if prices is None:
            try:
                prices = {int(r): float(p) for r, p in json.loads(path.read_text())["price"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                prices = {}
            memory.drafting_prices[key] = prices
        if rows not in prices and _automatic():
            with torch.no_grad(), OtherProcessesLoad() as load:
                prices[rows] = measure_drafting_price(target, make_generator(), rows)
            if load.cores is None or load.cores <= MAX_OTHERS_LOAD:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(path, json.dumps({"method": method.__name__, "price": prices}, indent=1))
                except OSError:  # kept for this process; the verify profile's warning says how to fix it
                    pass
        return prices.get(rows)


def _size_order(sizes, round_: int) -> list[int]:
    """The sizes of one round: turned by one every round, and reversed every other."""
    turn = round_ % len(sizes)
    order = list(sizes[turn:] + sizes[:turn])
    return order if round_ % 2 else order[::-1]


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
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @property
    def fields(self) -> dict:
        """What a profile file records of the measurement."""
        return {"measured_at": self.measured_at, "others_load_cores": self.others_load,
                "verify_seconds": {str(b): {str(n): t for n, t in row.items()} for b, row in self.costs.items()}}


def measure_profile(target, attempts: int = 3, graphs: bool = False, **grid) -> ProfileMeasurement:
    """`measure_verify_cost` until a measurement is plausible (`implausible_costs`) and taken on a quiet machine (other
    processes kept under `MAX_OTHERS_LOAD` cores busy), at most `attempts` times; the last one is returned, with
    the problem that remains."""
    for attempt in range(1, attempts + 1):
        with OtherProcessesLoad() as load:
            costs = measure_verify_cost(target, graphs=graphs, **grid)
        problem = implausible_costs(costs)
        if problem is None and load.cores is not None and load.cores > MAX_OTHERS_LOAD:
            problem = (f"other processes kept {load.cores:.2f} cores busy while it was measured (at most "
                       f"{MAX_OTHERS_LOAD} allowed)")
        if problem is None:
            break
        if attempt < attempts:
            logger.warning("the verify-cost measurement is disturbed (%s): measuring again", problem)
    return ProfileMeasurement(costs, load.cores, attempt, problem)


def profile_path(target, graphs: bool = False) -> Path:
    return profile_dir() / f"{profile_key(target, graphs)}.json"


def profile_header(target, graphs: bool = False) -> dict:
    """What a profile file says of the target it was measured on."""
    return {"format": PROFILE_FORMAT, "key": profile_key(target, graphs), "graphs": graphs,
            "model_type": target.config.get_text_config().model_type, "device": str(target.device),
            "dtype": str(target.dtype), "threads": torch.get_num_threads()}


def save_profile(target, costs: dict[int, dict[int, float]], others_load: float | None = None,
                 graphs: bool = False) -> Path:
    path = profile_path(target, graphs)
    path.parent.mkdir(parents=True, exist_ok=True)
    measured = ProfileMeasurement(costs, others_load, 1, None)
    return atomic_write(path, json.dumps({**profile_header(target, graphs), **measured.fields}, indent=2))


def verify_cost_for(target, measure: bool = True, graphs: bool = False) -> VerifyCost | None:
    """The verify-cost profile for this target/device/dtype/threads (and graph mode: `graphs`, a call whose verify
    forward replays CUDA graphs is priced by a profile measured so), for one call: the costs and corrections the last
    call on the target kept (`keep_verify_cost`), else the cached file's, measured once (a few seconds) when missing,
    unreadable or implausible; None when automatic profiling is off (HF_DIFFSPEC_AUTO_PROFILE=0), or `measure` is
    False, and none is cached. A measurement taken while other processes kept the machine busy is used by this process
    alone (`_measure_and_keep`); one that cannot be saved, by this target object alone. Calls that need a missing
    profile at once wait for one measurement. The object returned is the call's own (no other call observes into
    it); it holds the target only to
    measure again."""
    path = profile_path(target, graphs)
    remeasure = functools.partial(_remeasure_stale, target, path, graphs=graphs) if _automatic() else None
    with MEASURING:  # the file is read (or the profile measured) once per target
        kept, remeasured = memory_of(target).verify_costs_for(path, functools.partial(
            _cached_or_measured, target, path, measure, graphs=graphs))
    if kept is None:
        return None
    return VerifyCost(kept[0], remeasure=None if remeasured else remeasure, path=path, corrections=kept[1],
                      observations=kept[2], loads=kept[3])


def keep_verify_cost(target, cost: VerifyCost) -> None:
    """Hand a call's costs and corrections back: the next call on the target starts from them (a cost model that
    came from no profile file keeps nothing)."""
    if cost.path is not None:
        memory_of(target).keep_costs(cost.path, cost.costs, cost.corrections, cost.observations, cost.loads)


def _automatic() -> bool:
    return os.environ.get("HF_DIFFSPEC_AUTO_PROFILE", "1") != "0"


def _cached_or_measured(target, path: Path, measure: bool, memory, graphs: bool = False
                        ) -> dict[int, dict[int, float]] | None:
    """The costs of the cached profile at `path`, or measured now when it is missing, unreadable or implausible;
    None when there is none and HF_DIFFSPEC_AUTO_PROFILE=0 (or `measure` is False)."""
    automatic = _automatic()
    costs, problem = read_profile(path)
    if not measure:
        return costs
    if costs is not None and problem is None:
        return costs
    if not automatic:
        if costs is not None:
            memory.warn_once(logger, f"the cached verify-cost profile {path} {problem}; HF_DIFFSPEC_AUTO_PROFILE=0 "
                             "keeps it. Re-measure it on a quiet machine: hf-diffspec profile --target ... --dtype ...")
            return costs
        missing = (f"the verify-cost profile {path} {problem}" if problem else
                   f"no verify-cost profile for this target on {target.device} in {target.dtype} "
                   f"({torch.get_num_threads()} threads)")
        memory.warn_once(logger, f"{missing} and HF_DIFFSPEC_AUTO_PROFILE=0: drafts are verified at a fixed length. "
                                 "Run `hf-diffspec profile --target ... --dtype ...` once to measure one.")
        return None
    if problem is not None:
        logger.warning("the cached verify-cost profile %s %s: measuring it again", path, problem)
    else:
        logger.warning("measuring this target's verify cost on %s in %s (%d threads), once; cached in %s",
                       target.device, target.dtype, torch.get_num_threads(), profile_dir())
    return _measure_and_keep(target, graphs)


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
    if "disturbed" in data:  # this process's own measurement, on a busy machine (`_measure_and_keep`)
        if data.get("measured_by") == _this_process():
            return costs, None
        return costs, f"was measured on a busy machine by another process ({data['disturbed']})"
    return costs, implausible_costs(costs)


def _measure_and_keep(target, graphs: bool = False) -> dict[int, dict[int, float]]:
    """Measure the quick profile and cache it. A disturbed one (a busy machine) is cached marked as this process's:
    every target of the architecture in this process uses it (no measurement per model instance), and another
    process measures again (`read_profile`)."""
    path, header = profile_path(target, graphs), profile_header(target, graphs)
    measured = measure_profile(target, graphs=graphs, **QUICK_PROFILE)
    fields = {**header, **measured.fields}
    if measured.problem is not None:
        logger.warning("the verify-cost profile was measured on a busy machine (%s); used in this process, not "
                       "cached for others. `hf-diffspec profile` measures one on a quiet machine.", measured.problem)
        if path.is_file() and read_profile(path)[1] is None:
            return measured.costs  # a re-measurement: the quiet profile on disk stays for other processes
        fields.update(disturbed=measured.problem, measured_by=_this_process())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(fields, indent=2))
    except OSError as error:  # a read-only home, a cache path that is a file, a full disk
        logger.warning("the verify-cost profile cannot be cached (%s: %s); used by this model, measured again "
                       "by the next. Set HF_DIFFSPEC_CACHE to a writable folder to keep it.",
                       type(error).__name__, error)
    return measured.costs


def _remeasure_stale(target, path: Path, why: str, graphs: bool = False) -> dict[int, dict[int, float]]:
    """Live steps disagree with the profile in use (`why`): measure it again, once per target and profile."""
    memory = memory_of(target)
    with MEASURING:
        if str(path) in memory.remeasured:  # another call measured it meanwhile
            kept = memory.kept_costs(path)
            if kept:
                return kept[0]
        memory.remeasured.add(str(path))
        logger.warning("live steps disagree with the verify-cost profile %s (%s): measuring it again, once", path, why)
        costs = _measure_and_keep(target, graphs)
        memory.keep_costs(path, costs)
        return costs


def _this_process() -> str:
    """This process, as a disturbed profile names the one that may use it: its pid and start time (a later process
    given the same pid is another one)."""
    try:
        started = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{os.getpid()}@{started}"


# what a first run measures before speculating (seconds); `hf-diffspec profile` measures the full grid
QUICK_PROFILE = dict(sizes=(1, 2, 4, 8, 16), batches=(1, 4, 16), context_length=128, repeats=3)
MAX_OTHERS_LOAD = 0.25  # cores other processes may keep busy while a profile that gets cached is measured
