"""What our decoding loop cannot run losslessly, refused before the first forward with the alternative named.

Imports: torch/transformers only (this file travels in `custom_generate/`).
"""

from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from .verify_recurrent import ROLLBACK_MODEL_TYPES, linear_attention_supported
from .verify_cache import drops_visible_keys
from .verify_attention import SWITCHED_IMPLEMENTATIONS


def refuse_unsupported(model, generation_config, kwargs) -> None:
    """Raise ValueError when the target, its attention backend or its cache cannot run our loop.

    - Trees and ragged batches verify with 4D additive float masks: eager, sdpa and flex_attention (the mask becomes a
      score modifier) take them; FlashAttention 2 / 3 targets verify through `verify_attention.py`; other flash and
      paged kernels are refused.
    - Every step crops the target's cache to the accepted tokens and compacts the accepted tree path into place:
      only a `DynamicCache` kept on the device allows that, or the loop's own `StaticCache` for
      `cache_implementation="static"` (full-attention targets); offloaded and quantized caches do not.
    - The loop feeds the target's own decoder hidden states to the drafter: decoder-only targets.
    - Rolling a step back is cropping KV: a target with other layers (chunked attention, linear attention of models
      we do not know) would continue from a state that saw rejected drafts. Sliding-window layers keep all their KV in
      our cache and see their window through the mask (`verify_inputs.py`): one window for all of them, causal only.
      Linear-attention layers are rolled back by `verify_recurrent.py`, for the models it knows (Qwen3.5 / Qwen3.6,
      dense and MoE).
    """
    for check in SUPPORT_CHECKS:
        check(model, generation_config, kwargs)


def _refuse_encoder_decoder(model, generation_config, kwargs) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; speculative decoding with a DiffusionDrafter runs "
            "decoder-only (causal LM) targets. Use transformers' assisted generation with a small assistant model "
            "(generate(..., assistant_model=<an encoder-decoder assistant>)) for this one."
        )


def _refuse_other_layers(model, generation_config, kwargs) -> None:
    """Layers whose state cropping KV does not roll back, and sliding windows of different sizes."""
    config = model.config
    text_config = config.get_text_config(decoder=True)
    # as transformers' caches read them: sliding layers also where only `sliding_window` says so (Mistral), "dummy"
    # for layers without KV of their own (Gemma 4's KV-sharing layers reuse KV computed in the same forward)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    known = {"full_attention", "sliding_attention", "dummy"}
    if linear_attention_supported(config):
        known.add("linear_attention")
    other_layers = sorted(set(layer_types) - known)
    if other_layers == ["linear_attention"]:
        raise ValueError(
            f"{type(model).__name__} ({text_config.model_type}) has linear-attention layers; their recurrent state is "
            f"rolled back to the accepted drafts only for {', '.join(ROLLBACK_MODEL_TYPES)} (Qwen3.5 / Qwen3.6) "
            "targets. Decode this target with plain generate (no assistant_model)."
        )
    if other_layers:
        raise ValueError(
            f"{type(model).__name__} has {other_layers} layers; this version rolls rejected drafts back by cropping "
            "attention KV only, which would leave those layers' state wrong. Decode this target with plain "
            "generate (no assistant_model)."
        )
    windows = sorted({kw["sliding_window"] for kind, kw in zip(layer_types, layer_kwargs)
                      if kind == "sliding_attention"})
    if len(windows) > 1:
        raise ValueError(
            f"{type(model).__name__} has sliding-attention layers with different windows {windows}; speculative "
            "decoding masks one window for all of them. Decode this target with plain generate (no assistant_model)."
        )


def _refuse_bidirectional(model, generation_config, kwargs) -> None:
    text_config = model.config.get_text_config(decoder=True)
    if not getattr(text_config, "is_causal", True) or getattr(text_config, "use_bidirectional_attention", None) in (
            True, "all"):
        raise ValueError(
            f"{type(model).__name__} is configured for bidirectional attention (an embedding model); speculative "
            "decoding verifies drafts with causal attention. Generate with a causal configuration of the model, or "
            "with plain generate."
        )


def _refuse_attention_backend(model, generation_config, kwargs) -> None:
    """FlashAttention 2 / 3 targets prefill with their kernels and verify through `verify_attention.py` (SDPA, so
    only where the model has an SDPA path); other flash and paged kernels (hub kernels, paged caches) take no 4D
    mask."""
    verifies_with_sdpa = getattr(model, "_supports_sdpa", True)
    for where, attention in _attention_implementations(model.config):
        taken = attention in SWITCHED_IMPLEMENTATIONS and verifies_with_sdpa
        if ("flash" in attention or "paged" in attention) and not taken:
            # gpt-oss has no SDPA path (attention sinks): eager and flex_attention take the masks too
            advice = "'sdpa' (or 'eager')" if verifies_with_sdpa else (
                f"'eager' (or 'flex_attention'; {type(model).__name__} has no SDPA attention)")
            raise ValueError(
                f"attn_implementation={attention!r}{where} cannot take the 4D float attention masks that draft trees "
                f"and batches of different lengths are verified with; load the target with attn_implementation="
                f"{advice}."
            )


def _refuse_cache(model, generation_config, kwargs) -> None:
    """Caches the loop cannot crop and compact in place."""
    cache_implementation = kwargs.get("cache_implementation", generation_config.cache_implementation)
    if cache_implementation == "static":  # the capture-ready verify step (`verify_graphs.py`)
        layer_types = set(get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0])
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"cache_implementation='static' (the capture-ready verify step) needs a target whose layers all attend "
                f"fully; {type(model).__name__} has {sorted(layer_types - {'full_attention'})} layers, whose cache "
                "must drop keys or hold recurrent states. Leave cache_implementation unset (the default path)."
            )
    elif cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={cache_implementation!r} is not supported: speculative decoding crops the target's "
            "cache to the accepted tokens and compacts accepted tree paths every step, which needs a dynamic cache "
            "on the device, or the loop's own preallocated one. Leave cache_implementation unset (or 'dynamic'), or "
            "set it to 'static' (the capture-ready verify step, full-attention targets)."
        )
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # `past_key_values`: its name before 5.24
    if cache is not None and (not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False)):
        raise ValueError(
            f"a cache of type {type(cache).__name__}{' (offloaded)' if isinstance(cache, DynamicCache) else ''} "
            "is not supported: speculative decoding crops the target's cache to the accepted tokens and compacts "
            "accepted tree paths every step, which needs a DynamicCache on the device. Pass a DynamicCache or none."
        )
    if cache is not None and drops_visible_keys(cache):
        raise ValueError(
            "a DynamicCache built with the model's config drops the keys of sliding-window layers once they leave the "
            "window, so it cannot be rolled back to the accepted tokens. Pass DynamicCache() (no config: every layer "
            "keeps all its keys) or no cache."
        )


def _attention_implementations(config) -> list[tuple[str, str]]:
    """(where, implementation) of the config and its sub-configs (a multimodal model loaded with
    `attn_implementation={"text_config": ...}` sets the text model's alone); `where` names the sub-config."""
    found = [("", str(config._attn_implementation or ""))]
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found.append((f" (in {name})", str(sub._attn_implementation or "")))
    return found


# in this order: the first that applies names the problem
SUPPORT_CHECKS = (_refuse_encoder_decoder, _refuse_other_layers, _refuse_bidirectional, _refuse_attention_backend,
                  _refuse_cache)
