"""Qwen3.5 / Qwen3.6 targets (dense and MoE): Gated DeltaNet linear-attention layers beside full-attention ones.

A verify forward advances the linear layers' recurrent and convolution states through every verified token; after a
rejection the loop must leave them as if only the accepted tokens had been seen (`runtime/verify_recurrent.py`).
The oracle drafts the target's own continuation with random corruptions, so steps both accept a whole chain and stop
inside one; the tests check that both happen."""

import copy

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from hf_diffspec.runtime import verifier as verifier_module
from hf_diffspec.runtime.drafting import (
    BestFirstTreeCandidateGenerator,
    DiffusionCandidateGenerator,
    PrefixTreeCandidateGenerator,
)
from hf_diffspec.runtime.verify_cache import select_rows
from hf_diffspec.runtime.verify_recurrent import RecurrentStates, _tree_forward
from hf_diffspec.runtime.verify_cache import full_kv_cache
from hf_diffspec.runtime.tree import CandidateTree, TreeLayout
from helpers import (
    NoisyOracle,
    ProposalRecorder,
    install_oracle,
    marginal_counts,
    oracle_drafter_outputs,
    random_ids,
    tiny_drafter,
    tiny_dual_drafter,
    tiny_hybrid_target,
    two_sample_chi2,
)
from test_batched import PAD, left_padded, mixed_prompts, rows_alone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ["qwen3_5", "qwen3_5_moe"]


def chains_verified(monkeypatch) -> list:
    """Records, for every verify forward of the loop, whether all of its trees were chains."""
    seen, build = [], verifier_module.tree_forward_inputs

    def recording(trees, *args):
        seen.append(all(tree.is_chain for tree in trees))
        return build(trees, *args)

    monkeypatch.setattr(verifier_module, "tree_forward_inputs", recording)
    return seen


@pytest.mark.every_step_speculates("counts cut and whole chains")
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_chains_are_identical_to_plain_generate(monkeypatch, kind):
    target = tiny_hybrid_target(kind, seed=1, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(1, 10)
    kwargs = dict(max_new_tokens=40, do_sample=False)
    reference = target.generate(ids, **kwargs)
    oracle = NoisyOracle(reference, vocab_size=128, noise=0.25, seed=3)
    install_oracle(monkeypatch, oracle)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference)

    stats = out.speculation_stats
    steps = list(zip(stats.committed_per_step, (len(tree) for tree in oracle.trees)))
    partial = sum(committed < verified for committed, verified in steps)
    whole = sum(committed == verified > 1 for committed, verified in steps)
    assert partial >= 3 and whole >= 3, steps  # rollbacks and whole chains both happened
    assert stats.linear_state_replays == partial


@pytest.mark.every_step_speculates("the last step must cut a chain")
@pytest.mark.parametrize("kind", KINDS)
def test_returned_cache_holds_the_states_of_the_committed_tokens(monkeypatch, kind):
    """The cache a call returns continues exactly like plain generate's: the last step stopped inside a chain."""
    target = tiny_hybrid_target(kind, seed=2, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(2, 9)
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(reference, vocab_size=128, noise=0.4, seed=5))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    assert out.speculation_stats.committed_per_step[-1] < 6  # the chain of the last step was cut
    following = target.generate(out.sequences, cache=out.cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(following, reference[:, : following.shape[1]])


@pytest.mark.every_step_speculates("asserts that trees and grafted lookup drafts were verified")
@pytest.mark.parametrize("kind", KINDS)
def test_best_first_trees_with_lookup_branches_equal_plain_generate(monkeypatch, kind):
    """A drafter configured for best-first trees, with prompt-lookup drafts grafted on as one more branch: the
    trees go through the linear layers in their tree form, and the output is plain generate's."""
    target = tiny_hybrid_target(kind, seed=3, layers=3, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, draft_tree_budget=8)
    ids = torch.cat([random_ids(3, 6)] * 3, dim=1)  # repeats: prompt lookup finds matches
    kwargs = dict(max_new_tokens=30, do_sample=False)
    reference = target.generate(ids, **kwargs)
    oracle_drafter_outputs(monkeypatch, drafter, target, reference[0], margin=2.0)  # confident, not certain
    proposals = ProposalRecorder(monkeypatch, BestFirstTreeCandidateGenerator)
    chains = chains_verified(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, prompt_lookup_num_tokens=4, return_dict_in_generate=True,
                          **kwargs)
    assert torch.equal(out.sequences, reference)
    assert proposals.trees and not all(chains)  # best-first trees, verified as trees
    stats = out.speculation_stats
    assert stats.lookup_tokens > 0 and stats.linear_state_replays >= 3


@pytest.mark.every_step_speculates("asserts that D2SD trees were verified")
@pytest.mark.parametrize("rows", [1, 3])
def test_d2sd_prefix_trees_equal_plain_generate(monkeypatch, rows):
    target = tiny_hybrid_target("qwen3_5", seed=4, layers=4, sharpen=4)
    dual = tiny_dual_drafter(target, block_size=6, seed=1, num_branches=3, tree_budget=10,
                             branches_from_first_pass=True)
    prompts = mixed_prompts(7, lengths=(5, 9, 2))[:rows]
    ids, mask = left_padded(prompts)
    alone = rows_alone(target, prompts, max_new_tokens=24, do_sample=False)
    oracle_drafter_outputs(monkeypatch, dual.first, target, alone)
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    out = target.generate(ids, attention_mask=mask, assistant_model=dual, max_new_tokens=24, do_sample=False,
                          return_dict_in_generate=True)
    assert [out.sequences[r, ids.shape[1] - len(p) :].tolist() for r, p in enumerate(prompts)] == alone
    assert any(not t.is_chain for t in proposals.trees)
    assert out.speculation_stats.linear_state_replays >= 3


def test_a_tree_through_a_linear_layer_equals_each_root_to_node_path():
    """Each node's output of a GatedDeltaNet's tree form equals the layer's own forward over the node's root-to-node
    path from the same cached states, row by row (padding slots aside); the cache's states are left as they were."""
    target = tiny_hybrid_target("qwen3_5", seed=7, layers=2)
    module = target.model.layers[0].linear_attn
    trees = [CandidateTree(list(range(7)), [-1, 0, 0, 1, 1, 2, 5]), CandidateTree(list(range(5)), [-1, 0, 1, 0, 3])]
    torch.manual_seed(0)
    prefix, nodes = torch.randn(2, 5, 64), torch.randn(2, 7, 64)
    cache = full_kv_cache(target.config)
    with torch.no_grad():
        module(hidden_states=prefix, cache=cache)
        states = [cache.layers[0].conv_states[0].clone(), cache.layers[0].recurrent_states[0].clone()]
        ours = _tree_forward(module, cache.layers[0], TreeLayout.of(trees, "cpu"), nodes)
    assert torch.equal(cache.layers[0].conv_states[0], states[0])
    assert torch.equal(cache.layers[0].recurrent_states[0], states[1])
    for row, tree in enumerate(trees):
        for node in range(len(tree)):
            path = [node]
            while tree.parents[path[0]] >= 0:
                path.insert(0, tree.parents[path[0]])
            alone = copy.deepcopy(cache)
            select_rows(alone, torch.tensor([row]))
            with torch.no_grad():
                reference = module(hidden_states=nodes[row : row + 1, path], cache=alone)
            torch.testing.assert_close(ours[row, node], reference[0, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.every_step_speculates("drafts must be accepted and rejected")
def test_sampling_follows_the_targets_distribution(monkeypatch):
    """Drafts drawn from the drafter, verified by rejection sampling along chains: the marginals of the 2nd and
    last tokens match plain sampling (two-sample chi-square, df <= 15 each). The dense target only: the rollback is
    the same code for the MoE one, whose greedy tests cover it."""
    vocab = 16
    target = tiny_hybrid_target("qwen3_5", seed=5, vocab_size=vocab, layers=3, sharpen=6)
    drafter = tiny_drafter(target, block_size=6, seed=1)
    ids = random_ids(0, 8, vocab)
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=0)
    proposals = ProposalRecorder(monkeypatch, DiffusionCandidateGenerator)
    n = 200
    plain = marginal_counts(target, ids, vocab, n, 0, **kwargs)
    ours = marginal_counts(target, ids, vocab, n, 10_000, assistant_model=drafter, **kwargs)
    assert all(t.draft_laws is not None for t in proposals.trees if len(t) > 1)
    accepted = replays = 0  # drafts must be accepted, and rejected, for the check to mean anything
    for seed in range(10):
        torch.manual_seed(seed)
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
        accepted += sum(c - 1 for c in out.speculation_stats.committed_per_step)
        replays += out.speculation_stats.linear_state_replays
    assert accepted > 3 and replays > 3
    for slot in range(2):
        assert two_sample_chi2(plain[slot], ours[slot]) < 40  # the 0.999 quantile of chi2(15) is ~37.7


@pytest.mark.every_step_speculates("drafts must be verified, accepted and rejected, for the check to mean anything")
def test_batched_sampling_follows_each_rows_distribution(monkeypatch):
    """Each row of a left-padded batch sampled on a hybrid target is distributed as its prompt sampled alone
    (chi-square on the marginals of its 2nd and 5th new tokens), drafts drawn and verified by rejection sampling row
    by row. The drafts are peaked on the greedy continuation (one prompt for every row, so that the oracle drafter
    serves rows that finish at different steps). A coarse check: at this sample size it does not see a wrong linear
    state (the greedy tests do), nor a rejection residual left at p."""
    vocab, slots = 16, (1, 4)
    target = tiny_hybrid_target("qwen3_5", seed=12, vocab_size=vocab, layers=3, sharpen=6)
    drafter = tiny_drafter(target, block_size=5, seed=2)
    prompt = torch.randint(2, vocab, (6,), generator=torch.Generator().manual_seed(6))
    ids, mask = left_padded([prompt, prompt])
    ids, mask = torch.nn.functional.pad(ids, (2, 0), value=PAD), torch.nn.functional.pad(mask, (2, 0))
    kwargs = dict(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=0)
    greedy = target.generate(prompt[None], max_new_tokens=5, do_sample=False)[0]
    oracle_drafter_outputs(monkeypatch, drafter, target, greedy)  # q ~ 1 on the greedy token
    n, replays = 150, 0
    ours, plain = torch.zeros(2, len(slots), vocab), torch.zeros(len(slots), vocab)
    for seed in range(n):
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True,
                              **kwargs)
        replays += out.speculation_stats.linear_state_replays
        torch.manual_seed(50_000 + seed)
        alone = target.generate(prompt[None], **kwargs)
        for i, slot in enumerate(slots):
            plain[i, alone[0, len(prompt) + slot]] += 1
            for r in range(2):
                ours[r, i, out.sequences[r, ids.shape[1] + slot]] += 1
    assert replays > n
    for r in range(2):
        for i in range(len(slots)):
            assert two_sample_chi2(plain[i], ours[r, i]) < 40  # 0.999 quantile of chi2(15) ~ 37.7


@pytest.mark.every_step_speculates("counts rollbacks")
@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_fixed_drafts_draws_what_plain_sampling_draws(monkeypatch, kind):
    """Drafts without a distribution (the oracle's) are accepted when the target's own draw equals them, so the loop
    consumes randomness exactly as plain sampling does: the same seed gives the same tokens, as long as every state
    the target samples from is right."""
    vocab = 16
    target = tiny_hybrid_target(kind, seed=6, vocab_size=vocab, layers=4, sharpen=6)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(1, 8, vocab)
    greedy = target.generate(ids, max_new_tokens=12, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(greedy, vocab_size=vocab, noise=0.0))
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=0)
    same = replays = 0
    for seed in range(15):
        torch.manual_seed(seed)
        plain = target.generate(ids, **kwargs)
        torch.manual_seed(seed)
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
        same += torch.equal(plain, out.sequences)
        replays += out.speculation_stats.linear_state_replays
    assert replays > 5
    assert same >= 14


def refused_before_any_forward(target, drafter, match, **kwargs):
    calls = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(assistant_model=drafter, max_new_tokens=4, **kwargs)
    finally:
        handle.remove()
    assert not calls


def test_other_linear_attention_models_are_refused():
    """Only Qwen3.5's linear layers are known to the rollback: Qwen3-Next's, for one, are refused."""
    torch.manual_seed(0)
    target = Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"])).eval()
    drafter = tiny_drafter(target)
    refused_before_any_forward(target, drafter, "linear-attention layers.*qwen3_5_text.*plain generate",
                               input_ids=random_ids(0, 6))


def partial_accepts(stats, trees) -> int:
    """Row-steps whose chain was cut (the target stopped before its last draft): each needs a rollback."""
    return sum(committed < len(tree) for committed, tree in zip(stats.committed_per_step, trees))


@pytest.mark.every_step_speculates("counts the row-steps whose chain was cut")
@pytest.mark.parametrize("kind", KINDS)
def test_rollback_runs_no_projection(monkeypatch, kind):
    """The rollback runs only the convolution and the recurrence: none of a linear layer's projections (nor any
    other layer) runs while the states are put back and advanced."""
    target = tiny_hybrid_target(kind, seed=1, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(1, 10)
    reference = target.generate(ids, max_new_tokens=30, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(reference, vocab_size=128, noise=0.25, seed=3))
    calls, rolling_back, keep_accepted = [], [False], RecurrentStates.keep_accepted

    def counting(self, *args):
        rolling_back[0] = True
        try:
            keep_accepted(self, *args)
        finally:
            rolling_back[0] = False

    monkeypatch.setattr(RecurrentStates, "keep_accepted", counting)
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_pre_hook(lambda *args: calls.append(rolling_back[0])) for m in linears]
    try:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                              return_dict_in_generate=True)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(out.sequences, reference)
    assert out.speculation_stats.linear_state_replays >= 3
    assert calls and not any(calls)


@pytest.mark.every_step_speculates("counts the row-steps whose chain was cut")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("branches", [0, 2])
def test_rows_ragged_left_padded_and_finishing_early_equal_each_row_alone(monkeypatch, kind, rows, branches):
    """Left-padded prompts of different lengths, chains (or trees: `branches` wrong siblings per depth) cut at
    different places in different rows, a row that emits the EOS and leaves the batch (every cache, the linear
    states included): each row equals plain greedy generate of its prompt alone."""
    target = tiny_hybrid_target(kind, seed=rows, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    prompts = mixed_prompts(rows, lengths=(9, 3, 14, 6))[:rows]
    free = rows_alone(target, prompts, max_new_tokens=24, do_sample=False)
    eos = free[0][len(prompts[0]) + 5]  # row 0 stops after 6 tokens
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    alone = rows_alone(target, prompts, **kwargs)
    oracle = NoisyOracle([torch.tensor(f) for f in free], vocab_size=128, noise=0.25, branches=branches, seed=rows)
    install_oracle(monkeypatch, oracle)
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    got = [out.sequences[r, ids.shape[1] - len(p) :].tolist()[: len(alone[r])] for r, p in enumerate(prompts)]
    assert got == alone
    stats = out.speculation_stats
    assert partial_accepts(stats, oracle.trees) >= 3 and stats.linear_state_replays >= 3
    if rows > 1:
        assert len({len(a) for a in alone}) > 1 and len(set(stats.committed_per_step)) > 1  # ragged, rows drop
    assert all(tree.is_chain for tree in oracle.trees) == (branches == 0)


def row_states_by_length(monkeypatch, layer: int) -> dict:
    """After every step, the first active row's states in linear layer `layer`, by that row's committed count."""
    snapshots, committed, keep_accepted = {}, [0], RecurrentStates.keep_accepted

    def snapshot(self, paths, num_slots):
        keep_accepted(self, paths, num_slots)
        committed[0] += len(paths[0])
        states = self.cache.layers[layer]
        snapshots[committed[0]] = (states.conv_states[0][0].clone(), states.recurrent_states[0][0].clone())

    monkeypatch.setattr(RecurrentStates, "keep_accepted", snapshot)
    return snapshots


@pytest.mark.every_step_speculates("counts the row-steps whose chain was cut")
@pytest.mark.parametrize("branches", [0, 2])
def test_the_image_text_model_runs_rows_and_trees_like_plain_generate(monkeypatch, branches):
    """Qwen3.5's image-text model (`Qwen3_5ForConditionalGeneration`) on text: a ragged, left-padded batch of
    chains or trees, each row equal to plain greedy generate of its prompt alone."""
    target = tiny_hybrid_target("qwen3_5_vl", seed=5, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    prompts = mixed_prompts(5, lengths=(9, 3, 6))
    free = rows_alone(target, prompts, max_new_tokens=20, do_sample=False)
    oracle = NoisyOracle([torch.tensor(f) for f in free], vocab_size=128, noise=0.25, branches=branches, seed=5)
    install_oracle(monkeypatch, oracle)
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    assert [out.sequences[r, ids.shape[1] - len(p) :].tolist() for r, p in enumerate(prompts)] == free
    assert partial_accepts(out.speculation_stats, oracle.trees) >= 3
    assert out.speculation_stats.linear_state_replays >= 3


@pytest.mark.every_step_speculates("the rows' chains are cut at different places")
def test_a_left_padded_rows_states_equal_its_states_alone(monkeypatch):
    """The linear layers' states of a short, left-padded row of a batch equal those of the same prompt generated
    alone, after every step where both have committed the same tokens: left padding enters no state, and each row
    is rolled back to its own tokens."""
    target = tiny_hybrid_target("qwen3_5", seed=4, layers=4, sharpen=4)
    drafter = tiny_drafter(target, block_size=6)
    prompts = mixed_prompts(4, lengths=(4, 13))
    free = rows_alone(target, prompts, max_new_tokens=30, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle([torch.tensor(f) for f in free], vocab_size=128, noise=0.3, seed=4))
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    with monkeypatch.context() as patch:
        batched = row_states_by_length(patch, layer=0)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
    assert out.speculation_stats.linear_state_replays >= 3
    install_oracle(monkeypatch, NoisyOracle([torch.tensor(free[0])], vocab_size=128, noise=0.3, seed=5))
    alone = row_states_by_length(monkeypatch, layer=0)
    target.generate(prompts[0][None], assistant_model=drafter, **kwargs)
    common = sorted(set(batched) & set(alone))
    assert len(common) >= 3, (sorted(batched), sorted(alone))
    for length in common:
        for ours, reference in zip(batched[length], alone[length]):
            torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
