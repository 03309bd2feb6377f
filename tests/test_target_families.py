"""Targets with sliding-window layers (Gemma 3, Gemma 4, gpt-oss, Mistral) and mixture-of-experts MLPs (gpt-oss,
Qwen3-MoE) run our loop losslessly: greedy fp32 output identical to plain `generate` (chains and best-first trees with
prompt lookup, one row and a left-padded ragged batch) and sampling from the target's own distribution. Prompts plus
generations are several windows long, and trees are deeper than the window, so the window is crossed inside trees."""

import pytest
import torch
from transformers import DynamicCache

from hf_diffspec.runtime import verify_inputs
from hf_diffspec.runtime.drafting import BestFirstTreeCandidateGenerator
from hf_diffspec.runtime.verify_inputs import AttentionLayout, verify_masks
from hf_diffspec.runtime.tree import CandidateTree, TreeLayout
from hf_diffspec.runtime.verify_inputs import tree_forward_inputs
from helpers import (
    FAMILIES,
    NoisyOracle,
    ProposalRecorder,
    assert_sampling_matches_plain,
    install_oracle,
    oracle_drafter_outputs,
    tiny_drafter,
    tiny_family_target,
)

WINDOW = 4
PAD = 0


def left_padded(lengths, vocab, seed):
    """(ids, mask) of left-padded prompts of the given lengths that repeat a phrase (prompt lookup finds drafts)."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, vocab, (5,), generator=gen)
    prompts = [torch.cat([torch.randint(2, vocab, (max(n - 5, 0),), generator=gen), phrase])[-n:] for n in lengths]
    ids = torch.full((len(prompts), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, ids.shape[1] - len(prompt):] = prompt
        mask[row, ids.shape[1] - len(prompt):] = 1
    return ids, mask


def references(ref, mask):
    """Each row of a plain `generate` output without its left padding (the oracles index rows by position)."""
    pad = mask.shape[1] - mask.sum(-1)
    return [row[p:] for row, p in zip(ref, pad.tolist())]


# one row: the mask the model builds over our full cache (chains of one length); a ragged batch: our masks
BATCHES = {"one_row": [9], "ragged_batch": [9, 3, 6]}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.every_step_speculates("asserts tau and partial accepts of oracle chains")
def test_chains_greedy_identical_to_plain_generate(monkeypatch, one_torch_thread, family, batch):
    """Chains accepted in part, rows accepting different numbers of tokens."""
    target = tiny_family_target(family, seed=1, window=WINDOW, sharpen=3)
    drafter = tiny_drafter(target, block_size=6)
    ids, mask = left_padded(BATCHES[batch], 128, seed=1)
    kwargs = dict(max_new_tokens=18, do_sample=False)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    install_oracle(monkeypatch, NoisyOracle(references(ref, mask), vocab_size=128, noise=0.25, seed=1))
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    assert out.speculation_stats.tau > 2, "drafts should be accepted, across the window"
    assert len(set(out.speculation_stats.committed_per_step)) > 1


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.every_step_speculates("asserts the trees verified")
def test_best_first_trees_with_prompt_lookup_greedy_identical_to_plain_generate(monkeypatch, one_torch_thread,
                                                                                  family, batch):
    """The drafter's own best-first trees (its outputs pointed at the target's continuation, with a margin small
    enough to leave siblings) plus prompt-lookup branches; some nodes are a window or more below their root."""
    target = tiny_family_target(family, seed=2, window=WINDOW, sharpen=3)
    drafter = tiny_drafter(target, block_size=7, draft_tree_budget=10, draft_tree_width=3, prompt_lookup_num_tokens=4)
    ids, mask = left_padded([n + 1 for n in BATCHES[batch]], 128, seed=2)
    kwargs = dict(max_new_tokens=18, do_sample=False)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    oracle_drafter_outputs(monkeypatch, drafter, target, references(ref, mask), margin=4.0)
    proposals = ProposalRecorder(monkeypatch, BestFirstTreeCandidateGenerator)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    assert any(not t.is_chain for t in proposals.trees)
    assert max(t.max_depth for t in proposals.trees) >= WINDOW  # the deepest node's window leaves its root out
    assert out.speculation_stats.tau > 2


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_masked_prompt_slots_count_in_the_window_as_in_plain_generate(one_torch_thread, family):
    """Plain generate's window counts slots, a row's masked prompt slots included (right padding: it warns, and
    runs it); so does ours."""
    target = tiny_family_target(family, seed=4, window=WINDOW, sharpen=3)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[0, 2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), target.generate(ids, **kwargs))


@pytest.mark.every_step_speculates("asserts drafts were made")
def test_sampling_is_exactly_the_targets_distribution(monkeypatch, one_torch_thread):
    """Rejection sampling over sampled best-first trees (verified with our masks), the prompt longer than the window
    (gpt-oss: sliding layers, attention sinks, MoE)."""
    vocab = 12
    target = tiny_family_target("gpt_oss", seed=3, vocab_size=vocab, window=WINDOW, sharpen=6)
    drafter = tiny_drafter(target, block_size=5, seed=3, draft_tree_budget=6, draft_tree_width=3)
    ids = torch.randint(2, vocab, (1, 7), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.9, top_k=0)
    assert_sampling_matches_plain(target, ids, vocab, drafter, limit=33, n=200, **kwargs)  # chi2(11) 0.999 ~ 31.3
    proposals = ProposalRecorder(monkeypatch, BestFirstTreeCandidateGenerator)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert out.speculation_stats.drafted_tokens > 0 and any(not t.is_chain for t in proposals.trees)


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss"])
@pytest.mark.every_step_speculates("counts sampled drafts checked against their exact prefix")
def test_sampled_tokens_are_drawn_from_the_targets_logits_at_their_exact_prefix(monkeypatch, one_torch_thread,
                                                                               family):
    """What makes sampling exact beside rejection sampling itself: every token a sampled ragged batch commits is
    chosen from logits equal to a plain forward's over that row's committed prefix (its padding masked as plain
    generate masks it). Sensitive where the distribution test's few hundred samples are not: a mask without the
    window shifts these logits by far more than the tolerance."""
    from hf_diffspec.runtime.batch import RowCommitter

    target = tiny_family_target(family, seed=5, window=WINDOW, sharpen=3)
    drafter = tiny_drafter(target, block_size=5, seed=5, draft_tree_budget=6, draft_tree_width=3)
    ids, mask = left_padded([9, 4, 7], 128, seed=5)
    seen = []
    choose = RowCommitter.choose_and_commit

    def recording(self, raw_logits, drafts=None):
        seen.append((self.input_ids[0].clone(), raw_logits[0].clone(), drafts is not None))
        return choose(self, raw_logits, drafts)

    monkeypatch.setattr(RowCommitter, "choose_and_commit", recording)
    torch.manual_seed(5)
    # top_k=0 (no compact laws): every token is committed token by token, where each one's logits can be checked
    # alone; the device path takes the same verify logits (`test_sampling_exactness.py` covers both paths' laws)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=True, top_k=0)
    assert len(seen) > 12 and sum(with_drafts for *_, with_drafts in seen) > 12
    for prefix, logits, _ in seen:
        row_mask = torch.cat([mask[(ids == prefix[: ids.shape[1]]).all(-1)][0],
                              torch.ones(len(prefix) - ids.shape[1], dtype=torch.long)])
        with torch.no_grad():
            expected = target(prefix[None], attention_mask=row_mask[None]).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_sliding_layers_see_only_the_window_counted_in_each_rows_own_slots():
    """Row 0 sees its whole cache; row 1 has one slot of left padding and a hole (a draft row 0 accepted). A tree
    node at depth d is slot (row's slots) + d, and sees a key when their slot distance is below the window."""
    layout = AttentionLayout(sliding_window=3, mixed=True)
    past_valid = torch.tensor([[True] * 6, [False, True, True, True, False, True]])
    trees = [CandidateTree.chain(5, torch.tensor([6, 7])), CandidateTree.chain(5, torch.tensor([6, 7]))]
    _, mask, _ = tree_forward_inputs(trees, past_valid, torch.tensor([6, 4]), torch.float32)
    depths = TreeLayout.of(trees, past_valid.device).depths
    masks = verify_masks(layout, mask, depths, past_valid, prompt_length=4)
    full, sliding = (masks[k][:, 0] == 0 for k in ("full_attention", "sliding_attention"))
    assert torch.equal(full, mask[:, 0] == 0)
    # row 0: the root (slot 6) sees slots 4..6, its child 5..7
    assert sliding[0, 0].tolist() == [False] * 4 + [True] * 3 + [False] * 2
    assert sliding[0, 1].tolist() == [False] * 5 + [True] * 3 + [False]
    # row 1: the hole at slot 4 takes no slot, so its root (slot 5 of the row) sees slots 3 and 5 and itself
    assert sliding[1, 0].tolist() == [False, False, False, True, False, True, True, False, False]
    assert verify_masks(AttentionLayout(sliding_window=3, mixed=False), mask, depths, past_valid, 4).shape == mask.shape
    assert verify_masks(layout, None, depths, past_valid, 4) is None


@pytest.mark.every_step_speculates("needs oracle drafts verified at every step to show the break")
def test_a_window_off_by_one_breaks_identity(monkeypatch, one_torch_thread):
    """The identity tests see the window: masking one key more than the target's window changes the output."""
    target = tiny_family_target("gemma3", seed=1, window=WINDOW, sharpen=3)
    drafter = tiny_drafter(target, block_size=6)
    ids, mask = left_padded([9, 3, 6], 128, seed=2)
    kwargs = dict(max_new_tokens=18, do_sample=False)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    install_oracle(monkeypatch, NoisyOracle(references(ref, mask), vocab_size=128, noise=0.25, seed=1))
    layout = AttentionLayout.of(target.config)
    monkeypatch.setattr(verify_inputs.AttentionLayout, "of",
                        classmethod(lambda cls, config: cls(layout.sliding_window - 1, layout.mixed)))
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    assert not torch.equal(out, ref)


def test_the_returned_cache_holds_what_plain_generate_holds(one_torch_thread):
    """Plain generate returns a cache whose sliding layers hold their last window - 1 keys; ours holds every key of
    its full layers and the sliding layers' last window - 1 keys too, at the same slot numbers (Gemma 4's KV-sharing
    layers hold none, as in plain generate); plain generate continues from it as from its own."""
    target = tiny_family_target("gemma4", window=WINDOW)
    drafter = tiny_drafter(target)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs).cache
    ours = target.generate(ids, assistant_model=drafter, **kwargs).cache
    assert plain.is_sliding == [True, False, False, False] and plain.layers[0].keys.shape[2] == WINDOW - 1
    assert ours.is_sliding == plain.is_sliding and ours.is_dummy == plain.is_dummy == [False, False, True, True]
    assert [layer.keys.shape[2] for layer in ours.layers[:2]] == [WINDOW - 1, 9 + 8 - 1]  # the last token: uncached
    assert ours.get_seq_length(0) == ours.get_seq_length(1) == plain.get_seq_length(0) == 9 + 8 - 1
    torch.testing.assert_close(ours.layers[0].keys, plain.layers[0].keys, rtol=1e-5, atol=1e-5)
    sequence = target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    continued = target.generate(sequence, cache=ours, **kwargs)
    assert torch.equal(continued, target.generate(sequence, cache=plain, **kwargs))
    ids = torch.randint(2, 128, (1, 6))
    assert torch.equal(target.generate(ids, assistant_model=drafter, cache=DynamicCache(), max_new_tokens=6,
                                       do_sample=False), target.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.every_step_speculates("the bound on a sliding layer's keys counts the tree slots a step adds")
@pytest.mark.parametrize("family,lengths", [("gemma3", [9, 4]), ("gpt_oss", [7, 7]), ("mistral", [7, 7])])
def test_sliding_layers_hold_a_bounded_number_of_keys_over_a_thousand_tokens(monkeypatch, one_torch_thread, family,
                                                                             lengths):
    """A sliding layer keeps the keys within some row's window (and the cache's tail of tree nodes not yet compacted),
    as plain generate keeps its window: its size does not grow with the output, and the output stays identical.
    Left-padded rows with trees, and chains of rows without padding, which see every slot until they diverge."""
    from hf_diffspec.runtime.verifier import COMPACT_AFTER_HIDDEN_SLOTS, TargetVerifier
    from hf_diffspec.runtime.verify_cache import WindowedLayer

    window, block = 8, 6
    target = tiny_family_target(family, seed=3, window=window, sharpen=3)
    ids, mask = left_padded(lengths, 128, seed=3)
    kwargs = dict(max_new_tokens=1000, do_sample=False)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    if mask.all():  # chains: the rows see every slot while they accept alike, then diverge
        drafter = tiny_drafter(target, block_size=block)
        install_oracle(monkeypatch, NoisyOracle(references(ref, mask), vocab_size=128, noise=0.05, seed=1))
    else:
        drafter = tiny_drafter(target, block_size=block, draft_tree_budget=8, draft_tree_width=2)
        oracle_drafter_outputs(monkeypatch, drafter, target, references(ref, mask), margin=4.0)
    held, full = [], []
    keep = TargetVerifier.keep

    def recording(self, *args, **kwargs):
        kept = keep(self, *args, **kwargs)
        layers = self.cache.layers
        held.append(max(layer.keys.shape[2] for layer in layers if isinstance(layer, WindowedLayer)))
        full.append(self.cache.get_seq_length())
        return kept

    monkeypatch.setattr(TargetVerifier, "keep", recording)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    assert full[-1] > 1000 and len(held) > 100
    # the window, the rows' raggedness within a step, and the tail of hidden tree nodes before it is compacted
    assert max(held) <= window + 2 * block + COMPACT_AFTER_HIDDEN_SLOTS
    assert min(held[len(held) // 2:]) <= window + 2 * block  # once the tail is closed up: about the window
