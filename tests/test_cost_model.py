"""The measured cost model: profiles, interpolation, choosing how much to verify, and losslessness with it on."""

import pytest
import torch

import hf_diffspec
from hf_diffspec.candidate_generator import DiffusionCandidateGenerator
from hf_diffspec.cost_model import VerifyCost, best_node_count, measure_verify_cost, profile_key, save_profile
from helpers import tiny_drafter, tiny_target


def test_interpolation_and_extrapolation():
    cost = VerifyCost({1: 1.0, 4: 1.3, 8: 2.1})
    assert cost(1) == 1.0 and cost(0) == 1.0
    assert cost(2) == pytest.approx(1.1) and cost(6) == pytest.approx(1.7)
    assert cost(12) == pytest.approx(2.9)


def test_verify_more_only_when_it_pays():
    flat = VerifyCost({1: 1.0, 16: 1.0})       # verifying is free: take every node with any chance
    steep = VerifyCost({1: 1.0, 2: 2.0, 16: 16.0})  # each token costs a full forward: never worth it
    probs = [0.9, 0.8, 0.5, 0.1, 0.01]
    assert best_node_count(probs, flat, 0.1) == 6
    assert best_node_count(probs, steep, 0.1) == 1
    moderate = VerifyCost({1: 1.0, 3: 1.05, 6: 1.5})
    assert best_node_count(probs, moderate, 0.2) == 4  # confident nodes in, long shots out
    assert best_node_count([0.0, 0.0], moderate, 0.2) == 1


def test_profile_is_keyed_by_device_dtype_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    assert VerifyCost.for_target(target) is None
    costs = measure_verify_cost(target, sizes=(1, 2, 4), context_length=16, repeats=2)
    assert set(costs) == {1, 2, 4} and all(t > 0 for t in costs.values())
    save_profile(target, costs)
    assert VerifyCost.for_target(target).costs == costs
    key = profile_key(target)
    assert profile_key(target.to(torch.bfloat16)) != key  # another dtype is another profile: measured anew
    assert VerifyCost.for_target(target) is None


@pytest.mark.parametrize("dual", [False, True])
def test_cost_model_lengths_stay_lossless(tmp_path, monkeypatch, dual):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("qwen3", seed=6)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    save_profile(target, {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.2, 16: 1.6})
    drafter = tiny_drafter(target, block_size=8)
    if dual:
        drafter = hf_diffspec.DualDiffusionDrafter.from_drafters(drafter, None, num_branches=3)
    sizes = []
    original = DiffusionCandidateGenerator.propose

    def recording(self, *args, **kwargs):
        tree = original(self, *args, **kwargs)
        sizes.append(len(tree))
        return tree

    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", recording)
    ids = torch.randint(2, 128, (1, 9))
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=25),
                       target.generate(ids, max_new_tokens=25))
    assert len(set(sizes)) > 1, "the verified size should follow the drafter's confidence"
