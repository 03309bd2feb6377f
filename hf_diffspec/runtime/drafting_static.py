"""The capture-ready drafting pass: the drafter's forward over preallocated memory, with the static verify step
(`cache_implementation="static"`, `verify_graphs.py`).

Every tensor the drafter's forward reads keeps its address and shape from one pass to the next, for a given number of
rows, context width and attended slots, so that a CUDA graph captured over it could be replayed at every step:

- the drafter's context K/V live in a preallocated cache (`StaticDrafterCache`): each layer writes new keys in place at
  its length, held on the device (transformers' `StaticLayer.cumulative_length`), and hands the forward its first
  `attended` slots (256, 512, ... as the verify step's: `verify_inputs.attended_slots`); the block's K/V are written
  after the context and cropped after the pass, as on the default path;
- the context a pass adds (the features of the tokens committed since the last pass) is padded to a power of two of
  slots (`context_width`): padding slots are masked and cropped with the block, so a step's accepted count does not
  change the forward's shapes;
- the anchors' block embeddings, the context features, the positions and the (rows, attended slots) mask are copied
  into persistent buffers, one set per (rows, context width, attended slots).

With `HF_DIFFSPEC_CUDA_GRAPHS=1` on a CUDA device (as the verify forward: `verify_graphs.graph_backend`), the drafter's
forward is captured once per (rows, context width, attended slots) and replayed (`verify_graphs.ForwardGraphs`' rule:
the first pass of a shape runs eagerly and captures it; a capture that fails warns once and every later pass of this
drafter runs eagerly).

Rows that finish leave the cache's memory in place (`select_rows`: the rows kept are its first rows, the moved ones
copied), so every row count reads the same memory in every call; each is a shape of its own. Drafters with causal or
sliding-window layers read their keys' positions from the cache's length, and D²SD branches read the whole cached
context of a row: both draft on the default path (`supports_static_drafting`).

The cache and its buffers outlive the call, kept on the drafter per inference mode (`lease_drafter_step` /
`keep_drafter_step`), so the memory a later call's forward reads is the one an earlier call's would have been captured
over. On the CPU the pass computes what the default path computes (`tests/test_static_drafting.py`).

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import torch
from transformers.cache_utils import Cache, StaticLayer

from .control_state import memory_of
from .tree import index_range
from .verify_cache import kept_rows, static_capacity
from .verify_graphs import ForwardGraphs, graph_backend
from .verify_inputs import ValidSlots, attended_slots


class AttendedStaticLayer(StaticLayer):
    """A `StaticLayer` whose `update` hands the forward the first `attended` slots (set before each pass), not the
    whole preallocated capacity."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len)
        self.attended = max_cache_len

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return keys[:, :, : self.attended], values[:, :, : self.attended]


class StaticDrafterCache(Cache):
    """The drafter's context K/V, preallocated: one `AttendedStaticLayer` per drafter layer."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[AttendedStaticLayer(capacity) for _ in range(num_layers)])

    def attend(self, slots: int) -> None:
        for layer in self.layers:
            layer.attended = slots


def supports_static_drafting(drafter) -> bool:
    """Whether `drafter` (a DFlash drafter) can draft over a `StaticDrafterCache`: no causal and no sliding-window
    layers (both derive their keys' positions from the cache's length, which the padded context would shift)."""
    config = drafter.config
    return not config.causal_layers and not config.uses_sliding_window


def context_width(slots: int) -> int:
    """The slots a pass gives `slots` new context tokens: the next power of two up to 64 (the usual case: a step's
    accepted tokens), exactly `slots` past it (a prompt, or features piled up over many steps without a pass)."""
    if slots == 0 or slots > 64:
        return slots
    return 1 << (slots - 1).bit_length()


class StaticDrafterStep:
    """The drafter's preallocated cache and the persistent inputs of its forward (see the module docstring)."""

    def __init__(self, drafter, rows: int, max_length: int, backend=None):
        config = drafter.config  # (the drafter itself is not kept: this step is kept on it)
        self.graphs = ForwardGraphs(backend, memory_of(drafter), "the drafter's forward") if backend else None
        self.graph_mode = backend is not None
        self.capacity = static_capacity(max_length + config.block_size)
        self.cache = StaticDrafterCache(config.num_hidden_layers, self.capacity)
        empty = torch.empty(rows, config.num_key_value_heads, 0, config.head_dim, dtype=drafter.dtype,
                            device=drafter.device)
        for layer in self.cache.layers:  # allocated now, not inside the first pass
            layer.lazy_initialization(empty, empty)
        self.whole = [(layer.keys, layer.values) for layer in self.cache.layers]  # what `select_rows` narrows
        self.buffers: dict[tuple[int, int, int], tuple] = {}
        self.inference = torch.is_inference_mode_enabled()  # its tensors are inference tensors
        self.made_for = (drafter.dtype, drafter.device)  # a drafter moved or cast since needs a step of its own

    @property
    def rows(self) -> int:
        """The rows the cache was made for."""
        return self.whole[0][0].shape[0]

    def reset(self) -> None:
        """Empty the cache in place for a new call, with all its rows."""
        for layer, (keys, values) in zip(self.cache.layers, self.whole):
            layer.keys, layer.values = keys, values
        self.cache.reset()

    def select_rows(self, moves) -> None:
        """Keep the rows still decoding: `moves` (from `BatchState.drop_finished`) as the cache's first rows, in its
        own memory."""
        for layer in self.cache.layers:
            layer.keys, layer.values = kept_rows(layer.keys, moves), kept_rows(layer.values, moves)

    def draft(self, drafter, context, context_positions: torch.Tensor, valid: ValidSlots, new_valid,
              noise: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """`drafter`'s forward over [cached ; `context` ; block], as `DrafterContext.draft_block` runs it on the
        default path: `context` (rows, n, features) or None, at `context_positions` (rows, n), `new_valid` (rows, n)
        the slots of it each row sees, written into `valid` (the cached slots each row sees); `noise` (rows, block,
        hidden): the block's embeddings at `block_positions`. Only the context's n slots stay cached; returns the
        block's hidden states. Every slot is placed at the cache's count on the device: the ops are the same
        whatever the cache holds, within one (rows, context width, attended slots)."""
        rows, new = context_positions.shape
        block = noise.shape[1]
        width = context_width(new)
        used = valid.used + width + block
        if used > self.capacity:
            raise RuntimeError(f"the drafter's static cache holds {self.capacity} slots and this pass needs {used}")
        attended = attended_slots(used, self.capacity)
        key = (rows, width, attended)
        if key not in self.buffers:
            features = None if context is None else context.new_zeros(rows, width, context.shape[-1])
            self.buffers[key] = (features, noise.new_zeros(rows, block, noise.shape[-1]),
                                 block_positions.new_zeros(rows, width + block),
                                 torch.zeros(rows, attended, dtype=torch.bool, device=noise.device))
        features, noise_buffer, positions, sees = self.buffers[key]
        first = self.cache.layers[0].cumulative_length.clone()  # the cache's count before the pass
        slots = index_range(attended, noise.device)
        if context is not None:
            features[:, :new].copy_(context)
            features[:, new:].zero_()
            positions[:, :new].copy_(context_positions)
            positions[:, new:width].copy_(block_positions[:, :1].expand(-1, width - new))  # masked: any position
            valid.write_at(first, new_valid, new)
        noise_buffer.copy_(noise)
        positions[:, width:].copy_(block_positions)
        # the cached slots each row sees and the context's, not the context's padding, and the block
        block_start = first + width
        torch.logical_or(valid.buffer[:, :attended] & (slots < first + new),
                         (slots >= block_start) & (slots < block_start + block), out=sees)
        self.cache.attend(attended)
        cache = self.cache

        def forward():  # what a CUDA graph captures: every tensor it reads is one of its closure's
            return drafter(noise_embeds=noise_buffer, context_hidden_states=features, position_ids=positions,
                           attention_mask=sees, cache=cache).last_hidden_state

        if self.graphs is None:
            hidden = forward()
        else:  # a graph's output is overwritten by its next replay: the pass's own copy
            hidden = self.graphs.run(forward, cache, (rows, width + block, attended)).clone()
        cache.crop(-(width - new + block))  # the padding and the block: only the context stays cached
        return hidden


def lease_drafter_step(drafter, rows: int, max_length: int) -> StaticDrafterStep | None:
    """The static drafting step for a call of `rows` rows and `max_length` tokens on `drafter`: the one an earlier
    call in this inference mode kept, emptied in place, when it has these rows and room enough and was made for the
    drafter's dtype and device; else a new one. None where the drafter cannot draft over one
    (`supports_static_drafting`)."""
    if not supports_static_drafting(drafter):
        return None
    memory = memory_of(drafter)
    backend = None if memory.graph_capture_failed else graph_backend(drafter.device)
    mode = ("drafter", backend is not None, torch.is_inference_mode_enabled())
    with memory.lock:
        step = memory.static_steps.pop(mode, None)
    if (step is None or step.rows != rows or step.capacity < static_capacity(max_length + drafter.config.block_size)
            or step.made_for != (drafter.dtype, drafter.device)):
        return StaticDrafterStep(drafter, rows, max_length, backend)
    step.reset()
    return step


def keep_drafter_step(drafter, step: StaticDrafterStep | None) -> None:
    """At a call's end, `step` is where the next call on `drafter` in its inference mode starts."""
    if step is None:
        return
    memory = memory_of(drafter)
    with memory.lock:
        memory.static_steps["drafter", step.graph_mode, step.inference] = step
