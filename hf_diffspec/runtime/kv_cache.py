"""Slot bookkeeping in the target's KV cache: crop it, or move each row's chosen slots together."""

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticLayer


def gather_slots(cache, start: int, index: torch.Tensor, end: int | None = None) -> None:
    """In every K/V layer, move row r's slot `start + index[r, j]` to slot `start + j`, in place, then crop the cache
    to `start + n` slots (`index` (rows, n), each row's entries ascending). `end`: the slots in use, when the layers'
    tensors hold more (a preallocated `StaticLayer`); else their length. RoPE stays right: a key keeps the position
    it was written at, whatever its slot; the rows' validity masks say which slots each row sees. Linear-attention
    layers hold no K/V (their states are rolled back by `recurrent_state.py`); layers that keep no KV of their own
    (Gemma 4's KV-sharing ones) are skipped. A sliding layer that dropped its oldest slots (`dropped`, see
    `sliding_window.WindowedLayer`) holds slot s at s - dropped."""
    layers = [layer for layer in attention_layers(cache) if layer.keys is not None]
    if not layers:
        return
    n = index.shape[1]
    if end is None:
        end = layers[0].keys.shape[2] + getattr(layers[0], "dropped", 0)
    index = index.to(layers[0].keys.device)[:, None, :, None]
    expanded = {}  # per (heads, head dim, first slot): the index expanded to it (layers usually share a few)
    for layer in layers:
        first = start - getattr(layer, "dropped", 0)
        for tensor in (layer.keys, layer.values):
            shape = tensor.shape
            if (shape[1], shape[3], first) not in expanded:
                expanded[shape[1], shape[3], first] = (index + first).expand(-1, shape[1], -1, shape[3])
            tensor[:, :, first : first + n] = tensor.gather(2, expanded[shape[1], shape[3], first])
    if end > start + n:
        crop_attention(cache, end - start - n)


def attention_layers(cache) -> list:
    """The cache's layers that hold per-token K/V (linear-attention layers hold states instead)."""
    return [layer for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]


def crop_attention(cache, tokens: int) -> None:
    """Drop the last `tokens` (> 0) entries of every K/V layer (a `StaticLayer` lowers its length on the device and
    keeps its tensors). Linear-attention layers' states are left to
    `recurrent_state.py` (`Cache.crop` refuses them); their token count (`get_seq_length`, which `generate` reads
    from the first layer) follows the K/V layers' length."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            count_linear_tokens(layer, -tokens)
        else:
            layer.crop(-tokens)


def count_linear_tokens(layer, tokens: int) -> None:
    """Add `tokens` (may be negative) to a linear-attention layer's token count; transformers < 5.25 keeps none."""
    if getattr(layer, "cumulative_length_linear", None) is not None:
        layer.cumulative_length_linear.add_(tokens)


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows `index` in every layer of the cache: K/V, and linear-attention layers' conv and
    recurrent states (`Cache.batch_select_indices` skips those)."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):  # K/V (a layer may hold both K/V and linear states)
            layer.batch_select_indices(index)
        elif isinstance(layer, StaticLayer) and layer.is_initialized:  # new tensors: a new batch size's buffers
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for key, state in states.items():
                if state is not None:
                    states[key] = state[index]


class LinearStates:
    """The convolution and recurrent states (and token counts) of a cache's linear-attention layers as they are now;
    `restore` writes them back into the cache's own tensors (their addresses stay). A cache without such layers
    keeps nothing."""

    def __init__(self, cache):
        self.saved = []  # (layer, kind, state index, copy)
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for kind in ("conv_states", "recurrent_states"):
                    self.saved += [(layer, kind, k, s.clone()) for k, s in getattr(layer, kind).items() if s is not None]
                if getattr(layer, "cumulative_length_linear", None) is not None:  # transformers >= 5.25 counts tokens
                    self.saved.append((layer, None, None, layer.cumulative_length_linear.clone()))

    def restore(self) -> None:
        for layer, kind, index, saved in self.saved:
            (layer.cumulative_length_linear if kind is None else getattr(layer, kind)[index]).copy_(saved)
