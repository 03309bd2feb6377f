"""Configuration of the block-diffusion drafter (DFlash architecture).

Self-contained on purpose (torch/transformers only): `save_pretrained` copies this file into checkpoints so that
`AutoConfig.from_pretrained(dir, trust_remote_code=True)` works without hf_diffspec installed.

Published DFlash drafters load with no conversion step: `DiffusionDrafterConfig.from_pretrained` reads z-lab's layout
(a `qwen3`-type config with `dflash_config` nested, what `dflash.DFlashDraftModel` reads) and transformers' own DFlash
drafter layout (`muse_glimmer_assistant`) and maps every field that changes the drafts onto ours
(`config_dict_from_published`).
"""

from transformers import CONFIG_MAPPING, MuseGlimmerAssistantConfig, PreTrainedConfig, Qwen3Config


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """DFlash's rule: `num_features` decoder-layer outputs spread uniformly from layer 1 to layer L-3 (0-based)."""
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_target_layers <= num_features:
        return list(range(num_target_layers))
    if num_features == 1:
        return [num_target_layers // 2]
    last = max(num_target_layers - 3, 1)
    # a set: small targets would otherwise repeat a layer
    return sorted({int(round(1 + i * (last - 1) / (num_features - 1))) for i in range(num_features)})


def default_num_target_layers(target_layer_ids: list[int]) -> int:
    """The target depth `default_target_layer_ids` implies when a checkpoint does not record it: its last feature
    layer is L-3, so L = max(ids) + 3 (Qwen3-8B: [1, 9, 17, 25, 33] -> 36 layers)."""
    return max(target_layer_ids) + 3


class DiffusionDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of [`DiffusionDrafter`], a block-diffusion drafter conditioned on a target model's hidden states.

    The decoder dimensions (`hidden_size`, heads, `head_dim`) follow the target because the drafter borrows the
    target's input embeddings and LM head; depth and MLP width are free.

    Args:
        hidden_size (`int`): width of the residual stream; must equal the target's hidden size.
        intermediate_size (`int`): SwiGLU MLP width.
        num_hidden_layers (`int`): number of drafter decoder layers.
        num_attention_heads / num_key_value_heads / head_dim (`int`): attention shape (GQA, QK-norm, RoPE).
        rms_norm_eps (`float`), hidden_act (`str`), initializer_range (`float`), attention_bias (`bool`).
        rope_theta (`float`): RoPE base; taken from the target by `from_target`.
        rope_parameters (`dict`, *optional*): transformers' RoPE parameters (`rope_type` and its fields, e.g. Llama 3's
            `llama3` scaling); computed by transformers' `ROPE_INIT_FUNCTIONS`. `rope_scaling` is read as well.
            Default: plain RoPE with `rope_theta`.
        max_position_embeddings (`int`): longest context the drafter is meant for.
        vocab_size (`int`, *optional*): vocabulary of the target whose LM head the drafter borrows (`None`: the
            target's, filled in at bind time; transformers' DFlash layout does not record it).
        layer_types (`list[str]`, *optional*): per drafter layer, `"full_attention"` (default) or
            `"sliding_attention"`: the layer's queries see only keys less than `sliding_window` positions away.
        sliding_window (`int`, *optional*): window of the sliding-attention layers: a key is visible when
            |query position - key position| < sliding_window. `None`: no window.
        causal_layers (`list[int]`, *optional*): drafter layers in which a block slot sees only the slots up to itself
            (and the context), instead of the whole block (DFlash's default, `[]`); z-lab's sliding-window layers are
            causal.
        output_multiplier (`float`): draft logits are the target LM head's times this (z-lab's `output_multiplier`).
        final_logit_softcapping (`float`, *optional*): then tanh-capped at this value (z-lab's, for Gemma targets).
        input_embedding_scale (`float`, *optional*): embed the block's tokens as the target's raw embedding rows
            times this (z-lab's drafters); `None` (default): through the target's input embedding module as it is.
        block_size (`int`): tokens per block `[anchor, MASK x (block_size-1)]`; one forward drafts block_size-1 tokens.
        target_layer_ids (`list[int]`): 0-based target decoder layers whose outputs are fused into the drafter's
            context (`hidden_states[i + 1]` in transformers' numbering). Defaults to DFlash's uniform spread.
        num_target_layers (`int`): depth of the target the drafter was built for (validated at bind time).
        mask_token_id (`int`, *optional*): use this row of the target embedding table as the MASK embedding. When
            `None` (default) the drafter owns a trained MASK embedding and the target's vocabulary is untouched.
        target_model_type (`str`, *optional*): `model_type` of the target, for clear errors on mismatch.
        target_name_or_path (`str`, *optional*): where the target came from (informational, used in model cards).
        draft_role (`str`): `"first"` for a DFlash drafter, `"variable_prefix"` for a D²SD VP drafter.
        num_draft_tokens (`int`, *optional*): how many of the block's block_size-1 drafts are sent to the target for
            verification (default: all). Verifying costs more per token than it drafts, so on slow hardware fewer is
            often faster; chosen by measurement for shipped drafters.
        length_head (`bool`): the drafter carries an acceptance (length) head: for every draft slot of a block it
            predicts the probability that the target accepts that draft given it accepted the ones before (AdaFlash's
            adaptive length head, per position). At inference those probabilities feed the cost model that sizes
            what the target verifies. Trained alone with the drafter frozen (`hf-diffspec train length-head`).
        length_head_size (`int`): width of the head's MLP.
        draft_tree_budget (`int`, *optional*): draft a best-first TREE of at most this many nodes per step instead of
            a chain, from the same single drafter pass (DDTree-style: token paths ranked by the product of their
            slot probabilities); the cost model may verify fewer. `None` (default): chains. A published layout loads
            with the runtime's defaults (`RUNTIME_DEFAULTS`: trees and prompt lookup) unless the call sets them.
        draft_tree_width (`int`): most children per tree node (the top-ranked tokens of a slot).
        prompt_lookup_num_tokens (`int`, *optional*): when decoding greedily, also verify up to this many tokens
            copied from the row's own text after an earlier occurrence of its last tokens (prompt lookup, as
            transformers' `prompt_lookup_num_tokens`), as one more branch of each step's tree or, where the measured
            cost model finds it faster, alone without a drafter forward. `generate(prompt_lookup_num_tokens=...)`
            overrides it per call (0: off). `None` (default): off.
        draft_vocab_size (`int`, *optional*): draft over only this many target tokens, the ids in the checkpoint's
            `draft_vocab_ids` buffer (sorted; e.g. the most frequent tokens of the training data). Only their rows of
            the target's LM head are computed, which is most of a draft's cost on a CPU; a token outside the subset is
            never drafted, so verification stays exact. `None` (default): the full vocabulary.
        block_conv (`bool`): DFlash 2's grouped dynamic causal convolution over the block's positions, before and after
            every attention and MLP sublayer: out_t = sum_o (base[o] + delta_t[o, group]) * x_{t-o}, o < kernel,
            zero-padded at the block's start, delta_t a bias-free projection of the sublayer's normed input. It lets a
            slot see what the slots before it became, so the block is drafted coherently. Initialised as an exact
            no-op, so a DFlash drafter is the special case. Default False.
        block_conv_kernel (`int`): positions each convolution reaches back (DFlash 2: 2).
        block_conv_group_size (`int`): channels sharing one dynamic weight (DFlash 2: 16); divides hidden_size.
        selector_rank (`int`, *optional*): DFlash 2's candidate selector, with token codebooks of this rank: slot t's
            top `selector_top_k` tokens b are rescored with the token a drafted at slot t-1 (the anchor before slot
            1), S_t(a, b) = U_t(b) + <A[a] * W h_t, B[b]> with U_t the drafter's logits, and the block is drafted
            left to right from those scores. Initialised as an exact no-op (B = 0), so a DFlash drafter is the
            special case. `None` (default): no selector.
        selector_top_k (`int`): candidates per slot the selector chooses among (DFlash 2: 16).
    """

    model_type = "diffusion_drafter"
    #: what a drafter whose checkpoint does not choose (a published layout) runs with: best-first trees of up to 15
    #: nodes per step, sized by the measured cost model, and prompt-lookup branches when decoding greedily (the
    #: shipped SmolLM2 drafter's measured choice)
    RUNTIME_DEFAULTS = {"draft_tree_budget": 15, "draft_tree_width": 8, "prompt_lookup_num_tokens": 10}

    def __init__(
        self,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        attention_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 8192,
        vocab_size: int | None = 49152,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        causal_layers: list[int] | None = None,
        output_multiplier: float = 1.0,
        final_logit_softcapping: float | None = None,
        input_embedding_scale: float | None = None,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int = 30,
        mask_token_id: int | None = None,
        target_model_type: str | None = None,
        target_name_or_path: str | None = None,
        draft_role: str = "first",
        num_draft_tokens: int | None = None,
        length_head: bool = False,
        length_head_size: int = 256,
        draft_tree_budget: int | None = None,
        draft_tree_width: int = 8,
        prompt_lookup_num_tokens: int | None = None,
        draft_vocab_size: int | None = None,
        block_conv: bool = False,
        block_conv_kernel: int = 2,
        block_conv_group_size: int = 16,
        selector_rank: int | None = None,
        selector_top_k: int = 16,
        **kwargs,
    ):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one drafted token), got {block_size}")
        if hidden_size % num_attention_heads and head_dim is None:
            raise ValueError("hidden_size is not divisible by num_attention_heads; pass head_dim explicitly")
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if draft_role not in ("first", "variable_prefix"):
            raise ValueError(f"draft_role must be 'first' or 'variable_prefix', got {draft_role!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_bias = attention_bias
        self.rope_theta = float(rope_theta)
        # standardised (with `rope_theta` and a `rope_scaling` kwarg) by PreTrainedConfig.__init__ below
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = vocab_size
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if len(self.layer_types) != num_hidden_layers or unknown:
            raise ValueError(f"layer_types must name 'full_attention' or 'sliding_attention' for each of the "
                             f"{num_hidden_layers} layers, got {self.layer_types}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None for no window), got {sliding_window}")
        self.sliding_window = sliding_window
        self.causal_layers = sorted(causal_layers or [])
        if any(not 0 <= i < num_hidden_layers for i in self.causal_layers):
            raise ValueError(f"causal_layers {self.causal_layers} must be drafter layers (0..{num_hidden_layers - 1})")
        self.output_multiplier = float(output_multiplier)
        self.final_logit_softcapping = final_logit_softcapping or None
        self.input_embedding_scale = input_embedding_scale
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.target_layer_ids = (
            list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(num_target_layers)
        )
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {num_target_layers} layers")
        self.mask_token_id = mask_token_id
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.draft_role = draft_role
        if num_draft_tokens is not None and not 1 <= num_draft_tokens <= block_size - 1:
            raise ValueError(f"num_draft_tokens must be between 1 and block_size-1={block_size - 1}, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self.length_head = bool(length_head)
        self.length_head_size = length_head_size
        if draft_tree_budget is not None and draft_tree_budget < 1:
            raise ValueError(f"draft_tree_budget must be >= 1 drafted node (or None for chains), got {draft_tree_budget}")
        if draft_tree_width < 1:
            raise ValueError(f"draft_tree_width must be >= 1, got {draft_tree_width}")
        self.draft_tree_budget = draft_tree_budget
        self.draft_tree_width = draft_tree_width
        if prompt_lookup_num_tokens is not None and prompt_lookup_num_tokens < 0:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 0 (or None for no lookup), got {prompt_lookup_num_tokens}")
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= (vocab_size or draft_vocab_size):
            raise ValueError(
                f"draft_vocab_size must be between 1 and vocab_size={vocab_size} (or None for the full vocabulary), "
                f"got {draft_vocab_size}"
            )
        self.draft_vocab_size = draft_vocab_size
        if block_conv and (block_conv_kernel < 1 or hidden_size % block_conv_group_size):
            raise ValueError(
                f"block_conv needs block_conv_kernel >= 1 and block_conv_group_size dividing hidden_size={hidden_size}, "
                f"got kernel {block_conv_kernel} and group size {block_conv_group_size}"
            )
        self.block_conv = bool(block_conv)
        self.block_conv_kernel = block_conv_kernel
        self.block_conv_group_size = block_conv_group_size
        if selector_rank is not None and vocab_size is None:
            raise ValueError("the candidate selector has a codebook row per target token: set vocab_size")
        if selector_rank is not None and (selector_rank < 1 or not 1 <= selector_top_k <= vocab_size):
            raise ValueError(f"the selector needs selector_rank >= 1 and 1 <= selector_top_k <= vocab_size, got rank "
                             f"{selector_rank} and top-k {selector_top_k}")
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
        self.validate_rope()

    @property
    def uses_sliding_window(self) -> bool:
        return self.sliding_window is not None and "sliding_attention" in self.layer_types

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """`PreTrainedConfig.get_config_dict`, with a published DFlash layout read as ours."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return config_dict_from_published(config_dict), kwargs


def published_layout(config_dict: dict) -> str | None:
    """`"zlab"` for z-lab's DFlash / DFlash 2 layout, `"hf-native"` for transformers' DFlash drafter, else None."""
    if config_dict.get("model_type") == DiffusionDrafterConfig.model_type:
        return None
    architectures = config_dict.get("architectures") or []
    if "dflash_config" in config_dict or any(a in architectures for a in ("DFlashDraftModel", "DFlash2DraftModel")):
        return "zlab"
    if config_dict.get("model_type") == MuseGlimmerAssistantConfig.model_type:
        return "hf-native"
    return None


def config_dict_from_published(config_dict: dict) -> dict:
    """Our config fields for a published DFlash drafter's `config.json` (returned unchanged when it is ours).

    The published dict is first read by the config class its own drafter reads (z-lab's: the transformers config
    of its `model_type`, Qwen3's by default; transformers': `MuseGlimmerAssistantConfig`), so absent fields take the
    defaults that drafter runs with. The runtime's defaults (`DiffusionDrafterConfig.RUNTIME_DEFAULTS`) are added:
    a published checkpoint does not choose trees or prompt lookup.
    """
    layout = published_layout(config_dict)
    if layout is None:
        return config_dict
    fields = {k: v for k, v in config_dict.items()
              if k not in ("architectures", "auto_map", "model_type", "transformers_version")}
    if layout == "zlab":
        source_class = CONFIG_MAPPING.get(config_dict.get("model_type"), Qwen3Config)
        ours = _from_zlab(source_class(**fields), config_dict.get("dflash_config") or {},
                          config_dict.get("architectures") or [])
    else:
        ours = _from_hf_native(MuseGlimmerAssistantConfig(**fields))
    for name in ("dtype", "torch_dtype"):
        if config_dict.get(name) is not None:
            ours["dtype"] = config_dict[name]
    return {"model_type": DiffusionDrafterConfig.model_type, **DiffusionDrafterConfig.RUNTIME_DEFAULTS, **ours}


def _shared_fields(source) -> dict:
    heads = source.num_attention_heads
    return dict(
        hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(source, "num_key_value_heads", None) or heads,
        head_dim=getattr(source, "head_dim", None) or source.hidden_size // heads,
        hidden_act=getattr(source, "hidden_act", "silu"), rms_norm_eps=source.rms_norm_eps,
        rope_parameters=dict(source.rope_parameters), max_position_embeddings=source.max_position_embeddings,
        vocab_size=getattr(source, "vocab_size", None), tie_word_embeddings=False,
    )


def _from_zlab(source, nested: dict, architectures: list[str]) -> dict:
    """What `dflash.DFlashDraftModel` (0.1.0) reads: a `dflash_config` field first, then the config attribute."""

    def value(name, default=None):
        return nested.get(name, getattr(source, name, default))

    num_target_layers = getattr(source, "num_target_layers", None)
    layer_ids = value("target_layer_ids")
    if layer_ids is None and num_target_layers is None:
        raise ValueError("this z-lab DFlash config has neither dflash_config.target_layer_ids nor num_target_layers: "
                         "the target layers the drafter reads are unknown")
    if layer_ids is None:  # z-lab's rule: one target layer per drafter layer, spread like ours
        layer_ids = default_target_layer_ids(num_target_layers, source.num_hidden_layers)
    mask_token_id = value("mask_token_id")
    if mask_token_id is None:
        raise ValueError("this z-lab DFlash config has no dflash_config.mask_token_id: the target token whose "
                         "embedding is MASK is unknown")
    layer_types = list(getattr(source, "layer_types", None) or ["full_attention"] * source.num_hidden_layers)
    # z-lab: a sliding-window layer attends causally unless the config's `is_causal` says otherwise
    is_causal = getattr(source, "is_causal", None)
    causal = [i for i, kind in enumerate(layer_types)
              if (kind == "sliding_attention" if is_causal is None else bool(is_causal))]
    softcap = value("final_logit_softcapping")
    fields = dict(
        _shared_fields(source), attention_bias=getattr(source, "attention_bias", False),
        block_size=int(value("block_size", 16)), target_layer_ids=list(layer_ids),
        num_target_layers=num_target_layers or default_num_target_layers(layer_ids), mask_token_id=mask_token_id,
        layer_types=layer_types,
        sliding_window=getattr(source, "sliding_window", None) if "sliding_attention" in layer_types else None,
        causal_layers=causal, output_multiplier=float(value("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
    )
    dflash_2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    if "DFlash2DraftModel" in architectures or any(value(name) is not None for name in dflash_2):
        missing = [name for name in dflash_2 if value(name) is None]
        if missing:
            raise ValueError(f"this DFlash 2 config lacks {missing} (dflash_config or top level)")
        fields.update(block_conv=True, block_conv_kernel=int(value("conv_kernel_size")),
                      block_conv_group_size=int(value("conv_group_size")),
                      selector_rank=int(value("selector_rank")), selector_top_k=int(value("selector_top_k")))
    return fields


def _from_hf_native(source) -> dict:
    """What transformers' `MuseGlimmerAssistantModel` reads. Its bidirectional window is inclusive
    (|query - key| <= sliding_window), ours exclusive: one more."""
    layer_types = list(source.layer_types)
    return dict(
        _shared_fields(source), attention_bias=False, block_size=source.block_size,
        target_layer_ids=list(source.target_layer_ids),
        num_target_layers=default_num_target_layers(source.target_layer_ids), mask_token_id=source.mask_token_id,
        layer_types=layer_types,
        sliding_window=source.sliding_window + 1 if "sliding_attention" in layer_types else None,
    )


__all__ = ["DiffusionDrafterConfig", "config_dict_from_published", "default_num_target_layers",
           "default_target_layer_ids", "published_layout"]
