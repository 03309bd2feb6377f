"""Block-diffusion drafter (DFlash architecture) as a transformers `PreTrainedModel`.

Read top to bottom: norms and RoPE, attention with the target's features injected as extra K/V, the decoder layer,
then `DiffusionDrafter` itself. The drafter has no embedding table and no LM head of its own: it borrows the target's
frozen ones (`bind_target`), which are never stored in the drafter's checkpoint.

Self-contained on purpose (torch/transformers + single-dot relative imports): `save_pretrained` copies this file into
checkpoints for `trust_remote_code` loading.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .configuration_diffusion_drafter import DiffusionDrafterConfig, published_layout

#: checkpoint tensor names of published DFlash drafters -> ours (transformers' `key_mapping` of `from_pretrained`):
#: transformers' DFlash drafter names the feature projection `encoder.*`; z-lab's DFlash 2 names its convolutions
#: per sublayer and its selector `candidate_selector` (upstream files store the codebooks without `.weight`)
PUBLISHED_KEY_MAPPING = {
    r"^encoder\.fc\.": "fc.",
    r"^encoder\.output_norm_enc\.": "hidden_norm.",
    r"\.attention_conv\.base_kernel": ".block_convs.0.base",
    r"\.attention_conv\.kernel_projection": ".block_convs.0.delta",
    r"\.mlp_conv\.base_kernel": ".block_convs.1.base",
    r"\.mlp_conv\.kernel_projection": ".block_convs.1.delta",
    r"^candidate_selector\.hidden_projection": "selector.proj",
    r"^candidate_selector\.predecessor_codebook(?:\.weight)?": "selector.previous_codes",
    r"^candidate_selector\.successor_codebook(?:\.weight)?": "selector.candidate_codes",
}


class DiffusionDrafterRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DiffusionDrafterRotaryEmbedding(nn.Module):
    """RoPE over absolute positions with transformers' RoPE functions (`config.rope_parameters`: plain, Llama 3's
    `llama3`, `yarn`, `dynamic`, ...); returns (cos, sin) of shape (batch, seq, head_dim)."""

    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @property
    def rope_init_fn(self):
        return self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]

    @staticmethod
    def compute_default_rope_parameters(config: DiffusionDrafterConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update  # RoPE types whose frequencies depend on the sequence length (dynamic, longrope)
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DiffusionDrafterAttention(nn.Module):
    """Non-causal attention whose keys/values are [context features ; block] and whose queries are the block only.

    The fused target features never pass through Q, the MLP or the residual stream: in every layer they are projected
    by that layer's own k_proj/v_proj (+ k_norm, RoPE at their absolute positions) and act as a K/V prefix. The cache,
    when given, accumulates them across decoding steps. The attention itself is transformers' implementation named
    by `config._attn_implementation` (sdpa by default, eager), given the additive float mask the drafter built.
    """

    is_causal = False  # the block attends bidirectionally; causal layers get it from their mask

    def __init__(self, config: DiffusionDrafterConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DiffusionDrafterRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DiffusionDrafterRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_context(self, context, cos, sin):
        """This layer's K/V of the fused context features (RoPE at their positions), as stored in the cache."""
        batch, ctx_len, _ = context.shape
        k = self.k_norm(self.k_proj(context).view(batch, ctx_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(context).view(batch, ctx_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, hidden_states, context, cos, sin, attention_mask=None, cache=None, extend_cache=True):
        batch, q_len, _ = hidden_states.shape
        # a context row shared by `groups` consecutive rows of blocks (training: a sequence's blocks in several rows)
        # is projected once and its K/V repeated, never its features
        groups = 1 if context is None else batch // context.shape[0]
        kv_input = hidden_states if context is None or groups > 1 else torch.cat([context, hidden_states], dim=1)
        kv_len = kv_input.shape[1]

        q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # cos/sin cover [context ; block]; queries are the block, i.e. the last q_len positions
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos[:, -kv_len:], sin[:, -kv_len:])
        if groups > 1:
            ctx_len = context.shape[1]
            context_k, context_v = self.project_context(context, cos[::groups, :ctx_len], sin[::groups, :ctx_len])
            k = torch.cat([context_k.repeat_interleave(groups, dim=0), k], dim=2)
            v = torch.cat([context_v.repeat_interleave(groups, dim=0), v], dim=2)
        if cache is not None and extend_cache:
            k, v = cache.update(k, v, self.layer_idx)
        elif cache is not None:  # read-only: a cached context per row, or one shared by every row (D²SD branches)
            layer = cache.layers[self.layer_idx]
            k = torch.cat([layer.keys.expand(batch, -1, -1, -1), k], dim=2)
            v = torch.cat([layer.values.expand(batch, -1, -1, -1), v], dim=2)
        if attention_mask is not None and attention_mask.shape[-1] > k.shape[2]:
            attention_mask = attention_mask[..., -k.shape[2]:]  # a sliding-window cache layer keeps the latest keys

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, q_len, -1))


class DiffusionDrafterMLP(nn.Module):
    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DiffusionDrafterBlockConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolutions around one sublayer (see `block_conv` in the config): one over
    the sublayer's normed input before it, one over its output after it, both with dynamic kernels projected from
    that normed input. `base` (2, kernel, hidden) holds the static kernels (before, after); `delta` projects to
    both dynamic kernels, (before, after) x offset x channel group, the layout of z-lab's DFlash 2 checkpoints.
    Queries arrive as whole blocks of `block_size` positions, one after another."""

    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__()
        self.config = config  # block_size is read per call: a trainer may change it on a loaded drafter
        self.kernel = config.block_conv_kernel
        self.group_size = config.block_conv_group_size
        self.base = nn.Parameter(torch.zeros(2, self.kernel, config.hidden_size))  # base[:, 0] = 1: identity
        self.delta = nn.Linear(config.hidden_size, 2 * self.kernel * config.hidden_size // self.group_size, bias=False)

    def forward(self, sublayer, normed: torch.Tensor) -> torch.Tensor:
        batch, q_len, hidden = normed.shape
        size = self.config.block_size
        if q_len % size:
            raise ValueError(f"block_conv needs whole blocks of {size} positions, got {q_len}")
        delta = self.delta(normed).view(batch, -1, size, 2, self.kernel, hidden // self.group_size)
        delta = delta.repeat_interleave(self.group_size, dim=-1)
        before = self.convolve(normed, self.base[0], delta[..., 0, :, :])
        return self.convolve(sublayer(before), self.base[1], delta[..., 1, :, :])

    def convolve(self, x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """out_t = sum_o (base[o] + delta_t[o]) * x_{t-o}, zero before the block's first position."""
        batch, q_len, hidden = x.shape
        size = self.config.block_size
        blocks = x.view(batch, -1, size, hidden)
        out = torch.zeros_like(blocks)
        for offset in range(self.kernel):
            shifted = F.pad(blocks, (0, 0, offset, 0))[:, :, :size]
            out = out + (base[offset] + delta[..., offset, :]) * shifted
        return out.view(batch, q_len, hidden)


class DiffusionDrafterDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffusionDrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DiffusionDrafterAttention(config, layer_idx)
        self.mlp = DiffusionDrafterMLP(config)
        self.input_layernorm = DiffusionDrafterRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DiffusionDrafterRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # DFlash 2: convolutions around the attention (0) and the MLP (1); None for DFlash
        self.block_convs = (nn.ModuleList(DiffusionDrafterBlockConv(config) for _ in range(2))
                            if config.block_conv else None)

    def _sublayer(self, index: int, sublayer, normed: torch.Tensor) -> torch.Tensor:
        return sublayer(normed) if self.block_convs is None else self.block_convs[index](sublayer, normed)

    def forward(self, hidden_states, context, cos, sin, attention_mask=None, cache=None, extend_cache=True):
        def attend(x):
            return self.self_attn(x, context, cos, sin, attention_mask, cache, extend_cache)

        hidden_states = hidden_states + self._sublayer(0, attend, self.input_layernorm(hidden_states))
        return hidden_states + self._sublayer(1, self.mlp, self.post_attention_layernorm(hidden_states))


class DiffusionDrafterLengthHead(nn.Module):
    """Per draft slot k of a block: the logit of P(the target accepts draft k | it accepted drafts 1..k-1).

    Input per slot: [x_k ; mean of the block's draft slots], with x the drafter's final hidden states, detached (the
    head never changes the drafts). A residual MLP as in AdaFlash's length head, but per position: the running
    products of its probabilities are the reach probabilities the cost model needs to size each verification. It
    reads hidden states only, so the verify length is decided before any draft goes through the LM head, and only
    the slots that will be verified do.
    """

    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__()
        size = config.length_head_size
        self.proj = nn.Linear(2 * config.hidden_size, size)
        self.mid = nn.Linear(size, size)
        self.out = nn.Linear(size, 1)

    def forward(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """draft_hidden (batch, block-1, hidden), every draft slot of the block -> acceptance logits (batch, block-1)."""
        x = draft_hidden.detach().to(self.proj.weight.dtype)
        pooled = x.mean(1, keepdim=True).expand_as(x)
        h = F.silu(self.proj(torch.cat([x, pooled], dim=-1)))
        h = h + F.silu(self.mid(h))
        return self.out(h).squeeze(-1)


class DiffusionDrafterSelector(nn.Module):
    """DFlash 2's candidate selector: drafts in a block are predicted independently, so the drafter's argmax path
    can be incoherent even when the right tokens are among its top candidates. Per slot t, the top-k tokens b are
    rescored given the token a chosen at slot t-1: S_t(a, b) = U_t(b) + <A[a] * W h_t, B[b]>, U_t the drafter's
    logits, h_t its hidden state, A and B rank-r token codebooks. B starts at zero: a fresh selector is a no-op."""

    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.previous_codes = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))  # A
        self.candidate_codes = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))  # B

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor,
                candidate_logits: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), previous (...) token ids, candidates and their logits (..., k) -> scores (..., k)."""
        query = F.embedding(previous, self.previous_codes) * self.proj(hidden.to(self.proj.weight.dtype))
        pair = (F.embedding(candidates, self.candidate_codes) * query[..., None, :]).sum(-1)
        return candidate_logits.float() + pair.float()


class ScaledTargetEmbedding(nn.Module):
    """The target's raw embedding rows times `scale`: how z-lab's drafters embed their block
    (`input_embedding_scale`), whatever scaling the target's own embedding module applies (Gemma's, for one)."""

    def __init__(self, embedding: nn.Module, scale: float):
        super().__init__()
        self.embedding = embedding
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embedding.weight) * self.scale


class DiffusionDrafterPreTrainedModel(PreTrainedModel):
    config_class = DiffusionDrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffusionDrafterDecoderLayer"]
    # forward has no loss-related kwargs: keep Trainer from assuming it scales the loss for accumulation
    accepts_loss_kwargs = False
    # transformers' attention functions that take the additive float masks trees and ragged batches need
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, DiffusionDrafterRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, DiffusionDrafterRotaryEmbedding):
            # non-persistent buffers: from_pretrained materialises them empty, so they are (re)computed here
            inv_freq, _ = module.rope_init_fn(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
        elif isinstance(module, DiffusionDrafterBlockConv):  # an exact no-op until trained
            module.base.zero_()
            module.base[:, 0].fill_(1.0)
            module.delta.weight.zero_()
        elif isinstance(module, DiffusionDrafterSelector):  # B = 0: an exact no-op until trained
            # unit-scale A: with both A and W h at initializer scale, <A[a] * W h, B[b]> would take thousands of steps
            # to reach the scale of the logits it corrects
            module.previous_codes.normal_(0.0, 1.0)
            module.candidate_codes.zero_()
        elif isinstance(module, DiffusionDrafter) and module.mask_embedding is not None:
            module.mask_embedding.normal_(0.0, std)


class DiffusionDrafter(DiffusionDrafterPreTrainedModel):
    r"""
    A DFlash-style block-diffusion drafter.

    One forward pass takes the embeddings of a block `[anchor, MASK x (block_size-1)]` and returns the final-normed
    hidden states of every block position; the target's LM head turns slot k into a draft for the token k positions
    after the anchor. The block attends bidirectionally to itself and to all committed context, whose information
    arrives as the target's hidden states of `config.target_layer_ids`, fused by `fc` + `hidden_norm` and injected as
    extra keys/values in every layer.

    Forward contract (the same one transformers' DFlash candidate generator uses):
        `noise_embeds` (batch, q, hidden): block embeddings;
        `context_hidden_states` (batch, c, len(target_layer_ids) * hidden), optional: raw target features of the
            context tokens not yet in `cache`; without a cache it may have fewer rows, each the context of as many
            consecutive rows of blocks (training: a sequence's blocks in several rows), projected once per row;
        `position_ids` (batch, c + q): absolute positions of [context ; block];
        `attention_mask`, optional: additive float mask (batch, 1, q, kv) over [cached ; context ; block] keys, or a
            2D 0/1 mask (batch, kv); `None` means every query sees every key;
        `cache`, optional: a transformers `Cache` that accumulates the context K/V (callers crop the block after use);
        `mask_positions` (batch, q) bool, optional: slots to replace by the MASK embedding inside the forward (what
            training uses, so that the MASK embedding is used inside forward under DDP/peft wrappers);
        `extend_cache` (default True): False reads `cache` without writing to it, broadcasting its (batch 1) context
            to every row: several blocks (D²SD branches) drafted against one cached context in one pass.

    The target's input embeddings and LM head are borrowed, frozen, through `bind_target` (done by `from_target` and
    `from_pretrained(..., target=...)`).

    `from_pretrained` also reads published DFlash drafters as they are on the Hub: z-lab's layout (DFlash and DFlash 2)
    and transformers' own DFlash drafter (see `DiffusionDrafterConfig` and `PUBLISHED_KEY_MAPPING`).

    With `config.draft_vocab_size` set, the drafter drafts over a reduced vocabulary: the sorted target ids in its
    `draft_vocab_ids` buffer (saved with the weights; `set_draft_vocabulary` changes them). Only those rows of the
    target's LM head are computed; `compute_logits` still returns logits over the full vocabulary, -inf elsewhere.
    """

    # a checkpoint with a length head loads without it (`length_head=False`): its weights are dropped on purpose
    _keys_to_ignore_on_load_unexpected = [r"^length_head\."]

    def __init__(self, config: DiffusionDrafterConfig):
        super().__init__(config)
        feature_size = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(feature_size, config.hidden_size, bias=False)
        self.hidden_norm = DiffusionDrafterRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DiffusionDrafterDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = DiffusionDrafterRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DiffusionDrafterRotaryEmbedding(config)
        self.length_head = DiffusionDrafterLengthHead(config) if config.length_head else None
        self.selector = DiffusionDrafterSelector(config) if config.selector_rank is not None else None
        # A drafter-owned MASK embedding keeps the target's vocabulary untouched.
        self.mask_embedding = (
            nn.Parameter(torch.zeros(config.hidden_size)) if config.mask_token_id is None else None
        )
        # Sorted target ids of a reduced draft vocabulary, saved with the weights; -1 until set or loaded.
        self.register_buffer(
            "draft_vocab_ids",
            None if config.draft_vocab_size is None else torch.full((config.draft_vocab_size,), -1, dtype=torch.long),
        )
        # Borrowed target modules live outside the module tree: never saved, never trained, never moved by .to().
        self._borrowed: dict[str, nn.Module] = {}
        self._draft_head = None  # (what it was sliced from, ids, weight rows, bias rows): see draft_vocab_head
        # load_state_dict writes draft_vocab_ids in place: slice the head again afterwards
        self.register_load_state_dict_post_hook(lambda module, _keys: setattr(module, "_draft_head", None))
        self.post_init()

    # ----- binding to a target -------------------------------------------------------------------------------------
    def bind_target(self, target: PreTrainedModel) -> "DiffusionDrafter":
        """Borrow `target`'s input embeddings and LM head after checking that the drafter was built for it."""
        if self.config.vocab_size is None:  # a layout that does not record it (transformers' DFlash drafter)
            self.config.vocab_size = target.config.get_text_config().vocab_size
        check_target_compatible(self.config, target)
        if self.draft_vocab_ids is not None:
            check_draft_vocab_ids(self.draft_vocab_ids, self.config.vocab_size)
        embed = target.get_input_embeddings()
        if self.config.input_embedding_scale is not None:
            embed = ScaledTargetEmbedding(embed, self.config.input_embedding_scale)
        self._borrowed = {"embed_tokens": embed, "lm_head": target.get_output_embeddings()}
        self._draft_head = None
        return self

    def set_draft_vocabulary(self, token_ids) -> "DiffusionDrafter":
        """Draft over only `token_ids` (target ids, any order, no repeats; stored sorted in `draft_vocab_ids` and
        saved with the weights), or over the full vocabulary with `None`. Updates `config.draft_vocab_size`."""
        if token_ids is None:
            self.draft_vocab_ids, self.config.draft_vocab_size = None, None
        else:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
            check_draft_vocab_ids(ids, self.config.vocab_size)
            self.config.draft_vocab_size = len(ids)
            self.draft_vocab_ids = ids.to(self.device)
        self._draft_head = None
        return self

    @property
    def is_bound(self) -> bool:
        return bool(self._borrowed)

    def _borrowed_module(self, name: str) -> nn.Module:
        if not self._borrowed:
            raise RuntimeError(
                "This DiffusionDrafter is not bound to a target model, so it has no embeddings or LM head. "
                "Create it with DiffusionDrafter.from_target(target), load it with "
                "DiffusionDrafter.from_pretrained(path, target=target), or call drafter.bind_target(target)."
            )
        return self._borrowed[name]

    @property
    def target_embed_tokens(self) -> nn.Module:
        return self._borrowed_module("embed_tokens")

    @property
    def target_lm_head(self) -> nn.Module:
        return self._borrowed_module("lm_head")

    # ----- the target's features ----------------------------------------------------------------------------------
    @property
    def target_feature_layers(self) -> list[int]:
        """`output_hidden_states` indices of the target layers this drafter reads (index 0 is the embeddings, so
        layer i is index i + 1)."""
        return [i + 1 for i in self.config.target_layer_ids]

    def gather_target_features(self, hidden_states) -> torch.Tensor:
        """The drafter's `context_hidden_states` from a target forward's `hidden_states` (all layers, or only
        `target_feature_layers` when the target was asked for those): the selected layers concatenated on the last
        dim, (batch, seq, len(target_layer_ids) * hidden)."""
        return torch.cat([hidden_states[i] for i in self.target_feature_layers], dim=-1)

    @classmethod
    def from_target(cls, target: PreTrainedModel, draft_vocab_ids=None, **config_overrides) -> "DiffusionDrafter":
        """A freshly initialised drafter sized to `target` (same width, heads and RoPE), bound to it, in its dtype;
        drafting over the target ids `draft_vocab_ids` only when given (see `set_draft_vocabulary`)."""
        if config_overrides.get("draft_vocab_size") is not None:
            raise ValueError("pass the reduced vocabulary itself, from_target(target, draft_vocab_ids=...), "
                             "not draft_vocab_size: its size follows from the ids")
        config = drafter_config_for_target(target.config, **config_overrides)
        drafter = cls(config).to(device=target.device, dtype=target.dtype)
        if draft_vocab_ids is not None:
            drafter.set_draft_vocabulary(draft_vocab_ids)
        return drafter.bind_target(target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, target: PreTrainedModel | None = None, **kwargs):
        """`PreTrainedModel.from_pretrained`, plus `target=`: bind to that target and match its device and dtype."""
        if target is not None:
            kwargs.setdefault("dtype", target.dtype)
        wants_info = kwargs.pop("output_loading_info", False)
        # a DFlash checkpoint turned into a DFlash 2 one: the new parts start as exact no-ops (_init_weights)
        added = ([".block_convs."] if kwargs.get("block_conv") else []) + (
            ["selector."] if kwargs.get("selector_rank") is not None else [])
        # mismatched shapes are reported below, naming the tensors
        kwargs.setdefault("ignore_mismatched_sizes", True)
        kwargs.setdefault("key_mapping", PUBLISHED_KEY_MAPPING)
        try:
            drafter, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except Exception as error:
            if "safetensor" not in type(error).__name__.lower():
                raise
            raise OSError(
                f"could not read the drafter weights in {pretrained_model_name_or_path} ({error}); the file is "
                "truncated or corrupt. Re-save it with drafter.save_pretrained(...) or re-download it."
            ) from error
        # a drafter with randomly initialised parts would draft garbage silently: refuse incomplete checkpoints
        broken = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
        if added:  # the drafter is unchanged until they are trained
            broken["missing_keys"] = [k for k in broken.get("missing_keys", []) if not any(a in k for a in added)]
            broken = {k: v for k, v in broken.items() if v}
        missing_head = [k for k in broken.get("missing_keys", []) if k.startswith("length_head.")]
        if missing_head:
            raise OSError(
                f"the drafter config at {pretrained_model_name_or_path} asks for a length head (length_head=True) but "
                f"the checkpoint has no weights for it ({missing_head}). Train one with `hf-diffspec train length-head "
                f"--init {pretrained_model_name_or_path}`, or load with length_head=False to draft without it."
            )
        if "draft_vocab_ids" in broken.get("missing_keys", []):
            raise OSError(
                f"the drafter config at {pretrained_model_name_or_path} drafts over a reduced vocabulary "
                f"(draft_vocab_size={drafter.config.draft_vocab_size}) but the checkpoint has no draft_vocab_ids "
                "tensor naming its tokens. Re-save the drafter after drafter.set_draft_vocabulary(ids), or load it "
                "with draft_vocab_size=None to draft over the full vocabulary."
            )
        if broken:
            layout = published_layout(PreTrainedConfig.get_config_dict(pretrained_model_name_or_path)[0])
            if layout is not None:
                raise OSError(
                    f"the {layout} DFlash checkpoint at {pretrained_model_name_or_path} does not hold the tensors its "
                    f"config describes: {broken}. If its download was cut short, download it again; if a complete "
                    "published drafter fails so, its layout differs from the ones this version maps (z-lab DFlash / "
                    "DFlash 2, transformers' DFlash drafter): please report it with its config.json."
                )
            raise OSError(
                f"the drafter checkpoint at {pretrained_model_name_or_path} is incomplete or corrupt: {broken}. "
                "Re-save it with drafter.save_pretrained(...) or re-download it."
            )
        # saved again, the drafter is in our layout: transformers would otherwise write the published names back
        drafter._weight_conversions = None
        if target is not None:
            drafter = drafter.to(target.device).bind_target(target)
        return (drafter, info) if wants_info else drafter

    # ----- the forward pass ---------------------------------------------------------------------------------------
    def mask_embeds(self, batch: int, length: int) -> torch.Tensor:
        """Embeddings of `length` MASK tokens, shape (batch, length, hidden)."""
        if self.mask_embedding is not None:
            return self.mask_embedding.expand(batch, length, -1)
        embed = self.target_embed_tokens
        mask_ids = torch.full((batch, length), self.config.mask_token_id, device=embed.weight.device)
        return embed(mask_ids)

    def block_embeds(self, anchor_ids: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """Embeddings of `[anchor, MASK x (block_size-1)]` for a (batch,) tensor of anchors."""
        block_size = block_size or self.config.block_size
        if self.mask_embedding is None:  # MASK is a target token: the whole block in one lookup
            ids = torch.full((anchor_ids.shape[0], block_size), self.config.mask_token_id, device=anchor_ids.device)
            ids[:, 0] = anchor_ids
            return self.target_embed_tokens(ids)
        anchor = self.target_embed_tokens(anchor_ids[:, None])
        masks = self.mask_embeds(anchor_ids.shape[0], block_size - 1).to(anchor.dtype)
        return torch.cat([anchor, masks], dim=1)

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        use_cache: bool | None = None,
        mask_positions: torch.Tensor | None = None,
        extend_cache: bool = True,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        batch, q_len, _ = noise_embeds.shape
        noise_embeds = noise_embeds.to(self.fc.weight.dtype)
        if mask_positions is not None:  # (batch, q) bool: slots that hold MASK, whatever noise_embeds has there
            masks = self.mask_embeds(batch, q_len).to(noise_embeds.dtype)
            noise_embeds = torch.where(mask_positions[..., None], masks, noise_embeds)
        context = None
        if context_hidden_states is not None and context_hidden_states.shape[1] > 0:
            expected = self.fc.in_features
            if context_hidden_states.shape[-1] != expected:
                raise ValueError(
                    f"context_hidden_states has {context_hidden_states.shape[-1]} features per token but this drafter "
                    f"expects {expected} (= {len(self.config.target_layer_ids)} target layers x hidden "
                    f"{self.config.hidden_size}); pass the target's hidden states of layers "
                    f"{self.config.target_layer_ids} concatenated on the last dimension"
                )
            context = self.hidden_norm(self.fc(context_hidden_states.to(self.fc.weight.dtype)))
        ctx_len = 0 if context is None else context.shape[1]
        if context is not None and context.shape[0] != batch and (batch % context.shape[0] or cache is not None):
            raise ValueError(
                f"context_hidden_states has {context.shape[0]} rows for {batch} rows of blocks: pass one context row "
                "per row of blocks, or (without a cache) one per group of consecutive rows, the rows being a multiple"
            )
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + ctx_len + q_len, device=noise_embeds.device)[None].expand(batch, -1)
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(
                f"position_ids must cover context + block ({ctx_len} + {q_len} positions), got {position_ids.shape[-1]}"
            )
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = expand_padding_mask(attention_mask, q_len, noise_embeds.dtype)
        elif attention_mask is not None:
            attention_mask = attention_mask.to(noise_embeds.dtype)

        masks = self.layer_masks(attention_mask, position_ids.expand(batch, -1), q_len, cache, extend_cache,
                                 noise_embeds.dtype)
        cos, sin = self.rotary_emb(noise_embeds, position_ids)
        hidden_states = noise_embeds
        for layer, mask in zip(self.layers, masks):
            hidden_states = layer(hidden_states, context, cos, sin, mask, cache, extend_cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    def layer_masks(self, attention_mask, position_ids, q_len: int, cache, extend_cache: bool, dtype) -> list:
        """Each layer's additive mask: the caller's, where the layer is causal (`causal_layers`: no key after the
        query) or has a sliding window (`layer_types`: no key `sliding_window` or more positions away) also
        blocking those keys. Positions, not slot indices, decide: a batch's cache holds slots a row does not see."""
        config = self.config
        kinds = [(i in config.causal_layers, config.uses_sliding_window and kind == "sliding_attention")
                 for i, kind in enumerate(config.layer_types)]
        if not any(causal or window for causal, window in kinds):
            return [attention_mask] * len(self.layers)
        distance = position_ids[:, -q_len:, None] - self.key_positions(position_ids, cache, extend_cache)[:, None]
        masks = {}
        for causal, window in set(kinds):
            blocked = torch.zeros_like(distance, dtype=torch.bool)
            if causal:
                blocked |= distance < 0
            if window:
                blocked |= distance.abs() >= config.sliding_window
            base = attention_mask if attention_mask is not None else distance.new_zeros(distance.shape, dtype=dtype)[:, None]
            masks[causal, window] = base.masked_fill(blocked[:, None], torch.finfo(dtype).min)
        return [masks[kind] if kind in masks else attention_mask for kind in kinds]

    def key_positions(self, position_ids: torch.Tensor, cache, extend_cache: bool = True) -> torch.Tensor:
        """Positions of the keys a forward attends to, [cached ; context ; block], (batch, kv), given those of
        [context ; block]. With a sliding window, the positions of cached keys are kept in the cache beside the
        layers' K/V, as one more layer: whatever crops the cache or selects its rows keeps them aligned with the
        keys. Without one (or in a cache of fixed layers), cached keys are taken as the positions just before."""
        if cache is None:
            return position_ids
        slot = self.config.num_hidden_layers
        if self.config.uses_sliding_window and getattr(cache, "layer_class_to_replicate", None) is not None:
            new = position_ids[:, None, :, None].float()  # shaped like keys: (batch, 1, seq, 1)
            if extend_cache:
                return cache.update(new, new, slot)[0][:, 0, :, 0].long()
            cached = cache.layers[slot].keys[:, 0, :, 0].long().expand(position_ids.shape[0], -1)
            return torch.cat([cached, position_ids], dim=1)
        past = cache.get_seq_length()
        before = position_ids[:, :1] - torch.arange(past, 0, -1, device=position_ids.device)
        return torch.cat([before, position_ids], dim=1)

    @torch.no_grad()
    def prefill_context(self, context_hidden_states: torch.Tensor, position_ids: torch.Tensor, cache) -> None:
        """Append the K/V of new context tokens to `cache` in every layer, without drafting a block. Context K/V
        depend only on the fused features (never on the block), so they can be computed ahead of any draft."""
        context = self.hidden_norm(self.fc(context_hidden_states.to(self.fc.weight.dtype)))
        if self.config.uses_sliding_window:
            self.key_positions(position_ids, cache)  # recorded beside the K/V
        cos, sin = self.rotary_emb(context, position_ids)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_context(context, cos, sin)
            cache.update(k, v, i)

    def add_length_head(self) -> "DiffusionDrafter":
        """Attach a freshly initialised length head (config.length_head becomes True); no-op if there is one."""
        if self.length_head is None:
            self.config.length_head = True
            head = DiffusionDrafterLengthHead(self.config).to(device=self.device, dtype=self.dtype)
            head.apply(self._init_weights)
            self.length_head = head
        return self

    def use_mask_token(self, mask_token_id: int) -> "DiffusionDrafter":
        """Embed MASK as the target's token `mask_token_id` from now on (`config.mask_token_id`), as DFlash engines
        (vLLM, SGLang, z-lab, transformers' DFlash path) do, and drop the drafter's own MASK embedding. The drafter
        drafts differently afterwards: fine-tune it with the new MASK before use."""
        if not 0 <= mask_token_id < self.config.vocab_size:
            raise ValueError(f"mask_token_id must be a target token id in [0, {self.config.vocab_size}), "
                             f"got {mask_token_id}")
        self.config.mask_token_id = int(mask_token_id)
        self.mask_embedding = None
        return self

    def draft_vocab_head(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(weight, bias, ids): the rows `draft_vocab_ids` of the target's LM head, detached (the head is frozen),
        and those ids on the head's device. Sliced once and kept until the target's head or the ids change: on a CPU
        (bf16, 15 slots, 8192 of 49152 rows, one thread) slicing on every call cost ~15% more than the matmul alone."""
        lm_head = self.target_lm_head
        weight = lm_head.weight
        source = (weight.data_ptr(), weight.dtype, weight.device, self.draft_vocab_ids.data_ptr())
        if self._draft_head is None or self._draft_head[0] != source:
            ids = self.draft_vocab_ids.to(weight.device)
            bias = lm_head.bias.detach()[ids] if getattr(lm_head, "bias", None) is not None else None
            self._draft_head = (source, ids, weight.detach()[ids], bias)
        _, ids, rows, bias = self._draft_head
        return rows, bias, ids

    def compute_draft_vocab_logits(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary only, (..., draft_vocab_size), and the target ids of their columns; with
        the full vocabulary, the target's logits and `None`. For callers that map columns back themselves (training's
        cross-entropy over V' logits): no full-vocabulary tensor is built. A published drafter's `output_multiplier`
        and `final_logit_softcapping` apply."""
        lm_head = self.target_lm_head
        # as one (tokens, hidden) matrix: a slice of the block (its draft slots) is a strided view, and a 3-D input
        # took a batched matmul that copied the head's weight on every call in the decoding loop (bf16 CPU, 15 slots
        # x 16384 rows: 11.4 ms a call against 2.1 ms as a 2-D matmul; a strided input: 3.1 ms against 0.5 ms)
        shape = hidden_states.shape[:-1]
        hidden_states = hidden_states.to(lm_head.weight.dtype).reshape(-1, hidden_states.shape[-1])
        if self.draft_vocab_ids is None:
            logits, ids = lm_head(hidden_states), None
        else:
            weight, bias, ids = self.draft_vocab_head()
            logits = F.linear(hidden_states, weight, bias)
        logits = logits.view(*shape, logits.shape[-1])
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits, ids

    def select_drafts(self, draft_hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                      temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's drafts chosen left to right by the candidate selector: at slot t, among the drafter's top-k
        tokens (of `logits` (rows, T, V)), by softmax(S_t(previous draft, .) / temperature), the argmax when
        `temperature` is None, else a sample. Returns drafts (rows, T), candidates (rows, T, k) and the selector's
        distribution over them (rows, T, k): the draft distribution rejection sampling must use."""
        top = logits.float().topk(min(self.config.selector_top_k, logits.shape[-1]), dim=-1)
        previous, drafts, distributions = anchors, [], []
        for t in range(logits.shape[1]):
            scores = self.selector(draft_hidden[:, t], previous, top.indices[:, t], top.values[:, t])
            probs = (scores / max(temperature or 1.0, 1e-5)).softmax(-1)
            pick = probs.argmax(-1) if temperature is None else torch.multinomial(probs, 1).squeeze(-1)
            previous = top.indices[:, t].gather(-1, pick[:, None]).squeeze(-1)
            drafts.append(previous)
            distributions.append(probs)
        return torch.stack(drafts, 1), top.indices, torch.stack(distributions, 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's full vocabulary through the borrowed (frozen) target LM head; with a
        reduced draft vocabulary only its rows are computed and every other token gets -inf (never drafted).

        Full-width logits keep every caller (chain, tree and D²SD drafting, sampling, rejection sampling) unchanged.
        Measured on a CPU (bf16, 1 row x 15 slots, one thread, interleaved): the -inf fill and the scatter add ~1 ms
        to the ~16 ms of the 8192-row matmul (all 49152 rows: ~94 ms). Callers that can map columns back themselves
        skip it, and a softmax over the full width, with `compute_draft_vocab_logits`."""
        logits, ids = self.compute_draft_vocab_logits(hidden_states)
        if ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_lm_head.weight.shape[0]), float("-inf"))
        return full.index_copy(-1, ids, logits)


def check_draft_vocab_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a clear error unless `ids` is a non-empty, strictly increasing 1-D tensor of ids in [0, vocab_size)."""
    problem = None
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        problem = f"a non-empty 1-D tensor of integer ids is needed, got shape {tuple(ids.shape)} of {ids.dtype}"
    elif int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        problem = f"ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}"
    elif ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        problem = "ids must be sorted and distinct"
    if problem:
        raise ValueError(
            f"invalid draft vocabulary (draft_vocab_ids): {problem}. Set it with drafter.set_draft_vocabulary(ids), "
            "or re-save the drafter (a checkpoint with config.draft_vocab_size needs its draft_vocab_ids tensor)."
        )


def expand_padding_mask(mask_2d: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, kv) 0/1 mask -> (batch, 1, q_len, kv) additive float mask (0 = attend, dtype min = blocked)."""
    blocked = mask_2d[:, None, None, :].eq(0).expand(-1, 1, q_len, -1)
    return torch.zeros(blocked.shape, dtype=dtype, device=mask_2d.device).masked_fill(blocked, torch.finfo(dtype).min)


def drafter_config_for_target(target_config, **overrides) -> DiffusionDrafterConfig:
    """A `DiffusionDrafterConfig` whose attention shape, RoPE (type and scaling included) and vocabulary follow
    `target_config`; a target with RoPE per layer type lends its full-attention layers' RoPE, and one whose layers
    differ in shape (Gemma 4's wider full-attention layers) lends a full-attention layer's shape with it."""
    text_config = target_config.get_text_config()
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    rope = dict(rope.get("full_attention") or {}) if "full_attention" in rope else rope
    rope_theta = rope.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    layer = text_config.per_layer_config[layer_types.index("full_attention") if "full_attention" in layer_types else 0]
    heads = layer.num_attention_heads
    values = dict(
        hidden_size=text_config.hidden_size,
        intermediate_size=text_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(layer, "num_key_value_heads", None) or heads,
        head_dim=getattr(layer, "head_dim", None) or text_config.hidden_size // heads,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_parameters=rope or None,
        max_position_embeddings=getattr(text_config, "max_position_embeddings", 8192),
        vocab_size=text_config.vocab_size,
        num_target_layers=text_config.num_hidden_layers,
        target_model_type=text_config.model_type,
        target_name_or_path=getattr(target_config, "_name_or_path", None) or None,
    )
    values.update(overrides)
    return DiffusionDrafterConfig(**values)


def check_target_compatible(config: DiffusionDrafterConfig, target: PreTrainedModel) -> None:
    """Raise a clear error when `target` is not a model this drafter can be used with."""
    text_config = target.config.get_text_config()
    problems = []
    if text_config.hidden_size != config.hidden_size:
        problems.append(f"hidden size {text_config.hidden_size} != drafter's {config.hidden_size}")
    if text_config.vocab_size != config.vocab_size:
        problems.append(f"vocabulary {text_config.vocab_size} != drafter's {config.vocab_size}")
    if text_config.num_hidden_layers != config.num_target_layers:
        problems.append(f"{text_config.num_hidden_layers} layers != the {config.num_target_layers} the drafter expects")
    elif max(config.target_layer_ids) >= text_config.num_hidden_layers:
        problems.append(f"target_layer_ids {config.target_layer_ids} exceed its {text_config.num_hidden_layers} layers")
    if config.target_model_type and text_config.model_type != config.target_model_type:
        problems.append(f"model_type {text_config.model_type!r} != {config.target_model_type!r}")
    if target.get_output_embeddings() is None:
        problems.append("it has no LM head (load it with AutoModelForCausalLM)")
    if problems:
        raise ValueError(
            "This drafter was built for a different target model: "
            + "; ".join(problems)
            + f". The drafter expects target {config.target_name_or_path or config.target_model_type!s}; "
            "train or load a drafter for this target (DiffusionDrafter.from_target(target) makes a new one)."
        )


__all__ = ["PUBLISHED_KEY_MAPPING", "DiffusionDrafter", "DiffusionDrafterLengthHead", "DiffusionDrafterPreTrainedModel", "drafter_config_for_target", "check_target_compatible", "check_draft_vocab_ids"]
