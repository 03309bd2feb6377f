"""The capture-ready verify step (`cache_implementation="static"`, `hf_diffspec/runtime/verify_graphs.py`): the same
tokens as plain generate and as the default path, with every input of the verify forward in a buffer that keeps its
address and shape from step to step, and no host read inside that forward (a CUDA graph could not be captured over
one). The statistics asserted need every step to speculate: these tests carry `every_step_speculates`."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_diffspec.bench.host_syncs import DEVICE_TO_HOST
from hf_diffspec.runtime import verifier as verifier_module
from hf_diffspec.runtime.verify_inputs import VERIFY_WIDTHS, verify_width
from helpers import (NoisyOracle, assert_sampling_matches_plain, install_oracle, random_ids, tiny_drafter,
                     tiny_family_target, tiny_hybrid_target, tiny_target)


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


class EmulatedGraphs:
    """CUDA graph semantics on the CPU: a graph reads and writes the memory it was captured over, whatever the loop's
    variables hold later. A capture runs the forward (a warm-up, then the captured run), puts the cache's lengths back
    (`rewind`) and records what the forward reads: the tensors of its closure (tokens, mask, positions), the cache and
    every tensor of the cache's layers (keys, values, lengths), with their addresses. A replay runs the forward again
    on exactly those tensors (the loop's current ones swapped out meanwhile) and writes its results into the captured
    outputs, which stay the ones the loop reads. A captured tensor whose memory moved fails the replay: a graph would
    read freed memory."""

    def __init__(self):
        self.captured, self.replays = {}, 0

    @staticmethod
    def _reads(forward) -> tuple[dict, list[dict]]:
        """The closure's variables, and the tensors of each of its cache's layers."""
        cells = {name: cell.cell_contents for name, cell in zip(forward.__code__.co_freevars, forward.__closure__)}
        layers = [{name: value for name, value in vars(layer).items() if isinstance(value, torch.Tensor)}
                  for layer in cells["cache"].layers]
        return cells, layers

    def capture(self, forward, rewind):
        forward()  # the warm-up
        rewind()
        outputs = forward()
        rewind()
        cells, layers = self._reads(forward)
        tensors = [v for v in cells.values() if isinstance(v, torch.Tensor)] + [t for l in layers for t in l.values()]
        self.captured[forward] = (outputs, cells, layers, [(t, t.data_ptr()) for t in tensors])
        return forward, outputs

    @staticmethod
    def _swap(forward, cells: dict, layers: list[dict]) -> None:
        for name, cell in zip(forward.__code__.co_freevars, forward.__closure__):
            cell.cell_contents = cells[name]
        for layer, tensors in zip(cells["cache"].layers, layers):
            for name, tensor in tensors.items():
                setattr(layer, name, tensor)

    def replay(self, graph) -> None:
        self.replays += 1
        static, cells, layers, addresses = self.captured[graph]
        assert all(t.data_ptr() == address for t, address in addresses), "a captured tensor's memory moved"
        now = self._reads(graph)
        assert now[0]["cache"] is cells["cache"], "the loop verifies with another cache than the one captured"
        self._swap(graph, cells, layers)  # the closure's cells are the loop's variables: put back after
        try:
            fresh = graph()
        finally:
            self._swap(graph, *now)
        static.logits.copy_(fresh.logits)
        for mine, new in zip(static.hidden_states, fresh.hidden_states):
            if mine is not None:  # (the layers the drafter does not read are not returned)
                mine.copy_(new)


@pytest.mark.parametrize("rows,branches", [(1, 0), (3, 2)])
@pytest.mark.every_step_speculates("asserts accepted paths of oracle trees")
def test_verify_graphs_replay_to_plain_generates_tokens(monkeypatch, rows, branches):
    """`HF_DIFFSPEC_CUDA_GRAPHS=1` on a GPU: one graph per (rows, width), captured on its shape's first step and
    replayed after. Emulated here with graph semantics (static outputs overwritten by each replay, a capture that
    leaves the cache's lengths alone): plain generate's tokens, and most steps replayed."""

    emulated = EmulatedGraphs()
    monkeypatch.setattr(verifier_module, "graph_backend", lambda device: emulated)  # on a GPU: CudaGraphs
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


class FailingGraphs(EmulatedGraphs):
    """Graphs whose capture fails after its warm-up forward has run (the cache written past the step's keys, its
    lengths advanced), as a kernel that cannot be captured would."""

    def __init__(self):
        super().__init__()
        self.attempts = 0

    def capture(self, forward, rewind):
        self.attempts += 1
        forward()
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.every_step_speculates("asserts the captured path's steps")
def test_a_capture_that_fails_goes_on_eagerly_with_one_warning(monkeypatch):
    """A capture that raises: plain generate's tokens all the same, one warning, no second attempt in the call."""
    failing = FailingGraphs()
    monkeypatch.setattr(verifier_module, "graph_backend", lambda device: failing)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(4, 8, rows=2)
    reference = target.generate(ids, max_new_tokens=24, do_sample=False)
    with pytest.warns(RuntimeWarning, match="goes on without graphs") as warned:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                              cache_implementation="static")
    assert torch.equal(out, reference)
    assert failing.attempts == 1 and len([w for w in warned if "CUDA graph" in str(w.message)]) == 1
