"""Counting what stalls an asynchronous device between two target forwards of the decoding loop.

On a GPU every `.item()`, `.tolist()`, `bool(tensor)`, `nonzero()` or copy to the host waits until the device has run
everything queued before it, as does a wait for the whole device (`device_clock.synchronize`, which a host clock
read after the device's work needs, and `torch.cuda.synchronize`), and a copy from pageable host memory
(`torch.tensor(list, device=...)`) waits too. The
loop's host work between forwards is added to every step; these calls are where it also makes the device wait.

`HostSyncCounter` is a `TorchFunctionMode` that counts them outside the forwards of the models it is given, per loop
step: the calls between the end of one target forward and the start of the next are one step's (what the loop does
after a verify forward and before the next one: accept, commit, cache bookkeeping, lookup, drafting, tree inputs).
It sees every tensor as "the device's" (the counts are the same on a CPU), which is what the budget is about: how
many times per step the host would wait on a device. A read (`DEVICE_TO_HOST`) counts whatever tensor it reads. A
copy into host memory (`.to` the host, `copy_` into a host tensor) counts when its source is the device's; where a
tensor lives is then told as on a GPU: a CPU tensor is host memory when the loop runs on a device, and on a CPU run
when the host made it (`_made_on_host`: with no device, the device written as the string "cpu", pinned; its views
and results) or copied it there. On a CPU run a `torch.device("cpu")` object is how the loop names its own device
(`tensor.to(device)`), so only the string "cpu" (or a host tensor) names the host there.
"""

import contextlib
import os
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from ..runtime import device_clock

# calls that read a device value on the host (each waits for the device)
DEVICE_TO_HOST = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.Tensor.numpy, torch.equal,
    torch.Tensor.unique, torch.unique, torch.masked_select, torch.Tensor.masked_select, torch.argwhere,
    torch.Tensor.argwhere, torch.Tensor.repeat_interleave, torch.repeat_interleave, torch.Tensor.__array__,
}
# of those, the ones that read the device only when `repeats` is a tensor and no `output_size` is given: an int count
# (transformers' Gated DeltaNet repeats key heads for value heads so) is known on the host
REPEATS = {torch.Tensor.repeat_interleave, torch.repeat_interleave}
# calls that build a tensor from host (Python) data: a host-to-device copy when the tensor lands on a device
HOST_TO_DEVICE = {torch.tensor, torch.as_tensor, torch.asarray}


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _from_host(data) -> bool:
    if isinstance(data, torch.Tensor):
        return False
    if isinstance(data, (list, tuple)):
        return not (data and all(isinstance(d, torch.Tensor) for d in data))
    return True


class HostSyncCounter(TorchFunctionMode):
    """Counts host synchronisations (`syncs`) and host-to-device copies (`copies`) per loop step, outside the forwards
    of `models` (hooked while counting). `target`: the model whose forwards delimit steps.

    After the run, `steps` holds one `Counter` of call names per window between two consecutive target forwards
    (window 0 is between the prefill and the first verify forward); `per_step_syncs` / `per_step_copies` their
    totals."""

    def __init__(self, target, models=()):
        super().__init__()
        self.target = target
        self.models = [target, *models]
        self.depth = 0  # > 0 inside a counted model's forward
        self.forwards = 0
        self.steps: list[Counter] = []
        self.current: Counter | None = None  # None before the first target forward ends
        self.handles = []
        parameter = next(target.parameters(), None)
        self.cpu_run = parameter is None or parameter.device.type == "cpu"
        self._host: dict[int, weakref.ref] = {}  # id -> tensor, for the host tensors of a CPU run

    def __enter__(self):
        for model in self.models:
            is_target = model is self.target
            self.handles.append(model.register_forward_pre_hook(lambda *_, t=is_target: self._enter(t)))
            self.handles.append(model.register_forward_hook(lambda *_, t=is_target: self._leave(t)))
        # waits for the whole device: the loop's (`device_clock.synchronize`) and torch's own
        self._synchronizers = [(device_clock, "synchronize", device_clock.synchronize),
                               (torch.cuda, "synchronize", torch.cuda.synchronize)]
        for owner, name, real in self._synchronizers:
            setattr(owner, name, self._counting_wait(real))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for owner, name, real in self._synchronizers:
            setattr(owner, name, real)
        return super().__exit__(*exc)

    def _counting_wait(self, wait):
        def counted(*args, **kwargs):
            if self.depth == 0 and self.current is not None:
                self.current["sync:synchronize"] += 1
            return wait(*args, **kwargs)
        return counted

    def _enter(self, is_target: bool) -> None:
        if is_target and self.depth == 0 and self.current is not None:
            self.steps.append(self.current)
        self.depth += 1

    def _leave(self, is_target: bool) -> None:
        self.depth -= 1
        if is_target and self.depth == 0:
            self.forwards += 1
            self.current = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0 and self.current is not None:
            name = getattr(func, "__name__", str(func))
            self.current["calls"] += 1  # every torch call: each costs a dispatch on the host
            if func in DEVICE_TO_HOST and not (func in REPEATS and _repeats_known(args, kwargs)):
                self.current["sync:" + name] += 1
            elif func in HOST_TO_DEVICE and args and _from_host(args[0]):
                self.current["copy:" + name] += 1
            elif func is torch.Tensor.to and self._to_host(args, kwargs) and not self.is_host(args[0]):
                self.current["sync:to(cpu)"] += 1
            elif func is torch.Tensor.copy_ and isinstance(args[1], torch.Tensor) and self.is_host(args[0]) \
                    and not self.is_host(args[1]):
                self.current["sync:copy_(to host)"] += 1
            elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1 \
                    and _is_bool_index(args[1]):
                self.current[f"sync:{name}[bool]"] += 1
        result = func(*args, **kwargs)
        if self.depth == 0 and self.cpu_run:
            result = self._note_host(func, args, kwargs, result)
        return result

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is host memory (see the module's docstring)."""
        if tensor.device.type != "cpu":
            return False
        if not self.cpu_run:
            return True
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark_host(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._host[key] = weakref.ref(tensor, lambda _, key=key: self._host.pop(key, None))

    def _to_host(self, args, kwargs) -> bool:
        """Whether a `Tensor.to` call copies to host memory."""
        target = _to_target(args, kwargs)
        if isinstance(target, torch.Tensor):
            return self.is_host(target)
        if target is None or torch.device(target).type != "cpu":
            return False
        return not self.cpu_run or isinstance(target, str)  # a CPU run's torch.device is the loop's own

    def _note_host(self, func, args, kwargs, result):
        """On a CPU run, remember which of `func`'s results are host memory: what the host made or copied there. A
        copy between the host and the loop's device that torch returned as its own source (on a CPU, nothing moves)
        is made a copy, as on a device."""
        if not isinstance(result, torch.Tensor):
            return result
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            source = args[0]
            to_host = func is torch.Tensor.cpu or self._to_host(args, kwargs)
            if to_host and not self.is_host(source):
                result = result.clone() if result is source else result
                self._mark_host(result)
            elif not to_host and self.is_host(source) and _to_target(args, kwargs) is not None:
                result = result.clone() if result is source else result  # the host's tensor, now on the device
            return result
        if func is torch.Tensor.copy_:
            return result
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        if tensors and all(self.is_host(t) for t in tensors) or not tensors and _made_on_host(kwargs):
            self._mark_host(result)
        elif func is torch.Tensor.pin_memory:
            self._mark_host(result)
        return result

    @property
    def per_step_syncs(self) -> list[int]:
        return [sum(v for k, v in step.items() if k.startswith("sync:")) for step in self.steps]

    @property
    def per_step_calls(self) -> list[int]:
        """Torch calls per step outside the forwards (tensor attribute reads included): the loop's dispatch count."""
        return [step["calls"] for step in self.steps]

    @property
    def per_step_copies(self) -> list[int]:
        return [sum(v for k, v in step.items() if k.startswith("copy:")) for step in self.steps]

    def worst(self) -> Counter:
        """The window with the most syncs and copies (to say where they are)."""
        return max(self.steps, key=lambda s: sum(s.values()), default=Counter())


def _repeats_known(args, kwargs) -> bool:
    """Whether a `repeat_interleave` call's output size is known on the host (an int `repeats`, or `output_size`)."""
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    return not isinstance(repeats, torch.Tensor) or kwargs.get("output_size") is not None


def _to_target(args, kwargs):
    """Where a `Tensor.to(...)` call moves its tensor: a device (string or `torch.device`), a tensor (`.to(other)`:
    where `other` is), or None (a dtype change alone)."""
    if "device" in kwargs:
        return kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device, torch.Tensor)):
            return arg
        if isinstance(arg, int) and not isinstance(arg, bool):
            return torch.device("cuda", arg)  # an int is a device index
    return None


def _made_on_host(kwargs) -> bool:
    """Whether a call that reads no tensor (a factory) makes host memory: no device, the string "cpu", or pinned."""
    if kwargs.get("pin_memory"):
        return True
    device = kwargs.get("device")
    return device is None or isinstance(device, str) and torch.device(device).type == "cpu"


def _flat(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


@contextlib.contextmanager
def drafting_ahead(on: bool):
    """Within the block, drafter steps draft their successor ahead of their read (`on`, as where a read waits for the
    device) or every pass at its own step (as on a CPU): `HF_DIFFSPEC_DRAFT_AHEAD`, put back after."""
    saved = os.environ.get("HF_DIFFSPEC_DRAFT_AHEAD")
    os.environ["HF_DIFFSPEC_DRAFT_AHEAD"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HF_DIFFSPEC_DRAFT_AHEAD"]
        else:
            os.environ["HF_DIFFSPEC_DRAFT_AHEAD"] = saved
