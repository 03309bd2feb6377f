"""The capture-ready verify step: `generate(..., assistant_model=drafter, cache_implementation="static")`.

Every tensor the verify forward reads keeps its address and shape from one step to the next, for a given number of
rows and verify width, so that a CUDA graph captured over that forward can be replayed every step:

- the target's KV cache is transformers' `StaticCache`, preallocated for the call (`static_kv_cache`): each layer
  writes new keys in place at its length, which it holds on the device (`StaticLayer.cumulative_length`); cropping
  back to the accepted tokens lowers that length, and compacting accepted tree paths is an in-place gather
  (`kv_cache.gather_slots`);
- the verify width is bucketed to `VERIFY_WIDTHS` (padding slots see only themselves, their outputs ignored), so one
  graph per (rows, width) serves every step;
- the tokens, positions and the (rows, 1, width, capacity) additive mask are copied into persistent buffers
  (`CaptureReadyInputs`); keys past the cache's length are masked there, so the forward reads the whole
  preallocated cache with no shape that depends on the step.

On the CPU it is the default path computed over the preallocated cache, identical to it (`tests/test_static_verify.py`).
With `HF_DIFFSPEC_CUDA_GRAPHS=1` on a CUDA device the verify forward is captured once per (rows, width) and replayed
(`VerifyGraphs`; opt-in until a GPU run has checked it inside `generate`: the standalone capture was exact, 2026-12-04).
Targets whose caches must drop keys (sliding windows) or hold recurrent states (linear attention) are refused with it
(`support.py`): they decode on the default path.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import os

import torch
from transformers import StaticCache

from .kv_cache import crop_attention

VERIFY_WIDTHS = (4, 8, 16, 32, 64)
# slots past the longest row the cache needs room for: hidden tree nodes before a compaction (`batch.py`'s
# COMPACT_AFTER_HIDDEN_SLOTS, 64, plus one step's) and the widest verify step's padding
HEADROOM = 64 + 2 * VERIFY_WIDTHS[-1]


def verify_width(nodes: int) -> int:
    """The bucketed width a step of `nodes` (its largest tree) is verified at: the smallest of `VERIFY_WIDTHS` that
    holds it, else the next multiple of the largest."""
    for width in VERIFY_WIDTHS:
        if nodes <= width:
            return width
    return -(-nodes // VERIFY_WIDTHS[-1]) * VERIFY_WIDTHS[-1]


def static_kv_cache(config, max_length: int) -> StaticCache:
    """The target's preallocated cache for a call of at most `max_length` tokens per row (its tensors are made at
    the prefill, on the target's device and in its dtype)."""
    return StaticCache(config=config.get_text_config(decoder=True), max_cache_len=max_length + HEADROOM)


class CaptureReadyInputs:
    """Persistent inputs of the verify forward, one set per (rows, width): tokens and positions (rows, width), the
    additive mask (rows, 1, width, capacity). `fill` copies a step's inputs into them in place."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def fill(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """`tokens`, `positions` (rows, width) and `mask` (rows, 1, width, used) over the `used` cached slots and the
        step's nodes, as `tree_forward_inputs` makes them: the same tensors in the step's persistent buffers, the
        mask blocked past `used`."""
        rows, width = tokens.shape
        used = mask.shape[-1]
        if used > self.capacity:
            raise RuntimeError(f"the static cache holds {self.capacity} slots and this step needs {used}: "
                               "static_verify.HEADROOM is too small for this call")
        key = (rows, width)
        if key not in self.buffers:
            self.buffers[key] = (torch.empty_like(tokens), torch.empty_like(positions),
                                 mask.new_empty(rows, 1, width, self.capacity))
        token_buffer, position_buffer, mask_buffer = self.buffers[key]
        token_buffer.copy_(tokens)
        position_buffer.copy_(positions)
        mask_buffer[..., :used].copy_(mask)
        mask_buffer[..., used:].fill_(torch.finfo(mask.dtype).min)
        return token_buffer, mask_buffer, position_buffer


class CudaGraphs:
    """Captures and replays CUDA graphs (`torch.cuda.CUDAGraph`), warmed up on a side stream as capturing asks."""

    def capture(self, forward, rewind):
        """(graph, its static outputs) of `forward`; `rewind()` puts the cache's lengths back after the warm-up
        forward (capturing runs nothing, so it leaves them as they are)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
            rewind()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = forward()
        return graph, outputs

    def replay(self, graph) -> None:
        graph.replay()


def graph_backend(device: torch.device):
    """CUDA graphs for the verify forward: opt-in (`HF_DIFFSPEC_CUDA_GRAPHS=1`) with `cache_implementation="static"` on
    a CUDA device; None elsewhere (the forward runs eagerly)."""
    if device.type == "cuda" and os.environ.get("HF_DIFFSPEC_CUDA_GRAPHS") == "1":
        return CudaGraphs()
    return None


class VerifyGraphs:
    """The verify forward as one graph per (rows, width): the first step of a shape runs its forward eagerly (its
    outputs are that step's) and captures it; later steps of that shape replay the graph over the persistent inputs
    (`CaptureReadyInputs`) and the preallocated cache, and read its static outputs (valid until the next replay: the
    loop consumes them within the step; the drafter's features are concatenated copies). Rows leaving the batch
    reallocate the cache's tensors, so graphs of another batch size are dropped."""

    def __init__(self, backend):
        self.backend = backend
        self.graphs: dict[tuple[int, int], tuple] = {}

    def run(self, forward, cache, rows: int, width: int):
        if (rows, width) in self.graphs:
            graph, outputs = self.graphs[rows, width]
            self.backend.replay(graph)
            return outputs
        self.graphs = {shape: entry for shape, entry in self.graphs.items() if shape[0] == rows}
        outputs = forward()  # this step's own forward, eager
        crop_attention(cache, width)  # back to the lengths the captured forward must start from
        self.graphs[rows, width] = self.backend.capture(forward, lambda: crop_attention(cache, width))
        for layer in cache.layers:  # as this step's forward left them (capturing ran nothing)
            layer.cumulative_length.add_(width)
        return outputs
