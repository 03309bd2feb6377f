"""The capture-ready verify step (`cache_implementation="static"`, `hf_diffspec/runtime/verify_graphs.py`): the same
tokens as plain generate and as the default path, with every input of the verify forward in a buffer that keeps its
address and shape from step to step, and no host read inside that forward (a CUDA graph could not be captured over
one). The statistics asserted need every step to speculate: these tests carry `every_step_speculates`."""

import random
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_diffspec.bench.host_syncs import DEVICE_TO_HOST
from hf_diffspec.runtime import decoding
from hf_diffspec.runtime import verifier as verifier_module
from hf_diffspec.runtime import verify_graphs
from hf_diffspec.runtime.verify_inputs import VERIFY_WIDTHS, ValidSlots, verify_width
from helpers import (DispatchTrace, EmulatedGraphs, FailingGraphs, NoisyOracle, assert_sampling_matches_plain,
                     install_oracle, oracle_drafter_outputs, random_ids, tiny_drafter, tiny_family_target,
                     tiny_hybrid_target, tiny_target)


class HostReads(TorchFunctionMode):
    """Counts calls that read a device value on the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in DEVICE_TO_HOST:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class VerifyRecorder:
    """Per verify forward of `target` (one with a 4D mask): its width and rows, the addresses of its inputs and of
    every cache layer's keys, and the host reads made inside it."""

    def __init__(self, target):
        self.steps = []
        self._reads = None
        self.handles = [target.register_forward_pre_hook(self._before, with_kwargs=True),
                        target.register_forward_hook(self._after, with_kwargs=True)]

    def _before(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            cache = kwargs["cache"]
            tokens = kwargs.get("input_ids", args[0] if args else None)
            self.steps.append(dict(
                rows=tokens.shape[0], width=tokens.shape[1], mask_width=mask.shape[-1],
                inputs=(tokens.data_ptr(), mask.data_ptr(), kwargs["position_ids"].data_ptr()),
                keys=tuple(layer.keys.data_ptr() for layer in cache.layers)))
            self._reads = HostReads().__enter__()

    def _after(self, module, args, kwargs, output):
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self.steps[-1]["host_reads"] = self._reads.calls
            self._reads = None

    def remove(self):
        for handle in self.handles:
            handle.remove()


def test_valid_slots_keep_each_rows_visible_slots_in_place():
    """`ValidSlots`, the rows' visible cached slots: appended slots grow the room by doubling (the default path); a
    step written at a count on the device keeps only the slots it says (the capture-ready path, the rest cropped);
    a compaction replaces the tail and clears what it left; rows leave by index. Every view equals the tensor the
    same steps would have joined with `torch.cat`."""
    rows = 3
    prompt = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    grown, expected = ValidSlots(prompt), prompt
    room = grown.buffer.shape[1]
    for step in range(40):  # past the first room (64): it doubles, the slots kept
        visible = torch.rand(rows, 2, generator=torch.Generator().manual_seed(step)) > 0.5
        grown.append(visible)
        expected = torch.cat([expected, visible], dim=1)
        assert torch.equal(grown.view, expected)
    assert grown.buffer.shape[1] > room
    static = ValidSlots(prompt, capacity=32)
    written = torch.tensor([[True, True, False, False], [True, False, False, False], [True, True, True, False]])
    static.write_at(torch.tensor(3), written, 3)  # a 4-wide step at slot 3, its last slot cropped
    assert static.buffer.shape == (rows, 32) and torch.equal(static.view, torch.cat([prompt, written[:, :3]], 1))
    static.replace_from(3, torch.tensor([[True], [True], [True]]))  # a compaction kept one slot of the tail
    assert torch.equal(static.view, torch.cat([prompt, torch.ones(rows, 1, dtype=torch.bool)], 1))
    assert not static.buffer[:, 4:].any()  # what the tail held past it is cleared
    static.select_rows(torch.tensor([2, 0]))
    assert torch.equal(static.view, torch.cat([prompt, torch.ones(rows, 1, dtype=torch.bool)], 1)[[2, 0]])


def test_verify_widths_are_bucketed():
    assert [verify_width(n) for n in (1, 4, 5, 9, 17, 33, 64, 65, 130)] == [4, 4, 8, 16, 32, 64, 64, 128, 192]


@pytest.mark.parametrize("rows,branches,compact_after", [(1, 0, 64), (3, 2, 4), (3, 0, 10_000)])
@pytest.mark.every_step_speculates("asserts accepted paths of oracle trees")
def test_static_cache_is_identical_to_plain_generate_with_persistent_inputs(monkeypatch, rows, branches,
                                                                           compact_after):
    """Chains and trees, one row and three that accept different numbers of tokens (compacted every few hidden
    slots, or only at the end): plain generate's tokens; every verify forward at a bucketed width reads the
    preallocated cache (one address per layer while the batch keeps its rows) through a mask over all of it, with
    tokens, mask and positions in one buffer per (rows, width), and reads nothing on the host."""
    monkeypatch.setattr(verifier_module, "COMPACT_AFTER_HIDDEN_SLOTS", compact_after)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=rows)
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.2, branches=branches, seed=rows))
    recorder = VerifyRecorder(target)
    try:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                              cache_implementation="static", return_dict_in_generate=True)
    finally:
        recorder.remove()
    assert torch.equal(out.sequences, reference)
    assert out.speculation_stats.tau > 1.5
    steps = recorder.steps
    assert len(steps) == out.speculation_stats.target_forwards - 1  # every verify forward (not the prefill)
    capacity = steps[0]["mask_width"]
    assert capacity >= 8 + 40 and all(s["mask_width"] == capacity for s in steps)
    assert {s["width"] for s in steps} <= set(VERIFY_WIDTHS)
    for batch in {s["rows"] for s in steps}:  # rows that reach max_length first leave: a new batch size
        assert len({s["keys"] for s in steps if s["rows"] == batch}) == 1  # written in place, never reallocated
        for width in {s["width"] for s in steps}:
            assert len({s["inputs"] for s in steps if (s["rows"], s["width"]) == (batch, width)}) <= 1
    assert all(s["host_reads"] == [] for s in steps)
    if rows == 1:  # the returned cache holds the committed tokens, and its length is the loop's
        assert int(out.cache.get_seq_length()) == out.sequences.shape[1] - 1


@pytest.mark.every_step_speculates("asserts accepted paths of oracle chains")
def test_a_long_call_attends_to_the_cached_slots_it_uses_not_the_whole_capacity(monkeypatch):
    """A call whose cache is preallocated for hundreds of tokens: its verify forwards attend to 256 cached slots, then
    512 (`attended_slots`), not to the whole capacity from the first step; plain generate's tokens."""
    from hf_diffspec.runtime.verify_cache import static_capacity

    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=1)
    reference = target.generate(ids, max_new_tokens=400, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.2, seed=1))
    recorder = VerifyRecorder(target)
    keys_read = []
    from hf_diffspec.runtime import verify_attention

    sdpa = verify_attention.scaled_dot_product_attention
    monkeypatch.setattr(verify_attention, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: (keys_read.append(k.shape[2]), sdpa(q, k, v, **kw))[1])
    try:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=400, do_sample=False,
                              cache_implementation="static")
    finally:
        recorder.remove()
    assert torch.equal(out, reference)
    widths = [s["mask_width"] for s in recorder.steps]
    assert static_capacity(8 + 400) == 768 and widths[0] == 256 and set(widths) == {256, 512}, sorted(set(widths))
    assert widths == sorted(widths)
    assert set(keys_read) == {256, 512}  # the attention reads no key past the attended slots


@pytest.mark.every_step_speculates("compares tau with the default path's")
def test_static_cache_matches_the_default_path_when_rows_finish_early(monkeypatch):
    """Rows that stop at EOS leave the batch (the preallocated cache keeps the other rows, reallocated once), and
    prompt lookup grafts its drafts: the same tokens and the same acceptance as the default path."""
    target = tiny_target("qwen3", seed=5, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=5)
    ids = random_ids(7, 10, rows=3)
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    eos = int(plain[1, 10 + 6])  # row 1 stops after 7 tokens (others maybe earlier or later)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    reference = target.generate(ids, **kwargs)
    kwargs["prompt_lookup_num_tokens"] = 3
    rows_alive = []
    select_rows = verifier_module.select_rows
    monkeypatch.setattr(verifier_module, "select_rows", lambda cache, index, moves=None: (
        rows_alive.append(len(index)), select_rows(cache, index, moves)))
    default = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    static = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True,
                             cache_implementation="static", **kwargs)
    assert torch.equal(default.sequences, reference) and torch.equal(static.sequences, reference)
    assert rows_alive  # rows left the batch
    assert static.speculation_stats.committed_per_step == default.speculation_stats.committed_per_step


@pytest.mark.every_step_speculates("asserts drafts were made")
def test_static_cache_sampling_is_the_targets_distribution():
    vocab = 12
    target = tiny_target("llama", seed=3, vocab_size=vocab, sharpen=5)
    drafter = tiny_drafter(target, block_size=4, seed=3)
    ids = torch.randint(2, vocab, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=0)
    assert_sampling_matches_plain(target, ids, vocab, drafter, limit=33, drafter_kwargs=dict(
        cache_implementation="static"), **kwargs)  # 0.999 quantile of chi2(11) ~ 31.3
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, cache_implementation="static",
                          **kwargs)
    assert out.speculation_stats.drafted_tokens > 0


@pytest.mark.parametrize("make", [lambda: tiny_family_target("gemma3"), lambda: tiny_hybrid_target()],
                         ids=["sliding", "linear_attention"])
def test_static_cache_is_refused_for_caches_that_drop_keys_or_hold_states(make):
    target = make()
    drafter = tiny_drafter(target)
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="cache_implementation='static'.*Leave cache_implementation unset"):
        target.generate(random_ids(0, 6), assistant_model=drafter, max_new_tokens=4, cache_implementation="static")
    hook.remove()
    assert not calls


@pytest.mark.parametrize("rows,branches", [(1, 0), (3, 2)])
@pytest.mark.every_step_speculates("asserts accepted paths of oracle trees")
def test_verify_graphs_replay_to_plain_generates_tokens(monkeypatch, rows, branches):
    """`HF_DIFFSPEC_CUDA_GRAPHS=1` on a GPU: one graph per (rows, width), captured on its shape's first step and
    replayed after. Emulated here with graph semantics (static outputs overwritten by each replay, a capture that
    leaves the cache's lengths alone): plain generate's tokens, and most steps replayed."""

    emulated = EmulatedGraphs()
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: emulated)  # on a GPU: CudaGraphs
    monkeypatch.setattr(verifier_module, "COMPACT_AFTER_HIDDEN_SLOTS", 8)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=rows)
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.2, branches=branches, seed=rows))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert emulated.captured and emulated.replays > len(emulated.captured)
    assert out.speculation_stats.tau > 1.5


@pytest.mark.every_step_speculates("asserts the captured path's steps")
def test_a_capture_that_fails_goes_on_eagerly_with_one_warning(monkeypatch):
    """A capture that raises: plain generate's tokens all the same, one warning, no second attempt in the call."""
    failing = FailingGraphs()
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: failing)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=2)
    reference = target.generate(ids, max_new_tokens=24, do_sample=False)
    with pytest.warns(RuntimeWarning, match="goes on without graphs") as warned:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                              cache_implementation="static")
    assert torch.equal(out, reference)
    assert failing.attempts == 1 and len([w for w in warned if "CUDA graph" in str(w.message)]) == 1


@pytest.mark.every_step_speculates("asserts the captured shapes' replays")
def test_a_second_call_of_the_same_shape_replays_the_first_calls_graphs(monkeypatch):
    """The static cache, the persistent inputs and the graphs outlive the call, rows finishing early included (they
    keep the cache's memory): later calls of the same rows (and a prompt of another length within the same capacity)
    capture only (rows, width) shapes no call captured before, replay every other verify forward, and write plain
    generate's tokens; a call of another row count gets a step of its own."""
    emulated = EmulatedGraphs()
    shapes = emulated.shapes
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: emulated)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    first, longer = random_ids(4, 8, rows=2), random_ids(5, 11, rows=2)
    references = [target.generate(ids, max_new_tokens=30, do_sample=False) for ids in (first, longer)]
    install_oracle(monkeypatch, NoisyOracle([*references[0], *references[1]], vocab_size=128, noise=0.2, seed=2))
    kwargs = dict(assistant_model=drafter, max_new_tokens=30, do_sample=False, cache_implementation="static",
                  num_assistant_tokens=4)
    for ids, reference in [(first, references[0]), (first, references[0]), (longer, references[1])]:
        replays, captured = emulated.replays, len(shapes)
        out = target.generate(ids, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, reference)
        assert emulated.replays - replays == out.speculation_stats.target_forwards - 1 - (len(shapes) - captured)
    assert len(shapes) == len(set(shapes)), shapes  # no shape captured twice
    assert emulated.replays > 2 * len(shapes)
    assert {rows for rows, _ in shapes} == {1, 2}  # rows finished before others: graphs of one row kept too
    captured = len(shapes)
    target.generate(first[:1], **kwargs)  # one row from the start: its own cache, inputs and graphs
    assert len(shapes) > captured


@pytest.mark.every_step_speculates("asserts the captured shapes")
def test_rows_that_finish_one_by_one_are_padded_to_a_power_of_two_and_capture_per_bucket(monkeypatch):
    """Five rows that stop at EOS at different steps: the forward keeps 5 rows (all of them), then 4, 2, 1 (the next
    power of two of the rows left: padding rows see only themselves), so graphs are captured for those row counts
    alone, never for 3; plain generate's tokens, and the returned cache holds the rows that decoded last."""
    emulated = EmulatedGraphs()
    shapes = emulated.shapes
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: emulated)
    target = tiny_target("qwen3", seed=5, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=5)
    ids = random_ids(7, 10, rows=5)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)[:, 10:]

    def stops(eos):  # the step each row stops at (40: never)
        hits = torch.isin(plain, torch.tensor(eos))
        return [int(row.nonzero()[0]) if row.any() else 40 for row in hits]

    tokens = plain.unique().tolist()  # two stop tokens at which the rows stop at the most different steps
    eos = max(([a, b] for a in tokens for b in tokens if a < b), key=lambda pair: len(set(stops(pair))))
    assert len(set(stops(eos))) >= 4, stops(eos)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    reference = target.generate(ids, **kwargs)
    recorder = VerifyRecorder(target)
    try:
        out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=3, return_dict_in_generate=True,
                              cache_implementation="static", **kwargs)
    finally:
        recorder.remove()
    rows_forwarded = [s["rows"] for s in recorder.steps]
    assert torch.equal(out.sequences, reference)
    assert set(rows_forwarded) <= {5, 4, 2, 1} and len(set(rows_forwarded)) >= 3, rows_forwarded
    assert {rows for rows, _ in shapes} <= {5, 4, 2, 1}
    assert out.cache.layers[0].keys.shape[0] <= 2 or rows_forwarded[-1] == out.cache.layers[0].keys.shape[0]


def test_a_call_with_graphs_does_not_take_the_step_a_call_without_them_kept(monkeypatch):
    """Graphs switched on after a static call without them (`HF_DIFFSPEC_CUDA_GRAPHS=1` set between calls): the
    next call captures its graphs, and one without them again takes the eager step."""
    emulated = EmulatedGraphs()
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=1)
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    kwargs = dict(assistant_model=drafter, max_new_tokens=16, do_sample=False, cache_implementation="static")
    for backend, captures in [(None, 0), (emulated, 1), (None, 1), (emulated, 1)]:
        monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: backend)
        assert torch.equal(target.generate(ids, **kwargs), reference)
        assert (len(emulated.captured) >= 1) == bool(captures)
    assert emulated.replays >= 2


def test_a_graphed_call_is_priced_by_a_profile_measured_through_graphs(monkeypatch, tmp_path):
    """The verify-cost profile's key carries graph mode: a call whose verify forward replays graphs measures (once)
    and reads a profile of its own, timed through the capture-ready step's graphs; an eager call reads the eager one."""
    from hf_diffspec.runtime import control_profiles

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "1")
    emulated = EmulatedGraphs()
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: emulated)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=1)
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                          cache_implementation="static")
    assert torch.equal(out, reference)
    graphed = control_profiles.profile_path(target, graphs=True)
    assert graphed.is_file() and not control_profiles.profile_path(target).exists()
    assert graphed != control_profiles.profile_path(target)
    assert {4, 16} <= {rows for rows, _ in emulated.shapes}  # the profile's rows, replayed as graphs
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: None)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                                       cache_implementation="static"), reference)
    assert control_profiles.profile_path(target).is_file()  # the eager call measured the eager profile


def test_static_calls_inside_and_outside_inference_mode_follow_one_another():
    """A step made under `torch.inference_mode()` holds inference tensors, which a call outside it cannot write:
    calls in either mode, in any order, each find a step they can use."""
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=1)
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    kwargs = dict(assistant_model=drafter, max_new_tokens=12, do_sample=False, cache_implementation="static")
    for inference in (True, False, True, False):
        with torch.inference_mode(inference):
            assert torch.equal(target.generate(ids, **kwargs), reference)


def test_a_failed_capture_is_not_tried_again_in_later_calls(monkeypatch):
    """A capture that raised warns once, in the first call (whose verify-cost profile, measured through graphs,
    meets it first); no later forward on the model tries again: later calls run eagerly."""
    failing = FailingGraphs()
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: failing)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=1)
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    with pytest.warns(RuntimeWarning, match="goes on without graphs") as warned:
        outs = [target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                                cache_implementation="static") for _ in range(3)]
    assert all(torch.equal(out, reference) for out in outs)
    assert failing.attempts == 1 and len([w for w in warned if "CUDA graph" in str(w.message)]) == 1


def test_calls_at_once_never_share_a_static_step():
    """Two calls of one shape at once each take a step of their own (a shared one would interleave two calls' keys
    in one cache); after them the last to end is kept for the next call."""
    from hf_diffspec.runtime.control_state import memory_of

    target = tiny_target("llama", seed=3)
    taken = [verify_graphs.lease_static_step(target, 2, 40) for _ in range(2)]
    assert taken[0] is not taken[1] and taken[0].cache is not taken[1].cache
    for step in taken:  # as a call's prefill leaves it: its rows known
        step.cache.early_initialization(2, 1, 4, torch.float32, torch.device("cpu"))
        verify_graphs.keep_static_step(target, step)
    assert list(memory_of(target).static_steps.values()) == [taken[1]]  # the last to end
    assert verify_graphs.lease_static_step(target, 2, 40) is taken[1]
    assert verify_graphs.lease_static_step(target, 2, 40) is not taken[1]  # taken out while a call holds it


def test_one_static_step_is_kept_and_serves_the_calls_it_fits():
    """As transformers keeps one static cache, one step is kept (the memory it holds is the last call's): a call of
    its rows within its capacity takes it, a longer call or one of other rows gets a new one in its place."""
    from hf_diffspec.runtime.control_state import memory_of

    target = tiny_target("llama", seed=3)

    def used(step, rows):  # as a call's prefill leaves it, then its end
        step.cache.early_initialization(rows, 1, 4, torch.float32, torch.device("cpu"))
        verify_graphs.keep_static_step(target, step)
        return step

    small = used(verify_graphs.lease_static_step(target, 2, 40), 2)
    assert verify_graphs.lease_static_step(target, 2, 60) is small  # 60 + headroom fit its 256 slots
    used(small, 2)
    large = used(verify_graphs.lease_static_step(target, 2, 100), 2)  # 100 do not: a new one of 512
    assert large is not small and large.capacity == 512 and len(memory_of(target).static_steps) == 1
    assert verify_graphs.lease_static_step(target, 2, 40) is large  # a shorter call fits the larger one
    used(large, 2)
    other = verify_graphs.lease_static_step(target, 1, 40)
    assert other is not large
    used(other, 1)
    assert list(memory_of(target).static_steps.values()) == [other]


@pytest.mark.every_step_speculates("compares the verify forwards of two calls step by step")
def test_the_verify_forward_dispatches_the_same_ops_on_the_same_memory_in_every_step_of_its_shape(monkeypatch):
    """What a CUDA graph replays is what was dispatched when it was captured: the same ops, on the same shapes and
    scalars, reading and writing the same memory. Traced at the aten level, every verify forward of one (rows,
    width), in this call and the next, dispatches exactly that: nothing of the step reaches the forward as a Python
    number, and the cache and inputs a later call's forward reads are the ones an earlier call's graph captured."""
    monkeypatch.setattr(verifier_module, "COMPACT_AFTER_HIDDEN_SLOTS", 4)  # compactions between the forwards
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=2)
    reference = target.generate(ids, max_new_tokens=30, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.3, branches=2, seed=1))
    traces: dict[tuple, list] = {}
    mode = []

    def before(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # a verify forward (the prefill has no 4D mask)
            mode.append(DispatchTrace().__enter__())
            traces.setdefault(tuple(args[0].shape), []).append(mode[-1])

    def after(module, args, kwargs, output):
        if mode:
            mode.pop().__exit__(None, None, None)

    handles = [target.register_forward_pre_hook(before, with_kwargs=True),
               target.register_forward_hook(after, with_kwargs=True)]
    try:
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                                  cache_implementation="static")
            assert torch.equal(out, reference)
    finally:
        for handle in handles:
            handle.remove()
    assert sum(len(t) >= 4 for t in traces.values()) >= 1, {k: len(t) for k, t in traces.items()}
    for shape, steps in traces.items():
        for step in steps[1:]:
            assert step.ops == steps[0].ops, shape


class StepOps(TorchDispatchMode):
    """Every aten op a loop step dispatches outside the target's and the drafter's forwards (paused while `inside`
    is positive): its name and its arguments' shapes, dtypes and scalars."""

    def __init__(self):
        super().__init__()
        self.ops, self.lines, self.inside = [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            flat, _ = tree_flatten((args, kwargs or {}))
            self.ops.append((str(func), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
                                              for a in flat)))
            self.lines.append(_runtime_line())
        return func(*args, **(kwargs or {}))

    def differences(self, other: "StepOps") -> list:
        """The ops where `other` differs, with the runtime lines that dispatched them (for a failure's message)."""
        return [(a, b) for a, b in zip(zip(self.lines, self.ops), zip(other.lines, other.ops)) if a[1] != b[1]][:3]


def _runtime_line() -> str:
    frame = sys._getframe(2)
    while frame is not None and "hf_diffspec" not in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename.split('hf_diffspec/')[-1]}:{frame.f_lineno}"


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.every_step_speculates("compares steps of one shape, which needs every step to draft")
def test_the_whole_step_dispatches_the_same_ops_in_every_step_of_its_shape(monkeypatch, sample):
    """What a CUDA graph of the whole step would replay: outside the two forwards (which the test above and
    `test_static_drafting.py` trace), every step that verifies trees of the same sizes with forwards of the same
    shapes dispatches the same ops on the same shapes and scalars, whatever the rows accepted: the validity masks
    written in place at the caches' counts on the device, the caches cropped by counts on the device. Two rows that accept different numbers of drafts at
    different steps (a drafter pointed at a continuation with wrong tokens in it), chains of a fixed length drafted
    ahead, as on a GPU, greedy and sampling (plain generate's tokens)."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=2)
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    rng = random.Random(5)
    noisy = [[t if p < 8 or rng.random() > 0.25 else (t + 1) % 128 for p, t in enumerate(row.tolist())]
             for row in reference]
    oracle_drafter_outputs(monkeypatch, drafter, target, noisy)
    steps, kept, sizes = [], [], []
    step, keep, forward = decoding._step, verifier_module.TargetVerifier.keep, verifier_module.TargetVerifier.forward

    def traced_step(call, start):
        steps.append((StepOps(), []))
        with steps[-1][0]:
            return step(call, start)

    def recorded_keep(self, paths, *args):
        kept.append([len(p) for p in paths])
        return keep(self, paths, *args)

    def recorded_forward(self, trees, *args):
        sizes.append(tuple(len(t) for t in trees))
        return forward(self, trees, *args)

    def enter(module, args, kwargs):
        if steps:
            steps[-1][0].inside += 1
            steps[-1][1].append(tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                                      if isinstance(t, torch.Tensor)))

    def leave(module, args, kwargs, output):
        if steps:
            steps[-1][0].inside -= 1

    monkeypatch.setattr(decoding, "_step", traced_step)
    monkeypatch.setattr(verifier_module.TargetVerifier, "keep", recorded_keep)
    monkeypatch.setattr(verifier_module.TargetVerifier, "forward", recorded_forward)
    handles = [hook for model in (target, drafter) for hook in (
        model.register_forward_pre_hook(enter, with_kwargs=True), model.register_forward_hook(leave, with_kwargs=True))]
    try:
        torch.manual_seed(0)
        # sampling at top-k 1: the sampled step's ops (laws, draws, rejection), the greedy tokens the drafter points at
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=sample,
                              **(dict(top_k=1) if sample else {}), num_assistant_tokens=4,
                              cache_implementation="static", eos_token_id=None)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(out, reference)
    by_shape: dict[tuple, list] = {}
    for (trace, shapes), trees, counts in zip(steps[1:], sizes[1:], kept[1:]):  # (the first follows the prefill)
        by_shape.setdefault((trees, *shapes), []).append((trace, counts))
    common = max(by_shape.values(), key=len)
    assert len(common) >= 6 and len({tuple(c) for _, c in common}) >= 3, [c for _, c in common]
    for shape, group in by_shape.items():
        for trace, counts in group[1:]:
            assert trace.ops == group[0][0].ops, (shape, counts, group[0][1], group[0][0].differences(trace))
