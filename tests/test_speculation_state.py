"""What the runtime keeps across `generate` calls (`hf_diffspec.runtime.control_state`): on the target, drafters held
weakly, and forgotten by `hf_diffspec.reset_speculation_state()`."""

import gc

import pytest
import torch

import hf_diffspec
from hf_diffspec.runtime.control_profiles import save_profile, verify_cost_for
from hf_diffspec.runtime.drafting import candidate_generator_for
from hf_diffspec.runtime.control_speculation import StepKind, StepRecord, controller_for, keep_controller
from hf_diffspec.runtime.control_state import MEMORY_ATTRIBUTE, memory_of
from helpers import tiny_drafter, tiny_target


@pytest.fixture(autouse=True)
def fresh_state():
    hf_diffspec.reset_speculation_state()
    yield
    hf_diffspec.reset_speculation_state()


def _speculation_loses(control, rows: int = 1) -> None:
    """Measurements that make the next steps at `rows` rows plain ones: drafter steps that accept nothing and take
    100 s."""
    for _ in range(3):
        control.record(StepRecord(StepKind.DRAFT, rows, 0, rows, 100.0, 4, 0.001, 99.999), [0] * rows, [0] * rows)
        control.record(StepRecord(StepKind.PLAIN, rows, 0, rows, 0.001, 1, 0.001), [0] * rows, [0] * rows)


def test_after_reset_a_call_starts_fresh(tmp_path, monkeypatch):
    """A call starts from what earlier calls measured (here: speculation loses, so it decodes plainly); after
    `reset_speculation_state()` it measures afresh: its first step is a drafter step, and the verify-cost profile is re-read
    without the corrections observed before."""
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # the synthetic profile below is kept as saved
    target = tiny_target("llama", seed=4)
    drafter = tiny_drafter(target, block_size=4, seed=4)
    save_profile(target, {1: {n: 0.01 + 0.001 * n for n in (1, 2, 4, 8)}})
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=8, do_sample=False, assistant_model=drafter, return_dict_in_generate=True,
                  prompt_lookup_num_tokens=0)

    policy = candidate_generator_for(drafter, target).policy
    _speculation_loses(policy.control)
    policy.keep_measurements()  # as a call does at its end
    out = target.generate(ids, **kwargs)
    stats = out.speculation_stats
    assert stats.plain_steps == stats.target_forwards - 1  # what was measured before the call held: no drafter step
    cost = verify_cost_for(target)
    assert cost.corrections  # the call's steps refined the profile, for the next call
    kept = candidate_generator_for(drafter, target).policy.control
    assert kept is not policy.control and kept.loop.trials.keys() >= policy.control.loop.trials.keys()

    hf_diffspec.reset_speculation_state()
    fresh = candidate_generator_for(drafter, target).policy.control
    assert not fresh.drafter.trials and not fresh.loop.trials
    fresh_cost = verify_cost_for(target)
    assert not fresh_cost.corrections and fresh_cost.costs == cost.costs
    out = target.generate(ids, **kwargs)
    stats = out.speculation_stats
    assert stats.plain_steps < stats.target_forwards - 1  # unmeasured: speculation is tried first


def test_controllers_are_held_weakly_by_drafter_and_target():
    """The measurements live on the target: a collected target's go with it (a model created later never starts
    from them, whatever address it gets), and a collected drafter's entries leave the target's memory."""
    target, other = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=4)
    for model in (target, other):
        control = controller_for(drafter, model, "DiffusionCandidateGenerator", None)
        _speculation_loses(control)
        keep_controller(drafter, model, "DiffusionCandidateGenerator", control)
    assert len(memory_of(target).controllers[drafter]) == 1 and len(memory_of(other).controllers[drafter]) == 1
    kept = controller_for(drafter, target, "DiffusionCandidateGenerator", None)
    assert kept.loop.trials == {k: 0.5 * v for k, v in control.loop.trials.items()}
    assert not controller_for(drafter, target, "BestFirstTreeCandidateGenerator", None).loop.trials
    memory = memory_of(other)
    del other, model
    gc.collect()
    assert len(memory.controllers) == 1  # held by nothing but this test now: the target that kept it is gone
    del drafter
    gc.collect()
    assert len(memory_of(target).controllers) == 0 and len(memory.controllers) == 0


def test_a_fixed_length_keeps_no_state():
    target = tiny_target("llama", seed=0)
    drafter = tiny_drafter(target, block_size=4)
    policy = candidate_generator_for(drafter, target, num_draft_tokens=2).policy
    assert isinstance(policy, hf_diffspec.FixedLength) and policy.depth_limit(0, 10) == 2
    assert MEMORY_ATTRIBUTE not in target.__dict__  # a fixed length neither reads nor keeps anything


def test_each_call_observes_into_a_verify_cost_of_its_own(tmp_path, monkeypatch):
    """Calls running at once each take their own copy of the kept costs, corrections and step counts: what one call
    observes reaches neither the other nor the memory until it hands its copy back (and then only the next call
    sees it)."""
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")
    target = tiny_target("llama", seed=4)
    save_profile(target, {1: {n: 0.01 + 0.001 * n for n in (1, 2, 4, 8)}})
    verify_cost_for(target)  # the file read into the memory: later calls copy what the memory keeps
    first, second = verify_cost_for(target), verify_cost_for(target)
    for _ in range(5):  # live steps far slower than the profile: corrections and counts move
        first.observe(4, 1, 0.5)
    assert first.corrections and first.observations
    assert not second.corrections and not second.observations
    assert first.costs is not second.costs and first.corrections is not second.corrections
    assert not verify_cost_for(target).corrections  # the memory still holds what was kept
    from hf_diffspec.runtime.control_profiles import keep_verify_cost

    keep_verify_cost(target, first)
    third = verify_cost_for(target)
    assert third.corrections == first.corrections and third.corrections is not first.corrections
