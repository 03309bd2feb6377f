"""Attention for the verify forward, registered with transformers' `AttentionInterface`.

A verify step has q > 1 new tokens over a cache. transformers' SDPA path then takes a mask (it skips one only when
q == 1 or q == kv), and with a mask it copies the whole KV cache `num_key_value_groups` times per layer (`repeat_kv`)
and SDPA serves it with the memory-efficient kernel: at long context a verify step costs several plain steps. Here:

- chains (no mask: every row sees its whole cache and verifies the same number of tokens): causal attention aligned
  bottom-right (query i sees keys up to kv - q + i). SDPA's `is_causal` is aligned top-left when q != kv, so it is
  `torch.nn.attention.bias.causal_lower_right`, which runs FlashAttention with GQA and no mask tensor where the device
  allows it; elsewhere the causal mask is built once per forward and goes the way of the trees';
- trees and ragged rows (an additive mask per row): the query heads that share a key/value head are packed into the
  query dimension, (rows, kv_heads, groups * q, dim), so attention reads every key once and nothing is copied; the
  mask, repeated for the groups, is built once per forward (shared by all layers) with rows padded to a multiple of 16,
  the alignment the memory-efficient kernel reads a mask with in place.

The function is switched in for the verify forward only (`verify_attention`), on targets loaded with SDPA or
FlashAttention (eager and flex_attention targets verify as they are; a plain decode step of an SDPA target without
windows, one token a row seeing its whole cache, takes the model's own attention, as plain generate's steps do:
`VerifyAttention.needed`), and only in the thread (or asyncio task) that
runs that forward: the target's config answers `VERIFY_ATTENTION` there and its own implementation everywhere else,
so other calls on the same model, speculative or plain, run meanwhile as they would alone. The switch and the
masks its layers share live in a `contextvars.ContextVar`; while speculative calls run on a model, its config has a
class of its own, a subclass that reads that variable and counts the calls holding it; the last call to end puts the
config's own class back (`VerifyAttention.held`). The masks themselves come from `verify_inputs.py`. A FlashAttention target prefills with its own
kernels; its steps run here, chains through SDPA's FlashAttention kernel (no mask), trees and ragged rows packed:
transformers' FlashAttention path takes no 4D mask, and at batch 1 it reads the positions on the host in every
layer to look for packed sequences. transformers builds no mask for an implementation it does not know, so
every mask the layers need comes from the loop or from here: the chain's causal mask, and a sliding layer's window
(from the `sliding_window` the layer passes, as it does for FlashAttention).

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import contextlib
import contextvars
import threading

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .verify_inputs import packed_mask

VERIFY_ATTENTION = "hf_diffspec_verify"


class _VerifyForward:
    """The verify forward in progress in this context (thread or task): the configs it switched to
    `VERIFY_ATTENTION` (by id) and the masks its layers share, {key: (source mask, packed mask)}."""

    def __init__(self, config_ids: frozenset[int]):
        self.config_ids = config_ids
        self.packed: dict = {}


# the verify forward running in this context, if any: other threads and tasks never see it
_CURRENT: contextvars.ContextVar[_VerifyForward | None] = contextvars.ContextVar("hf_diffspec_verify_forward",
                                                                                 default=None)


def _memo() -> dict:
    """The masks the layers of this context's verify forward share (a fresh dict outside one)."""
    current = _CURRENT.get()
    return current.packed if current is not None else {}


def _lower_right_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: int) -> bool:
    """Whether SDPA's FlashAttention kernel serves a bottom-right causal chain here (GQA included, no mask)."""
    if query.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, True, groups > 1))


def verify_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: (rows, q, heads, dim) attention output, no weights."""
    rows, heads, q, dim = query.shape
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
        # the capture-ready step's preallocated cache: only its first slots are attended (`attended_slots`)
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    kv_heads, kv = key.shape[1], key.shape[2]
    others = ("position_bias", "softcap", "s_aux", "sinks")  # what SDPA's own path refuses or handles
    if dropout or not getattr(module, "is_causal", True) or any(kwargs.get(k) is not None for k in others):
        if attention_mask is None:  # transformers built none: the implementation is not one it makes masks for
            attention_mask = packed_mask(None, 1, q, kv, sliding_window, query.dtype, query.device, _memo())
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = heads // kv_heads
    if attention_mask is None and sliding_window is None and _lower_right_flash(query, key, value, groups):
        out = scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q, kv), scale=scaling,
                                           enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    # one new token per row that sees every key (a plain decode step): no mask, as plain generate's SDPA call
    sees_all = attention_mask is None and q == 1 and (sliding_window is None or kv <= sliding_window)
    mask = None if sees_all else packed_mask(attention_mask, groups, q, kv, sliding_window, query.dtype, query.device,
                                             _memo())
    packed = query.reshape(rows, kv_heads, groups * q, dim)  # head h = k * groups + g reads key/value head k
    out = scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    # reshape, not view: CUDA kernels return this output strided (heads outermost in memory)
    return out.reshape(rows, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(VERIFY_ATTENTION, verify_attention_forward)


# the implementations whose verify forwards run `verify_attention_forward`
SWITCHED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")


def _attention_configs(model) -> list:
    """The model's config and sub-configs whose attention implementation verify switches."""
    configs = [model.config, *(getattr(model.config, name, None) for name in getattr(model.config, "sub_configs", {}))]
    seen, out = set(), []
    for config in configs:
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            if _own_attributes(config).get("_attn_implementation_internal") in SWITCHED_IMPLEMENTATIONS:
                out.append(config)
    return out


def _switched_name(config) -> str | None:
    """`_attn_implementation_internal` of a config held by `verify_attention`: `VERIFY_ATTENTION` inside a verify
    forward of this context on it, the config's own value everywhere else."""
    current = _CURRENT.get()
    if current is not None and id(config) in current.config_ids:
        return VERIFY_ATTENTION
    return _own_attributes(config).get("_attn_implementation_internal")


def _set_name(config, value) -> None:
    _own_attributes(config)["_attn_implementation_internal"] = value


def _own_attributes(config) -> dict:
    # past the config's own __getattribute__ / __setattr__ (attribute maps, strict dataclass checks): they cost
    # microseconds, and these run in every attention layer of a verify forward
    return object.__getattribute__(config, "__dict__")


_HOLDS_LOCK = threading.Lock()


def _hold(config) -> None:
    """One more call holds `config`: the first gives it a class of its own whose `_attn_implementation_internal` is
    read per context (`_switched_name`), same name and fields, and which counts the calls holding it."""
    cls = type(config)
    if "_hf_diffspec_holders" not in cls.__dict__:
        cls = type(cls.__name__, (cls,), {
            "_attn_implementation_internal": property(_switched_name, _set_name), "_hf_diffspec_holders": 0,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_hf_diffspec_base": cls})
        object.__setattr__(config, "__class__", cls)
    cls._hf_diffspec_holders += 1


def _release(config) -> None:
    """One call less holds `config`: the last puts its own class back (nothing of the runtime stays on the model)."""
    cls = type(config)
    cls._hf_diffspec_holders -= 1
    if cls._hf_diffspec_holders == 0:
        object.__setattr__(config, "__class__", cls._hf_diffspec_base)


class VerifyAttention:
    """`verify_attention_forward` in place of `model`'s SDPA or FlashAttention attention for one call's verify
    forwards: `held()` around the call, `switched()` around each verify forward. Only forwards in the switched
    context (thread or task) see it: other calls on the same model, speculative or plain, keep the model's own
    attention and masks meanwhile."""

    def __init__(self, model):
        self.configs = _attention_configs(model)
        self.config_ids = frozenset(map(id, self.configs))
        # the model's own SDPA attention serves a plain decode step as plain generate's (`needed`)
        self.own_sdpa = bool(self.configs) and all(
            _own_attributes(c).get("_attn_implementation_internal") == "sdpa" for c in self.configs)

    def needed(self, queries: int, mask, sliding_window: int | None) -> bool:
        """Whether a forward of `queries` tokens per row with `mask` (None: every row sees its whole cache) takes the
        verify attention: not a plain decode step of an SDPA target without windows, which the model's own attention
        runs exactly as plain generate does (and costs no call of this module's per layer)."""
        return not (queries == 1 and mask is None and sliding_window is None and self.own_sdpa)

    @contextlib.contextmanager
    def held(self):
        with _HOLDS_LOCK:
            for config in self.configs:
                _hold(config)
        try:
            yield self
        finally:
            with _HOLDS_LOCK:
                for config in self.configs:
                    _release(config)

    @contextlib.contextmanager
    def switched(self):
        token = _CURRENT.set(_VerifyForward(self.config_ids))
        try:
            yield
        finally:
            _CURRENT.reset(token)


@contextlib.contextmanager
def verify_attention(model):
    """The forwards inside run the verify attention (a call's `held` and one forward's `switched` at once)."""
    attention = VerifyAttention(model)
    with attention.held(), attention.switched():
        yield
