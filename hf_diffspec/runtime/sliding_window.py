"""Targets with sliding-window attention layers (Gemma 3 / 4, gpt-oss, Mistral, ...): every layer keeps its whole KV
cache, and the window lives in the attention mask.

A `DynamicCache` built from such a model's config drops a sliding layer's keys once they leave the window, so it cannot
be cropped back to the accepted tokens or have accepted tree paths compacted into place. Ours (`full_kv_cache`) holds
a sliding layer's keys in a `WindowedLayer`: every key some row may still see (the window behind the oldest row's next
slot, and the cache's tail of tree nodes not yet compacted), the older ones dropped after each step
(`drop_old_keys`), so that it holds about what plain `generate` holds. The keys a sliding layer must not see are
hidden by its mask, exactly as transformers' `sliding_window_overlay` hides them: a query sees a key when
`kv_idx > q_idx - sliding_window`, both counted in the slots plain `generate` gives them (a row's prompt slots, padding
included, then one slot per generated token). Rows of a ragged batch leave holes in our cache (slots of drafts another
row accepted), so slots are renumbered per row before the window is applied; the columns a windowed layer dropped
are then left out of its mask.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs



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


class WindowedLayer(DynamicLayer):
    """A sliding layer's keys and values in our loop: the cache's slots from `dropped` on (the older ones no query
    of any row can see any more). Slot numbers, sequence length and mask sizes stay those of the cache's full layers:
    cropping the tail and compacting tree paths work as on them, and a `generate` call continuing from the returned
    cache builds the sliding layers' masks from `get_mask_sizes` (the offset of a `DynamicSlidingWindowLayer`)."""

    is_sliding = True  # transformers reads a sliding layer's mask sizes from it (continuing, eager attention)

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def drop_front(self, slots: int) -> None:
        if slots > 0 and self.is_initialized:
            self.keys, self.values = self.keys[:, :, slots:], self.values[:, :, slots:]
            self.dropped += slots

    def get_seq_length(self) -> int:
        return self.dropped + super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return super().get_seq_length() + query_length, self.dropped


def full_kv_cache(config) -> DynamicCache:
    """The target's cache for our loop: as plain `generate` builds it, but a sliding layer drops its keys only when
    our loop says which ones no row can see any more (`WindowedLayer`, `drop_old_keys`)."""
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    cache.layers = [WindowedLayer() if sliding else layer for layer, sliding in zip(cache.layers, cache.is_sliding)]
    return cache


def drops_visible_keys(cache) -> bool:
    """True when a sliding layer of `cache` drops keys on its own once they leave the window (a cache built from the
    model's config): it cannot be rolled back to the accepted tokens. Ours (`WindowedLayer`) drop none a row may see."""
    return any(sliding and not isinstance(layer, WindowedLayer)
               for layer, sliding in zip(cache.layers, cache.is_sliding))


def dropped_slots(cache) -> int:
    """The cache slots the windowed layers dropped (the same for all of them; 0 without any)."""
    return next((layer.dropped for layer in cache.layers if isinstance(layer, WindowedLayer)), 0)


def drop_old_keys(cache, window: int | None, next_slots: list[int], kept_from: int) -> None:
    """Drop the windowed layers' slots that no query can see any more. `next_slots`: each row's next slot counted
    as plain `generate` counts them (its committed length - 1: the anchor's); a tree node at depth d sits at that + d,
    so the oldest key any of them sees is (the smallest next slot) - window + 1. Counted and cache slots coincide
    before `kept_from` (the start of the tail, where rows may have holes) and a cache slot is never counted higher
    than its index, so dropping up to there is safe and the tail is left to compaction."""
    if window is None or not next_slots:
        return
    end = min(min(next_slots) - window + 1, kept_from)
    for layer in cache.layers:
        if isinstance(layer, WindowedLayer):
            layer.drop_front(end - layer.dropped)


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
