"""Configuration of the block-diffusion drafter (DFlash architecture).

Self-contained on purpose (torch/transformers only): `save_pretrained` copies this file into checkpoints so that
`AutoConfig.from_pretrained(dir, trust_remote_code=True)` works without hf_diffspec installed.
"""

from transformers import PreTrainedConfig


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
        max_position_embeddings (`int`): longest context the drafter is meant for.
        vocab_size (`int`): vocabulary of the target whose LM head the drafter borrows.
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
            slot probabilities); the cost model may verify fewer. `None` (default): chains.
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
        max_position_embeddings: int = 8192,
        vocab_size: int = 49152,
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
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = vocab_size
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
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab_size:
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
        if selector_rank is not None and (selector_rank < 1 or not 1 <= selector_top_k <= vocab_size):
            raise ValueError(f"the selector needs selector_rank >= 1 and 1 <= selector_top_k <= vocab_size, got rank "
                             f"{selector_rank} and top-k {selector_top_k}")
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


__all__ = ["DiffusionDrafterConfig", "default_target_layer_ids"]
