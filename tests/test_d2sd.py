"""D²SD: dual drafter checkpoints, prefix-tree construction, lossless tree decoding, bad input."""

import itertools
import random

import pytest
import torch
from transformers import AutoModel

import hf_diffspec
from hf_diffspec.runtime.drafting import (DiffusionCandidateGenerator, PrefixTreeCandidateGenerator,
                                          candidate_generator_for)
from hf_diffspec.runtime.control_speculation import SpeculationController
from hf_diffspec.runtime.drafting_prefix_tree import (
    Branch, RowPlan, branch_slots, plan_rows, plan_table, prefix_tree, unpack_plans,
)
from helpers import (
    ProposalRecorder,
    decoy_oracle_drafter_outputs,
    marginal_counts,
    oracle_drafter_outputs,
    random_ids,
    tiny_drafter,
    tiny_dual_drafter,
    tiny_target,
    two_sample_chi2,
)


def dual_for(target, variant="vp", seed=0, **tree):
    """variant: "vp" (a second drafter), "reuse" (the first drafter re-drafts), "resample" (no second pass)."""
    return tiny_dual_drafter(target, block_size=8, seed=seed, vp_seed=seed + 100 if variant == "vp" else None,
                             branches_from_first_pass=variant == "resample", **tree)


def accepted_nodes(trees, committed_per_step, sequence, root_position):
    """Per step (one row), the tree nodes its committed tokens walked, root excluded: step k's root sits at
    `root_position` plus the tokens committed before it, its accepted drafts are the tokens after the root but the
    last (the bonus)."""
    walks = []
    for tree, committed in zip(trees, committed_per_step):
        node, walk = 0, []
        for token in sequence[root_position + 1 : root_position + committed]:
            node = tree.children[node][token]
            walk.append(node)
        walks.append(walk)
        root_position += committed
    return walks


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", ["vp", "reuse", "resample"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.every_step_speculates("asserts the prefix trees each step verified and accepted")
def test_d2sd_greedy_accepts_branches_and_is_identical_to_plain_generate(monkeypatch, kind, variant, seed):
    """The first drafter drafts plain generate's continuation but is fooled, unsure, at seeded decoy positions; the
    VP drafter (when there is one) drafts the continuation. Trees branch at the decoys and the right token is a
    branch's alternative: every case accepts drafts, and some steps accept a branch and drafts below it."""
    target = tiny_target(kind, seed=seed, sharpen=4)
    dual = dual_for(target, variant, seed=seed, num_branches=3, tree_budget=10, max_depth=6)
    ids = random_ids(seed, 10)
    kwargs = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.1)
    reference = target.generate(ids, **kwargs)
    rng = random.Random(seed)
    decoys = {p: (int(reference[0, p]) + 1 + rng.randrange(126)) % 128 for p in range(11, 40) if rng.random() < 0.3}
    decoy_oracle_drafter_outputs(monkeypatch, dual.first, target, reference[0], decoys)
    if dual.vp is not None:
        oracle_drafter_outputs(monkeypatch, dual.vp, target, reference[0])
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    out = target.generate(ids, assistant_model=dual, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference)
    trees = proposals.trees
    assert trees and all(len(t) <= 10 and t.max_depth <= 6 for t in trees)
    assert any(not t.is_chain for t in trees)
    committed = out.speculation_stats.committed_per_step
    assert sum(committed) + 1 == 30
    walks = accepted_nodes(trees, committed, out.sequences[0].tolist(), ids.shape[1])
    assert sum(map(len, walks)) >= 20  # accepted drafts of the 29 after the first (22-24 measured; 0 without oracle)
    # a node that is not its parent's first child is a branch's alternative (the main draft comes first)
    branch_depths = [[depth for depth, node in enumerate(walk)
                      if node != min(tree.children[tree.parents[node]].values())] for tree, walk in zip(trees, walks)]
    assert any(depths and depths[0] < len(walk) - 1 for depths, walk in zip(branch_depths, walks)), \
        "no step accepted a branch's alternative and drafts below it"


def test_prefix_tree_branches_where_rejection_is_likeliest():
    vocab = 10
    # drafts 1, 2, 3, 4 with confidences 0.9, 0.3, 0.9, 0.9: rejection is likeliest at slot 2 (i = 1)
    first = first_drafter_probs([[0.9, 0.3, 0.9, 0.9]], vocab)[0].float()
    branch_probs = torch.full((1, 1, 3, vocab), 0.01)  # the slots after the one branch's prefix
    branch_probs[..., 7] = 0.5   # VP's favourite everywhere
    branch_probs[..., 2] = 0.4
    branch_probs = branch_probs / branch_probs.sum(-1, keepdim=True)

    device_plan = plan_rows(first[None], torch.tensor([4]), num_branches=1, sample=False)
    table, alternative = plan_table(device_plan, branch_probs, sample=False)
    plans, branches = unpack_plans(table.tolist(), device_plan, first[None], branch_probs, alternative, limits=[4])
    plan, branches = plans[0], branches[0]
    assert plan.drafts.tolist() == [1, 2, 3, 4] and plan.picks == [1]   # one branch, re-drafted after the prefix [1]
    tree = prefix_tree(0, plan, branches, budget=16, sample=False)
    node = 0
    for token in [1, 2, 3, 4]:                      # the main chain is kept whole
        node = tree.children[node][token]
    after_prefix = tree.children[tree.children[0][1]]
    assert set(after_prefix) == {2, 7}              # main draft 2 and the VP's alternative (never the same token)
    # each node's confidence is its reach score: c_1 ... c_k on the main chain; a branch's r(i) times its
    # alternative's probability, then times its further drafts' maxima
    branch = branches[0]
    expected = {(1, 2, 3, 4)[: k + 1]: plan.main_scores[k] for k in range(4)}
    path, score = (1, branch.alternative), plan.boundary[1] * branch.alternative_score
    expected[path] = score
    for token, maximum in zip(branch.tokens, branch.maxima):
        path, score = path + (token,), score * maximum
        expected[path] = score
    paths = [()]
    for token, parent in zip(tree.token_list[1:], tree.parents[1:]):
        paths.append(paths[parent] + (token,))
    assert len(tree) == 8 and tree.confidences == pytest.approx([expected[p] for p in paths[1:]])
    small = prefix_tree(0, plan, branches, budget=4, sample=False)
    assert len(small) == 4 and all(p < i for i, p in enumerate(small.parents) if i)
    assert small.confidences == pytest.approx(sorted(expected.values(), reverse=True)[:3])


def test_a_prefix_tree_is_made_on_its_laws_device():
    """The tree's tokens and laws live where the drafter's laws do (a GPU's case, here the meta device): the host
    holds only the plan's numbers."""
    laws = torch.full((3, 6), 1 / 6, device="meta")
    plan = RowPlan(laws.new_zeros(3, dtype=torch.long), [1, 2, 3], [0.5, 0.25, 0.125], [0.5, 0.25, 0.125], [0], laws)
    branch = Branch(0, 4, 0.5, laws[0], [5], [0.5], [laws[1]])
    tree = prefix_tree(0, plan, [branch], budget=8, sample=True)
    assert tree.token_list == [0, 1, 4, 2, 5, 3]
    assert tree.tokens.device.type == "meta" and tree.draft_laws.probs.device.type == "meta"


def test_a_branch_without_an_alternative_leaves_the_other_branches_in_the_tree():
    """A branch whose second-drafter law held only the main draft has no alternative (None) and is left out; the
    branches after it are still grafted."""
    laws = torch.full((3, 6), 1 / 6)
    plan = RowPlan(laws.new_zeros(3, dtype=torch.long), [1, 2, 3], [0.5, 0.25, 0.125], [0.5, 0.25, 0.125], [0, 1],
                   laws)
    branches = [Branch(0, None, 0.0, laws[0], [], [], []), Branch(1, 4, 0.5, laws[1], [5], [0.5], [laws[2]])]
    tree = prefix_tree(0, plan, branches, budget=8, sample=False)
    assert sorted(tree.children[tree.children[0][1]]) == [2, 4]  # the second branch's alternative after prefix [1]


def first_drafter_probs(confidences: list[list[float]], vocab: int = 64) -> torch.Tensor:
    """(rows, depth, vocab) laws whose slot k puts `confidences[r][k]` on token k + 1, the rest spread evenly (so
    `confidences` are the laws' maxima where they are above 1 / vocab)."""
    probs = torch.zeros(len(confidences), len(confidences[0]), vocab, dtype=torch.float64)
    for r, row in enumerate(confidences):
        for k, c in enumerate(row):
            probs[r, k] = (1 - c) / (vocab - 1)
            probs[r, k, k + 1] = c
    return probs


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_plan_rows_scores_each_slot_and_picks_each_rows_likeliest_rejections_within_its_limit(device):
    """The reach score c_1 ... c_k of each draft, the rejection-boundary posterior r(i) = c_1 ... c_i (1 - c_{i+1}),
    and per row the K prefix lengths of largest r(i) among its first `limit` slots, ascending, the earliest first
    among equal ones. On the meta device the plan is built where its inputs are (a GPU's case: no host tensor
    enters it)."""
    confidences = [[0.6, 0.1, 0.5, 0.9],   # r = 0.4, 0.54, 0.03, 0.003: picks 0, 1
                   [0.9, 0.9, 0.2, 0.5],   # r = 0.1, 0.09, 0.648, 0.081; limit 2: slot 2 is past it, picks 0, 1
                   [1.0, 1.0, 1.0, 1.0]]   # point masses (top-k 1): r = 0 everywhere, the earliest first
    probs = first_drafter_probs(confidences).to(device)
    limits = torch.tensor([4, 2, 4], device=device)
    plan = plan_rows(probs, limits, num_branches=2, sample=False)
    assert plan.picks.device.type == plan.boundary.device.type == device
    assert branch_slots(plan.picks, 3).device.type == device
    if device == "meta":
        return
    c = torch.tensor(confidences, dtype=torch.float64)
    reach = torch.cat([torch.ones(3, 1, dtype=torch.float64), c.cumprod(1)[:, :-1]], 1)
    torch.testing.assert_close(plan.main_scores, c.cumprod(1))
    torch.testing.assert_close(plan.boundary, reach * (1 - c))
    assert plan.drafts.tolist() == [[1, 2, 3, 4]] * 3
    assert plan.picks.tolist() == [[0, 1], [0, 1], [0, 1]]
    # one branch a row: row 0's largest r(i) is at 1, row 1's within its limit at 0, row 2's the first of its ties
    assert plan_rows(probs, limits, num_branches=1, sample=False).picks.tolist() == [[1], [0], [0]]
    # with room for it, row 1 picks slot 2 (the limit is what kept it out)
    wide = plan_rows(probs, torch.tensor([4, 4, 4]), num_branches=1, sample=False)
    assert wide.picks.tolist() == [[1], [2], [0]]
    assert branch_slots(wide.picks, 3).tolist() == [[[1, 2, 3]], [[2, 3, 4]], [[0, 1, 2]]]


def test_plan_table_draws_every_branch_token_from_its_law_when_sampling():
    """When sampling, each branch's alternative is drawn from the second drafter's first law with the main draft
    taken out (renormalised), and its further drafts from their laws: not their argmax, or drafts no longer follow
    the laws the tree hands rejection sampling. A point-mass law (top-k 1) draws its one token."""
    rows, vocab = 20_000, 4
    torch.manual_seed(0)
    first = first_drafter_probs([[0.7, 0.7, 0.7]] * rows, vocab).float()  # r = 0.3, 0.21, 0.147: branch at 0
    law = torch.tensor([0.1, 0.4, 0.2, 0.3])
    branch_probs = law.expand(rows, 1, 3, vocab).clone()
    branch_probs[0, 0, 2] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # row 0's last slot: a point mass at token 2
    plan = plan_rows(first, torch.full((rows,), 3), num_branches=1, sample=True)
    table, alternative = plan_table(plan, branch_probs, sample=True)
    plans, branches = unpack_plans(table.tolist(), plan, first, branch_probs, alternative, limits=[3] * rows)
    assert all(len(b) == 1 and b[0].prefix_length == 0 for b in branches)
    main_drafts = torch.tensor([p.tokens[0] for p in plans])
    alternatives = torch.tensor([b[0].alternative for b in branches])
    continuations = torch.tensor([b[0].tokens for b in branches])  # slots 1, 2 of the branch
    assert branches[0][0].tokens[1] == 2
    # each further draft carries the law it was drawn from (slots 1, 2 of the branch), its maximum beside it
    assert len(branches[0][0].laws) == 2 and torch.equal(branches[0][0].laws[1], branch_probs[0, 0, 2])
    assert branches[0][0].maxima == pytest.approx([0.4, 1.0])
    for token in range(vocab):  # the alternative's law: the branch law without the row's main draft
        excluded = main_drafts == token
        if excluded.any():
            assert not (alternatives[excluded] == token).any()
        expected = (law[token] / (1 - law[main_drafts])).masked_fill(excluded, 0).mean()
        assert abs((alternatives == token).double().mean() - expected) < 0.015
        assert abs((continuations[1:] == token).double().mean() - law[token]) < 0.015


def test_dual_drafter_saves_and_loads_as_one_checkpoint(tmp_path):
    target = tiny_target("llama")
    dual = dual_for(target, num_branches=2, tree_budget=9)
    hf_diffspec.save_drafter(dual, tmp_path)
    assert (tmp_path / "modeling_dual_drafter.py").exists() and (tmp_path / "custom_generate" / "drafting_prefix_tree.py").exists()
    loaded = hf_diffspec.DualDiffusionDrafter.from_pretrained(tmp_path, target=target)
    assert loaded.config.num_branches == 2 and loaded.config.tree_budget == 9 and loaded.vp is not None
    assert isinstance(AutoModel.from_pretrained(tmp_path), hf_diffspec.DualDiffusionDrafter)
    ids = torch.randint(2, 128, (1, 8))
    assert torch.equal(target.generate(ids, assistant_model=loaded, max_new_tokens=12),
                       target.generate(ids, max_new_tokens=12))


def _drafting_ahead(monkeypatch, ahead: bool) -> list:
    """D²SD's passes drafted ahead (as on a GPU, where reads wait) or at each step; with `ahead`, the controller
    expects every next step to draft (so each is drafted ahead). Returns the list the passes run ahead are counted in."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1" if ahead else "0")
    if ahead:
        monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)
    passes, ahead_pass = [], PrefixTreeCandidateGenerator._ahead_pass

    def counted(self, *args):
        passes.append(1)
        return ahead_pass(self, *args)

    monkeypatch.setattr(PrefixTreeCandidateGenerator, "_ahead_pass", counted)
    return passes


@pytest.mark.parametrize("variant", ["chain", "vp", "vp-ahead"])
@pytest.mark.every_step_speculates("asserts drafts were drawn and accepted at every step")
def test_rejection_sampling_with_drawn_drafts_is_exactly_the_targets_distribution(monkeypatch, variant):
    """Drafts drawn from the drafters' distributions, verified by recursive rejection sampling: the marginals of
    the 2nd and last tokens match plain sampling (two-sample chi-square, df <= 15 each). `vp-ahead`: D²SD's passes
    drafted ahead, as on a GPU (their drafts drawn before the step's own acceptance draws)."""
    passes_ahead = _drafting_ahead(monkeypatch, variant.endswith("ahead"))
    vocab = 16
    target = tiny_target("llama", seed=5, vocab_size=vocab, sharpen=6)
    if variant == "chain":
        drafter, generator_class = tiny_drafter(target, block_size=6, seed=1), DiffusionCandidateGenerator
    else:
        drafter = tiny_dual_drafter(target, block_size=6, seed=1, vp_seed=2, num_branches=3, tree_budget=10)
        generator_class = PrefixTreeCandidateGenerator
    proposals = ProposalRecorder(monkeypatch, generator_class)
    ids = torch.randint(2, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    # drafted ahead: a top-k law (compact), accepted on the device, whose outcome the pass run ahead starts from (a
    # law over the whole vocabulary is accepted token by token on the host, with no pass ahead)
    kwargs = dict(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=8 if variant.endswith("ahead") else 0)
    n = 300
    plain = marginal_counts(target, ids, vocab, n, 0, **kwargs)
    spec = marginal_counts(target, ids, vocab, n, 10_000, assistant_model=drafter, **kwargs)
    trees = [t for t in proposals.trees if len(t) > 1]
    assert trees and all(t.draft_laws is not None for t in trees)
    if variant != "chain":
        assert any(not t.is_chain for t in trees)
    accepted = 0  # drafts must really be accepted for the check to mean anything
    for seed in range(20):
        torch.manual_seed(seed)
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
        accepted += sum(c - 1 for c in out.speculation_stats.committed_per_step)
    assert accepted > 5
    for row in range(2):
        assert two_sample_chi2(plain[row], spec[row]) < 40  # the 0.999 quantile of chi2(15) is ~37.7
    assert (len(passes_ahead) > n) == variant.endswith("ahead")


def test_bad_d2sd_configurations_are_refused():
    target = tiny_target("llama")
    first = tiny_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="only 3 prefix lengths"):
        hf_diffspec.DualDiffusionDrafter.from_drafters(first, None, num_branches=4)
    with pytest.raises(ValueError, match="block_size"):
        hf_diffspec.DualDiffusionDrafter.from_drafters(first, tiny_drafter(target, block_size=8), num_branches=2)
    other_target = tiny_target("llama", vocab_size=96)
    with pytest.raises(ValueError, match="vocab_size"):
        hf_diffspec.DualDiffusionDrafter.from_drafters(first, tiny_drafter(other_target, block_size=4), num_branches=2)
    dual = hf_diffspec.DualDiffusionDrafter.from_drafters(first, None, num_branches=2)
    with pytest.raises(ValueError, match="chains only"):
        hf_diffspec.assisted_generate_with_stock_loop(target, dual, inputs=torch.randint(2, 128, (1, 6)),
                                                      max_new_tokens=4)


@pytest.mark.parametrize("ahead", [False, True], ids=["at-each-step", "drafted-ahead"])
@pytest.mark.parametrize("max_new_tokens", [2, 3, 5, 12])
@pytest.mark.every_step_speculates("asserts the size of every verified tree")
def test_trees_never_exceed_the_token_budget(monkeypatch, max_new_tokens, ahead):
    """A row's tree is cut at the tokens the row may still commit (and at the node budget). The first drafter is an
    oracle, so every main draft is right and trees are as deep as they may be: without the cut they would verify
    drafts past max_new_tokens. The last step is the edge: its tree was cut by the budget, and all of it accepted.
    Drafted ahead, the plan is made within limits computed on the device: the same cut."""
    passes_ahead = _drafting_ahead(monkeypatch, ahead)
    target = tiny_target("qwen3", seed=2)
    dual = dual_for(target, num_branches=3, tree_budget=12)  # max_depth 7 (block 8)
    ids = random_ids(2, 7)
    ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    oracle_drafter_outputs(monkeypatch, dual.first, target, target.generate(ids, max_new_tokens=20)[0])
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    out = target.generate(ids, assistant_model=dual, max_new_tokens=max_new_tokens, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert proposals.steps
    for remaining, trees in proposals.steps:
        assert all(t.max_depth <= left and len(t) <= 12 for t, left in zip(trees, remaining))
    (left,), (last,) = proposals.steps[-1]
    assert left < dual.config.max_depth and last.max_depth == left, "the last tree must be cut by the token budget"
    assert out.speculation_stats.committed_per_step[-1] == left + 1  # its main chain accepted, then the bonus token
    assert bool(passes_ahead) == (ahead and max_new_tokens > 2)  # (the prefill drafts the first step ahead)


@pytest.mark.every_step_speculates("asserts on the drafted trees' laws")
def test_sampled_prefix_trees_carry_compact_laws_after_top_k(monkeypatch):
    """With a top-k warper, a sampled D²SD tree's nodes keep their laws as compact as the slots' they were drawn
    from (top-k + 4 candidates, the alternative's removed token included), not one vocabulary-wide row per node."""
    vocab = 64
    target = tiny_target("llama", seed=5, vocab_size=vocab, sharpen=6)
    drafter = tiny_dual_drafter(target, block_size=6, seed=1, vp_seed=2, num_branches=3, tree_budget=10)
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    ids = torch.randint(2, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True, top_k=8,
                    max_new_tokens=12)
    laws = [t.draft_laws for t in proposals.trees if t.draft_laws is not None]
    assert laws and all(law.ids is not None and law.width == 8 + 4 for law in laws)
    assert all(torch.allclose(law.probs[1:].sum(-1), torch.ones(len(law.probs) - 1)) for law in laws)


@pytest.mark.every_step_speculates("records the drafting generator's contexts")
def test_branches_from_the_first_pass_keep_no_context_for_an_unused_vp_drafter(monkeypatch):
    """With `branches_from_first_pass` a dual drafter's VP drafter drafts nothing: the loop keeps no context for it
    (it queued every step's target features there and never took them: a call's memory grew with its length)."""
    target = tiny_target("llama", seed=1)
    dual = tiny_dual_drafter(target, block_size=8, seed=1, vp_seed=2, branches_from_first_pass=True)
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    ids = random_ids(1, 8)
    out = target.generate(ids, assistant_model=dual, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False))
    generator = proposals.generators[0]
    assert len(proposals.steps) > 2 and generator.contexts == [generator.first]


def test_branch_blocks_drafted_side_by_side_are_each_prefix_drafted_alone():
    """`DrafterContext.draft_branches`: the K blocks of a row, drafted side by side in one forward, are each the block
    [anchor, the row's first i drafts, MASK...] drafted alone over that row's cached context: slot s holds draft s - 1
    up to the branch's prefix length i, every later slot is a MASK, and a block sees the context and itself only."""
    from transformers import DynamicCache

    from hf_diffspec.runtime.drafting import DrafterContext

    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target, block_size=5, seed=2)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    roots, root_positions = torch.tensor([3, 9]), torch.tensor([7, 7])
    drafts = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
    picks = torch.tensor([[0, 2, 3], [1, 2, 4]])  # prefix lengths, ascending
    with torch.no_grad():
        features = drafter.gather_target_features(target(ids, output_hidden_states=drafter.target_feature_layers)
                                                  .hidden_states)
        positions = torch.arange(7)[None].expand(2, -1)
        context = DrafterContext(drafter)
        context.pending.append((features, positions, torch.ones(2, 7, dtype=torch.bool), None))
        hidden = context.draft_branches(roots, root_positions, drafts, picks, 5)
        assert hidden.shape[:3] == (2, 3, 5)
        for r in range(2):
            cache = DynamicCache()
            drafter.prefill_context(features[r : r + 1], positions[r : r + 1], cache)
            for b, i in enumerate(picks[r].tolist()):
                tokens = torch.cat([roots[r : r + 1], drafts[r, :i], roots[r].repeat(4 - i)])[None]
                alone = drafter(noise_embeds=drafter.target_embed_tokens(tokens), position_ids=7 + torch.arange(5)[None],
                                cache=cache, mask_positions=torch.arange(5)[None] > i, extend_cache=False)
                torch.testing.assert_close(hidden[r, b], alone.last_hidden_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("from_first_pass", [False, True])
def test_each_branch_slot_takes_the_law_drafted_for_it(from_first_pass):
    """`_planned_pass`: a branch re-drafted after prefix length i takes, at its j-th slot, the law of block slot
    i + j + 1 of its own block (the branch drafter's pass); taken from the first pass, the first pass's law at slot
    i + j. Slots past the block are never read. Picks reach the block's last slot here (4 branches of 3 slots over
    5 drafted slots)."""
    target = tiny_target("llama", seed=6)
    dual = tiny_dual_drafter(target, block_size=6, seed=6, vp_seed=None if from_first_pass else 7, num_branches=4,
                             branch_length=3, branches_from_first_pass=from_first_pass)
    generator = candidate_generator_for(dual, target, num_draft_tokens=5)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    blocks = []
    draft_branches = generator.branch_context.draft_branches
    generator.branch_context.draft_branches = lambda *args: blocks.append(draft_branches(*args)) or blocks[-1]
    with torch.no_grad():
        out = target(ids, output_hidden_states=dual.target_feature_layers)
        generator.add_context(out.hidden_states, slice(None), torch.arange(7)[None].expand(2, -1))
        roots, positions, hidden = generator._draft_block([3, 9], [7, 7])
        (probs, branch_probs, _, _, _, _, picks), _ = generator._planned_pass(roots, positions, hidden,
                                                                              torch.tensor([5, 5]), 5)
        depth = probs.shape[1]
        assert depth == 5 and (picks.max(-1).values + 2 >= depth).all()
        for r, b, j in itertools.product(range(2), range(4), range(3)):
            slot = int(picks[r, b]) + j
            if from_first_pass:
                if slot < depth:
                    torch.testing.assert_close(branch_probs[r, b, j], probs[r, slot])
            elif slot + 1 < 6:
                law = generator._distributions(dual.vp.compute_logits(blocks[0][r, b, slot + 1][None]))[0]
                torch.testing.assert_close(branch_probs[r, b, j], law)


def test_a_d2sd_row_with_room_for_one_draft_gets_a_tree_one_level_deep():
    """`_planned_trees`: each row's tree within its limit, from one pass planned for the deepest: a row with room for
    one draft gets its depth-1 nodes (the main draft, and a branch's alternative where one is planned at 0), a row
    with none its anchor alone."""
    target = tiny_target("llama", seed=6)
    dual = tiny_dual_drafter(target, block_size=6, seed=6, num_branches=3)
    generator = candidate_generator_for(dual, target, num_draft_tokens=5)  # (every node the budget holds)
    ids = torch.randint(2, 128, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = target(ids, output_hidden_states=dual.target_feature_layers)
        generator.add_context(out.hidden_states, slice(None), torch.arange(7)[None].expand(3, -1))
        roots, positions, hidden = generator._draft_block([3, 9, 4], [7, 7, 7])
        limits = [1, 0, 5]
        tensors, table = generator._planned_pass(roots, positions, hidden, torch.tensor(limits), 5)
        trees = generator._planned_trees([3, 9, 4], tensors, table.tolist(), limits)

    assert [t.tokens[0].item() for t in trees] == [3, 9, 4]
    assert len(trees[0]) > 1 and trees[0].max_depth == 1
    assert len(trees[1]) == 1
    assert trees[2].max_depth > 1
