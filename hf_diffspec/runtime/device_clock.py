"""Timing work on an asynchronous device: a host clock read only once the device has run what was launched.

On a GPU a kernel launch returns at once; a timestamp taken right after launching a step's last kernels (the cache
gathers of the verifier's `keep`, a recurrent replay) leaves their device time out of that step and puts it into
whichever later step first waits on the device. The gates and the draft-length policy compare such times, so every
stamp the loop feeds them is taken with `device_time`. On the CPU work is done when launched: the synchronisation is
free and the code path is the same (tests substitute a fake device clock through `synchronize` and `clock`).
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
