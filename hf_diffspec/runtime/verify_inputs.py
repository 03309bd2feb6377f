"""The verify forward's inputs: its tokens and positions, and every attention mask the target sees while it
verifies (one module builds them all).

- `tree_forward_inputs`: one tree per row as a rectangle, with the additive 4D mask of the trees over each row's
  visible cached slots (`None` for chains every row verifies in full: the causal mask, aligned bottom-right);
- `verify_masks`: sliding-window targets (Gemma 3 / 4, gpt-oss, Mistral, ...): the window lives in the mask. A query
  sees a key when `kv_idx > q_idx - sliding_window`, both counted in the slots plain `generate` gives them (a row's
  prompt slots, padding included, then one slot per generated token), exactly as transformers'
  `sliding_window_overlay` hides them. Rows of a ragged batch leave holes in our cache (slots of drafts another row
  accepted), so slots are renumbered per row before the window is applied; the columns a windowed layer dropped
  (`verify_cache.WindowedLayer`) are then left out of its mask;
- `ValidSlots`: which cached slots each row sees, kept in place step after step;
- `CaptureReadyInputs`: the capture-ready step's persistent buffers (widths bucketed to `VERIFY_WIDTHS`, the cached
  slots attended to `attended_slots`), the mask blocked past the cache's used slots (`verify_graphs.py`);
- `packed_mask`: the mask the verify attention reads (`verify_attention.py`), for queries packed by key/value head,
  and the chain's causal mask when transformers built none.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from .tree import CandidateTree, TreeLayout, index_range

MASK_ALIGNMENT = 16  # elements: the memory-efficient kernel reads a mask in place when its rows are this aligned


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, `dtype`'s lowest value elsewhere: the form every attention takes (eager attention adds the
    mask, so a bool mask would be silently wrong there)."""
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(allowed, 0)


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention masks a target's layers take. `sliding_window`: the window of its sliding layers (None: full
    attention only); `mixed`: full and sliding layers both, so the model takes a dict of masks by layer type."""

    sliding_window: int | None
    mixed: bool

    @classmethod
    def of(cls, config) -> "AttentionLayout":
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        windows = {kw["sliding_window"] for kind, kw in zip(layer_types, layer_kwargs) if kind == "sliding_attention"}
        if len(windows) > 1:  # refused before the first forward (support.py)
            raise ValueError(f"sliding layers with different windows {sorted(windows)}")
        window = next(iter(windows), None)
        return cls(sliding_window=window, mixed=window is not None and "full_attention" in layer_types)


def verify_masks(layout: AttentionLayout, mask: torch.Tensor | None, depths: torch.Tensor, past_valid: torch.Tensor,
                 prompt_length: int, dropped: int = 0):
    """The `attention_mask` to verify a batch of trees with, from `tree_forward_inputs`' full-attention `mask`;
    `depths` (rows, n): each node's depth in its tree, -1 for padding slots (`TreeLayout.depths`).

    Full attention only: `mask` itself. Sliding layers only: `mask` within the window. Both: a dict by layer type (the
    form Gemma 3 / 4 and gpt-oss take). `None` (every row sees its whole cache and verifies a chain of one length)
    stays `None`: the verify attention then applies each sliding layer's window itself, counted bottom-right over the
    cache's slots, which is plain generate's window (no row has holes or padding then; `verify_attention.py`).
    `dropped`: the slots the windowed layers dropped (`dropped_slots`), left out of the sliding layers' mask."""
    if mask is None or layout.sliding_window is None:
        return mask
    windowed = mask.masked_fill(~_within_window(layout.sliding_window, depths, past_valid, prompt_length)[:, None],
                                torch.finfo(mask.dtype).min)[..., dropped:]
    if not layout.mixed:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def _within_window(window: int, depths: torch.Tensor, past_valid: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """(rows, n, past + n) bool: whether each tree node (query) is within `window` of each key, counting slots as plain
    `generate` would have them: prompt slots as they are, then the row's own accepted tokens one after the other."""
    counted = past_valid.clone()
    counted[:, :prompt_length] = True
    past_slots = counted.long().cumsum(-1) - 1  # a hole repeats its neighbour's number: it is masked anyway
    node_slots = counted.sum(-1, keepdim=True) + depths.clamp(min=0)  # the anchor takes the row's next slot; padding
    key_slots = torch.cat([past_slots, node_slots], dim=1)              # nodes see only themselves anyway
    return key_slots[:, None, :] > node_slots[:, :, None] - window


def tree_forward_inputs(trees: list[CandidateTree], past_valid: torch.Tensor, root_positions,
                        dtype: torch.dtype, layout: TreeLayout | None = None, past_all_valid: bool | None = None):
    """Target inputs to verify one tree per row in one forward: `(tokens, attention_mask, position_ids)`.

    tokens (rows, n) and position_ids (rows, n), with n the largest tree: a node at depth d sits at its row's root
    position + d; shorter rows are padded with slots that see only themselves (their outputs are ignored).
    attention_mask (rows, 1, n, past + n) is additive float in `dtype` (0 = attend, dtype min = blocked), never bool:
    eager attention adds the mask, so a bool mask would be silently wrong there. `past_valid` (rows, past) marks
    which cached slots each row may see (False: padding, or slots of drafts another row accepted).
    When every row sees its whole cache and verifies a chain of the same length, the mask is the causal one aligned
    bottom-right: `None` is returned for it, and the verify attention (`verify_attention.py`) runs a causal kernel
    without a mask tensor. (SDPA's own path would not: for q > 1 over a cache transformers builds the mask itself.)

    `root_positions`: (rows,) tensor (or list); `layout`: the trees' `TreeLayout` when the caller has it;
    `past_all_valid`: whether `past_valid` is all True, when the caller knows it (else it is read from the device).
    """
    rows, past = past_valid.shape
    device = past_valid.device
    layout = layout or TreeLayout.of(trees, device)
    if past_all_valid is None:
        past_all_valid = bool(past_valid.all())
    if layout.uniform_chains and past_all_valid:
        return layout.tokens, None, layout.depths + past
    roots = torch.as_tensor(root_positions, device=device)
    positions = roots[:, None] + layout.depths.clamp(min=0)
    allowed = torch.cat([past_valid[:, None, :] & layout.real[:, :, None], layout.ancestors], dim=-1)
    return layout.tokens, additive_mask(allowed, dtype)[:, None], positions


VERIFY_WIDTHS = (4, 8, 16, 32, 64)


def verify_width(nodes: int) -> int:
    """The bucketed width a step of `nodes` (its largest tree) is verified at: the smallest of `VERIFY_WIDTHS` that
    holds it, else the next multiple of the largest."""
    for width in VERIFY_WIDTHS:
        if nodes <= width:
            return width
    return -(-nodes // VERIFY_WIDTHS[-1]) * VERIFY_WIDTHS[-1]


ATTENDED_SLOTS = 256  # the fewest cached slots a capture-ready forward attends to; then doubling up to the capacity


def attended_slots(used: int, capacity: int) -> int:
    """The cached slots (from the first) a capture-ready forward with `used` of `capacity` slots attends to: the
    smallest of 256, 512, 1024, ... that holds them, at most the capacity. Its keys past `used` are masked: a few
    buckets (a graph each) instead of the whole preallocated cache from the first step."""
    slots = ATTENDED_SLOTS
    while slots < used:
        slots *= 2
    return min(slots, capacity)


class ValidSlots:
    """(rows, cached slots) bool: which cached slots each row may attend to (False: padding, slots of drafts another
    row accepted, tree nodes off its accepted path), in a buffer with room past them, so that a step's slots are
    written in place rather than grown by `torch.cat`. `capacity`: the static cache's slots (the buffer never grows,
    and a step's slots are written at the device's count of them: `write_at`); None: the room doubles as needed."""

    def __init__(self, valid: torch.Tensor, capacity: int | None = None):
        rows, self.used = valid.shape
        self.buffer = valid.new_zeros(rows, capacity or max(2 * self.used, 64))
        self.buffer[:, : self.used] = valid

    @property
    def view(self) -> torch.Tensor:
        return self.buffer[:, : self.used]

    def append(self, visible: torch.Tensor) -> None:
        """`visible` (rows, n): the next n slots."""
        end = self.used + visible.shape[1]
        if end > self.buffer.shape[1]:
            grown = self.buffer.new_zeros(self.buffer.shape[0], 2 * end)
            grown[:, : self.used] = self.view
            self.buffer = grown
        self.buffer[:, self.used : end] = visible
        self.used = end

    def write_at(self, first: torch.Tensor, visible: torch.Tensor, kept: int) -> None:
        """`visible` (rows, width) written at slots `first` (on the device: the cache's count before the step) to
        `first` + width, of which the first `kept` stay in the cache (the rest are cropped and must be False): no
        shape or scalar of the step's own in the ops."""
        self.buffer.index_copy_(1, first + index_range(visible.shape[1], visible.device), visible)
        self.used += kept

    def replace_from(self, start: int, tail: torch.Tensor) -> None:
        """The slots from `start` on become `tail` (rows, n) (a compaction moved them)."""
        end = start + tail.shape[1]
        self.buffer[:, start:end] = tail
        self.buffer[:, end : self.used] = False
        self.used = end

    def select_rows(self, index: torch.Tensor) -> None:
        self.buffer = self.buffer[index]


class CaptureReadyInputs:
    """Persistent inputs of the verify forward, one set per (rows, width, attended slots): tokens and positions
    (rows, width), the additive mask (rows, 1, width, attended) (`attended_slots`: the verify attention reads the
    cache's keys that far). `fill` writes a step's inputs into them in place, the mask built over the attended slots
    from the rows' `ValidSlots` with the step's nodes placed at the device's count of cached slots, so that two steps
    of one shape dispatch the same ops on the same shapes and scalars (what a CUDA graph of the whole step needs)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffers: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def fill(self, layout: TreeLayout, valid: ValidSlots, first: torch.Tensor, roots: torch.Tensor,
             dtype: torch.dtype, padded_rows: int):
        """The step's `(tokens, attention_mask, position_ids)` for `layout`'s trees (rows, width) over the cached
        slots `valid` marks, the nodes at slots `first` (the cache's count, on the device) to `first` + width.
        `padded_rows`: the rows of the forward (the static cache's `rows_bucket`), the ones past the batch's whose
        queries each see their own slot alone."""
        rows, width = layout.tokens.shape
        used = valid.used + width
        if used > self.capacity:
            raise RuntimeError(f"the static cache holds {self.capacity} slots and this step needs {used}: "
                               "verify_cache.HEADROOM is too small for this call")
        attended = attended_slots(used, self.capacity)
        key = (padded_rows, width, attended)
        device = layout.tokens.device
        if key not in self.buffers:
            self.buffers[key] = (layout.tokens.new_zeros(padded_rows, width),
                                 layout.tokens.new_zeros(padded_rows, width),
                                 torch.empty(padded_rows, 1, width, attended, dtype=dtype, device=device),
                                 torch.zeros(padded_rows, width, attended, dtype=torch.bool, device=device),
                                 torch.eye(width, dtype=torch.bool, device=device).expand(padded_rows, width, width))
        token_buffer, position_buffer, mask_buffer, allowed, alone = self.buffers[key]
        token_buffer[:rows].copy_(layout.tokens)
        position_buffer[:rows].copy_(roots[:, None] + layout.depths.clamp(min=0))
        # cached slots: those the row sees, before the step's own; the step's nodes: each sees its ancestors
        cached = valid.buffer[:, :attended] & (index_range(attended, device) < first)
        allowed[:rows] = cached[:, None, :] & layout.real[:, :, None]
        nodes = (first + index_range(width, device)).expand(padded_rows, width, width)
        allowed[:rows].scatter_(2, nodes[:rows], layout.ancestors)
        if padded_rows > rows:  # padding rows: each query sees its own new slot, nothing else
            allowed[rows:] = False
            allowed[rows:].scatter_(2, nodes[rows:], alone[rows:])
        mask_buffer[:, 0].fill_(torch.finfo(dtype).min).masked_fill_(allowed, 0)
        return token_buffer, mask_buffer, position_buffer


def aligned(width: int) -> int:
    return -(-width // MASK_ALIGNMENT) * MASK_ALIGNMENT


def packed_mask(mask: torch.Tensor | None, groups: int, q: int, kv: int, sliding_window: int | None,
                dtype: torch.dtype, device: torch.device, memo: dict) -> torch.Tensor:
    """(rows or 1, 1, groups * q, kv) additive mask for group-packed queries, in rows of `aligned(kv)` elements;
    `mask=None`: the chain's causal mask, aligned bottom-right (within `sliding_window` when given). `memo`: the
    masks built in this forward, shared by its layers."""
    source = (id(mask), mask.shape if mask is not None else None, groups, q, kv, sliding_window, dtype)
    if source in memo:
        return memo[source][1]
    if mask is None:
        query_slots = torch.arange(kv - q, kv, device=device)[:, None]
        key_slots = torch.arange(kv, device=device)[None]
        allowed = key_slots <= query_slots
        if sliding_window is not None:
            allowed &= key_slots > query_slots - sliding_window
        mask = additive_mask(allowed, dtype)[None, None]
    elif mask.dtype == torch.bool:
        mask = additive_mask(mask, dtype)
    rows = mask.shape[0]
    packed = torch.full((rows, 1, groups * q, aligned(kv)), torch.finfo(dtype).min, dtype=dtype, device=device)
    packed = packed[..., :kv]
    packed.view(rows, 1, groups, q, kv).copy_(mask[:, :1, None, :, -kv:].to(dtype))
    memo[source] = (mask, packed)  # the source is kept so that its id is not reused within the forward
    return packed
