"""The trace replay (`hf_diffspec.bench.replay`): a recorded trace replays what the live loop commits."""

import random

import pytest
import torch

from hf_diffspec.bench.replay import ReplayCosts, positions_of, record_trace, replay_call
from hf_diffspec.runtime.control_speculation import StepKind
from helpers import char_tokenizer, oracle_drafter_outputs, tiny_drafter, tiny_target

COSTS = {"verify": {"1": {"1": 0.01, "16": 0.012}, "4": {"1": 0.012, "16": 0.02}}, "drafting": {"1": 0.002}}


class Always:
    """Every step one kind, every lookup draft found."""

    def __init__(self, kind):
        self.kind = kind

    def decide(self, rows, ngrams, lengths):
        return self.kind, max(lengths, default=0)

    def observe_lookups(self, *args):
        pass

    def record(self, *args):
        pass


def test_a_replayed_drafter_step_commits_what_the_live_loop_commits(monkeypatch):
    """A trace recorded from a prompt (plain fp32 greedy output, and at every position the drafter's whole
    best-first tree on the target's features of the committed prefix) replays the live loop step for step: drafter
    steps verifying the whole tree (a fixed length, no lookup) commit the same counts in the same order. The drafter
    proposes plain generate's continuation with every eighth token wrong, so steps accept different depths."""
    target = tiny_target("llama", seed=5, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, seed=5, draft_tree_budget=5, draft_tree_width=2)
    tokenizer = char_tokenizer(128)
    prompt = {"id": "p", "domain": "test", "text": "abcabcabd"}
    ids = tokenizer(prompt["text"], return_tensors="pt", add_special_tokens=False).input_ids
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0]
    reference = plain.clone()
    reference[ids.shape[1] + 2 :: 8] = (reference[ids.shape[1] + 2 :: 8] + 1) % 128
    oracle_drafter_outputs(monkeypatch, drafter, target, reference)
    trace = record_trace(target, drafter, tokenizer, prompt, max_new_tokens=24, lookup_tokens=4)
    live = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=24,
                           do_sample=False, num_assistant_tokens=5, prompt_lookup_num_tokens=0,
                           return_dict_in_generate=True)
    assert trace["sequence"] == live.sequences[0].tolist() == plain.tolist()  # the recorded decode is plain's
    positions = positions_of(trace)
    assert len(positions) == 24 - 1  # one per committed prefix from the first new token on, the last one excluded
    for p in positions:
        assert all(p.accepted[q - 1] for q, ok in zip(p.parents, p.accepted) if ok and q)  # accepted: a path
    costs = ReplayCosts(COSTS, noise=0.0)
    no_lookup = [p.__class__(**{**p.__dict__, "lookup": [], "ngram": 0, "lookup_accepted": 0}) for p in positions]
    replayed = replay_call(Always(StepKind.DRAFT), [no_lookup], costs, random.Random(0))
    stats = live.speculation_stats
    assert replayed.committed == stats.committed_per_step and sum(replayed.committed) == 24 - 1
    assert len(set(replayed.committed)) > 2  # steps accepted different depths
    plain_replay = replay_call(Always(StepKind.PLAIN), [positions], costs, random.Random(0))
    assert plain_replay.committed == [1] * 23
    assert plain_replay.seconds == pytest.approx(23 * 0.01)  # the profile's one-token forward, no noise


def test_the_oracle_is_at_least_every_fixed_kind():
    target = tiny_target("llama", seed=2, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, seed=2, draft_tree_budget=5, draft_tree_width=2)
    trace = record_trace(target, drafter, char_tokenizer(128), {"id": "q", "domain": "test", "text": "xyzxyzxy"},
                         max_new_tokens=32, lookup_tokens=4)
    costs = ReplayCosts(COSTS, noise=0.0)
    rows = [positions_of(trace)]
    oracle = replay_call(Always(StepKind.PLAIN), rows, costs, random.Random(0), oracle=True)
    for kind in StepKind:
        assert oracle.rate >= 0.999 * replay_call(Always(kind), rows, costs, random.Random(0)).rate
