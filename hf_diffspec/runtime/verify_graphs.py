"""The capture-ready verify step: `generate(..., assistant_model=drafter, cache_implementation="static")`.

Every tensor the verify forward reads keeps its address and shape from one step to the next, for a given number of
rows and verify width, so that a CUDA graph captured over that forward can be replayed every step:

- the target's KV cache is transformers' `StaticCache`, preallocated (`verify_cache.target_cache`): each layer
  writes new keys in place at its length, which it holds on the device (`StaticLayer.cumulative_length`); cropping
  back to the accepted tokens lowers that length, and compacting accepted tree paths is an in-place gather
  (`verify_cache.gather_slots`);
- the verify width is bucketed to `VERIFY_WIDTHS` (padding slots see only themselves, their outputs ignored), and the
  cached slots attended to `verify_inputs.attended_slots` (256, 512, ... up to the capacity), so one graph per (rows,
  width, attended slots) serves every step;
- the tokens, positions and the (rows, 1, width, attended slots) additive mask are copied into persistent buffers
  (`verify_inputs.CaptureReadyInputs`); keys past the cache's length are masked there, so the forward reads the
  attended slots of the preallocated cache with no shape that depends on the step.

On the CPU it is the default path computed over the preallocated cache, identical to it (`tests/test_static_verify.py`).
With `HF_DIFFSPEC_CUDA_GRAPHS=1` on a CUDA device the verify forward is captured once per shape and replayed
(`ForwardGraphs`, which also captures the drafter's forward: `drafting_static.py`; opt-in until a GPU run has
checked it inside `generate`: the standalone capture was exact, 2026-12-04).

The cache, the inputs and the graphs outlive the call (`StaticStep`, one kept on the target by `control_state` per
graph mode and inference mode, as transformers keeps one static cache): the next call of the same rows, within its
capacity (rounded up to `verify_cache.CAPACITY_STEP` slots, so that prompts of other lengths fit), resets the cache
in place and replays the graphs the earlier one captured. As with transformers' own static cache, the cache a call
returns is the one the next call overwrites.

Targets whose caches must drop keys (sliding windows) or hold recurrent states (linear attention) are refused with it
(`support.py`): they decode on the default path.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import os
import warnings

import torch

from .control_state import memory_of
from .verify_cache import crop_attention, static_capacity, target_cache, whole_tensor
from .verify_inputs import CaptureReadyInputs


class CudaGraphs:
    """Captures and replays CUDA graphs (`torch.cuda.CUDAGraph`), warmed up on a side stream as capturing asks, all of
    one step's graphs in one memory pool (as vLLM's graphs of every batch size share one): each graph's outputs stay
    referenced, so no later capture takes their memory, and only one graph replays at a time."""

    def __init__(self):
        self.pool = None

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
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
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


class ForwardGraphs:
    """A capture-ready forward (the verify forward, or the drafter's: `drafting_static.py`) as one graph per (rows,
    width, attended slots), `width` the slots it writes to the cache: the first step of a shape runs its forward
    eagerly (its outputs are that step's) and captures it; later steps of that shape replay the graph over the
    persistent inputs (`CaptureReadyInputs`) and the preallocated cache, and read its static outputs (valid until the
    next replay: the loop consumes them within the step; the drafter's features are concatenated copies). Rows
    leaving the target's batch keep the cache's memory (its first rows, padded to `verify_cache.rows_bucket`), so
    graphs are captured per power of two of rows at most, and every one stays valid. A capture that fails (a kernel
    that cannot be captured, memory) leaves the cache as the step's eager forward left it, warns once, and every
    such forward on this model goes on eagerly (`memory`: the model's)."""

    def __init__(self, backend, memory, forward_name: str = "the verify forward"):
        self.backend = backend
        self.memory = memory  # the model's (`control_state`): a capture that failed there is not tried again
        self.forward_name = forward_name
        self.graphs: dict[tuple[int, int, int], tuple] = {}

    def run(self, forward, cache, shape: tuple[int, int, int]):
        """`forward` of `shape` (rows, width, attended slots), replayed when a graph of it was captured."""
        if self.backend is None or self.memory.graph_capture_failed:
            return forward()
        width = shape[1]
        if shape in self.graphs:
            graph, outputs = self.graphs[shape]
            self.backend.replay(graph)
            return outputs
        outputs = forward()  # this step's own forward, eager
        crop_attention(cache, width)  # back to the lengths the captured forward must start from
        lengths = [layer.cumulative_length.clone() for layer in cache.layers]
        try:
            self.graphs[shape] = self.backend.capture(forward, lambda: crop_attention(cache, width))
        except Exception as error:  # noqa: BLE001 (any failure to capture: the eager forward is always right)
            warnings.warn(f"capturing {self.forward_name} as a CUDA graph failed ({type(error).__name__}: {error}); "
                          "this call goes on without graphs, and later ones on this model",
                          RuntimeWarning, stacklevel=2)
            self.backend, self.graphs = None, {}
            self.memory.graph_capture_failed = True
            for layer, length in zip(cache.layers, lengths):  # a warm-up may have run: its writes lie past them
                layer.cumulative_length.copy_(length)
        for layer in cache.layers:  # as this step's forward left them (capturing ran nothing)
            layer.cumulative_length.add_(width)
        return outputs


class StaticStep:
    """What the capture-ready verify step keeps from one call to the next (see the module docstring): the
    preallocated cache, the persistent inputs and the graphs captured over them."""

    def __init__(self, model, max_length: int, backend):
        self.capacity = static_capacity(max_length)
        self.cache = target_cache(model.config, static_length=max_length)
        self.inputs = CaptureReadyInputs(self.capacity)
        self.graphs = ForwardGraphs(backend, memory_of(model)) if backend else None
        self.graph_mode = backend is not None  # made to replay graphs
        self.inference = torch.is_inference_mode_enabled()  # its tensors are inference tensors
        self.made_for = (model.dtype, model.device)  # a model moved or cast since needs a step of its own

    @property
    def rows(self) -> int | None:
        """The rows the cache was made for (None before the first call's prefill)."""
        layer = self.cache.layers[0]
        return whole_tensor(layer.keys).shape[0] if layer.is_initialized else None

    def reset(self) -> None:
        """Empty the cache in place for a new call, with all the rows it was made for (a call whose rows finished
        early left each layer a view of its first rows: `verify_cache.select_rows`)."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = whole_tensor(layer.keys), whole_tensor(layer.values)
        self.cache.reset()


def lease_static_step(model, rows: int, max_length: int) -> StaticStep:
    """The static step for a call of `rows` rows and `max_length` tokens: the one the last call in this graph and
    inference mode kept, when it has these rows and room enough (a larger cache costs nothing more: only the slots in
    use are attended) and was made for the model's dtype and device, its cache emptied in place (its tensors, and so
    its graphs, stay valid); else a new one."""
    memory = memory_of(model)
    backend = None if memory.graph_capture_failed else graph_backend(model.device)
    # tensors made under `torch.inference_mode()` cannot be written outside it: a step per mode
    mode = (backend is not None, torch.is_inference_mode_enabled())
    with memory.lock:
        step = memory.static_steps.pop(mode, None)
    if (step is None or step.rows != rows or step.capacity < static_capacity(max_length)
            or step.made_for != (model.dtype, model.device)):
        return StaticStep(model, max_length, backend)  # (one that does not fit is freed)
    step.reset()
    return step


def keep_static_step(model, step: StaticStep) -> None:
    """At a call's end, `step` is where the next call in its mode starts. One step per mode is kept, as transformers
    keeps one static cache: the memory it holds is the last call's to end (a call's own end comes after the
    verify-cost profile it measured, whose steps it replaces)."""
    if step.rows is None:
        return
    memory = memory_of(model)
    with memory.lock:
        memory.static_steps[step.graph_mode, step.inference] = step
