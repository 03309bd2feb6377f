"""The target's cache in the verify step: the one place it is created (`target_cache`), and everything that moves its
slots: cropping the tail, moving each row's chosen slots together, keeping rows, dropping a sliding layer's keys that
no row can see any more, and snapshotting linear-attention states.

Three forms, one function:
- transformers' `DynamicCache` as `generate` built it, when it holds every key the loop may need;
- `full_kv_cache` otherwise: a sliding layer keeps its keys in a `WindowedLayer`, every key some row may still see
  (the window behind the oldest row's next slot, and the cache's tail of tree nodes not yet compacted), the older ones
  dropped after each step (`drop_old_keys`). A cache built from such a model's config drops a sliding layer's keys once
  they leave the window, so it could not be cropped back to the accepted tokens or have accepted tree paths compacted
  into place. The keys a sliding layer must not see are hidden by its mask (`verify_inputs.py`);
- `StaticCache`, preallocated for the call, with `cache_implementation="static"` (the capture-ready step,
  `verify_graphs.py`): each layer writes new keys in place at its length, held on the device; cropping lowers that
  length and compacting is an in-place gather.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, StaticLayer

from .verify_inputs import VERIFY_WIDTHS

# slots past the longest row a static cache needs room for: hidden tree nodes before a compaction
# (`verifier.COMPACT_AFTER_HIDDEN_SLOTS`, 64, plus one step's) and the widest verify step's padding
HEADROOM = 64 + 2 * VERIFY_WIDTHS[-1]
CAPACITY_STEP = 256


def static_capacity(max_length: int) -> int:
    """The static cache's slots for a call of `max_length` tokens: room for its last step's tree, in whole
    `CAPACITY_STEP`s (calls a few tokens apart share one cache and its graphs: `verify_graphs.StaticStep`)."""
    return -(-(max_length + HEADROOM) // CAPACITY_STEP) * CAPACITY_STEP


def target_cache(config, cache=None, static_length: int | None = None):
    """The target's cache for one call: `cache` (what generate made; None with use_cache=False, when the loop still
    keeps one of its own: verifying drafts needs the prefix cached) when it can be cropped back to the accepted
    tokens, else a `full_kv_cache`; with `static_length` (`cache_implementation="static"`, the call's max length) a
    preallocated `StaticCache` of `static_capacity(static_length)` slots."""
    if static_length is not None:
        return StaticCache(config=config.get_text_config(decoder=True), max_cache_len=static_capacity(static_length))
    if cache is None or drops_visible_keys(cache):
        return full_kv_cache(config)
    return cache


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




def gather_slots(cache, start: int, index: torch.Tensor, end: int | None = None) -> None:
    """In every K/V layer, move row r's slot `start + index[r, j]` to slot `start + j`, in place, then crop the cache
    to `start + n` slots (`index` (rows, n), each row's entries ascending). `end`: the slots in use, when the layers'
    tensors hold more (a preallocated `StaticLayer`); else their length. RoPE stays right: a key keeps the position
    it was written at, whatever its slot; the rows' validity masks say which slots each row sees. Linear-attention
    layers hold no K/V (their states are rolled back by `verify_recurrent.py`); layers that keep no KV of their own
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
            # (a static layer may hold padding rows past the index's: `rows_bucket`)
            tensor[: index.shape[0], :, first : first + n] = tensor.gather(2, expanded[shape[1], shape[3], first])
    if end > start + n:
        crop_attention(cache, end - start - n)


def attention_layers(cache) -> list:
    """The cache's layers that hold per-token K/V (linear-attention layers hold states instead)."""
    return [layer for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]


def crop_attention(cache, tokens) -> None:
    """Drop the last `tokens` (> 0; a 0-d tensor on the device for a static cache) entries of every K/V layer (a
    `StaticLayer` lowers its length on the device and keeps its tensors). Linear-attention layers' states are left to
    `verify_recurrent.py` (`Cache.crop` refuses them); their token count (`get_seq_length`, which `generate` reads
    from the first layer) follows the K/V layers' length."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            count_linear_tokens(layer, -tokens)
        elif isinstance(layer, StaticLayer):  # (its own `crop` compares the count with 0 on the host)
            layer.cumulative_length.sub_(tokens)
        else:
            layer.crop(-tokens)


def cached_count(cache) -> torch.Tensor:
    """A static cache's slots in use, on the device (its first K/V layer's count; every one holds as many)."""
    return next(layer for layer in attention_layers(cache) if isinstance(layer, StaticLayer)).cumulative_length


def count_linear_tokens(layer, tokens: int) -> None:
    """Add `tokens` (may be negative) to a linear-attention layer's token count; transformers < 5.25 keeps none."""
    if getattr(layer, "cumulative_length_linear", None) is not None:
        layer.cumulative_length_linear.add_(tokens)


def select_rows(cache, index: torch.Tensor, moves=None) -> None:
    """Keep only the batch rows `index` in every layer of the cache: K/V, and linear-attention layers' conv and
    recurrent states (`Cache.batch_select_indices` skips those). `moves` (from `BatchState.drop_finished`): how a
    dynamic layer's K/V keep their rows in place (`kept_rows`); None: they are indexed."""
    for layer in cache.layers:
        # a layer whose rows are its keys and values alone (DynamicLayer's own row selection)
        own_rows = getattr(type(layer), "batch_select_indices", None) is DynamicLayer.batch_select_indices
        if moves is not None and own_rows:
            if layer.is_initialized:
                layer.keys, layer.values = kept_rows(layer.keys, moves), kept_rows(layer.values, moves)
        elif hasattr(layer, "batch_select_indices"):  # K/V (a layer may hold both K/V and linear states)
            layer.batch_select_indices(index)
        elif isinstance(layer, StaticLayer) and layer.is_initialized:
            if moves is not None:  # the first rows of the same memory, as many as their bucket: graphs stay valid
                whole = whole_tensor(layer.keys).shape[0]
                kept_rows(layer.keys, moves), kept_rows(layer.values, moves)
                rows = rows_bucket(moves[0], whole)
                layer.keys, layer.values = whole_tensor(layer.keys)[:rows], whole_tensor(layer.values)[:rows]
            else:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for key, state in states.items():
                if state is not None:
                    states[key] = state[index]


def rows_bucket(rows: int, whole: int) -> int:
    """The rows a static cache made for `whole` rows keeps while `rows` decode: the next power of two, at most all of
    them. Rows past `rows` are padding (`verify_inputs.CaptureReadyInputs.fill`): the forward's shapes, and so its
    graphs, change only when the rows left cross a power of two."""
    return min(1 << (rows - 1).bit_length(), whole)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor `tensor` is a view of (itself if none): a static layer's whole preallocated K/V."""
    return tensor if tensor._base is None else tensor._base


def kept_rows(tensor: torch.Tensor, moves) -> torch.Tensor:
    """The rows `BatchState.drop_finished` keeps, along the batch dim (dim 0), written into `tensor`: `moves` =
    (rows kept, the places rows move to, the rows that move). Each moving row is copied into its place and the result
    is the first rows, a view: only the moved rows are copied, where indexing copied every row (at 64 rows, a K/V
    cache of ~0.6 GB at each row that finished)."""
    kept, places, rows = moves
    if len(places):
        tensor[places] = tensor[rows]
    return tensor[:kept]


class LinearStates:
    """The convolution and recurrent states (and token counts) of a cache's linear-attention layers as they are now,
    per layer index; `restore` writes them back into the cache's own tensors (their addresses stay). A cache without
    such layers keeps nothing. `layers`: only these layer indices (None: all)."""

    def __init__(self, cache, layers=None):
        self.saved: dict[int, dict] = {}  # layer index -> {(kind, key): copy}
        for index, layer in enumerate(cache.layers):
            if not isinstance(layer, LinearAttentionCacheLayerMixin) or (layers is not None and index not in layers):
                continue
            copies = {(kind, key): state.clone() for kind in ("conv_states", "recurrent_states")
                      for key, state in getattr(layer, kind).items() if state is not None}
            if getattr(layer, "cumulative_length_linear", None) is not None:  # transformers >= 5.25 counts tokens
                copies["cumulative_length_linear", None] = layer.cumulative_length_linear.clone()
            self.saved[index] = copies
        self.cache = cache

    def of(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state, recurrent state) of layer `index` as saved."""
        return self.saved[index]["conv_states", 0], self.saved[index]["recurrent_states", 0]

    def restore(self) -> None:
        for index, copies in self.saved.items():
            layer = self.cache.layers[index]
            for (kind, key), saved in copies.items():
                (getattr(layer, kind) if key is None else getattr(layer, kind)[key]).copy_(saved)
