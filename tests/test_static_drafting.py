"""The capture-ready drafting pass (`hf_diffspec/runtime/drafting_static.py`), with `cache_implementation="static"`:
the drafter's forward reads a preallocated cache and persistent inputs, so that every pass of one (rows, context
width, attended slots) dispatches the same ops on the same memory, in a call and the next, and drafts what the
default pass drafts."""

import pytest
import torch

from hf_diffspec.runtime import drafting, drafting_static
from helpers import (DispatchTrace, EmulatedGraphs, FailingGraphs, ProposalRecorder, run_in_threads, tiny_drafter,
                     tiny_dual_drafter, tiny_target)

VOCAB = 48


def _decode(target, drafter, ids, monkeypatch, static_drafting: bool, **kwargs):
    """One static call; every tree proposed (tokens and parents, per step), the drafter's context at the end and
    every tree's confidences."""
    with monkeypatch.context() as patch:
        cls = drafting.generator_class(drafter)
        recorder = ProposalRecorder(patch, cls)
        patch.setattr(cls, "static_drafting", static_drafting)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              cache_implementation="static", return_dict_in_generate=True, **kwargs)
    return out, recorder.shapes(), recorder.generators[0].first, recorder.confidences()


@pytest.mark.every_step_speculates("compares the trees of every step")
@pytest.mark.parametrize("ahead", [False, True], ids=["at-each-step", "drafted-ahead"])
@pytest.mark.parametrize("tree_budget", [None, 8], ids=["chains", "best-first"])
def test_a_static_pass_drafts_what_the_default_pass_drafts(tree_budget, ahead, monkeypatch):
    """fp32, greedy, three rows that accept different numbers of drafts and stop at different steps (EOS), over the
    static verify step: every step's trees are those the default drafting pass gives, the output is plain
    `generate`'s, and the drafter's cached context at the end holds the same slots, visible to the same rows."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1" if ahead else "0")
    target = tiny_target("llama", seed=4, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=4, draft_tree_budget=tree_budget, draft_tree_width=2)
    ids = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=[7, 11], pad_token_id=0, num_assistant_tokens=4)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), **{k: v for k, v in kwargs.items()
                                                                                if k != "num_assistant_tokens"})
    static, static_trees, static_context, static_confidences = _decode(target, drafter, ids, monkeypatch, True,
                                                                       **kwargs)
    default, default_trees, default_context, default_confidences = _decode(target, drafter, ids, monkeypatch, False,
                                                                           **kwargs)
    assert isinstance(static_context.static, drafting_static.StaticDrafterStep) and default_context.static is None
    assert torch.equal(static.sequences, reference) and torch.equal(default.sequences, reference)
    assert len(set((reference != 0).sum(-1).tolist())) > 1  # rows finished at different steps
    assert static_trees == default_trees
    # the drafter's forwards themselves, not only their argmax: a padding slot seen would move these
    for a, b in zip(static_confidences, default_confidences, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(static_trees) > 4 and any(len(t[0]) > 1 for step in static_trees for t in step)
    assert torch.equal(static_context.valid, default_context.valid)
    cached = default_context.valid.shape[1]
    seen = default_context.valid[:, None, :cached, None]  # (what a row may not see is never read)
    for a, b in zip(static_context.cache.layers, default_context.cache.layers):
        assert int(a.cumulative_length) == cached  # padding and blocks cropped
        torch.testing.assert_close(a.keys[:, :, :cached] * seen, b.keys * seen)
        torch.testing.assert_close(a.values[:, :, :cached] * seen, b.values * seen)


@pytest.mark.every_step_speculates("compares the drafter's forwards of two calls step by step")
def test_the_drafters_forward_dispatches_the_same_ops_on_the_same_memory_in_every_pass_of_its_shape(monkeypatch):
    """What a CUDA graph replays is what was dispatched when it was captured. Traced at the aten level, every pass of
    the drafter's forward of one (rows, context width, attended slots), in this call and the next, dispatches the same
    ops on the same shapes and scalars, reading and writing the same memory: the step's accepted count reaches it
    as masked padding, not as a shape, and its cache and inputs outlive the call."""
    target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=3)
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    traces: dict[tuple, list] = {}
    mode = []

    def before(module, args, kwargs):
        shapes = tuple(None if kwargs.get(name) is None else tuple(kwargs[name].shape)
                       for name in ("noise_embeds", "context_hidden_states", "attention_mask"))
        mode.append(DispatchTrace().__enter__())
        traces.setdefault(shapes, []).append(mode[-1])

    def after(module, args, kwargs, output):
        mode.pop().__exit__(None, None, None)

    handles = [drafter.register_forward_pre_hook(before, with_kwargs=True),
               drafter.register_forward_hook(after, with_kwargs=True)]
    try:
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                                  cache_implementation="static", num_assistant_tokens=4)
            assert torch.equal(out, reference)
    finally:
        for handle in handles:
            handle.remove()
    assert sum(len(t) >= 4 for t in traces.values()) >= 1, {k: len(t) for k, t in traces.items()}
    assert len(traces) <= 8, list(traces)  # a few context widths, not one shape per accepted count and length
    for shape, passes in traces.items():
        for trace in passes[1:]:
            assert trace.ops == passes[0].ops, shape


@pytest.mark.every_step_speculates("compares the trees of every step")
def test_drafter_graphs_replay_to_the_eager_passes_drafts_and_outlive_the_call(monkeypatch):
    """`HF_DIFFSPEC_CUDA_GRAPHS=1` on a GPU: the drafter's forward is captured on its shape's first pass and replayed
    after, over the static cache and buffers. Emulated here with graph semantics (a replay reads and writes the
    memory captured, a captured tensor that moved fails it): every step's trees are the eager static pass's, plain
    `generate`'s output, most passes replayed, and a second call captures nothing new."""
    emulated = EmulatedGraphs()
    monkeypatch.setattr(drafting_static, "graph_backend", lambda device: emulated)  # on a GPU: CudaGraphs
    target = tiny_target("llama", seed=4, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=4)
    ids = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=[7, 11], pad_token_id=0, num_assistant_tokens=4)
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), **{k: v for k, v in kwargs.items()
                                                                                if k != "num_assistant_tokens"})
    graphed, graphed_trees, _, _ = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    captured = len(emulated.captured)
    assert captured and emulated.replays > captured
    again, again_trees, _, _ = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    assert len(emulated.captured) == captured  # the first call's graphs serve the second
    monkeypatch.setattr(drafting_static, "graph_backend", lambda device: None)
    eager, eager_trees, _, _ = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    for out in (graphed, again, eager):
        assert torch.equal(out.sequences, reference)
    assert graphed_trees == eager_trees and again_trees == eager_trees


@pytest.mark.every_step_speculates("asserts the captured path's passes")
def test_a_drafter_capture_that_fails_goes_on_eagerly_with_one_warning(monkeypatch):
    """A capture of the drafter's forward that raises: plain generate's tokens all the same, one warning naming the
    drafter's forward, and no second attempt on this drafter, in this call or the next."""
    failing = FailingGraphs()
    monkeypatch.setattr(drafting_static, "graph_backend", lambda device: failing)
    target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=3)
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    reference = target.generate(ids, max_new_tokens=24, do_sample=False)
    with pytest.warns(RuntimeWarning, match="drafter's forward as a CUDA graph failed") as warned:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                              cache_implementation="static", num_assistant_tokens=4)
    assert torch.equal(out, reference)
    assert failing.attempts == 1 and len([w for w in warned if "CUDA graph" in str(w.message)]) == 1
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                          cache_implementation="static", num_assistant_tokens=4)
    assert torch.equal(out, reference) and failing.attempts == 1


def test_static_calls_at_once_on_one_drafter_each_draft_over_a_step_of_their_own(monkeypatch):
    """Four static calls at once on one target and drafter (as a server's requests arrive): each leases a drafter
    step of its own (a shared one would interleave two calls' context keys) and writes plain `generate`'s output;
    one step is kept on the drafter for the next call, and it does not refer back to the drafter."""
    from hf_diffspec.runtime.control_state import memory_of

    target = tiny_target("llama", seed=6, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    prompts = [torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    references = [target.generate(ids, max_new_tokens=20, do_sample=False) for ids in prompts]
    leased = []
    lease = drafting_static.lease_drafter_step
    monkeypatch.setattr(drafting, "lease_drafter_step", lambda *args: leased.append(lease(*args)) or leased[-1])
    for _ in range(2):  # the second round starts with a step kept by the first
        leased.clear()
        outs = run_in_threads([lambda ids=ids: target.generate(ids, assistant_model=drafter, max_new_tokens=20,
                                                               do_sample=False, cache_implementation="static",
                                                               num_assistant_tokens=4) for ids in prompts])
        assert all(torch.equal(out, ref) for out, ref in zip(outs, references))
        assert len(leased) == 4 and len({id(step) for step in leased}) >= 2  # at least two held at once
    kept = [step for key, step in memory_of(drafter).static_steps.items() if key[0] == "drafter"]
    assert len(kept) == 1 and all(value is not drafter for value in vars(kept[0]).values())


def test_drafters_whose_keys_positions_come_from_the_cache_draft_on_the_default_path(monkeypatch):
    """A drafter with causal layers, and D²SD (whose branches read a row's whole cached context), draft on the
    default path with the static verify step, and still give plain `generate`'s output."""
    target = tiny_target("llama", seed=5, vocab_size=VOCAB, sharpen=3.0)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    contexts = []
    draft_block = drafting.DrafterContext.draft_block

    def recording(self, *args, **kwargs):
        contexts.append(self)
        return draft_block(self, *args, **kwargs)

    monkeypatch.setattr(drafting.DrafterContext, "draft_block", recording)
    causal = tiny_drafter(target, block_size=4, seed=5, causal_layers=[0])
    assert not drafting_static.supports_static_drafting(causal)
    for drafter in (causal, tiny_dual_drafter(target, block_size=6, seed=5, num_branches=2, tree_budget=8)):
        contexts.clear()
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                              cache_implementation="static", num_assistant_tokens=3)
        assert torch.equal(out, reference)
        assert contexts and all(context.static is None for context in contexts)
    assert drafting_static.supports_static_drafting(tiny_drafter(target, block_size=4, seed=5))


def test_the_context_a_pass_adds_is_padded_to_a_power_of_two_up_to_64_slots():
    assert [drafting_static.context_width(n) for n in (0, 1, 2, 3, 5, 8, 9, 33, 64, 65, 300)] == \
        [0, 1, 2, 4, 8, 8, 16, 64, 64, 65, 300]


@pytest.mark.every_step_speculates("compares the trees of every step")
def test_a_long_static_call_drafts_over_the_cached_slots_it_uses_not_the_whole_capacity(monkeypatch):
    """A call whose drafter cache is preallocated for hundreds of tokens: its passes read 256 cached slots, then 512
    (`attended_slots` of the slots in use, the pass's own included), not the whole capacity, and draft what the
    default pass drafts, at the boundary too (a pass that read fewer slots than it uses would lose its block's keys)."""
    target = tiny_target("llama", seed=3, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=6, seed=3)
    ids = torch.randint(2, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=400, do_sample=False, eos_token_id=None, pad_token_id=0)
    read = []
    update = drafting_static.AttendedStaticLayer.update

    def recording(layer, *args, **kw):
        keys, values = update(layer, *args, **kw)
        read.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(drafting_static.AttendedStaticLayer, "update", recording)
    static, static_trees, context, static_confidences = _decode(target, drafter, ids, monkeypatch, True, **kwargs)
    default, default_trees, _, default_confidences = _decode(target, drafter, ids, monkeypatch, False, **kwargs)
    assert context.static.capacity == 768 and set(read) == {256, 512} and read == sorted(read)
    assert torch.equal(static.sequences, default.sequences) and static_trees == default_trees
    for a, b in zip(static_confidences, default_confidences, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_kept_drafter_step_serves_only_a_call_of_its_rows_and_the_step_holds_the_drafters_dtype(monkeypatch):
    """The step a call keeps on the drafter serves the next call only when it has the same rows (else a new one is
    made); a bf16 drafter's static cache is bf16 (made in the drafter's dtype, not the default)."""
    target = tiny_target("llama", seed=6, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    leased = []
    lease = drafting_static.lease_drafter_step
    monkeypatch.setattr(drafting, "lease_drafter_step", lambda *args: leased.append(lease(*args)) or leased[-1])
    kwargs = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", num_assistant_tokens=4)
    for rows in (2, 2, 1):
        ids = torch.randint(2, VOCAB, (rows, 7), generator=torch.Generator().manual_seed(rows))
        out = target.generate(ids, assistant_model=drafter, **kwargs)
        assert torch.equal(out, target.generate(ids, max_new_tokens=12, do_sample=False))
    assert [step.rows for step in leased] == [2, 2, 1] and leased[1] is leased[0] and leased[2] is not leased[0]
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    target.generate(ids, assistant_model=drafter, **kwargs)
    assert leased[-1].cache.layers[0].keys.dtype == torch.bfloat16


def test_a_pass_after_dropped_slots_sees_none_of_its_contexts_padding():
    """Slots given back (`drop_last`, as a pass drafted ahead for nothing is) leave their visible bits behind the
    cache's count; a later pass whose context is padded (3 new slots, width 4) lays its padding over them and must
    not see it: its drafts and confidences are those of a pass that never had the dropped slots."""
    from hf_diffspec.runtime.drafting import candidate_generator_for

    target = tiny_target("llama", seed=5, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=6, seed=5)
    ids = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    positions = torch.arange(12)[None]

    def second_pass(dropped: bool):
        generator = candidate_generator_for(drafter, target, num_draft_tokens=5)
        generator.draft_statically(1, 64)
        assert generator.first.static is not None
        if dropped:  # a first pass over 7 slots, then the last 5 given back
            generator.add_context(hidden, slice(0, 7), positions[:, :7])
            generator.propose([int(ids[0, 6])], [6], [5])
            generator.first.drop_last(5, torch.tensor(5))
        else:
            generator.add_context(hidden, slice(0, 2), positions[:, :2])
            generator.propose([int(ids[0, 1])], [1], [5])
        generator.add_context(hidden, slice(2, 5), positions[:, 2:5])
        tree = generator.propose([int(ids[0, 4])], [4], [5])[0]
        return tree.token_list, torch.as_tensor(tree.confidences, dtype=torch.float64)

    (tokens, confidences), (expected_tokens, expected) = second_pass(True), second_pass(False)
    assert tokens == expected_tokens
    torch.testing.assert_close(confidences, expected, rtol=1e-5, atol=1e-6)
