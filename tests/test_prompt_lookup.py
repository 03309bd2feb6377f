"""Prompt-lookup drafts in our loop: finding them, grafting them onto draft trees, measuring their acceptance, and
losslessness with them (grafted onto drafter trees and chains, and verified alone without a drafter forward)."""

import pytest
import torch

from hf_diffspec.runtime.control_gates import AlwaysSpeculate, SpeculationGates, StepKind, StepRecord
from hf_diffspec.runtime.drafting_lookup import PromptLookup, graft
from hf_diffspec.runtime.control_policy import DraftLengthPolicy
from hf_diffspec.runtime.tree import CandidateTree
from helpers import tiny_drafter, tiny_target


def test_lookup_copies_what_followed_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(num_tokens=3, max_ngram=2)
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 6, 2, 3, 4, 5, 6])
    # suffix (5, 6) occurred once, at the start: 7 8 9 followed it
    drafts, ngram = lookup.find(ids, limit=10)
    assert drafts.tolist() == [7, 8, 9] and ngram == 2
    assert lookup.find(ids, limit=2)[0].tolist() == [7, 8]
    # suffix (0, 6) never occurred: the 1-gram (6) did, most recently before 2
    drafts, ngram = lookup.find(torch.tensor([5, 6, 7, 8, 6, 2, 0, 6]), limit=10)
    assert drafts.tolist() == [2, 0, 6] and ngram == 1
    drafts, ngram = lookup.find(torch.tensor([1, 2, 3]), limit=10)  # 3 never occurred before
    assert drafts.numel() == 0 and ngram == 0
    assert lookup.find(torch.tensor([4]), limit=10)[0].numel() == 0


def _reference_find(ids: list[int], limit: int, max_ngram: int, num_tokens: int):
    """Occurrence by occurrence: the longest earlier match of the suffix (at most max_ngram tokens), the most recent
    of those, and what followed it."""
    limit, length = min(limit, num_tokens), len(ids)
    best, best_end = 0, None
    for end in range(length - 1) if limit > 0 else ():
        matched = 0
        while matched < min(max_ngram, length - 1) and end - matched >= 0 and ids[end - matched] == ids[-1 - matched]:
            matched += 1
        if matched and matched >= best:
            best, best_end = matched, end
    return (ids[best_end + 1 : best_end + 1 + limit], best) if best else ([], 0)


@pytest.mark.parametrize("max_ngram", [1, 3, 5])
def test_lookup_of_many_rows_at_once_equals_each_row_alone(max_ngram):
    gen = torch.Generator().manual_seed(max_ngram)
    lookup = PromptLookup(num_tokens=4, max_ngram=max_ngram)
    for _ in range(20):
        lengths = torch.randint(0, 30, (6,), generator=gen).tolist()
        limits = torch.randint(-1, 7, (6,), generator=gen).tolist()
        ids = torch.randint(0, 4, (6, max(lengths) + 5), generator=gen).numpy()  # stale tokens past each length
        found = lookup.find_rows(ids, lengths, limits)
        for row, (drafts, ngram) in enumerate(found):
            history = ids[row, : lengths[row]].tolist()
            assert (drafts.tolist(), ngram) == _reference_find(history, limits[row], max_ngram, 4), (history, limits[row])
            assert (lookup.find(ids[row, : lengths[row]], limits[row])[0].tolist(), ngram) == (drafts.tolist(), ngram)


def test_lookup_acceptance_is_measured_per_depth():
    lookup = PromptLookup(num_tokens=4, prior=(0.5, 0.5), prior_weight=2.0)
    assert lookup.reach(3, ngram=1) == pytest.approx([0.5, 0.25, 0.125])
    assert PromptLookup(num_tokens=3, prior=(0.4, 0.8)).reach(3, ngram=1) == pytest.approx([0.4, 0.32, 0.256])
    # drafts 1 2 3 4; the target committed 1 2 then 9 (3 rejected): depths 1-2 accepted, depth 3 rejected, 4 unseen
    lookup.record(torch.tensor([1, 2, 3, 4]), 2, torch.tensor([1, 2, 9]))
    assert lookup.trials[2] == [3, 3, 3, 2] and lookup.hits[2] == [2, 2, 1, 1]
    assert lookup.reach(4, ngram=2) == pytest.approx([2 / 3, 4 / 9, 4 / 27, 2 / 27])
    assert lookup.reach(2, ngram=1) == pytest.approx([0.5, 0.25])  # each match length is measured on its own


def test_graft_follows_the_trees_own_nodes_and_branches_off_where_the_tokens_differ():
    tree = CandidateTree(torch.tensor([0, 1, 2, 3]), [-1, 0, 1, 0])  # 0 -> 1 -> 2, 0 -> 3
    grafted = graft(tree, torch.tensor([1, 4, 5]))
    assert grafted.tokens.tolist() == [0, 1, 2, 3, 4, 5]
    assert grafted.parents == [-1, 0, 1, 0, 1, 4]  # 4 is a second child of node 1, 5 continues it
    assert graft(tree, torch.tensor([1, 2])) is tree  # already in the tree: nothing to add
    assert graft(CandidateTree.chain(7, torch.empty(0, dtype=torch.long)), torch.tensor([8, 9])).parents == [-1, 0, 1]


def _repetitive_prompts(vocab, rows, seed):
    """Prompts that repeat a phrase, so the target's continuation often copies it and lookup finds drafts."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, vocab, (rows, 5), generator=gen)
    return torch.cat([phrase, torch.randint(2, vocab, (rows, 2), generator=gen), phrase, phrase[:, :2]], dim=1)


@pytest.mark.parametrize("tree_budget", [None, 6])
@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "eager")])
@pytest.mark.every_step_speculates("asserts lookup drafts were verified")
def test_greedy_with_lookup_drafts_is_identical_to_plain_generate(kind, attn, tree_budget):
    vocab = 24
    target = tiny_target(kind, seed=1, vocab_size=vocab, attn=attn)
    drafter = tiny_drafter(target, block_size=5, seed=1, draft_tree_budget=tree_budget, prompt_lookup_num_tokens=4)
    ids = _repetitive_prompts(vocab, rows=3, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(max_new_tokens=40, do_sample=False)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    assert out.speculation_stats.lookup_tokens > 0
    off = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True,
                          prompt_lookup_num_tokens=0, **kwargs)
    assert torch.equal(off.sequences, ref) and off.speculation_stats.lookup_tokens == 0


@pytest.mark.every_step_speculates("counts drafter forwards and lookup tokens")
def test_steps_with_lookup_drafts_alone_are_lossless_and_skip_the_drafter(monkeypatch):
    """Where the gate finds lookup drafts alone faster, those steps verify them without a drafter forward."""
    monkeypatch.setattr(SpeculationGates, "decide",
                        lambda self, rows, lookup_ngram=0: StepKind.LOOKUP if lookup_ngram else StepKind.DRAFT)
    vocab = 24
    target = tiny_target("llama", seed=2, vocab_size=vocab)
    drafter = tiny_drafter(target, block_size=5, seed=2, prompt_lookup_num_tokens=4)
    ids = _repetitive_prompts(vocab, rows=2, seed=2)
    kwargs = dict(max_new_tokens=40, do_sample=False)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats
    assert stats.lookup_tokens > 0 and stats.draft_forwards < stats.target_forwards - 1
    assert stats.lookup_steps > 0  # steps by kind: every step after the prefill is counted once
    assert stats.draft_steps + stats.lookup_steps + stats.plain_steps == stats.target_forwards - 1


def test_steps_without_the_drafter_decode_plainly_where_lookup_drafts_alone_were_measured_to_lose(monkeypatch):
    """Where verifying lookup drafts alone loses to a plain step, a step without the drafter is a plain one."""
    monkeypatch.setattr(SpeculationGates, "decide", lambda self, rows, lookup_ngram=0: StepKind.PLAIN)
    vocab = 24
    target = tiny_target("llama", seed=2, vocab_size=vocab)
    drafter = tiny_drafter(target, block_size=5, seed=2, prompt_lookup_num_tokens=4)
    ids = _repetitive_prompts(vocab, rows=2, seed=2)
    kwargs = dict(max_new_tokens=30, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    stats = out.speculation_stats
    assert stats.lookup_tokens == 0 and stats.draft_forwards == 0
    assert stats.verified_slots == 2 * (stats.target_forwards - 1)  # one slot per row and step: plain steps


def _step(kind, rows, lookup_ngram, committed, seconds, slots=1):
    return StepRecord(kind, rows, lookup_ngram, committed, seconds, slots, verify_seconds=seconds)


def test_lookup_drafts_alone_are_verified_only_while_they_beat_plain_steps():
    """The cost model sizes lookup drafts from estimates; whether verifying them alone beats a plain step is
    measured, per match length and batch size, with rare probes once it loses."""
    gates = SpeculationGates()
    alone = gates.lookups_alone_gate(1)
    verified = [alone.should_speculate(16)]  # unmeasured: tried first
    gates.record(_step(StepKind.LOOKUP, 16, 1, 18, 0.2, slots=5))
    verified.append(alone.should_speculate(16))  # then a plain step
    gates.record(_step(StepKind.PLAIN, 16, 1, 16, 0.1))
    assert verified == [True, False]
    decisions = []
    for _ in range(250):  # 90 tokens/s alone against 160 plain: plain, probing lookup drafts now and then
        verify = alone.should_speculate(16)
        decisions.append(verify)
        gates.record(_step(StepKind.LOOKUP, 16, 1, 18, 0.2, slots=5) if verify
                     else _step(StepKind.PLAIN, 16, 1, 16, 0.1))
    assert 1 <= sum(decisions) <= 3
    # 3-token matches start from those measurements (no probe of their own at once), then measure their own:
    # 200 tokens/s alone against 160 plain, so after their first probe they are verified
    three = []
    for _ in range(300):
        verify = gates.lookups_alone_gate(3).should_speculate(16)
        three.append(verify)
        gates.record(_step(StepKind.LOOKUP, 16, 3, 40, 0.2, slots=5) if verify
                     else _step(StepKind.PLAIN, 16, 3, 16, 0.1))
    assert not three[0] and sum(three[-100:]) >= 80
    # a drafter step is measured by the gate of its match length, not by the lookups-alone one
    alone_steps = dict(gates.lookups_alone[3].steps)
    gates.record(_step(StepKind.DRAFT, 16, 3, 30, 0.3, slots=8))
    assert (16, True) in gates.after_match[3].steps and gates.lookups_alone[3].steps == alone_steps
    assert AlwaysSpeculate().decide(16, lookup_ngram=1) is StepKind.DRAFT  # a fixed length always drafts


@pytest.mark.every_step_speculates("asserts lookup drafts were verified")
def test_sampling_looks_up_and_bad_values_are_refused():
    """When sampling, copied tokens are drafted too (point masses, `verification.py`; their law is tested in
    `test_sampling_exactness.py`)."""
    vocab = 24
    target = tiny_target("llama", seed=0, vocab_size=vocab)
    drafter = tiny_drafter(target, block_size=5, prompt_lookup_num_tokens=4)
    ids = _repetitive_prompts(vocab, rows=1, seed=0)
    out = target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=20,
                          return_dict_in_generate=True)
    assert out.speculation_stats.lookup_tokens > 0
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be a non-negative integer"):
        target.generate(ids, assistant_model=drafter, prompt_lookup_num_tokens=-1, max_new_tokens=4)


def test_lookup_drafts_are_verified_only_where_the_measured_verify_cost_lets_them_pay():
    from hf_diffspec.runtime.control_profiles import VerifyCost

    flat_at_one_row_steep_at_four = VerifyCost({1: {1: 1.0, 2: 1.0, 16: 1.0}, 4: {1: 1.0, 2: 2.0, 16: 16.0}})
    policy = DraftLengthPolicy(block_size=16, verify_cost=flat_at_one_row_steep_at_four)
    reach = [0.4, 0.32, 0.256]
    assert policy.lookup_lengths([reach], rows=1) == [3]
    assert policy.lookup_lengths([reach] * 4, rows=4) == [0, 0, 0, 0]
    # one count for the batch's rectangle: a row with fewer drafts verifies what it has
    assert policy.lookup_lengths([reach, reach[:1]], rows=1) == [3, 1]


def test_a_first_step_with_lookup_drafts_starts_from_what_steps_without_them_measured():
    """At a batch size where the drafter was measured to lose, the first steps with lookup drafts do not probe the
    drafter again: they verify the lookup drafts alone; each match length then refines its own measurements."""
    gates = SpeculationGates()
    for _ in range(4):
        kind = gates.decide(64)
        gates.record(_step(kind, 64, 0, *((80, 2.0) if kind is StepKind.DRAFT else (64, 1.0))))
    assert gates.decide(64, lookup_ngram=3) is StepKind.LOOKUP
    gates.record(_step(StepKind.LOOKUP, 64, 3, 96, 1.1, slots=4))
    assert gates.decide(64, lookup_ngram=3) is not StepKind.DRAFT
    assert gates.after_match[3].steps[(64, False)] != gates.drafter.steps[(64, False)]
    fresh = SpeculationGates()  # nothing measured yet: the drafter is tried first, as always
    assert fresh.decide(64, lookup_ngram=3) is StepKind.DRAFT


def test_a_new_match_length_starts_from_another_ones_measurements_where_every_step_had_lookup_drafts():
    """At a large batch nearly every step has lookup drafts, so steps without them measure nothing there: a match
    length met for the first time starts from one already measured instead of probing the drafter again."""
    gates = SpeculationGates()
    for _ in range(4):  # 3-token matches: the drafter loses at 16 rows
        kind = gates.decide(16, lookup_ngram=3)
        gates.record(_step(kind, 16, 3, *((20, 2.0) if kind is StepKind.DRAFT else (18, 1.0)), slots=2))
    assert (16, True) not in gates.drafter.steps
    assert gates.decide(16, lookup_ngram=2) is not StepKind.DRAFT
    assert gates.after_match[2].steps[(16, True)] == gates.after_match[3].steps[(16, True)]


def _drafter_probes(match_lengths: list[int], steps: int = 2000) -> int:
    """Drafter steps the gates take at 16 rows where the drafter loses (3 plain steps' time for 1.2 tokens a row;
    a plain step: 1 token a row) and lookup drafts alone lose too, over `steps` steps whose match lengths cycle
    through `match_lengths`."""
    gates, drafted = SpeculationGates(), 0
    for i in range(steps):
        ngram = match_lengths[i % len(match_lengths)]
        kind = gates.decide(16, ngram)
        drafted += kind is StepKind.DRAFT
        committed, seconds = {StepKind.DRAFT: (19, 0.3), StepKind.LOOKUP: (17, 0.2), StepKind.PLAIN: (16, 0.1)}[kind]
        gates.record(_step(kind, 16, ngram, committed, seconds))
    return drafted


def test_a_drafter_that_clearly_loses_is_probed_rarely_by_the_gates_of_every_match_length():
    """At 16 rows a drafter step here commits 1.2 tokens a row for 3 plain steps' time: a probe costs 1.8 plain steps
    more than plain steps committing as much, and the next waits 1.8^2 / 0.004 steps, capped at 256. One gate alone
    probed it 22 times in 2,000 steps while waits grew in proportion to the loss. The gates of four match lengths
    each probe it a few times while their own measurements are young (the first steps after a match also verify
    lookup drafts alone, which lose too), then as rarely."""
    alone, shared = _drafter_probes([0]), _drafter_probes([0, 1, 2, 3])
    assert 1 <= alone <= 10, alone
    assert shared <= 20, shared
