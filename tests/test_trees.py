"""Best-first draft trees from one drafter pass (DDTree-style): shape, losslessness (greedy and sampling), batches."""

import pytest
import torch

from hf_diffspec.runtime.drafting_best_first import best_first_shape, build_best_first_tree, laws_to_device
from hf_diffspec.runtime.drafting import BestFirstTreeCandidateGenerator
from hf_diffspec.runtime.tree import CandidateTree, TreeLayout
from helpers import NoisyOracle, assert_sampling_matches_plain, install_oracle, random_ids, tiny_drafter, tiny_target


def test_best_first_shape_spends_the_budget_where_acceptance_is_likely():
    # slot 1 is sure (0.9), slot 2 hesitates between two tokens (0.45 / 0.4), slot 3 is sure again
    sorted_probs = [[0.9, 0.05, 0.03], [0.45, 0.4, 0.1], [0.95, 0.03, 0.01]]
    shape = best_first_shape(sorted_probs, budget=6)
    paths = [p for p, _ in shape]
    scores = [s for _, s in shape]
    assert scores == sorted(scores, reverse=True)
    assert all(p[:-1] in paths[:i] or len(p) == 1 for i, p in enumerate(paths))  # ancestors come first
    assert len(shape) == 6 and paths[:5] == [(0,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0)]  # both readings of slot 2
    assert scores[1] == pytest.approx(0.9 * 0.45)
    chain = best_first_shape([slot[:1] for slot in sorted_probs], budget=10)  # width 1: a chain
    assert [p for p, _ in chain] == [(0,), (0, 0), (0, 0, 0)]
    assert [s for _, s in chain] == pytest.approx([0.9, 0.405, 0.38475])
    assert best_first_shape(sorted_probs, budget=10, max_children=1) == chain  # the widest branching, capped
    # a token its law cannot draw (probability 0) is never a node, whatever the budget
    assert [p for p, _ in best_first_shape([[0.6, 0.4, 0.0], [1.0, 0.0, 0.0]], budget=10)] == \
        [(0,), (0, 0), (1,), (1, 0)]
    assert best_first_shape(sorted_probs, budget=0) == [] and best_first_shape([], budget=4) == []
    assert best_first_shape(sorted_probs, budget=1) == [((0,), 0.9)]
    assert len(best_first_shape(sorted_probs, budget=50)) == 3 + 3 ** 2 + 3 ** 3  # every path: each last rank too


def _random_tree(size: int, gen: torch.Generator) -> CandidateTree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    return CandidateTree(list(range(100, 100 + size)), parents)


@pytest.mark.parametrize("sizes", [[9, 5, 1], [70, 12], [6, 6], [40, 64]],
                         ids=["trees", "wide-trees", "one-size", "wider-than-a-word"])
@pytest.mark.parametrize("chains", [False, True])
def test_tree_layout_ancestors_depths_and_padding(sizes, chains):
    """Every row's ancestor matrix is its tree's root paths (a padding slot: itself only), whether built from the
    host's bits (trees of up to 62 nodes) or by rounds on the device (larger ones)."""
    gen = torch.Generator().manual_seed(sum(sizes))
    trees = [CandidateTree(list(range(n)), list(range(-1, n - 1))) if chains else _random_tree(n, gen) for n in sizes]
    layout = TreeLayout.of(trees, "cpu")
    n = max(sizes)
    assert layout.ancestors.shape == (len(trees), n, n) and layout.uniform_chains == (chains and len(set(sizes)) == 1)
    for row, tree in enumerate(trees):
        expected = torch.eye(n, dtype=torch.bool)
        for node in range(len(tree)):
            expected[node] = False
            expected[node, tree.path_to(node)] = True
        assert torch.equal(layout.ancestors[row], expected)
        assert layout.depths[row].tolist() == tree.depths + [-1] * (n - len(tree))
        assert layout.real[row].tolist() == [True] * len(tree) + [False] * (n - len(tree))
        assert layout.tokens[row].tolist() == tree.token_list + [tree.token_list[0]] * (n - len(tree))
    assert layout.levels.tolist() == list(range(max(t.max_depth for t in trees) + 1))


def test_a_tree_sampled_on_the_host_draws_each_node_by_inverting_its_law_without_earlier_siblings():
    """Compact laws on the host (`_sampled_tree`): each node's token is where its uniform number falls in its slot's
    law with the parent's earlier children taken out and the rest renormalised; a node whose law has no token left is
    skipped, and so are the nodes below it; the cost model's count cuts the shape first. Each node carries the law
    it was drawn from."""
    ids = [[10, 11, 12, -1], [20, 21, -1, -1], [30, 31, -1, -1]]
    laws = [[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
    shape = [((0,), 0.5), ((0, 0), 0.5), ((1,), 0.25), ((0, 1), 0.1), ((0, 1, 0), 0.05), ((2,), 0.02)]
    uniform = [0.5, 0.3, 0.75, 0.2, 0.4, 0.9]
    tree = build_best_first_tree(5, None, budget=6, sample=True, max_children=4, ranked=(laws, ids), shape=shape,
                                 device="cpu", uniform=uniform)
    # (0,): 0.5 is where token 11's interval [0.5, 0.75) starts. (0, 0): token 20. (1,): without 11, [2/3, 0, 1/3]:
    # 0.75 -> 12. (0, 1): its slot's law holds only 20, drawn already: skipped, and (0, 1, 0) below it. (2,): 10 is
    # the root's last token left
    assert tree.token_list == [5, 11, 20, 12, 10] and tree.parents == [-1, 0, 1, 0, 0]
    assert tree.confidences == [0.5, 0.5, 0.25, 0.02]
    assert tree.host_laws[1:, :4].tolist() == [ids[0], ids[1], ids[0], ids[0]]
    assert tree.host_laws[1:, 4:].flatten().tolist() == pytest.approx([0.5, 0.25, 0.25, 0.0, 1.0, 0.0, 0.0, 0.0,
                                                                       2 / 3, 0.0, 1 / 3, 0.0, 1.0, 0.0, 0.0, 0.0])
    cut = build_best_first_tree(5, None, budget=6, node_count=lambda reach: 3, sample=True, max_children=4,
                                ranked=(laws, ids), shape=shape, device=torch.device("meta"), uniform=uniform)
    assert cut.token_list == [5, 11, 20] and cut.tokens.device.type == "meta"  # made where the step runs
    # a uniform number at the law's rounded total (its float sum below 1) falls past the last token with mass, onto
    # the padding: the draw steps back to that last token, never past the law's end
    padded, padded_ids = [[0.3] * 5 + [0.0]], [[10, 11, 12, 13, 14, -1]]
    total = 0.0
    for p in padded[0]:
        total += p / sum(padded[0])
    assert total < 1.0
    edge = build_best_first_tree(5, None, budget=1, sample=True, max_children=4, ranked=(padded, padded_ids),
                                 shape=[((0,), 0.3)], device="cpu", uniform=[total])
    assert edge.token_list == [5, 14]


def test_a_batchs_host_laws_go_to_the_device_in_one_copy_padded_to_the_widest():
    """Trees sampled on the host carry their nodes' laws there (ids, then probabilities); `laws_to_device` gives
    each its `draft_laws` from one packed copy, every law padded to the batch's widest with id -1 and probability 0
    (no mass), and drops the host copy; a tree without host laws is left as it is."""
    import numpy as np

    narrow = CandidateTree([5, 10], [-1, 0])
    narrow.host_laws = np.array([[-1, -1, 0.0, 0.0], [10, 11, 0.6, 0.4]])
    wide = CandidateTree([5, 22, 20], [-1, 0, 0])
    wide.host_laws = np.array([[-1, -1, -1, 0.0, 0.0, 0.0], [20, 21, 22, 0.5, 0.3, 0.2], [20, 21, 22, 0.0, 0.6, 0.4]])
    greedy = CandidateTree([5, 1], [-1, 0])
    laws_to_device([wide, greedy, narrow], "cpu")  # the narrow law packed after the wide one
    assert narrow.host_laws is None and wide.host_laws is None and greedy.draft_laws is None
    assert narrow.draft_laws.ids.tolist() == [[-1, -1, -1], [10, 11, -1]]
    assert narrow.draft_laws.probs.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 0.6, 0.4, 0.0])
    assert wide.draft_laws.ids.tolist() == [[-1, -1, -1], [20, 21, 22], [20, 21, 22]]
    assert wide.draft_laws.probs.flatten().tolist() == pytest.approx([0, 0, 0, 0.5, 0.3, 0.2, 0, 0.6, 0.4])
    elsewhere = CandidateTree([5, 10], [-1, 0])
    elsewhere.host_laws = np.array([[-1, -1, 0.0, 0.0], [10, 11, 0.6, 0.4]])
    laws_to_device([elsewhere], torch.device("meta"))  # the laws go where the step runs
    assert elsewhere.draft_laws.ids.device.type == "meta" and elsewhere.draft_laws.probs.shape == (2, 2)


def test_sampled_trees_draw_distinct_siblings_from_known_distributions():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(3, 10), -1)
    tree = build_best_first_tree(5, probs, budget=9, sample=True, max_children=3)
    for node, children in enumerate(tree.children):
        assert len(children) == len(set(children))  # distinct tokens per parent
    greedy = build_best_first_tree(5, probs, budget=9, sample=False, max_children=3)
    assert tree.parents == greedy.parents  # the shape does not depend on what was drawn
    assert not tree.draft_laws.probs[0].any()  # the root was not drawn
    assert torch.allclose(tree.draft_laws.probs[1:].sum(-1), torch.ones(len(tree) - 1))
    assert greedy.draft_laws is None  # greedy drafts are point masses
    shape = best_first_shape(probs.topk(3, -1).values.tolist(), budget=9)
    assert greedy.confidences == [score for _, score in shape]  # each node's reach score
    ranked = (probs.topk(3, -1).values.tolist(), probs.topk(3, -1).indices.tolist())
    elsewhere = build_best_first_tree(5, torch.empty(3, 10, device="meta"), budget=9, sample=False, max_children=3,
                                      ranked=ranked)  # the tokens made on the laws' device
    assert elsewhere.tokens.device.type == "meta" and elsewhere.parents == greedy.parents
    for sample in (True, False):  # the cost model's count (root included) cuts the best-first order
        cut = build_best_first_tree(5, probs, budget=9, node_count=lambda reach: 4, sample=sample, max_children=3)
        assert cut.parents == greedy.parents[:4] and cut.confidences == greedy.confidences[:3]


def test_sampled_trees_stop_a_nodes_children_where_its_law_has_no_tokens_left():
    """A low temperature leaves a slot's law with fewer tokens than the tree may have siblings (here 2 of 3): the
    shape plans no third child (its score is 0) and nothing below it (they raised `invalid multinomial distribution`
    once), whatever the first two drew, and the rest of the tree is as the shape says."""
    probs = torch.zeros(2, 6)
    probs[0, [2, 3]] = torch.tensor([0.9, 0.1])  # two tokens only
    probs[1] = torch.softmax(torch.arange(6.0), -1)
    shape = best_first_shape(probs.topk(3, -1).values.tolist(), budget=12)
    assert sum(len(path) == 1 for path, _ in shape) == 2  # two children of the root: the third has no token
    for seed in range(20):
        torch.manual_seed(seed)
        tree = build_best_first_tree(5, probs, budget=12, sample=True, max_children=3)
        assert sorted(tree.children[0]) == [2, 3]
        assert torch.allclose(tree.draft_laws.probs[1:].sum(-1), torch.ones(len(tree) - 1))
        assert len(tree) == 1 + len([p for p, _ in shape if p[0] < 2])


def _tree_drafter(target, budget=8, width=3, **kw):
    drafter = tiny_drafter(target, block_size=5, **kw)
    drafter.config.draft_tree_budget = budget
    drafter.config.draft_tree_width = width
    return drafter


def _oracle_marginals(monkeypatch, references, vocab, seed=0):
    """Drafter marginals that know the target's continuation but rank it first only half of the time (second
    otherwise), so chains often fail where a tree's second branch is accepted; records the trees proposed."""
    trees, rng = [], torch.Generator().manual_seed(seed)
    original = BestFirstTreeCandidateGenerator.propose

    def propose(self, root_tokens, root_positions, remaining, ahead=None):
        self.oracle_positions = root_positions
        proposed = original(self, root_tokens, root_positions, remaining, ahead)
        trees.extend(proposed)
        return proposed

    def distributions(self, logits):
        rows, depth, _ = logits.shape
        probs = torch.full((rows, depth, vocab), 0.1 / (vocab - 2))
        for r, position in enumerate(self.oracle_positions):
            for k in range(depth):
                truth = references[r][position + 1 + k] if position + 1 + k < len(references[r]) else 0
                decoy = (truth + 1 + int(torch.randint(vocab - 1, (1,), generator=rng))) % vocab
                first_is_truth = bool(torch.rand(1, generator=rng) < 0.5)
                probs[r, k, truth] = 0.5 if first_is_truth else 0.4
                probs[r, k, decoy] = 0.4 if first_is_truth else 0.5
        return probs

    monkeypatch.setattr(BestFirstTreeCandidateGenerator, "propose", propose)
    monkeypatch.setattr(BestFirstTreeCandidateGenerator, "_distributions", distributions)
    return trees


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "eager")])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.every_step_speculates("asserts tau of best-first trees")
def test_best_first_trees_greedy_identical_to_plain_generate(monkeypatch, kind, attn, seed):
    target = tiny_target(kind, seed=seed, vocab_size=24, attn=attn)
    drafter = _tree_drafter(target, seed=seed)
    ids = torch.randint(2, 24, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.1)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    trees = _oracle_marginals(monkeypatch, [row[~pad].tolist() for row, pad in zip(ref, torch.cat(
        [mask == 0, torch.zeros(2, 30, dtype=torch.bool)], 1))], vocab=24, seed=seed)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    assert any(not t.is_chain for t in trees) and all(len(t) <= 9 for t in trees)
    tree_tau = out.speculation_stats.tau
    drafter.config.draft_tree_width = 1  # the same marginals as a chain: only first-ranked tokens
    chain = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(chain.sequences, ref)
    assert tree_tau > chain.speculation_stats.tau  # the second-ranked branches are accepted too


@pytest.mark.every_step_speculates("asserts drafts were made")
def test_best_first_tree_sampling_is_the_targets_distribution(monkeypatch):
    vocab = 12
    target = tiny_target("llama", seed=3, vocab_size=vocab, sharpen=5)
    drafter = _tree_drafter(target, budget=6, width=3, seed=3)
    ids = torch.randint(2, vocab, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=0)
    assert_sampling_matches_plain(target, ids, vocab, drafter, limit=33, **kwargs)  # 0.999 quantile of chi2(11) ~ 31.3
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert out.speculation_stats.drafted_tokens > 0


def test_a_small_tree_computes_distributions_only_for_the_slots_it_can_reach(monkeypatch):
    """A tree of B drafted nodes is at most B deep: the drafter's LM head runs over B slots, not the whole block."""
    target = tiny_target("llama", seed=0, vocab_size=24)
    drafter = tiny_drafter(target, block_size=8, draft_tree_budget=2)
    depths = []
    original = BestFirstTreeCandidateGenerator._distributions

    def distributions(self, logits):
        depths.append(logits.shape[1])
        return original(self, logits)

    monkeypatch.setattr(BestFirstTreeCandidateGenerator, "_distributions", distributions)
    ids = torch.randint(2, 24, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False), ref)
    assert depths and max(depths) <= 2


def _record_proposals(monkeypatch, cls):
    """Trees proposed and slots whose draft logits were computed, per step."""
    trees, slots = [], []
    propose, slot_logits = cls.propose, cls._slot_logits

    def recording_propose(self, *args):
        out = propose(self, *args)
        trees.append([(t.tokens.tolist(), t.parents) for t in out])
        return out

    def recording_slot_logits(self, *args):
        logits = slot_logits(self, *args)
        slots.append(logits.shape[1])
        return logits

    monkeypatch.setattr(cls, "propose", recording_propose)
    monkeypatch.setattr(cls, "_slot_logits", recording_slot_logits)
    return trees, slots


@pytest.mark.every_step_speculates("compares the trees of every step")
def test_trees_from_slot_by_slot_logits_are_the_trees_of_the_whole_block(monkeypatch):
    """The LM head runs over the block's slots in chunks (4, 8, 15) and stops once the budget's tree stays above the
    deepest slot computed: by best-first closure that is exactly the tree of the whole block, at less cost. (Chunks
    are taken past `ONE_PASS_SLOTS` rows x slots, as for a large batch; no pass is run ahead then.)"""
    from hf_diffspec.runtime import drafting

    monkeypatch.setattr(drafting, "ONE_PASS_SLOTS", 0)
    target = tiny_target("llama", seed=1, vocab_size=24)
    drafter = tiny_drafter(target, block_size=16, seed=1, draft_tree_budget=12, draft_tree_width=2)
    # a sharpened drafter: some trees are deep (the later chunks are needed), some wide (they are not)
    monkeypatch.setattr(BestFirstTreeCandidateGenerator, "_distributions",
                        lambda self, logits: (logits.float() * 8).softmax(-1))
    ids = torch.randint(2, 24, (2, 6), generator=torch.Generator().manual_seed(1))
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    trees, slots = _record_proposals(monkeypatch, BestFirstTreeCandidateGenerator)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False), ref)
    chunked, chunked_slots = list(trees), list(slots)
    monkeypatch.setattr(BestFirstTreeCandidateGenerator, "_slot_logits",
                        lambda self, hidden, span, needs_more: self.first.drafter.compute_logits(hidden[:, :span]))
    whole, _ = _record_proposals(monkeypatch, BestFirstTreeCandidateGenerator)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False), ref)
    assert chunked == whole
    assert 4 in chunked_slots and max(chunked_slots) > 4  # both ways out of the loop were taken


@pytest.mark.parametrize("sharpness", [8.0, 60.0])
@pytest.mark.every_step_speculates("counts the slots each step computed")
def test_chains_sized_by_the_cost_model_compute_only_the_slots_they_may_verify(monkeypatch, sharpness):
    from hf_diffspec.runtime import control_policy, drafting
    from hf_diffspec.runtime.control_cost import VerifyCost
    from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator

    monkeypatch.setattr(drafting, "ONE_PASS_SLOTS", 0)  # growing chunks, as for a large batch
    target = tiny_target("llama", seed=2, vocab_size=24)
    drafter = tiny_drafter(target, block_size=16, seed=2)
    # verifying costs little, so the chain length follows the drafter's confidences: a hesitant drafter (sharpness
    # 8) drafts short chains, a confident one (60) long ones
    monkeypatch.setattr(control_policy, "verify_cost_for",
                        lambda target, graphs=False: VerifyCost({1: {1: 1.0, 16: 1.3}}))
    monkeypatch.setattr(DiffusionCandidateGenerator, "_distributions",
                        lambda self, logits: (logits.float() * sharpness).softmax(-1))
    ids = torch.randint(2, 24, (2, 6), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    trees, slots = _record_proposals(monkeypatch, DiffusionCandidateGenerator)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False), ref)
    verified = [max(len(tokens) for tokens, _ in step) - 1 for step in trees]
    assert all(v <= s for v, s in zip(verified, slots))
    if sharpness < 10:  # chains of 1-2 drafts: the head never ran past its first chunk
        assert max(slots) == 4 and len(slots) > 10
    else:  # long chains: later chunks were computed when the chain reached them
        assert max(slots) > 4 and max(verified) > 4


@pytest.mark.parametrize("compact_after", [4, 10_000])
@pytest.mark.every_step_speculates("asserts accepted paths of oracle trees")
def test_accepted_paths_stay_in_place_and_hidden_nodes_are_dropped_in_batches(monkeypatch, compact_after):
    """Every accepted path sits behind wrong siblings (never its tree's first slots), so the cache holds tree nodes
    that no row accepted: hidden per row, then dropped by a compaction every `compact_after` hidden slots (4: many
    times a call) or only at the end (10,000). Both are plain generate's tokens, two rows and one; the cache returned
    at batch 1 holds the committed tokens alone and goes on exactly like plain generate's."""
    from hf_diffspec.runtime import verifier as verifier_module

    monkeypatch.setattr(verifier_module, "COMPACT_AFTER_HIDDEN_SLOTS", compact_after)
    hidden, moves = [], []
    compact = verifier_module.TargetVerifier.compact

    def hidden_slots(verifier):
        return verifier.valid.shape[1] - verifier._tail_start - max(verifier._tail_counts, default=0)

    def recording_compact(self, *args):
        hidden.append(hidden_slots(self))
        compact(self, *args)
        moves.append(hidden[-1] - hidden_slots(self))

    monkeypatch.setattr(verifier_module.TargetVerifier, "compact", recording_compact)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    for rows in (2, 1):
        ids = random_ids(4, 8, rows=rows)
        reference = target.generate(ids, max_new_tokens=40, do_sample=False)
        install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.2, branches=2, seed=rows))
        hidden.clear(), moves.clear()
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference[:, :out.sequences.shape[1]])
        assert out.speculation_stats.tau > 1.5 and max(hidden) > 0
        assert sum(m > 0 for m in moves) > (2 if compact_after == 4 else 0)
        assert max(hidden) < compact_after + 6 * 3  # hidden slots never outgrow the threshold by more than a tree
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1  # the last token is not cached yet
    following = target.generate(out.sequences, cache=out.cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(following, reference[:, : following.shape[1]])


def test_a_sampled_prefix_tree_skips_a_branch_whose_law_holds_only_the_main_draft():
    """D²SD, sampling: where the second drafter puts all its mass on the main draft (a low temperature), there is
    no alternative to draw; the branch is left out (it raised `invalid multinomial distribution` before)."""
    from hf_diffspec.runtime.drafting_prefix_tree import plan_rows, plan_table, prefix_tree, unpack_plans

    first = torch.zeros(3, 6)
    first[:, 2] = 1.0  # the main chain: 2, 2, 2
    branch = torch.zeros(2, 6)
    branch[:, 2] = 1.0  # the second drafter agrees: nothing else to draft
    plan = plan_rows(first[None], torch.tensor([3]), num_branches=1, sample=True)
    table, alternative = plan_table(plan, branch[None, None], sample=True)
    plans, branches = unpack_plans(table.tolist(), plan, first[None], branch[None, None], alternative, limits=[3])
    assert plans[0].tokens == [2, 2, 2] and plans[0].picks == [0]
    assert branches[0][0].alternative is None
    tree = prefix_tree(5, plans[0], branches[0], budget=8, sample=True)
    assert tree.tokens.tolist() == [5, 2, 2, 2] and tree.is_chain
    assert torch.equal(tree.draft_laws.probs[1:], first)  # the main chain's nodes keep the first drafter's laws


def test_best_first_trees_keep_within_each_rows_limit():
    """`BestFirstTreeCandidateGenerator._trees`, every row of a step from its ranked slots: a row with room for one
    draft gets depth-1 nodes only, a row with none its anchor alone, another the budget's best-first tree."""
    from hf_diffspec.runtime.drafting import candidate_generator_for

    target = tiny_target("llama", seed=4)
    drafter = tiny_drafter(target, block_size=6, seed=4, draft_tree_budget=8, draft_tree_width=2)
    generator = candidate_generator_for(drafter, target, num_draft_tokens=5)
    assert isinstance(generator, BestFirstTreeCandidateGenerator)
    hidden = torch.randn(3, 5, drafter.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        probs, table = generator._ranked_table(drafter.compute_logits(hidden), 2, 8)
    trees = generator._trees([5, 6, 7], probs, [generator._unpack(row, 5) for row in table.tolist()], [1, 0, 5], {})

    assert [t.tokens[0].item() for t in trees] == [5, 6, 7]
    assert len(trees[0]) == 3 and trees[0].max_depth == 1  # slot 1's two ranked tokens
    assert len(trees[1]) == 1
    assert len(trees[2]) == 9 and trees[2].max_depth > 1
