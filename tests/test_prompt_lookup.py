"""Prompt-lookup drafts in our loop: finding them, grafting them onto draft trees, measuring their acceptance, and
losslessness with them (grafted onto drafter trees and chains, and verified alone without a drafter forward)."""

import numpy as np
import pytest
import torch

from hf_diffspec.runtime.control_speculation import AlwaysSpeculate, SpeculationController, StepKind
from hf_diffspec.runtime.drafting_lookup import NO_LOOKUP_DRAFTS, LookupDrafts, PromptLookup, graft
from hf_diffspec.runtime.tree import CandidateTree, TreeLayout
from helpers import tiny_drafter, tiny_target


def test_lookup_copies_what_followed_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(num_tokens=3, max_ngram=2)
    ids = np.array([5, 6, 7, 8, 9, 1, 6, 2, 3, 4, 5, 6])
    # suffix (5, 6) occurred once, at the start: 7 8 9 followed it
    drafts, ngram = lookup.find(ids, limit=10)
    assert drafts.tolist() == [7, 8, 9] and ngram == 2
    assert lookup.find(ids, limit=2)[0].tolist() == [7, 8]
    # suffix (0, 6) never occurred: the 1-gram (6) did, most recently before 2
    drafts, ngram = lookup.find(np.array([5, 6, 7, 8, 6, 2, 0, 6]), limit=10)
    assert drafts.tolist() == [2, 0, 6] and ngram == 1
    drafts, ngram = lookup.find(np.array([1, 2, 3]), limit=10)  # 3 never occurred before
    assert drafts.size == 0 and ngram == 0
    drafts, ngram = lookup.find(np.array([4]), limit=10)  # one token: nothing before it
    assert drafts.size == 0 and ngram == 0
    # the longest match may span all but the last token: (3, 3) ends at the second 3, one token before the suffix
    drafts, ngram = PromptLookup(num_tokens=3, max_ngram=3).find(np.array([3, 3, 3]), limit=10)
    assert drafts.tolist() == [3] and ngram == 2


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


def test_a_steps_lookup_drafts_count_and_cut_per_row():
    """A step's drafts: its match length is the longest among rows that have drafts (a row's match with nothing
    after it does not count), and cutting them to the depth a step verifies keeps each row's first drafts; a depth
    of 0, or no row with drafts, leaves none."""
    drafts = LookupDrafts([[7, 8, 9], [], [4]], [2, 3, 1])
    assert drafts.ngram == 2 and drafts.num_tokens == 4 and drafts.lengths == [3, 0, 1]
    cut = drafts.truncated(2)
    assert cut.drafts == [[7, 8], [], [4]] and cut.ngrams == [2, 3, 1] and cut.ngram == 2
    assert drafts.truncated(1).drafts == [[7], [], [4]]  # one draft a row: a step may verify that much
    assert drafts.truncated(0) is NO_LOOKUP_DRAFTS and LookupDrafts([[], []], [3, 1]).ngram == 0
    assert LookupDrafts([[], []], [3, 1]).truncated(4) is NO_LOOKUP_DRAFTS
    with pytest.raises(ValueError, match="max_ngram >= 1"):
        PromptLookup(num_tokens=3, max_ngram=0)


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


def test_lookup_acceptance_is_measured_per_depth_and_match_length():
    """Draft d is observed when the committed tokens reach it: accepted given d - 1 was, or rejected at the first
    mismatch; each match length is measured on its own, from the pooled estimate."""
    controller = SpeculationController()
    assert controller._lookup_reach(2, 3, draw=False) == pytest.approx([0.5, 0.25, 0.125])  # Beta(1, 1)
    controller.observe_lookups([2], [[1, 2, 3, 4]], [[1, 2, 9]])  # 2 accepted, the third rejected, the fourth unseen
    assert controller.lookup.hits[2, 1] == 1 and controller.lookup.hits[2, 3] == 0
    assert controller.lookup.trials[2, 3] == 1 and (2, 4) not in controller.lookup.trials
    assert controller._lookup_reach(2, 1, draw=False)[0] > controller._lookup_reach(1, 1, draw=False)[0] > 0.5


@pytest.mark.parametrize("where", ["device", "host"])
def test_graft_follows_the_trees_own_nodes_and_branches_off_where_the_tokens_differ(where):
    """The lookup chain goes after the tree's nodes from the root, its shape known without the drafter's tokens;
    acceptance reads it merged: the repeats of the tree's nodes left out, the rest hung below the node they repeat
    (on the host for the token-by-token path, on the device for the batch's)."""
    tokens = torch.tensor([0, 1, 2, 3]) if where == "device" else [0, 1, 2, 3]
    tree = CandidateTree(tokens, [-1, 0, 1, 0])  # 0 -> 1 -> 2, 0 -> 3
    tree.confidences = [0.9, 0.5, 0.2]
    grafted = graft(tree, torch.tensor([1, 4, 5]))
    assert grafted.tokens.tolist() == [0, 1, 2, 3, 1, 4, 5]
    assert grafted.confidences == [0.9, 0.5, 0.2]  # the drafted nodes' (what the bench's replay records)
    assert grafted.parents == [-1, 0, 1, 0, 0, 4, 5]  # as the target's forward sees it
    assert grafted.children == [{1: 1, 3: 3}, {2: 2, 4: 5}, {}, {}, {}, {5: 6}, {}]  # 4 a second child of node 1
    other = CandidateTree(torch.tensor([0, 3, 7]), [-1, 0, 1])  # a second row: the chain 0 -> 3 -> 7
    layout = TreeLayout.of([grafted, graft(other, [3, 7, 8, 9])], torch.device("cpu"))
    assert layout.tokens.tolist() == [[0, 1, 2, 3, 1, 4, 5], [0, 3, 7, 3, 7, 8, 9]]
    assert layout.repeats.tolist() == [[False] * 4 + [True, False, False], [False] * 3 + [True, True, False, False]]
    assert layout.accept_parents.tolist() == [[0, 0, 1, 0, 0, 1, 5], [0, 0, 1, 0, 3, 2, 5]]
    assert layout.accept_ancestors[0, 6].nonzero().flatten().tolist() == [0, 1, 5, 6]
    assert layout.accept_ancestors[1, 6].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]
    assert layout.ancestors[1, 6].nonzero().flatten().tolist() == [0, 3, 4, 5, 6]  # what the forward attends to
    root_only = graft(CandidateTree.chain(7, torch.empty(0, dtype=torch.long)), torch.tensor([8, 9]))  # a chain cut to 0
    assert root_only.parents == [-1, 0, 1]
    # its root on the device, its lookup drafts on the host: both reach the forward's tokens
    assert TreeLayout.of([root_only], torch.device("cpu")).tokens.tolist() == [[7, 8, 9]]
    # a tree whose tokens the host holds keeps its device: its tokens are made there, lookup drafts included
    on_meta = graft(CandidateTree([0, 5], [-1, 0], device=torch.device("meta")), np.array([5, 6]))
    assert on_meta.tokens.device.type == "meta" and on_meta.token_list == [0, 5, 5, 6]


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
    """Where the controller finds lookup drafts alone faster, those steps verify them without a drafter forward."""
    monkeypatch.setattr(SpeculationController, "decide", lambda self, rows, ngrams, lengths: (
        StepKind.LOOKUP, max(lengths)) if any(lengths) else (StepKind.DRAFT, 0))
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
    monkeypatch.setattr(SpeculationController, "decide", lambda self, rows, ngrams, lengths: (StepKind.PLAIN, 0))
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
    """How deep lookup drafts go is `best_node_count`'s answer on the measured cost at the batch's rows: at one row
    (a flat cost) all of them, at four (each slot dearer) none; the batch's forward is a rectangle, so one depth for
    every row. A fixed draft length verifies every lookup draft found."""
    from hf_diffspec.runtime.control_cost import VerifyCost

    flat_at_one_row_steep_at_four = VerifyCost({1: {1: 1.0, 2: 1.0, 16: 1.0}, 4: {1: 1.0, 2: 2.0, 16: 16.0}})
    controller = SpeculationController(flat_at_one_row_steep_at_four, draft_price=100.0)  # never the drafter again
    controller.drafter.add_step([(0, 0, 0.0, 1.0)])  # after its first try, which accepted nothing
    for _ in range(30):  # 3-token matches: the first 3 drafts right
        controller.observe_lookups([3], [[1, 2, 3, 4]], [[1, 2, 3, 9]])
    assert controller.decide(1, [3], [4]) == (StepKind.LOOKUP, 4)
    assert controller.decide(4, [3] * 4, [4] * 4) == (StepKind.PLAIN, 0)
    assert AlwaysSpeculate().decide(16, [1] * 16, [3] * 16) == (StepKind.DRAFT, 3)
