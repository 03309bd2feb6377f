"""Keep only the accepted paths of verified trees in the target's KV cache."""

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def keep_accepted_paths(cache, past_length: int, paths: list[list[int]], padded_paths: torch.Tensor,
                        num_slots: int) -> None:
    """After a tree forward appended `num_slots` entries per row behind `past_length`, keep each row's `path`.

    Row r's accepted nodes move to slots past_length + 0..len(path)-1 and the cache is cropped to the longest path;
    `padded_paths` (rows, longest) repeats a shorter row's last node, and those copies are hidden by the row's validity
    mask. RoPE stays right: a node at depth d was written at position root + d, exactly its position on the linear
    path. Chains that accepted a prefix only need the crop. Linear-attention layers hold no K/V: their states are
    rolled back by `recurrent_state.py`. Layers that keep no KV of their own (Gemma 4's KV-sharing ones) are skipped.
    """
    kept = padded_paths.shape[1]
    if any(list(p) != list(range(len(p))) for p in paths):
        layers = [layer for layer in attention_layers(cache) if layer.keys is not None]
        index = (padded_paths.to(layers[0].keys.device) + past_length)[:, None, :, None]
        expanded = {}  # per (heads, head dim): the index expanded to it (layers usually share one)
        for layer in layers:
            for tensor in (layer.keys, layer.values):
                shape = (tensor.shape[1], tensor.shape[3])
                if shape not in expanded:
                    expanded[shape] = index.expand(-1, shape[0], -1, shape[1])
                tensor[:, :, past_length : past_length + kept] = tensor.gather(2, expanded[shape])
    if num_slots > kept:
        crop_attention(cache, num_slots - kept)


def attention_layers(cache) -> list:
    """The cache's layers that hold per-token K/V (linear-attention layers hold states instead)."""
    return [layer for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]


def crop_attention(cache, tokens: int) -> None:
    """Drop the last `tokens` entries of every K/V layer; linear-attention layers are left to `recurrent_state.py`
    (`Cache.crop` refuses them)."""
    for layer in attention_layers(cache):
        layer.crop(-tokens)
