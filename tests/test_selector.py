"""DFlash 2's candidate selector: an exact no-op when fresh, lossless greedy and sampling once it changes the path,
added to a DFlash checkpoint, and trained by the KD Trainer."""

import pytest
import torch

import hf_diffspec
from hf_diffspec.runtime.drafting import candidate_generator_for
from helpers import assert_sampling_matches_plain, tiny_drafter, tiny_target


def _with_selector(target, rank=8, top_k=4, seed=0, scramble=False, **kw):
    plain = tiny_drafter(target, seed=seed, **kw)
    drafter = tiny_drafter(target, seed=seed, selector_rank=rank, selector_top_k=top_k, **kw)
    missing, unexpected = drafter.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("selector.") for k in missing)
    if scramble:  # a selector that disagrees with the drafter's argmax
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            for codes in (drafter.selector.previous_codes, drafter.selector.candidate_codes):
                codes.copy_(torch.randn(codes.shape, generator=generator) * 3)
            drafter.selector.proj.weight.mul_(30)
    return plain, drafter


def _drafts(drafter, target, ids):
    generator = candidate_generator_for(drafter, target, num_draft_tokens=3)
    out = target(ids, output_hidden_states=drafter.target_feature_layers)
    positions = torch.arange(ids.shape[1])[None]
    generator.add_context(out.hidden_states, slice(None), positions)
    return generator.propose([int(out.logits[0, -1].argmax())], [ids.shape[1]], [8])[0].tokens


def test_a_fresh_selector_drafts_exactly_what_the_drafter_does():
    target = tiny_target("llama", seed=0)
    plain, drafter = _with_selector(target)
    assert drafter.selector.candidate_codes.abs().sum() == 0
    for seed in range(4):
        ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(_drafts(plain, target, ids), _drafts(drafter, target, ids))


def test_a_trained_selector_changes_the_path_and_greedy_stays_identical():
    target = tiny_target("qwen3", seed=1)
    plain, drafter = _with_selector(target, seed=1, scramble=True)
    changed = 0
    for seed in range(4):
        ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(seed))
        changed += not torch.equal(_drafts(plain, target, ids), _drafts(drafter, target, ids))
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False), ref)
    assert changed > 0


@pytest.mark.every_step_speculates("asserts drafts were made at every step")
def test_selector_sampling_is_the_targets_distribution():
    """The draft distribution is the selector's over its top-k candidates (sparse); rejection sampling uses it."""
    vocab = 12
    target = tiny_target("llama", seed=3, vocab_size=vocab, sharpen=5)
    _, drafter = _with_selector(target, top_k=3, seed=3, scramble=True)
    ids = torch.randint(2, vocab, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=0)
    fixed = dict(num_assistant_tokens=3)
    assert_sampling_matches_plain(target, ids, vocab, drafter, limit=33, drafter_kwargs=fixed, **kwargs)  # chi2(11)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **fixed, **kwargs)
    assert out.speculation_stats.drafted_tokens > 0


def test_a_selector_is_added_to_a_dflash_checkpoint_as_a_no_op(tmp_path):
    target = tiny_target("llama", seed=2)
    plain = tiny_drafter(target, seed=2)
    plain.save_pretrained(tmp_path / "dflash")
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "dflash", target=target, selector_rank=4)
    assert drafter.selector is not None and drafter.selector.candidate_codes.abs().sum() == 0
    ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_drafts(plain, target, ids), _drafts(drafter, target, ids))
    # a checkpoint whose config asks for a selector that its weights lack is refused unless adding one was asked
    drafter.save_pretrained(tmp_path / "dflash2")
    (tmp_path / "dflash2" / "model.safetensors").write_bytes((tmp_path / "dflash" / "model.safetensors").read_bytes())
    with pytest.raises(OSError, match="incomplete"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "dflash2", target=target)


@pytest.mark.every_step_speculates("asserts the trees the selector drafted")
def test_selector_trees_branch_coherently_and_greedy_stays_identical():
    """With a tree budget, the selector gives the branches: each node's children are its slot's candidates ranked
    by the selector given that node's own token."""
    from hf_diffspec.runtime.drafting_best_first import build_selector_tree, selector_tables, unpack_selector_table

    target = tiny_target("llama", seed=4)
    _, drafter = _with_selector(target, seed=4, scramble=True, block_size=6, draft_tree_budget=8, draft_tree_width=2)
    torch.manual_seed(0)
    hidden, logits = torch.randn(5, drafter.config.hidden_size), torch.randn(5, 128)
    table = selector_tables(torch.tensor([7]), hidden[None], logits[None], drafter.selector, 4, max_children=2)
    tree = build_selector_tree(7, unpack_selector_table(table[0].tolist(), 5, 4, 2), 5, budget=8,
                               device=logits.device)
    assert len(tree) == 9 and tree.parents[1] == 0
    top = logits.topk(4, dim=-1)
    for node in range(len(tree)):
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if kids:
            depth = tree.depths[node]
            scores = drafter.selector(hidden[depth], tree.tokens[node], top.indices[depth], top.values[depth])
            ranked = top.indices[depth][scores.argsort(descending=True)].tolist()
            assert tree.tokens[kids].tolist() == ranked[: len(kids)]
    for seed in range(3):
        ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and out.speculation_stats.drafted_tokens > 0


@pytest.mark.parametrize("vocab,top_k", [(4, 5), (50, 1), (50, 3)])
def test_selector_tables_unpack_to_each_slots_candidates_and_each_parents_ranked_children(vocab, top_k):
    """One row of `selector_tables`, read back (`unpack_selector_table`): slot d's top-k candidates, and per parent
    candidate its children's probabilities and candidate indices, best first; a vocabulary smaller than `top_k` (4
    against 5) has fewer candidates, which the row's length tells."""
    from hf_diffspec.runtime.drafting_best_first import selector_tables, unpack_selector_table

    _, drafter = _with_selector(tiny_target("llama", seed=0), top_k=top_k, scramble=True)
    generator = torch.Generator().manual_seed(vocab)
    depth, max_children = 3, 2
    logits = torch.randn(2, depth, vocab, generator=generator)
    hidden = torch.randn(2, depth, drafter.config.hidden_size, generator=generator)
    roots = torch.tensor([1, 2])
    with torch.no_grad():
        table = selector_tables(roots, hidden, logits, drafter.selector, top_k, max_children)
        k = min(top_k, vocab)
        top = logits.topk(k, dim=-1)
        for r in range(2):
            probs_of, order_of, tokens_of = unpack_selector_table(table[r].tolist(), depth, top_k, max_children)
            assert tokens_of == top.indices[r].tolist()
            for d in range(depth):
                parents = roots[r].expand(k) if d == 0 else top.indices[r, d - 1]
                scores = drafter.selector(hidden[r, d].expand(k, -1), parents, top.indices[r, d].expand(k, -1),
                                          top.values[r, d].expand(k, -1))
                expected, order = scores.softmax(-1).sort(-1, descending=True)
                m = min(max_children, k)
                assert torch.tensor(probs_of[d]) == pytest.approx(expected[:, :m], abs=1e-6)
                assert order_of[d] == order[:, :m].tolist()


def test_a_selector_tree_takes_each_nodes_children_from_its_own_tokens_table_best_first():
    """`build_selector_tree` from hand-made tables: a node's children come from the table of the candidate it holds,
    a path's score is the product of its conditional probabilities, nodes are taken best first within the budget, the
    cost model's count (given the reach scores in the order taken) cuts the tree, and the tree is made on the given
    device."""
    from hf_diffspec.runtime.drafting_best_first import build_selector_tree

    tokens_of = [[10, 11, 12], [20, 21, 22]]  # slot 0's candidates, slot 1's
    probs_of = [[[0.5, 0.3, 0.2]] * 3, [[0.9, 0.1, 0.0], [0.5, 0.5, 0.0], [0.6, 0.4, 0.0]]]  # per parent candidate
    order_of = [[[0, 1, 2]] * 3, [[0, 1, 2], [1, 0, 2], [2, 0, 1]]]  # a node holding 11 ranks 21 first, 12 ranks 22
    tables = (probs_of, order_of, tokens_of)
    tree = build_selector_tree(5, tables, depth=2, budget=4, device="cpu")
    # 10 (0.5), then its child 20 (0.5 * 0.9) before the root's second child 11 (0.3), then its third, 12 (0.2)
    assert tree.token_list == [5, 10, 20, 11, 12] and tree.parents == [-1, 0, 1, 0, 0]
    assert tree.confidences == pytest.approx([0.5, 0.45, 0.3, 0.2])
    wide = build_selector_tree(5, tables, depth=2, budget=7, device="cpu")
    # then 11's children 21 and 20 (0.3 * 0.5 each), and 12's first child, 22 (0.2 * 0.6)
    assert wide.token_list == [5, 10, 20, 11, 12, 21, 20, 22] and wide.parents == [-1, 0, 1, 0, 0, 3, 3, 4]
    seen = []
    cut = build_selector_tree(5, tables, depth=2, budget=7, device=torch.device("meta"),
                              node_count=lambda reach: seen.append(reach) or 3)
    assert seen == [pytest.approx([0.5, 0.45, 0.3, 0.2, 0.15, 0.15, 0.12])]  # every node the budget allows, in order
    assert cut.parents == [-1, 0, 1] and cut.confidences == pytest.approx([0.5, 0.45])
    assert cut.tokens.device.type == "meta"


def test_selector_trees_keep_within_each_rows_limit_and_hold_the_cost_models_node_count():
    """`_selector_trees`, every row of a step from its read tables: a row with no room left verifies its anchor alone,
    a row with room for one draft gets depth-1 candidates only, another the budget's best-first tree; with the cost
    model's node count (asked per row, given the step's rows) each tree holds that many nodes."""
    target = tiny_target("llama", seed=3)
    _, drafter = _with_selector(target, seed=3, scramble=True, block_size=6, draft_tree_budget=8, draft_tree_width=2)
    generator = candidate_generator_for(drafter, target, num_draft_tokens=5)
    hidden = torch.randn(3, 5, drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        table = generator._selector_table(torch.tensor([5, 6, 7]), hidden, drafter.compute_logits(hidden)).tolist()

    trees = generator._selector_trees([5, 6, 7], table, 5, [1, 0, 5])
    assert [t.tokens[0].item() for t in trees] == [5, 6, 7]
    assert len(trees[1]) == 1
    assert len(trees[0]) > 1 and trees[0].max_depth == 1
    assert len(trees[2]) == 9 and trees[2].max_depth > 1  # the budget's 8 drafts past the anchor
    asked = []
    generator.policy.tree_node_count = lambda reach, rows: asked.append((len(reach), rows)) or 3
    cut = generator._selector_trees([5, 6, 7], table, 5, [1, 0, 5])
    assert [len(t) for t in cut] == [3, 1, 3] and asked == [(len(trees[0]) - 1, 3), (8, 3)]
    assert cut[2].tokens.tolist() == trees[2].tokens[:3].tolist()


def test_selector_chains_draw_their_drafts_from_the_law_they_carry():
    """`SelectorCandidateGenerator._pick`: greedy, the selector's argmax path with each slot's confidence the
    largest probability of its law (over the candidates, per slot) and no law; sampling, drafts drawn from the
    selector's law at the call's temperature, which the chain carries for rejection sampling (a draft that is not a
    draw from the law it carries makes rejection sampling inexact)."""
    from transformers import TemperatureLogitsWarper

    from hf_diffspec.runtime.drafting import SelectorCandidateGenerator
    from hf_diffspec.runtime.sampling import SamplingLaws

    target = tiny_target("llama", seed=3, vocab_size=12, sharpen=5)
    _, drafter = _with_selector(target, top_k=3, seed=3, scramble=True)
    generator = candidate_generator_for(drafter, target, num_draft_tokens=3)
    assert type(generator) is SelectorCandidateGenerator
    hidden = torch.randn(2, 4, drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    roots = torch.tensor([5, 6])
    with torch.no_grad():
        logits = drafter.compute_logits(hidden)
        drafts, confidences, laws = generator._pick(hidden, logits, roots)
        expected, candidates, chosen = drafter.select_drafts(hidden, logits, roots)
        assert laws is None and torch.equal(drafts, expected)
        torch.testing.assert_close(confidences, chosen.max(-1).values)  # (rows, slots)
        generator.sampling = SamplingLaws([TemperatureLogitsWarper(0.5)])
        torch.manual_seed(0)
        picks = [generator._pick(hidden, logits, roots) for _ in range(400)]
    _, _, first = picks[0]
    # the law: the selector's at temperature 0.5, over slot 0's candidates given the anchor (later slots' laws
    # depend on the previous draw)
    scores = drafter.selector(hidden[:, 0], roots, candidates[:, 0], logits.float().topk(3, dim=-1).values[:, 0])
    torch.testing.assert_close(first.probs[:, 0], (scores / 0.5).softmax(-1))
    assert torch.equal(first.ids, candidates)
    assert not torch.allclose(first.probs[:, 0], scores.softmax(-1), atol=1e-3)  # the temperature is applied
    counts = torch.zeros(2, 3)
    for drafts, _, _ in picks:
        counts[torch.arange(2), (candidates[:, 0] == drafts[:, :1]).float().argmax(-1)] += 1
    expected_counts = 400 * first.probs[:, 0]
    chi2 = (((counts - expected_counts) ** 2) / expected_counts.clamp(min=1e-9)).sum(-1)
    assert (chi2 < 16.3).all(), (counts, expected_counts)  # chi2(2) at 0.9997


def test_dflash2_trees_come_from_the_selector_when_greedy_and_from_the_marginals_when_sampling():
    """A best-first tree drafter with a candidate selector builds its greedy trees from the selector's tables; when
    sampling, and without a selector, from the drafter's marginals (`_uses_selector`)."""
    from hf_diffspec.runtime.drafting import BestFirstTreeCandidateGenerator
    from hf_diffspec.runtime.sampling import SamplingLaws

    target = tiny_target("llama", seed=3)
    plain, drafter = _with_selector(target, seed=3, block_size=6, draft_tree_budget=8, draft_tree_width=2)
    with_selector = candidate_generator_for(drafter, target, num_draft_tokens=5)
    assert type(with_selector) is BestFirstTreeCandidateGenerator and with_selector._uses_selector()
    with_selector.sampling = SamplingLaws([])
    assert not with_selector._uses_selector()
    assert not candidate_generator_for(plain, target, num_draft_tokens=5)._uses_selector()
