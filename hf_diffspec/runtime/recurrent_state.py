"""Targets with linear-attention layers (Qwen3.5 / Qwen3.6 Gated DeltaNet, dense and MoE): rolling their recurrent
and convolution states back to each row's accepted tokens.

A linear-attention layer keeps no per-token K/V: it carries a recurrent state and the last inputs of its causal
convolution, and a verify forward advances both through every token it verifies, rejected drafts and the padding
after a shorter row's chain included. Cropping the cache, which rolls full-attention K/V back, cannot undo that. So
every step:

- before the verify forward, the linear layers' states are saved; during it, each layer's projections record what
  its state update consumes: the convolution's input (`in_proj_qkv`'s output) and the gate inputs `a` and `b`;
- when every row accepts all of its slots, the states the forward left are the right ones;
- otherwise the saved states are copied back into the cache's own tensors (their addresses never change) and only
  the state update runs again, over each row's accepted tokens: the causal convolution over [saved conv state ‖
  accepted inputs] and the gated delta recurrence. No projection, attention, MLP/MoE or LM head runs again. A row
  that accepted fewer tokens than the longest one is frozen past its count: its remaining steps run as identity
  updates (no decay, zero write strength), which leave a state exactly as it was.

The recorded inputs are exact: the drafts form a chain, so a token's input depends only on the tokens before it.
Left padding in a prompt enters no state: the prefill passes the 2D padding mask, which transformers hands the linear
layers to zero the padded inputs, and a zero input leaves a zero state zero.

Kernels: the recurrence runs through transformers' `torch_recurrent_gated_delta_rule`, which takes flash-linear-
attention's kernel where it is installed and runs on the inputs' device, its torch form otherwise (the CPU); the
convolution is torch's `conv1d`.

Chains only: a linear layer reads its input as one sequence and ignores the tree mask, so a tree's sibling branches
would flow into each other's state.

Imports: torch/transformers only (this file travels in `custom_generate/`).
"""

from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# text configs whose linear-attention layers (Qwen3.5 GatedDeltaNet) this module rolls back
ROLLBACK_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# the projections whose outputs a GatedDeltaNet's state update consumes (recorded in the verify forward)
CONSUMED_PROJECTIONS = ("in_proj_qkv", "in_proj_a", "in_proj_b")


def layer_types(config) -> set[str]:
    return set(getattr(config.get_text_config(), "layer_types", None) or [])


def has_linear_attention(config) -> bool:
    """Whether the target has linear-attention layers: it then verifies chains only (see the module docstring)."""
    return "linear_attention" in layer_types(config)


def linear_attention_supported(config) -> bool:
    """Linear-attention and full-attention layers only, of a model whose linear layers we know how to roll back."""
    return (config.get_text_config().model_type in ROLLBACK_MODEL_TYPES
            and layer_types(config) <= {"linear_attention", "full_attention"})


def refuse_unsupported_recurrent(model, drafter) -> None:
    """Raise ValueError, before the first forward, for what a linear-attention target cannot run losslessly."""
    if not has_linear_attention(model.config):
        return
    if drafter.config.model_type == "dual_diffusion_drafter":
        raise ValueError(
            f"{type(model).__name__} has linear-attention layers, so its drafts are verified as chains, never trees: "
            "a D²SD dual drafter's prefix trees cannot run on it. Pass the dual drafter's DFlash drafter "
            "(drafter.first) instead."
        )


class RecurrentStates:
    """The linear-attention layers of a target and their states in `cache`; a target without such layers has none,
    and then every method does nothing. `replays` counts the steps whose states were rolled back and advanced again."""

    def __init__(self, model, cache):
        self.cache = cache
        # Qwen3.5's GatedDeltaNet modules carry their layer's type and index
        self.layers = {module.layer_idx: module for module in model.modules()
                       if getattr(module, "layer_type", None) == "linear_attention" and hasattr(module, "layer_idx")}
        self.saved: dict[int, tuple] = {}  # layer index: (conv state, recurrent state)
        self.consumed: dict[int, dict[str, torch.Tensor]] = {}  # layer index: projection name: its output
        self.replays = 0

    def recording(self, num_slots: int):
        """Around the verify forward of `num_slots` tokens per row: save every linear layer's states and record what
        its state update consumes. A step of one token per row (a plain step) cannot be cut, so it saves nothing."""
        if not self.layers or num_slots == 1:
            return nullcontext()
        return self._recording()

    @contextmanager
    def _recording(self):
        for index in self.layers:
            layer = self.cache.layers[index]
            self.saved[index] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
            self.consumed[index] = {}

        def record(index, name, module, args, output):
            self.consumed[index][name] = output

        handles = [getattr(module, name).register_forward_hook(partial(record, index, name))
                   for index, module in self.layers.items() for name in CONSUMED_PROJECTIONS]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def keep_accepted(self, paths: list[list[int]], num_slots: int) -> None:
        """After each row verified a chain in a forward of `num_slots` slots per row and accepted the first
        `len(paths[row])` (its anchor and the drafts the target agreed with), leave the linear layers' states as if
        each row had seen only those."""
        counts, consumed, saved = [len(p) for p in paths], self.consumed, self.saved
        self.consumed, self.saved = {}, {}
        if not self.layers or min(counts) == num_slots:
            return
        kept = max(counts)
        for index, module in self.layers.items():
            _advance(module, self.cache.layers[index], saved[index], consumed[index], counts, kept)
        self.replays += 1


@torch.no_grad()
def _advance(module, layer, saved: tuple, consumed: dict, counts: list[int], kept: int) -> None:
    """Put `layer`'s saved states back and advance each row through its first `counts[row]` recorded tokens, as the
    GatedDeltaNet `module`'s forward would have (its projections' outputs in `consumed`). `kept`: max(counts)."""
    conv, recurrent = saved
    rows, channels, width = conv.shape
    device = conv.device
    counts = torch.tensor(counts, device=device)
    steps = torch.arange(kept, device=device)

    # causal convolution over [saved conv state ‖ accepted inputs]; the new conv state is each row's last `width`
    mixed = torch.cat([conv, consumed["in_proj_qkv"][:, :kept].transpose(1, 2).to(conv.dtype)], dim=-1)
    window = (counts[:, None] + torch.arange(width, device=device))[:, None, :].expand(rows, channels, width)
    layer.conv_states[0].copy_(mixed.gather(2, window))
    out = F.conv1d(mixed.to(module.conv1d.weight.dtype), module.conv1d.weight, module.conv1d.bias,
                   groups=channels)[..., -kept:]
    out = ACT2FN[module.activation](out).to(conv.dtype).transpose(1, 2)
    query, key, value = torch.split(out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(rows, kept, -1, module.head_k_dim)
    key = key.reshape(rows, kept, -1, module.head_k_dim)
    value = value.reshape(rows, kept, -1, module.head_v_dim)

    # the gated delta recurrence; past a row's count, identity updates (decay exp(0) = 1, write strength 0)
    live = (steps[None] < counts[:, None])[..., None]
    beta = consumed["in_proj_b"][:, :kept].sigmoid() * live
    g = -module.A_log.float().exp() * F.softplus(consumed["in_proj_a"][:, :kept].float() + module.dt_bias) * live
    _, state = _recurrent_rule(query, key, value, g=g, beta=beta, initial_state=recurrent, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
    layer.recurrent_states[0].copy_(state)


def _recurrent_rule(*args, **kwargs):
    # looked up at call time: the function kernels from the hub / flash-linear-attention replace is transformers'
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule(*args, **kwargs)
