"""What the runtime keeps from one `generate` call to the next: all of it lives in `SPECULATION_STATE`.

- `gates`: the speculation gates (`gates.py`) of each drafter decoding for each target, per setup (dtype, device,
  thread count, drafting method). A second call starts from what the first measured instead of paying for its
  probes again. Drafters and targets are held weakly: the entries go with the models, so a model created later
  never meets a collected one's measurements (as it could under an `id()` that Python reuses).
- `verify_costs`: the verify-cost profiles in use (`cost_model.py`), per profile file: its modification time, costs
  and the corrections live steps made to them (`VerifyCost.observe`), so these carry over to later calls on the
  same target architecture, device, dtype and thread count. Plain numbers: nothing here holds a model.
- `warned`: warnings already given (each is given once per process).
- `remeasured`: profiles already measured again because live steps disagreed with them (once per process).

Calls running at once (threads of one process) share none of it while they run: each call takes its own copy of
the gates and the verify cost at its start and hands them back at its end (under `lock`; the last call to end is
what the next one starts from). One thread measures a missing profile while the others that need
it wait for it (`measuring`).

`reset_speculation_state()` forgets all of it: the next call measures its gates afresh and re-reads the profiles
from disk (it does not re-measure them; `hf-diffspec profile` does). A saved drafter's `custom_generate/` folder is
a copy of this package with a state of its own; its `state.reset_speculation_state` resets that one.
"""

import threading
import weakref


class SpeculationState:
    """The runtime's cross-call state (see the module docstring)."""

    def __init__(self):
        self.lock = threading.RLock()
        self._measuring: dict[str, threading.Lock] = {}
        self.reset()

    def reset(self) -> None:
        with self.lock:
            # drafter -> target -> {(dtype, device, threads, method): SpeculationGates}, both weakly keyed
            self.gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
            # profile path -> (mtime_ns, costs, corrections, observations)
            self.verify_costs: dict[str, tuple] = {}
            self.warned: set[str] = set()
            self.remeasured: set[str] = set()  # profile paths re-measured after live steps disagreed (once per process)

    def measuring(self, path: str) -> threading.Lock:
        """The lock one thread holds while it measures the profile at `path` (the others wait, then read it)."""
        with self.lock:
            return self._measuring.setdefault(path, threading.Lock())


SPECULATION_STATE = SpeculationState()


def reset_speculation_state() -> None:
    """Forget every measurement kept across `generate` calls (speculation gates, verify-cost corrections, warnings
    given): the next call starts as the first one of a fresh process would, from the profiles cached on disk."""
    SPECULATION_STATE.reset()
