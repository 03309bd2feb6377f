"""Verify attention through transformers' `AttentionInterface` (`runtime/verify_attention.py`): the same outputs as
SDPA's own path (fp32), without copying the KV cache per query head group (`repeat_kv`)."""

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_attention
from transformers import DynamicCache

from hf_diffspec.runtime import verify_attention as va
from hf_diffspec.runtime.tree import CandidateTree
from hf_diffspec.runtime.verify_inputs import MASK_ALIGNMENT, packed_mask, tree_forward_inputs
from helpers import (NoisyOracle, ProposalRecorder, install_oracle, random_ids, tiny_drafter, tiny_family_target,
                     tiny_target)


def _verify_logits(model, switch: bool, tokens, mask, positions, cache):
    cache = copy.deepcopy(cache)
    with torch.no_grad(), va.verify_attention(model) if switch else torch.no_grad():
        return model(tokens, attention_mask=mask, position_ids=positions, cache=cache).logits


def _prefilled(model, rows: int, length: int):
    cache = DynamicCache()
    with torch.no_grad():
        model(random_ids(1, length, rows=rows), cache=cache)
    return cache


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4", "mistral"])
def test_verify_outputs_equal_sdpa_for_chains_trees_and_ragged_rows(family):
    model = tiny_target("llama", seed=2) if family == "llama" else tiny_family_target(family, seed=2, window=5)
    rows, past = 3, 11
    cache = _prefilled(model, rows, past)
    # a chain per row, every row seeing its whole cache: no mask, causal aligned bottom-right (one token: a plain step)
    for n in (1, 4):
        chain = random_ids(2, n, rows=rows)
        positions = torch.arange(past, past + n).expand(rows, -1)
        reference = _verify_logits(model, False, chain, None, positions, cache)
        torch.testing.assert_close(_verify_logits(model, True, chain, None, positions, cache), reference,
                                   rtol=1e-5, atol=1e-5)
    # trees of different sizes per row, and cached slots some rows may not see (padding, other rows' drafts)
    trees = [CandidateTree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2]), CandidateTree([3, 4], [-1, 0]),
             CandidateTree([10, 11, 12], [-1, 0, 1])]
    valid = torch.ones(rows, past, dtype=torch.bool)
    valid[0, :2] = False
    valid[2, 7] = False
    tokens, mask, positions = tree_forward_inputs(trees, valid, torch.tensor([past, past - 2, past - 1]),
                                                  torch.float32)
    assert mask is not None
    if family != "llama":  # sliding layers take their window through the mask
        from hf_diffspec.runtime.verify_inputs import AttentionLayout, verify_masks
        from hf_diffspec.runtime.tree import TreeLayout

        mask = verify_masks(AttentionLayout.of(model.config), mask, TreeLayout.of(trees, tokens.device).depths, valid,
                            prompt_length=past)
    reference = _verify_logits(model, False, tokens, mask, positions, cache)
    torch.testing.assert_close(_verify_logits(model, True, tokens, mask, positions, cache), reference,
                               rtol=1e-5, atol=1e-5)


def test_chain_lower_right_kernel_matches_the_packed_mask():
    """The FlashAttention route for chains (taken on CUDA) computes what the packed route computes on any device."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
    module = torch.nn.Module()
    packed, _ = va.verify_attention_forward(module, query, key, value, None, scaling=0.25)
    from torch.nn.attention.bias import causal_lower_right

    lower_right = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=0.25, enable_gqa=True,
                                                                   attn_mask=causal_lower_right(5, 13))
    torch.testing.assert_close(packed, lower_right.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_packed_attention_takes_the_strided_output_cuda_kernels_return(monkeypatch):
    """On CUDA, SDPA's kernels return the packed query's output (rows, kv heads, groups x q, dim) with the heads
    dimension outermost in memory (strided, not contiguous); on the CPU it comes back contiguous. The unpacking must
    not assume a layout: the first run on an H200 (2026-12-04) failed there with `view`."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
    mask = torch.zeros(2, 1, 5, 13).masked_fill_(torch.rand(2, 1, 5, 13) < 0.3, torch.finfo(torch.float32).min)
    mask[..., -5:] = 0
    module = torch.nn.Module()
    contiguous, _ = va.verify_attention_forward(module, query, key, value, mask, scaling=0.25)
    sdpa = va.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):  # the same values, laid out as (rows, groups x q, kv heads, dim) in memory
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(va, "scaled_dot_product_attention", strided_sdpa)
    strided, _ = va.verify_attention_forward(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(strided, contiguous, rtol=0, atol=0)


def test_packed_mask_rows_are_aligned_and_built_once_per_forward():
    mask = torch.zeros(3, 1, 4, 21)
    with va.verify_attention(tiny_target()):
        first = packed_mask(mask, 2, 4, 21, None, torch.float32, mask.device, va._memo())
        again = packed_mask(mask, 2, 4, 21, None, torch.float32, mask.device, va._memo())
    assert first is again and first.shape == (3, 1, 8, 21)
    assert all(stride % MASK_ALIGNMENT == 0 for stride in first.stride()[:-1]) and first.stride(-1) == 1


@pytest.mark.parametrize("kind", ["chains", "ragged-trees"])
@pytest.mark.every_step_speculates("asserts every step verified drafts, and rows accepting different numbers")
def test_verify_never_copies_the_kv_cache_per_head_group(kind, monkeypatch):
    """No `repeat_kv` copy in a verify forward: for one row's chains (the drafter's own), and for three rows' trees
    that accept different numbers of tokens in one step (a noisy oracle with wrong siblings), so that the rows'
    caches hold slots a row must not see."""
    target = tiny_target("llama", seed=3, sharpen=3.0)  # 4 query heads over 2 key/value heads
    assert target.model.layers[0].self_attn.num_key_value_groups == 2
    drafter = tiny_drafter(target, block_size=4, seed=3)
    ids = random_ids(4, 9, rows=1 if kind == "chains" else 3)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    expected = target.generate(ids, **kwargs)
    if kind == "ragged-trees":
        install_oracle(monkeypatch, NoisyOracle(list(expected), 128, noise=0.3, branches=1, seed=0))
    proposals = ProposalRecorder(monkeypatch)

    copies, verifying = [], []
    repeat_kv = sdpa_attention.repeat_kv

    def counting_repeat_kv(hidden_states, n_rep):
        copies.append(bool(verifying and verifying[-1]))
        return repeat_kv(hidden_states, n_rep)

    def note_forward(module, args, kwargs):
        cache = kwargs.get("cache")
        verifying.append(cache is not None and cache.get_seq_length() > 0)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting_repeat_kv)
    handles = [target.register_forward_pre_hook(note_forward, with_kwargs=True),
               target.register_forward_hook(lambda *_: verifying.append(False))]  # the drafter may copy its own
    try:
        out = target.generate(ids, **kwargs, assistant_model=drafter, return_dict_in_generate=True)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(out.sequences, expected)
    assert sum(verifying) >= 3
    assert not any(copies)
    # every row with room for drafts verified some (a row with one token left verifies its anchor alone)
    assert proposals.steps and all(len(tree) > 1 for remaining, trees in proposals.steps
                                   for tree, left in zip(trees, remaining) if left > 0)
    if kind == "ragged-trees":
        assert any(not tree.is_chain for tree in proposals.trees)
        committed, per_step = iter(out.speculation_stats.committed_per_step), []
        for _, trees in proposals.steps:  # one entry per row of the step
            per_step.append([next(committed) for _ in trees])
        assert any(len(set(step)) > 1 for step in per_step if len(step) > 1), "the rows never became ragged"


def test_long_context_bench_runs_at_tiny_scale(capsys):
    from hf_diffspec.bench import long_context

    rows = long_context.main(["--target", "tiny", "--contexts", "64,80", "--widths", "4", "--repeats", "1"])
    assert [(r["context"], r["width"]) for r in rows] == [(64, 4), (80, 4)]
    assert all(r[f"{kind}_{when}"] > 0 for r in rows for kind in ("chain", "tree") for when in ("before", "after"))
    assert "| 80 | 4 | 1 |" in capsys.readouterr().out


class FlashAttentionStandIn:
    """transformers' `flash_attention_2` as this CPU can run it: causal attention over a 2D padding mask (what
    transformers hands FlashAttention) or none; a 4D mask, which FlashAttention cannot take, fails the test. It
    counts its calls and the query lengths it saw."""

    def __init__(self):
        self.query_lengths = []

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 **kwargs):
        assert attention_mask is None or attention_mask.dim() == 2, "FlashAttention was handed a 4D mask"
        assert sliding_window is None
        self.query_lengths.append(query.shape[2])
        q, kv = query.shape[2], key.shape[2]
        allowed = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None]  # causal, aligned bottom-right
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, -kv:].bool()
        groups = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=allowed,
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.every_step_speculates("compares the kernels each step ran")
def test_flash_attention_targets_prefill_with_it_and_verify_through_the_verify_attention(monkeypatch, rows):
    """A target loaded with attn_implementation="flash_attention_2": plain generate's tokens, its prefill on
    FlashAttention (with the prompts' padding), every step (chains, trees, ragged rows) through the verify attention,
    never a 4D mask handed to FlashAttention; the target's implementation is its own again after the call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    flash = FlashAttentionStandIn()
    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", flash)
    target = tiny_target("llama", seed=4, sharpen=3.0)
    target.config._attn_implementation_internal = "flash_attention_2"  # flash-attn is not installed on a CPU
    assert "flash_attention_2" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    drafter = tiny_drafter(target, block_size=5, seed=4, draft_tree_budget=8, draft_tree_width=2)
    ids = random_ids(6, 9, rows=rows)
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0  # left padding in the other rows
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    flash.query_lengths.clear()
    verified = []

    def counting(*args, **kwargs):
        verified.append(1)
        return va.verify_attention_forward(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, va.VERIFY_ATTENTION, counting)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                          prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    layers = target.config.num_hidden_layers
    assert flash.query_lengths == [ids.shape[1]] * layers  # the prefill alone
    assert len(verified) == layers * (out.speculation_stats.target_forwards - 1)
    assert out.speculation_stats.tau > 1
    assert target.config._attn_implementation == "flash_attention_2"


@pytest.mark.every_step_speculates("steers plain and drafter steps")
@pytest.mark.parametrize("ragged", [False, True])
def test_a_plain_step_of_an_sdpa_target_runs_the_models_own_attention_as_plain_generate(monkeypatch, ragged):
    """A plain decode step (one token a row, every row seeing its whole cache) of an SDPA target takes the model's own
    attention, as plain generate's steps do (no verify attention call per layer); drafter steps, and plain steps of
    padded rows (which need the loop's mask), take the verify attention. Plain generate's tokens either way."""
    import itertools

    from transformers import AttentionInterface

    from helpers import steer_steps

    steer_steps(monkeypatch, itertools.cycle([False, True]))  # plain, drafter, plain, ...
    target = tiny_target("llama", seed=4, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=5, seed=4)
    ids = random_ids(6, 9, rows=2)
    mask = torch.ones_like(ids)
    if ragged:
        mask[1:, :2] = 0
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    verified, own = [], []

    def counting(module, query, *args, **kwargs):
        verified.append(query.shape[2])
        return va.verify_attention_forward(module, query, *args, **kwargs)

    targets_modules = {id(m) for m in target.modules()}

    def own_sdpa(module, query, *args, **kwargs):
        if id(module) in targets_modules:  # (the drafter's layers run SDPA too)
            own.append(query.shape[2])
        return sdpa_attention.sdpa_attention_forward(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, va.VERIFY_ATTENTION, counting)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", own_sdpa)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    layers = target.config.num_hidden_layers
    plain = out.speculation_stats.plain_steps
    assert plain >= 3
    if ragged:  # every step through the verify attention (the prefill alone through the model's own)
        assert own == [9] * layers and len(verified) == layers * (out.speculation_stats.target_forwards - 1)
    else:
        assert own == [9] * layers + [1] * (layers * plain) and 1 not in verified
