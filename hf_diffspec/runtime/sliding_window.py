"""Targets with sliding-window attention layers (Gemma 3 / 4, gpt-oss, Mistral, ...): every layer keeps its whole KV
cache, and the window lives in the attention mask.

A `DynamicCache` built from such a model's config drops a sliding layer's keys once they leave the window, so it cannot
be cropped back to the accepted tokens or have accepted tree paths compacted into place. Ours keeps every key (a
`DynamicLayer` where the config asks for a `DynamicSlidingWindowLayer`); the keys a sliding layer must not see are
hidden by its mask instead, exactly as transformers' `sliding_window_overlay` hides them: a query sees a key when
`kv_idx > q_idx - sliding_window`, both counted in the slots plain `generate` gives them (a row's prompt slots, padding
included, then one slot per generated token). Rows of a ragged batch leave holes in our cache (slots of drafts another
row accepted), so slots are renumbered per row before the window is applied.

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


def full_kv_cache(config) -> DynamicCache:
    """The target's cache for our loop: as plain `generate` builds it, but sliding layers keep every key."""
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    cache.layers = [DynamicLayer() if sliding else layer for layer, sliding in zip(cache.layers, cache.is_sliding)]
    return cache


def verify_masks(layout: AttentionLayout, mask: torch.Tensor | None, depths: torch.Tensor, past_valid: torch.Tensor,
                 prompt_length: int):
    """The `attention_mask` to verify a batch of trees with, from `tree_forward_inputs`' full-attention `mask`;
    `depths` (rows, n): each node's depth in its tree, -1 for padding slots (`TreeLayout.depths`).

    Full attention only: `mask` itself. Sliding layers only: `mask` within the window. Both: a dict by layer type (the
    form Gemma 3 / 4 and gpt-oss take). `None` (every row sees its whole cache and verifies a chain of one length)
    stays `None`: the verify attention then applies each sliding layer's window itself, counted bottom-right over the
    cache's slots, which is plain generate's window (no row has holes or padding then; `verify_attention.py`)."""
    if mask is None or layout.sliding_window is None:
        return mask
    windowed = mask.masked_fill(~_within_window(layout.sliding_window, depths, past_valid, prompt_length)[:, None],
                                torch.finfo(mask.dtype).min)
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
