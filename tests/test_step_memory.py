"""Per-step memory that does not scale with vocabulary x verified slots beyond the logits themselves: at 64 rows x 16
slots the step's extra allocations (CPU allocator events, counted by the profiler: load-independent) stay a small
fraction of the verify logits."""

import pytest
import torch

import hf_diffspec
from torch.profiler import ProfilerActivity, profile

from hf_diffspec.runtime import drafting
from hf_diffspec.runtime.batch import BatchState
from hf_diffspec.runtime.sampling import SamplingLaws
from helpers import random_ids, tiny_drafter, tiny_target

ROWS, SLOTS, VOCAB = 64, 16, 1024


def peak_extra_bytes(fn):
    """(fn(), the most bytes allocated by `fn` and alive at once) from the profiler's allocation and free events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for _, size in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                          if e.self_cpu_memory_usage):
        live += size
        peak = max(peak, live)
    return result, peak


@pytest.fixture
def bf16_pair():
    target = tiny_target("llama", seed=5, vocab_size=VOCAB, layers=1).to(torch.bfloat16)
    return target, tiny_drafter(target, block_size=SLOTS, seed=5).to(torch.bfloat16)


@pytest.mark.every_step_speculates("every step verifies 64 rows x 16 slots")
def test_greedy_acceptance_makes_no_copy_of_the_verify_logits(bf16_pair, monkeypatch):
    target, drafter = bf16_pair
    accept, measured = BatchState.accept, []

    def measuring(self, trees, logits, layout=None, before_read=None):
        if measured or logits.shape[1] < SLOTS:
            return accept(self, trees, logits, layout, before_read)
        paths, peak = peak_extra_bytes(lambda: accept(self, trees, logits, layout, before_read))
        measured.append(peak / logits.nbytes)
        return paths

    monkeypatch.setattr(BatchState, "accept", measuring)
    ids = random_ids(5, 8, vocab=VOCAB, rows=ROWS)
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=SLOTS + 1,
                    num_assistant_tokens=SLOTS - 1, do_sample=False)
    assert measured and max(measured) < 0.05  # a float32 copy would be 2x the bf16 logits


def test_drafter_logits_of_a_small_batch_take_one_pass_of_the_lm_head():
    """Growing chunks (4, 8, 15 slots) until the cost model has what it needs bound a large batch's memory; a small
    one takes every slot in one pass (one read of the LM head's weights)."""
    target = tiny_target("llama", seed=6)
    generator = drafting.candidate_generator_for(tiny_drafter(target, block_size=SLOTS, seed=6), target)
    drafter, calls = generator.first.drafter, []
    compute = drafter.compute_logits
    drafter.compute_logits = lambda hidden: calls.append(hidden.shape[:2]) or compute(hidden)
    hidden_size = target.config.hidden_size
    for rows in (2, 64):
        logits = generator._slot_logits(torch.randn(rows, SLOTS - 1, hidden_size), SLOTS - 1, lambda logits: True)
        assert logits.shape[:2] == (rows, SLOTS - 1)
    assert calls == [(2, 15), (64, 4), (64, 4), (64, 7)]


def test_d2sd_branches_read_their_rows_context_without_a_copy_per_branch():
    """D²SD re-drafts several branches per row against the row's cached context: the branches of a row share it
    through the mask (side by side in the row's sequence), so a step allocates less than one copy of the context's
    K/V, where a copy per branch (3 per row here) allocated three."""
    from hf_diffspec.runtime.drafting import DrafterContext

    target = tiny_target("llama", seed=7)
    torch.manual_seed(7)
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=4, block_size=8)
    context = DrafterContext(drafter)
    rows, length = 8, 512
    features = torch.randn(rows, length, drafter.fc.in_features)
    context.pending.append((features, torch.arange(length).expand(rows, -1), torch.ones(rows, length, dtype=torch.bool),
                            None))
    roots, positions = random_ids(7, rows, rows=1)[0], torch.full((rows,), length)
    drafts = torch.full((rows, 7), 5)
    picks = torch.tensor([1, 2, 3]).expand(rows, -1)  # three branches a row, after prefixes of 1, 2 and 3 drafts
    with torch.no_grad():  # as the loop drafts
        context.draft_block(roots, positions, 8)  # caches the context
        hidden, peak = peak_extra_bytes(lambda: context.draft_branches(roots, positions, drafts, picks, 8))
    cached = sum(layer.keys.nbytes + layer.values.nbytes for layer in context.cache.layers)
    assert hidden.shape == (rows, 3, 8, drafter.config.hidden_size)
    assert peak < cached, (peak, cached)


def test_finished_rows_leave_the_drafters_pending_features_without_a_copy_per_drop():
    """Steps without a drafter forward (plain and lookup steps) pile up the target's features until the drafter next
    runs; at 64 rows each finished row then copied all of them out (35 drops a call, seconds of it). A drop now
    allocates nothing, and the drafter still gets exactly the rows left, in their order."""
    from hf_diffspec.runtime.drafting import DrafterContext

    target = tiny_target("llama", seed=7)
    torch.manual_seed(7)
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    context, rows, width = DrafterContext(drafter), 6, drafter.fc.in_features
    steps = [(torch.randn(rows, n, width), torch.arange(n).expand(rows, -1) + 10 * s, torch.rand(rows, n) > 0.3)
             for s, n in enumerate((3, 1, 2))]
    context.pending += [(*step, None) for step in steps[:2]]
    drops = (torch.tensor([0, 2, 3, 4, 5]), torch.tensor([0, 1, 3, 4]))
    for keep in drops:
        _, peak = peak_extra_bytes(lambda: context.select_rows(keep))
        assert peak < steps[0][0][:1].nbytes, peak  # less than one row of one step's features
    context.pending.append((*(t[[0, 2, 4, 5]] for t in steps[2]), None))  # a later step has the rows left only
    features, positions, valid = context._take_pending(4)
    left = torch.tensor([0, 2, 4, 5])  # the rows kept by both drops, in order
    assert torch.equal(features, torch.cat([steps[0][0][left], steps[1][0][left], steps[2][0][left]], dim=1))
    assert torch.equal(positions, torch.cat([s[1][left] for s in steps], dim=1))
    assert torch.equal(valid, torch.cat([s[2][left] for s in steps], dim=1))


def test_finished_rows_leave_the_targets_cache_copying_only_the_rows_that_move():
    """Rows leave the batch as they finish; indexing the cache's K/V by the rows kept copied all of them at every
    drop (at 64 rows ~0.6 GB, 0.18 s, 35 times a call), where plain `generate` copies nothing. The rows kept are now
    ordered so that only survivors past the new end move into finished rows' places, written in place."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from hf_diffspec.runtime.batch import BatchState
    from hf_diffspec.runtime.verify_cache import select_rows

    rows, finished = 8, {1, 4}
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(rows, 2, 64, 16), torch.randn(rows, 2, 64, 16), layer)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    batch = BatchState.__new__(BatchState)  # the order `drop_finished` gives, without a decoding call around it
    batch.committers = [SimpleNamespace(row=r, limit=99, cut=lambda limit: 0) for r in range(rows)]
    batch.active, batch.cut_tokens, batch.anchors = list(range(rows)), {}, list(range(rows))
    batch._finished = lambda committer: committer.row in finished
    batch.root_position_tensor, batch._room = torch.arange(rows), None
    keep, index, moves = batch.drop_finished()
    assert sorted(keep) == [0, 2, 3, 5, 6, 7] and sum(place != row for place, row in enumerate(keep)) == 2
    _, peak = peak_extra_bytes(lambda: select_rows(cache, index, moves))
    one_row = before[0][0][:1].nbytes
    assert peak <= 2 * 2 * 2 * one_row, peak  # the two rows that move, keys and values, of two layers
    for (keys, values), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys, keys[keep]) and torch.equal(layer.values, values[keep])


@pytest.mark.parametrize("method", ["chains", "best-first trees", "prefix trees"])
@pytest.mark.every_step_speculates("needs trees of several nodes, as a fixed length drafts them")
def test_sampled_trees_keep_the_laws_of_their_nodes_alone(method):
    """Rejection sampling needs, for each drafted node, the law q its token was drawn from; those laws live through
    the verify forward beside its logits. At 64 rows x 16 slots the trees hold their nodes' laws and nothing else:
    not the laws of slots no tree verifies, not a second stacked copy."""
    target = tiny_target("llama", seed=5, vocab_size=VOCAB, layers=1)
    torch.manual_seed(5)
    if method == "prefix trees":
        drafter = hf_diffspec.DualDiffusionDrafter.from_drafters(tiny_drafter(target, block_size=SLOTS, seed=5), None,
                                                                 num_branches=2, branches_from_first_pass=True)
    else:
        drafter = tiny_drafter(target, block_size=SLOTS, seed=5,
                               draft_tree_budget=SLOTS if method == "best-first trees" else None)
    # chains: 5 of the block's 15 slots verified
    generator = drafting.candidate_generator_for(drafter, target, num_draft_tokens=5 if method == "chains" else None)
    generator.sampling = SamplingLaws([])  # temperature 1, dense laws
    ids = random_ids(5, 8, vocab=VOCAB, rows=ROWS)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        generator.add_context(out.hidden_states, slice(None), torch.arange(8).expand(ROWS, -1),
                              torch.ones(ROWS, 8, dtype=torch.bool))
        trees = generator.propose(ids[:, -1].tolist(), [8] * ROWS, [100] * ROWS)
    held = {tree.draft_laws.probs.untyped_storage().data_ptr(): tree.draft_laws.probs.untyped_storage().nbytes()
            for tree in trees}  # what the trees keep alive
    node_laws = sum(len(tree) for tree in trees) * VOCAB * 4  # a law per node (the root's row unused)
    assert any(len(tree) > 2 for tree in trees)
    assert sum(held.values()) == node_laws
