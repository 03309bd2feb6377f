"""Honest timing on an asynchronous device: what a step launches is that step's time, not the next one's, and timing
it never makes the host wait.

A fake device stands in for a GPU (`device_clock.synchronize`, `clock`, `uses_events` and `Event`): the host clock
stands still, and work "launched" on the device advances it only when the host waits for the device, by a
synchronisation or by reading a device value (`ReadsWait`). Events mark the device's timeline where they are
recorded and can be read once the device has passed them. A stamp taken before the device has run a step's last
launches would show up as a wrong time, exactly as it would on a GPU.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_diffspec.bench.host_syncs import DEVICE_TO_HOST

from hf_diffspec.bench import run_benchmark
from hf_diffspec.bench import runner
from hf_diffspec.runtime import device_clock
from hf_diffspec.runtime.verifier import TargetVerifier
from hf_diffspec.runtime.control_policy import DraftLengthPolicy
from helpers import random_ids, tiny_drafter, tiny_target


class FakeDevice:
    """Device seconds queued by launches; the host sees them pass only when it waits (`synchronize`, counted in
    `waits`, or a read)."""

    def __init__(self):
        self.now = 0.0
        self.queued = 0.0
        self.waits = 0

    def launch(self, seconds: float) -> None:
        self.queued += seconds

    def synchronize(self, device=None) -> None:
        self.waits += device is not None  # the loop's waits (a read's wait passes no device)
        self.now += self.queued
        self.queued = 0.0

    def event(self):
        """A CUDA event's stand-in: it marks where the device's timeline is when recorded."""
        device = self

        class FakeEvent:
            def record(self):
                self.at = device.now + device.queued

            def query(self):
                return device.now >= self.at

            def elapsed_time(self, end):
                assert self.query() and end.query(), "an event read before the device reached it"
                return (end.at - self.at) * 1000

        return FakeEvent()


class ReadsWait(TorchFunctionMode):
    """A read of a device value on the host waits for everything launched before it, as on a GPU."""

    def __init__(self, device: FakeDevice):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in DEVICE_TO_HOST:
            self.device.synchronize()
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_device(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(device_clock, "synchronize", device.synchronize)
    monkeypatch.setattr(device_clock, "clock", lambda: device.now)
    monkeypatch.setattr(device_clock, "uses_events", lambda _: True)
    monkeypatch.setattr(device_clock, "Event", device.event)
    return device


VERIFY, KEEP, DRAFT = 2.0, 1.0, 0.25  # device seconds of a target forward, of the verifier's keep, of a drafter forward


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.every_step_speculates("each step's draft time is that of one drafter forward")
def test_a_step_is_timed_with_the_device_work_it_launched(fake_device, monkeypatch, do_sample):
    """Every step's draft and verify times are the device work it launched, read without waiting for the device
    inside any step: the call waits four times whatever its steps (its start, the prefill, its end twice), greedy
    and sampling."""
    target = tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=4, draft_tree_budget=4)  # best-first trees record every draft time
    target.register_forward_hook(lambda *_: fake_device.launch(VERIFY))
    drafter.register_forward_hook(lambda *_: fake_device.launch(DRAFT))
    keep = TargetVerifier.keep

    def keep_launching(self, *args, **kwargs):  # the cache gathers run on the device after the step's read
        kept = keep(self, *args, **kwargs)
        fake_device.launch(KEEP)
        return kept

    draft_times = []
    monkeypatch.setattr(TargetVerifier, "keep", keep_launching)
    monkeypatch.setattr(DraftLengthPolicy, "record_draft_time", lambda self, seconds: draft_times.append(seconds))
    with ReadsWait(fake_device):
        out = target.generate(random_ids(0, 6), max_new_tokens=12, do_sample=do_sample, assistant_model=drafter,
                              return_dict_in_generate=True)
    stats = out.speculation_stats
    assert fake_device.waits == 4
    steps = len(stats.committed_per_step)
    assert steps >= 3 and stats.draft_forwards >= steps - 1  # the last step may have no room left to draft
    assert draft_times == [DRAFT] * stats.draft_forwards
    assert stats.draft_time_s == DRAFT * stats.draft_forwards
    assert stats.verify_time_s == (VERIFY + KEEP) * steps  # keep is its own step's, not the next one's
    assert stats.prefill_time_s == VERIFY  # the prefill forward; keep is not the first step's
    assert stats.total_time_s == stats.prefill_time_s + stats.draft_time_s + stats.verify_time_s


def test_the_bench_times_a_call_until_the_device_has_run_it(fake_device, monkeypatch):
    generate = runner.run_method

    def launching_generate(*args, **kwargs):  # a call returns while its last kernels are still queued
        out = generate(*args, **kwargs)
        fake_device.launch(1.0)
        return out

    monkeypatch.setattr(runner, "run_method", launching_generate)
    target = tiny_target("qwen3", seed=0)
    results = run_benchmark(target, _Tokenizer(), {}, [{"domain": "chat", "text": "abc"}], max_new_tokens=3,
                            progress=False, rounds=2)
    (run,) = results.values()
    assert run.seconds == 2.0 and run.first_round_seconds == 1.0  # the warm-up's queued work is no call's


class _Tokenizer:
    pad_token_id = 1
    padding_side = "left"

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=False):
        from transformers import BatchEncoding

        ids = torch.tensor([[2 + ord(c) % 100 for c in text] for text in texts])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
