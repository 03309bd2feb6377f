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
Targets whose caches must drop keys (sliding windows) or hold recurrent states (linear attention) are refused with it
(`support.py`): they decode on the default path.

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import torch
from transformers import StaticCache

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
