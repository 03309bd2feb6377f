"""What the runtime keeps from one `generate` call to the next, and where: on the target model itself, in a
`SpeculationMemory` (`memory_of(target)`), made at the first speculative call on it and freed with it.

- `controllers`: the speculation controller (`control_speculation.py`) of each drafter decoding for this target, per
  setup (dtype, device, thread count, drafting method). A second call starts from what the first measured, weighed
  less. Drafters are held weakly: their entries go with them.
- `verify_costs`: the verify-cost profiles in use (`control_profiles.py`), per profile file: its modification time,
  costs and the corrections live steps made to them (`VerifyCost.observe`), so these carry over to later calls.
  Plain numbers: the memory holds no model.
- `drafting_prices`: what a drafting pass costs in one-token verify steps, per drafter architecture, method and
  row count (`control_profiles.drafting_price_for`), as its cached file says or as measured.
- `warned`: warnings already given about this target; `remeasured`: profiles measured again because live steps
  disagreed with them (once per target).
- `static_steps`: the capture-ready verify step's preallocated cache, persistent inputs and CUDA graphs, one per
  (graph mode, inference mode) (`verify_graphs.StaticStep`): a call with `cache_implementation="static"` takes it,
  and the next call of its rows replays its graphs instead of capturing them again. Taken out while a call holds
  it: two calls at once never share one. `graph_capture_failed`: once a capture failed, no verify forward on the
  target tries again.

No module global is written while calls run. Calls running at once (threads of one process) share none of it while
they run: each call takes its own copy of the controller and the verify cost at its start and hands them back at its
end, under the memory's lock (the last call to end is what the next one starts from). One thread measures a profile at a
time (`MEASURING`); the others that need one wait, then read what it measured.

`reset_speculation_state()` forgets all of it: every memory made before is discarded at its next use, so the next call
learns its controller afresh and re-reads the profiles from disk (it does not re-measure them; `hf-diffspec profile`
does). A saved drafter's `custom_generate/` folder is a copy of this package with memories of its own.
"""

import copy
import os
import threading
import weakref

MEMORY_ATTRIBUTE = "_hf_diffspec_memory"
MEASURING = threading.Lock()  # held while a verify-cost profile is measured (one at a time: they time the machine)
_MAKING = threading.Lock()  # held while a target's memory is looked up or made


class _Epoch:
    """Moved by `reset_speculation_state`: memories made in an earlier epoch are discarded at their next use."""

    value = 0


class SpeculationMemory:
    """One target's cross-call state (see the module docstring)."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.lock = threading.RLock()
        # drafter (weakly) -> {(dtype, device, threads, method): SpeculationController}
        self.controllers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.verify_costs: dict[str, tuple] = {}  # profile path -> (mtime_ns, costs, corrections, observations, loads)
        self.drafting_prices: dict[str, dict[int, float]] = {}  # drafting price key -> {rows: price}
        self.warned: set[str] = set()
        self.remeasured: set[str] = set()
        self.static_steps: dict[tuple, object] = {}  # (graph mode, inference mode) -> StaticStep
        self.graph_capture_failed = False  # a CUDA graph capture failed on this target: verify forwards run eagerly

    def kept_costs(self, path) -> tuple | None:
        """Copies of (costs, corrections, observations, loads) the last call on the profile at `path` kept, while the file
        is the one they came from."""
        with self.lock:
            kept = self.verify_costs.get(str(path))
            if kept is None or kept[0] != _mtime(path):
                return None
            return copy.deepcopy(kept[1:])

    def verify_costs_for(self, path, load) -> tuple[tuple | None, bool]:
        """Copies of (costs, corrections, observations, loads) the last call on the profile at `path` kept, while the file
        is the one they came from; else `load(self)`'s costs (the file's, or measured), kept from now on (None:
        none). And whether the profile was measured again already (once per target)."""
        with self.lock:
            kept = self.kept_costs(path)
            if kept is None:
                costs = load(self)
                kept = None if costs is None else self.keep_costs(path, costs)
            return kept, str(path) in self.remeasured

    def keep_costs(self, path, costs: dict, corrections: dict | None = None, observations: dict | None = None,
                   loads: dict | None = None) -> tuple:
        """Copies of `costs` and their corrections (`VerifyCost`'s) become what the next call on the profile at `path` starts from;
        returns another copy of them."""
        with self.lock:
            kept = (copy.deepcopy(costs), copy.deepcopy(corrections or {}), dict(observations or {}), dict(loads or {}))
            self.verify_costs[str(path)] = (_mtime(path), *kept)
            return copy.deepcopy(kept)

    def warn_once(self, logger, message: str) -> None:
        with self.lock:
            if message in self.warned:
                return
            self.warned.add(message)
        logger.warning(message)


def _mtime(path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def memory_of(target) -> SpeculationMemory:
    """The memory `target` keeps across calls (made at its first use, and again after a reset)."""
    with _MAKING:
        memory = target.__dict__.get(MEMORY_ATTRIBUTE)
        if not isinstance(memory, SpeculationMemory) or memory.epoch != _Epoch.value:
            memory = target.__dict__[MEMORY_ATTRIBUTE] = SpeculationMemory(_Epoch.value)
        return memory


def reset_speculation_state() -> None:
    """Forget every measurement kept across `generate` calls (speculation controllers, verify-cost corrections, warnings
    given): the next call on any target starts as the first one of a fresh process would, from the profiles cached
    on disk."""
    with _MAKING:
        _Epoch.value += 1
