"""Drafting ahead (`drafting.draft_ahead`): a drafter step runs the next step's drafting pass from its outcome on the
device, before the host reads that outcome, so the next trees need no read of their own. The pass must draft what a
pass run at its own step would (same context, same anchors and positions), leave the drafter's context as that step
would have left it, and follow the rows that finish meanwhile; a pass the next step does not use is counted."""

import itertools

import pytest
import torch

from hf_diffspec.runtime import control_policy, drafting
from hf_diffspec.runtime.control_cost import VerifyCost
from hf_diffspec.runtime.control_speculation import SpeculationController
from helpers import oracle_drafter_outputs, randomize, steer_steps, tiny_drafter, tiny_dual_drafter, tiny_target

VOCAB = 48


def _decode(target, drafter, ids, monkeypatch, ahead: bool, flags: list | None = None, **kwargs):
    """One call; every tree proposed (tokens and parents, per step, and whether a pass run ahead drafted them) and
    the drafter's context at the end. `flags`: gets, at every step that drafts, whether the drafter's context held
    every row seeing every slot (passes drafted at their step then use no mask)."""
    generators, trees, drafted_ahead = [], [], []
    with monkeypatch.context() as patch:
        patch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1" if ahead else "0")
        cls = drafting.generator_class(drafter)
        propose = cls.propose

        def recording(self, *args, **kw):
            generators.append(self)
            if flags is not None:
                flags.append(self.first.all_valid)
            out = propose(self, *args, **kw)
            trees.append([(t.tokens.tolist(), list(t.parents)) for t in out])
            drafted_ahead.append((args[3:] or [kw.get("ahead")])[0] is not None)
            return out

        patch.setattr(cls, "propose", recording)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              return_dict_in_generate=True, **kwargs)
    return out, trees, generators[0].contexts, drafted_ahead


def _context_valid(context) -> torch.Tensor:
    """Which of the drafter context's slots, cached or pending, each row sees."""
    pending = [valid if kept is None else valid[kept] for _, _, valid, kept in context.pending]
    return torch.cat([context.valid, *pending], dim=1)


@pytest.mark.every_step_speculates("compares the trees of every step")
@pytest.mark.parametrize("method", ["chains", "best-first", "selector", "d2sd", "d2sd-vp"])
def test_a_pass_run_ahead_drafts_what_a_pass_at_its_own_step_drafts(method, monkeypatch):
    """fp32, greedy, three rows that accept different numbers of drafts and stop at different steps (EOS): every
    step's trees are those of the loop that drafts at each step, the output is plain `generate`'s, and the drafter's
    cached context at the end holds the same slots, visible to the same rows. DFlash 2's selector trees: their tables
    computed ahead over every slot a row may draft. D²SD (its first drafter again, or a VP drafter of its own cache):
    both passes ahead, planned within the next step's limits computed on the device."""
    target = tiny_target("llama", seed=4, vocab_size=VOCAB, sharpen=3.0)
    if method.startswith("d2sd"):
        drafter = tiny_dual_drafter(target, block_size=6, seed=4, vp_seed=5 if method == "d2sd-vp" else None,
                                    num_branches=3, tree_budget=10)
    else:
        drafter = tiny_drafter(target, block_size=6, seed=4, draft_tree_budget=None if method == "chains" else 8,
                               draft_tree_width=2, **(dict(selector_rank=4, selector_top_k=4)
                                                      if method == "selector" else {}))
    ids = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=[7, 11], pad_token_id=0, num_assistant_tokens=4)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), **{k: v for k, v in kwargs.items()
                                                                                if k != "num_assistant_tokens"})
    ahead, ahead_trees, ahead_contexts, drafted_ahead = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    at_step, step_trees, step_contexts, at_own_step = _decode(target, drafter, ids, monkeypatch, False, **kwargs)
    # every step that drafted something did so from a pass run ahead (the last may have no room left to draft)
    assert all(a for a, step in zip(drafted_ahead, ahead_trees) if any(len(t[0]) > 1 for t in step))
    assert not any(at_own_step)
    assert torch.equal(ahead.sequences, reference) and torch.equal(at_step.sequences, reference)
    lengths = (reference != 0).sum(-1)
    assert len(set(lengths.tolist())) > 1  # rows finished at different steps
    assert ahead_trees == step_trees
    assert len(ahead_trees) > 4 and any(len(t[0]) > 1 for step in ahead_trees for t in step)
    # every drafter's context (D²SD's VP drafter has its own), cached or pending (a step whose successor is not
    # drafted leaves its slots for the next pass to cache)
    assert len(ahead_contexts) == (2 if method == "d2sd-vp" else 1)
    for ahead_context, step_context in zip(ahead_contexts, step_contexts):
        assert torch.equal(_context_valid(ahead_context), _context_valid(step_context))
        assert ahead_context.all_valid == step_context.all_valid  # (whether passes mask the slots at all)
        cached = min(ahead_context.valid.shape[1], step_context.valid.shape[1])
        seen = step_context.valid[:, None, :cached, None]  # (what a row may not see is never read)
        for a, b in zip(ahead_context.cache.layers, step_context.cache.layers):
            torch.testing.assert_close(a.keys[:, :, :cached] * seen, b.keys[:, :, :cached] * seen)
            torch.testing.assert_close(a.values[:, :, :cached] * seen, b.values[:, :, :cached] * seen)
    assert ahead.speculation_stats.unused_drafting_passes == 0  # every step drafted


@pytest.mark.every_step_speculates("compares the trees of every step")
def test_a_pass_run_ahead_of_a_step_then_accepted_token_by_token_leaves_the_context_as_drafting_at_each_step(
        monkeypatch):
    """A step accepted on the device, then token by token after its read (a law not compacted exactly: here top-k 5
    over three unsuppressed tokens, every -inf tied), leaves no outcome for the pass run ahead of it: the pass gives
    back every slot of the step's paths it cached, and the step's context is queued as at a step drafted at its own
    time. The trees of every step and the drafter's context at the end are those of the loop that drafts at each
    step (sampled at temperature 1e-4: every law a point mass, so both runs draw the same tokens)."""
    target = tiny_target("llama", seed=5, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=5)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)  # (else the clock decides)
    suppress = [t for t in range(VOCAB) if t not in (3, 7, 11)]
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=1e-4, top_k=5, suppress_tokens=suppress,
                  num_assistant_tokens=4)
    passes, draft_ahead = [], drafting.DiffusionCandidateGenerator.draft_ahead
    monkeypatch.setattr(drafting.DiffusionCandidateGenerator, "draft_ahead",
                        lambda self, *args: passes.append(len(args) > 3) or draft_ahead(self, *args))
    ahead, ahead_trees, ahead_contexts, _ = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    assert sum(passes) > 4  # passes run ahead of steps (with their context), each given back
    at_step, step_trees, step_contexts, _ = _decode(target, drafter, ids, monkeypatch, False, **kwargs)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), **{k: v for k, v in kwargs.items()
                                                                             if k != "num_assistant_tokens"})
    assert torch.equal(ahead.sequences, reference) and torch.equal(at_step.sequences, reference)
    assert ahead_trees == step_trees and len(ahead_trees) > 4
    assert ahead.speculation_stats.unused_drafting_passes == 0
    (ahead_context,), (step_context,) = ahead_contexts, step_contexts
    assert ahead_context.length == step_context.length
    assert torch.equal(_context_valid(ahead_context), _context_valid(step_context))


@pytest.mark.every_step_speculates("compares the drafter's context after steps accepted whole")
def test_a_pass_run_ahead_of_a_step_accepted_whole_keeps_every_slot_it_cached(monkeypatch):
    """A drafter pointed at plain generate's continuation: every step accepts all its drafts, so the pass run ahead
    keeps every slot of the step's paths it cached (none to give back). The drafter's cache at the end holds the same
    slots, with the same keys and values, as the loop that drafts at each step has cached, every one of them seen by
    every row (no mask)."""
    target = tiny_target("llama", seed=8, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=6, seed=8)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=24, do_sample=False, num_assistant_tokens=4)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    oracle_drafter_outputs(monkeypatch, drafter, target, list(reference))
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)  # (else the clock decides)
    ahead, ahead_trees, (ahead_context,), drafted_ahead = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    at_step, step_trees, (step_context,), _ = _decode(target, drafter, ids, monkeypatch, False, **kwargs)
    assert torch.equal(ahead.sequences, reference) and torch.equal(at_step.sequences, reference)
    assert ahead_trees == step_trees and sum(drafted_ahead) > 3
    assert max(ahead.speculation_stats.committed_per_step) == 5  # steps that accepted all four drafts
    assert ahead_context.length == step_context.length
    assert torch.equal(_context_valid(ahead_context), _context_valid(step_context))
    assert ahead_context.all_valid is step_context.all_valid is True
    # (the loop drafting at each step queues the last step's slots, which a pass run ahead has cached)
    cached = min(ahead_context.valid.shape[1], step_context.valid.shape[1])
    assert cached > 20
    for a, b in zip(ahead_context.cache.layers, step_context.cache.layers):
        torch.testing.assert_close(a.keys[:, :, :cached], b.keys[:, :, :cached])
        torch.testing.assert_close(a.values[:, :, :cached], b.values[:, :, :cached])


@pytest.mark.every_step_speculates("steers each step's kind")
def test_a_pass_run_for_a_step_that_does_not_draft_is_counted_and_dropped(monkeypatch):
    """Steps alternate drafting and plain decoding: every drafter step drafts the next one ahead, which a plain
    step does not use; the output stays plain `generate`'s and the unused passes are counted. Where the controller
    does not expect a drafter step to pay, none is drafted ahead."""
    target = tiny_target("llama", seed=6, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))

    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")
    # the controller expects drafting to pay, and then decodes every third step plainly
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)
    pattern = [True, True, False]  # draft, draft, plain, ...
    runs = {}
    for ahead in (True, False):
        steer_steps(monkeypatch, itertools.cycle(pattern))
        flags = []
        runs[ahead] = (*_decode(target, drafter, ids, monkeypatch, ahead, flags, max_new_tokens=30, do_sample=False),
                       flags)
    out, trees, _, _, flags = runs[True]
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                                      do_sample=False))
    stats = out.speculation_stats
    assert stats.draft_steps > 2 and stats.plain_steps > 1
    # every plain step follows a drafter step (which drafted it ahead)
    assert stats.unused_drafting_passes == stats.plain_steps
    # a step drafted after a plain one drafts at its own time, masking what the loop drafting at each step masks
    at_step, step_trees, _, _, step_flags = runs[False]
    assert trees == step_trees and flags == step_flags
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: False)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=30,
                          do_sample=False, return_dict_in_generate=True)
    assert out.speculation_stats.plain_steps > 1 and out.speculation_stats.unused_drafting_passes == 0


def test_drafting_ahead_is_on_where_a_read_waits_for_the_device(monkeypatch):
    """On a CPU the host runs every op as it is called: a second read costs nothing, a pass the next step does not
    use does. Elsewhere (CUDA) a read waits for the device. `HF_DIFFSPEC_DRAFT_AHEAD` overrides either way."""
    from hf_diffspec.runtime.decoding import reads_wait

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("HF_DIFFSPEC_DRAFT_AHEAD", raising=False)
    assert not reads_wait(cpu) and reads_wait(cuda)
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")
    assert reads_wait(cpu)
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "0")
    assert not reads_wait(cuda)


def test_d2sd_plans_ahead_within_the_limits_its_step_will_have():
    """A D²SD pass drafted ahead picks its branch points within each row's limit at the next step, which it computes
    on the device from the next roots' positions (`limits_on_device`): the policy's `depth_limits` at every position,
    near a row's length limit and near the target's context end alike."""
    target = tiny_target("llama", seed=4, vocab_size=VOCAB)
    target.config.max_position_embeddings = 40
    drafter = tiny_dual_drafter(target, block_size=6, seed=4, num_branches=2)
    generator = drafting.candidate_generator_for(drafter, target)
    assert generator.policy.max_positions == 40
    span = generator._ahead_span()
    row_ends = [12, 30, 45, 60]  # a row's root position plus the drafts it may still commit
    for position in range(8, 40):
        positions = torch.full((len(row_ends),), position)
        expected = generator.policy.depth_limits([position] * len(row_ends), [e - position for e in row_ends])
        assert generator.limits_on_device(positions, row_ends, span).tolist() == expected, position


@pytest.mark.every_step_speculates("compares the chains of every step")
# (DFlash 2's selector draws its chains from its own law over its candidates, which top-k 1 does not make a point
# mass: sampled selector chains run ahead draw other tokens than at their step)
@pytest.mark.parametrize("method, sample", [("chains", False), ("chains", True), ("length-head", False),
                                            ("length-head", True), ("selector-chains", False)])
def test_a_pass_run_ahead_sizes_chains_by_the_reach_a_pass_at_its_own_step_reads(method, sample, monkeypatch):
    """With the cost model live, a chain's length comes from its slots' reach: the length head's estimates, else the
    drafter's confidences multiplied (for DFlash 2's selector chains, the drafter's own maxima too). A pass run ahead
    hands the next step the same reach as a pass at that step, and its chains carry the same laws when sampling. The
    cost model is pinned to a rule of the reach alone (a slot is verified while it is reached with probability at
    least the read's median), so that both runs size every chain alike whatever the clock says; every reach read is compared."""
    target = tiny_target("llama", seed=4, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=4, **(dict(selector_rank=4, selector_top_k=4)
                                                            if method == "selector-chains" else {}))
    if method == "length-head":
        randomize(drafter.add_length_head().length_head, seed=4)
    monkeypatch.setattr(control_policy, "verify_cost_for", lambda *args, **kwargs: VerifyCost({1: {1: 1.0, 8: 1.0}}))
    monkeypatch.setattr(control_policy, "drafting_price_for", lambda *args: 0.0)
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)  # (else the clock decides)
    reads, chosen = [], []

    def pinned(self, reach_rows, limits):
        reach_rows = [[float(r) for r in row[:k]] for row, k in zip(reach_rows, limits)]
        reads.append(reach_rows)
        middle = sorted(r for row in reach_rows for r in row)[sum(map(len, reach_rows)) // 2]
        chosen.append([sum(r >= middle for r in row) for row in reach_rows])
        return chosen[-1]

    monkeypatch.setattr(control_policy.DraftLengthPolicy, "chain_lengths", pinned)
    ids = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    # sampling at top-k 1: the laws' path (drawn drafts, laws carried to rejection sampling) with the draws, and so
    # both runs' tokens, independent of the random stream (a pass run ahead draws its slots at another moment)
    kwargs = dict(max_new_tokens=24, do_sample=sample, eos_token_id=[7, 11], pad_token_id=0,
                  **(dict(top_k=1) if sample else {}))
    runs = {}
    for ahead in (True, False):
        reads.clear()
        chosen.clear()
        laws = []
        cls = drafting.generator_class(drafter)
        chains = cls._chains

        def recording(self, *args, **kw):
            trees = chains(self, *args, **kw)
            laws.append([None if t.draft_laws is None else t.draft_laws.probs.clone() for t in trees])
            return trees

        monkeypatch.setattr(cls, "_chains", recording)
        torch.manual_seed(7)
        out, trees, _, drafted_ahead = _decode(target, drafter, ids, monkeypatch, ahead, **kwargs)
        monkeypatch.setattr(cls, "_chains", chains)
        runs[ahead] = out.sequences, trees, list(reads), laws, drafted_ahead
    (ahead_out, ahead_trees, ahead_reads, ahead_laws, drafted_ahead), (out, trees, step_reads, step_laws, _) = (
        runs[True], runs[False])
    assert any(drafted_ahead)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(ahead_out, reference) and torch.equal(out, reference)
    assert ahead_trees == trees
    # chains of several lengths (greedy: cut by the rule before the rows' limits)
    lengths = [len(t[0]) - 1 for step in trees for t in step]
    assert len(set(lengths)) >= 2 and max(lengths) > 0, lengths
    assert sample or any(n < len(row) for read, counts in zip(step_reads, chosen) for row, n in zip(read, counts))
    assert len(ahead_reads) == len(step_reads) > 4
    for a, b in zip(ahead_reads, step_reads):
        assert len(a) == len(b) and all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
                                        for x, y in zip(a, b)), (a, b)
    assert len(ahead_laws) == len(step_laws)
    for a, b in zip(ahead_laws, step_laws):
        for x, y in zip(a, b):
            assert (x is None) == (y is None) == (not sample)
            if sample:
                torch.testing.assert_close(x, y)


def test_a_pass_is_drafted_ahead_only_where_one_pass_of_the_lm_head_covers_its_slots():
    """`can_draft_ahead`: every slot a row may verify, at most the block's draft slots (`_ahead_span`), through the LM
    head in one pass of at most `ONE_PASS_SLOTS` rows x slots (past it the slots are computed in chunks sized by
    reads)."""
    target = tiny_target("llama", seed=9, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=6, seed=9)
    four = drafting.candidate_generator_for(drafter, target, num_draft_tokens=4)
    assert four._ahead_span() == 4 and drafting.ONE_PASS_SLOTS == 256
    assert four.can_draft_ahead(64) and not four.can_draft_ahead(65)
    many = drafting.candidate_generator_for(drafter, target, num_draft_tokens=10)
    assert many._ahead_span() == 5  # the block's draft slots
    assert many.can_draft_ahead(51) and not many.can_draft_ahead(52)


def test_a_steps_drafter_logits_take_one_pass_of_the_lm_head_up_to_256_rows_x_slots():
    """`_slot_logits`: up to `ONE_PASS_SLOTS` rows x slots every slot in one pass of the LM head (its weights read
    once), past it growing chunks until the slots computed decide what is verified (`needs_more`)."""
    target = tiny_target("llama", seed=9, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=16, seed=9)
    generator = drafting.candidate_generator_for(drafter, target, num_draft_tokens=8)
    asked = []

    def needs_more(logits):
        asked.append(logits.shape[1])
        return True

    for rows, span, chunks in ((32, 8, []), (33, 8, [4]), (33, 12, [4, 8])):  # chunks of 4, 8, 16 ... slots
        asked.clear()
        hidden = torch.randn(rows, 15, drafter.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            logits = generator._slot_logits(hidden, span, needs_more)
            torch.testing.assert_close(logits, drafter.compute_logits(hidden[:, :span]))
        assert asked == chunks, (rows, span, asked)
