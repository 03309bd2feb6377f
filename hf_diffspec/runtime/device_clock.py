"""Timing work on an asynchronous device without waiting for it.

On a GPU a kernel launch returns at once; a host timestamp taken right after launching a step's last kernels (the
cache gathers of the verifier's `keep`, a recurrent replay) would leave their device time out of that step and put it
into whichever later step first waits on the device. Inside the decoding loop, `StepClock` stamps the device's own
timeline instead: CUDA events recorded on the stream, never waited for, and read once the device has passed them
(the step's one host read passes everything launched before it, so a step's end is readable at the next step's
read: its time reaches the controller and the cost model one step late; all of them are moving averages). On the CPU
work is done when it is launched, and the host clock is the stamp. `device_time` (a host clock read after waiting
for the device) times whole calls and measurements. Tests substitute a fake device through `synchronize`, `clock`,
`uses_events` and `Event`.
"""

import time

import torch

clock = time.perf_counter  # the host clock


def synchronize(device: torch.device) -> None:
    """Wait until `device` has run everything queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta") and hasattr(torch, "accelerator"):  # torch >= 2.6
        torch.accelerator.synchronize(device)


def device_time(device: torch.device) -> float:
    """Host seconds at which `device` has finished everything launched on it so far."""
    synchronize(device)
    return clock()


def uses_events(device: torch.device) -> bool:
    """Whether `device` is timed by events on its own timeline (CUDA) rather than by the host clock."""
    return device.type == "cuda"


def Event():  # noqa: N802 (a factory standing in for the class, so that tests can replace it)
    return torch.cuda.Event(enable_timing=True)


class StepClock:
    """Stamps of a decoding call's steps that never wait for `device`: events on its timeline where it runs
    asynchronously (`uses_events`), the host clock elsewhere. `seconds(start, end)` reads two stamps once the device
    has passed `end`, and is None until then."""

    def __init__(self, device: torch.device):
        self.events = uses_events(device)

    def stamp(self):
        if not self.events:
            return clock()
        event = Event()
        event.record()
        return event

    def seconds(self, start, end) -> float | None:
        if not self.events:
            return end - start
        if not end.query():
            return None
        return start.elapsed_time(end) / 1000
