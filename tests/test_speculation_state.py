"""What the runtime keeps across `generate` calls (`hf_diffspec.runtime.state`): held weakly by the models it is
about, and forgotten by `hf_diffspec.reset_speculation_state()`."""

import gc

import pytest
import torch

import hf_diffspec
from hf_diffspec.runtime.cost_model import VerifyCost, save_profile
from hf_diffspec.runtime.drafting import candidate_generator_for
from hf_diffspec.runtime.gates import keep_speculation_gates, speculation_gates_for
from hf_diffspec.runtime.state import SPECULATION_STATE
from helpers import tiny_drafter, tiny_target


@pytest.fixture(autouse=True)
def fresh_state():
    hf_diffspec.reset_speculation_state()
    yield
    hf_diffspec.reset_speculation_state()


def _speculation_loses(gates, rows: int = 1) -> None:
    """Measurements that make the next steps at `rows` rows plain ones (a probe only after `max_wait` of them)."""
    gates.drafter.record(True, rows, committed=1, seconds=100.0)
    gates.drafter.record(False, rows, committed=1, seconds=0.001)


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
    _speculation_loses(policy.gates)
    policy.keep_measurements()  # as a call does at its end
    out = target.generate(ids, **kwargs)
    stats = out.speculation_stats
    assert stats.plain_steps == stats.target_forwards - 1  # what was measured before the call held: no drafter step
    cost = VerifyCost.for_target(target)
    assert cost.corrections  # the call's steps refined the profile, for the next call
    kept = candidate_generator_for(drafter, target).policy.gates
    assert kept is not policy.gates and kept.drafter.steps.keys() >= policy.gates.drafter.steps.keys()

    hf_diffspec.reset_speculation_state()
    fresh = candidate_generator_for(drafter, target).policy.gates
    assert not fresh.drafter.steps
    fresh_cost = VerifyCost.for_target(target)
    assert not fresh_cost.corrections and fresh_cost.costs == cost.costs
    out = target.generate(ids, **kwargs)
    stats = out.speculation_stats
    assert stats.plain_steps < stats.target_forwards - 1  # unmeasured: speculation is tried first


def test_gates_are_held_weakly_by_drafter_and_target():
    """A collected target's (or drafter's) measurements go with it: a model created later never starts from them,
    whatever address it gets."""
    target, other = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=4)
    for model in (target, other):
        gates = speculation_gates_for(drafter, model, "DiffusionCandidateGenerator")
        _speculation_loses(gates)
        keep_speculation_gates(drafter, model, "DiffusionCandidateGenerator", gates)
    assert len(SPECULATION_STATE.gates[drafter]) == 2
    assert speculation_gates_for(drafter, target, "DiffusionCandidateGenerator").drafter.steps == gates.drafter.steps
    assert not speculation_gates_for(drafter, target, "BestFirstTreeCandidateGenerator").drafter.steps
    del other, model
    gc.collect()
    assert list(SPECULATION_STATE.gates[drafter]) == [target]
    del drafter
    gc.collect()
    assert len(SPECULATION_STATE.gates) == 0


def test_a_fixed_length_keeps_no_state():
    target = tiny_target("llama", seed=0)
    drafter = tiny_drafter(target, block_size=4)
    policy = candidate_generator_for(drafter, target, num_draft_tokens=2).policy
    assert isinstance(policy, hf_diffspec.FixedLength) and policy.depth_limit(0, 10) == 2
    assert drafter not in SPECULATION_STATE.gates and not SPECULATION_STATE.verify_costs
