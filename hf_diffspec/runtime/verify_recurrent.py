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

Trees: a linear layer's own forward reads its input as one sequence, so for a verify forward whose trees are not
all chains each GatedDeltaNet runs a tree form instead (`_tree_forward`): the same projections, a convolution whose
window for each node is the node and its ancestors (the saved conv state above the root), and a recurrence where each
node's state extends its parent's, slot by slot (parents come first). The cache's states are left as saved; the
commit advances them along each row's accepted path, which is a chain, as above.

The recording and the tree form belong to the call that runs them: while speculative calls run on the model
(`RecurrentStates.held`), the linear layers and their projections have a forward that looks up the recording of its
own thread (or task) in a `contextvars.ContextVar` and otherwise runs the module's own forward, so a plain or
speculative call on the same model in another thread meanwhile is neither recorded nor switched to the tree form.
The last call to end puts the modules' own forwards back.

The recorded inputs are exact: a node's input depends only on its ancestors (the tree mask in the other layers).
Left padding in a prompt enters no state: the prefill passes the 2D padding mask, which transformers hands the linear
layers to zero the padded inputs, and a zero input leaves a zero state zero.

Kernels: a chain's verify forward is the layer's own (transformers picks flash-linear-attention's chunked kernel and
causal-conv1d's where they are installed and run on the inputs' device, their torch forms otherwise, as on the CPU).
The rollback and the tree form run the convolution in torch and the recurrence through transformers'
`torch_recurrent_gated_delta_rule`, which is flash-linear-attention's `fused_recurrent_gated_delta_rule` where that
is installed and runs, its torch form otherwise: either way a plain recurrence from an explicit initial state, which
no tree can fool (the tree form calls it one node at a time, from the node's parent's state).

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import contextvars
import threading
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .verify_cache import LinearStates, count_linear_tokens
from .tree import host_to_device

# text configs whose linear-attention layers (Qwen3.5 GatedDeltaNet) this module rolls back
ROLLBACK_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# the projections whose outputs a GatedDeltaNet's state update consumes (recorded in the verify forward)
CONSUMED_PROJECTIONS = ("in_proj_qkv", "in_proj_a", "in_proj_b")


def layer_types(config) -> set[str]:
    return set(getattr(config.get_text_config(), "layer_types", None) or [])


def linear_attention_supported(config) -> bool:
    """Linear-attention and full-attention layers only, of a model whose linear layers we know how to roll back."""
    return (config.get_text_config().model_type in ROLLBACK_MODEL_TYPES
            and layer_types(config) <= {"linear_attention", "full_attention"})


class RecurrentStates:
    """The linear-attention layers of a target and their states in `cache`; a target without such layers has none,
    and then every method does nothing. `replays` counts the steps whose states were rolled back and advanced again."""

    def __init__(self, model, cache):
        self.cache = cache
        # Qwen3.5's GatedDeltaNet modules carry their layer's type and index
        self.layers = {module.layer_idx: module for module in model.modules()
                       if getattr(module, "layer_type", None) == "linear_attention" and hasattr(module, "layer_idx")}
        self.saved: LinearStates | None = None  # the layers' states before the verify forward
        self.consumed: dict[int, dict[str, torch.Tensor]] = {}  # layer index: projection name: its output
        self.replays = 0

    def held(self):
        """For the whole call: the linear layers and their projections get a forward that looks up this context's
        recording (`_ContextualForward`); the last call holding them puts their own forwards back."""
        if not self.layers:
            return nullcontext()
        patches = [(module, partial(_linear_layer_forward, module)) for module in self.layers.values()]
        patches += [(getattr(module, name), partial(_recorded_projection, module, name))
                    for module in self.layers.values() for name in CONSUMED_PROJECTIONS]
        return _holding(patches)

    def recording(self, layout):
        """Around the verify forward of the trees laid out in `layout` (a `TreeLayout`): save every linear layer's
        states and record what its state update consumes; trees that are not all chains go through the linear layers
        in their tree form. A step of one token per row (a plain step) cannot be cut, so it saves nothing."""
        if not self.layers or layout.tokens.shape[1] == 1:
            return nullcontext()
        return self._recording(None if layout.chains else layout)

    @contextmanager
    def _recording(self, tree_layout):
        self.saved = LinearStates(self.cache, self.layers)
        self.consumed = {index: {} for index in self.layers}
        token = _RECORDING.set(_Recording(self, tree_layout))
        try:
            yield
        finally:
            _RECORDING.reset(token)

    def keep_accepted(self, paths: list[list[int]], num_slots: int) -> None:
        """After each row verified its tree in a forward of `num_slots` slots per row and accepted the nodes
        `paths[row]` (its root and the drafts the target agreed with, a chain), leave the linear layers' states as if
        each row had seen only those. Every row accepting all its slots verified chains: its states are right."""
        counts, consumed, saved = [len(p) for p in paths], self.consumed, self.saved
        self.consumed, self.saved = {}, None
        if not self.layers or min(counts) == num_slots:
            return
        kept = max(counts)
        device = self.cache.layers[next(iter(self.layers))].recurrent_states[0].device
        # per row: its count, then its path padded with its last node (one copy to the device)
        shape = host_to_device([[len(p), *p, *[p[-1]] * (kept - len(p))] for p in paths], device)
        for index, module in self.layers.items():
            _advance(module, self.cache.layers[index], saved.of(index), consumed[index], shape[:, 1:], shape[:, 0])
        self.replays += 1


class _Recording:
    """The verify forward being recorded in this context: whose states (`RecurrentStates`), and the trees' layout
    when the linear layers run their tree form (None: chains, their own forward)."""

    def __init__(self, states: RecurrentStates, tree_layout):
        self.states = states
        self.tree_layout = tree_layout

    def index_of(self, module) -> int | None:
        """`module`'s layer index when it is one of the recorded target's linear layers, else None."""
        index = getattr(module, "layer_idx", None)
        return index if self.states.layers.get(index) is module else None


# the recording in this context (thread or task), if any: other calls' forwards through the same modules never see it
_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("hf_diffspec_recording", default=None)


def _linear_layer_forward(module, forward, *args, **kwargs):
    """A GatedDeltaNet's forward while calls hold it: its tree form in a context recording trees over it, its own
    forward (`forward`) everywhere else."""
    recording = _RECORDING.get()
    index = recording.index_of(module) if recording is not None and recording.tree_layout is not None else None
    if index is None:
        return forward(*args, **kwargs)
    return _tree_forward(module, recording.states.cache.layers[index], recording.tree_layout, *args, **kwargs)


def _recorded_projection(owner, name, forward, *args, **kwargs):
    """A projection of the GatedDeltaNet `owner` while calls hold it: its output, kept as what the state update
    consumes when this context records `owner`."""
    output = forward(*args, **kwargs)
    recording = _RECORDING.get()
    index = recording.index_of(owner) if recording is not None else None
    if index is not None:
        recording.states.consumed[index][name] = output
    return output


class _ContextualForward:
    """A module's `forward` while speculative calls hold the module: `dispatch(forward, *args, **kwargs)`, where
    `forward` is the one it replaced (the class's, or an instance's own such as accelerate's offload hooks), put back
    when the last holder leaves. How many hold it is kept here, on the module."""

    def __init__(self, module, dispatch):
        self.replaced = module.__dict__.get("forward")
        self.forward = self.replaced or type(module).forward.__get__(module)
        self.dispatch = dispatch
        self.holders = 0

    def __call__(self, *args, **kwargs):
        return self.dispatch(self.forward, *args, **kwargs)


_HOLDS_LOCK = threading.Lock()


@contextmanager
def _holding(patches: list):
    """Hold each (module, dispatch) of `patches` for the block: the first holder installs a `_ContextualForward`,
    the last one removes it, so nothing stays on the user's model between calls."""
    with _HOLDS_LOCK:
        for module, dispatch in patches:
            installed = module.__dict__.get("forward")
            if not isinstance(installed, _ContextualForward):
                installed = module.forward = _ContextualForward(module, dispatch)
            installed.holders += 1
    try:
        yield
    finally:
        with _HOLDS_LOCK:
            for module, _ in patches:
                installed = module.__dict__["forward"]
                installed.holders -= 1
                if installed.holders == 0:
                    if installed.replaced is None:
                        del module.forward
                    else:
                        module.forward = installed.replaced


@torch.no_grad()
def _advance(module, layer, saved: tuple, consumed: dict, nodes: torch.Tensor, counts: torch.Tensor) -> None:
    """Put `layer`'s saved states back and advance each row through the recorded tokens of its first `counts[row]`
    accepted nodes (`nodes` (rows, max count), a row's slots along its path), as the GatedDeltaNet `module`'s forward
    would have (its projections' outputs in `consumed`)."""
    conv, recurrent = saved
    rows, channels, width = conv.shape
    device, kept = conv.device, nodes.shape[1]
    steps = torch.arange(kept, device=device)
    consumed = {name: output.gather(1, nodes[..., None].expand(-1, -1, output.shape[-1]))
                for name, output in consumed.items()}

    # causal convolution over [saved conv state ‖ accepted inputs]; the new conv state is each row's last `width`
    mixed = torch.cat([conv, consumed["in_proj_qkv"].transpose(1, 2).to(conv.dtype)], dim=-1)
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
    beta = consumed["in_proj_b"].sigmoid() * live
    g = -module.A_log.float().exp() * F.softplus(consumed["in_proj_a"].float() + module.dt_bias) * live
    _, state = _recurrent_rule(query, key, value, g=g, beta=beta, initial_state=recurrent, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
    layer.recurrent_states[0].copy_(state)


def _recurrent_rule(*args, **kwargs):
    # looked up at call time: the function kernels from the hub / flash-linear-attention replace is transformers'
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule(*args, **kwargs)


def _tree_forward(module, layer, tree_layout, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
    """A GatedDeltaNet's forward over trees (`tree_layout`, a `TreeLayout`: slots in node order, parents first):
    the module's own projections, gating and output; a causal convolution whose window for each node is the node and
    its ancestors, continuing into the cache's conv state above the root; and the gated delta recurrence with each
    node's state extending its parent's (the cache's recurrent state at the root). Padding slots start from the
    root's state too (their outputs are never read). The cache's states are left as they were: the commit advances
    them along the accepted paths (`_advance`); only its token count moves, as the K/V layers' length does."""
    rows, slots, _ = hidden_states.shape
    conv_state, recurrent_state = layer.conv_states[0], layer.recurrent_states[0]
    channels, width = conv_state.shape[1:]
    device = hidden_states.device
    mixed = module.in_proj_qkv(hidden_states).transpose(1, 2)
    z = module.in_proj_z(hidden_states).reshape(rows, slots, -1, module.head_v_dim)
    b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)

    # each slot's predecessor in [conv state ‖ slots]: a node's parent, the state's last column for a root
    # (and a padding slot), the column before for a state column
    root = tree_layout.depths <= 0
    node_pred = torch.where(root, width - 1, tree_layout.parents + width)
    state_pred = (torch.arange(width, device=device) - 1).clamp(min=0).expand(rows, -1)
    pred = torch.cat([state_pred, node_pred], dim=1)
    window = [torch.arange(width, width + slots, device=device).expand(rows, -1)]
    for _ in range(module.conv_kernel_size - 1):
        window.insert(0, pred.gather(1, window[0]))
    window = torch.stack(window, dim=-1)  # (rows, slots, kernel): the oldest input first
    extended = torch.cat([conv_state, mixed.to(conv_state.dtype)], dim=-1)
    inputs = extended.gather(2, window.flatten(1)[:, None].expand(-1, channels, -1)).view(rows, channels, slots, -1)
    weight = module.conv1d.weight.squeeze(1)  # (channels, kernel)
    out = (inputs.to(weight.dtype) * weight[:, None]).sum(-1)
    if module.conv1d.bias is not None:
        out = out + module.conv1d.bias[:, None]
    out = ACT2FN[module.activation](out).to(hidden_states.dtype).transpose(1, 2)
    query, key, value = torch.split(out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(rows, slots, -1, module.head_k_dim)
    key = key.reshape(rows, slots, -1, module.head_k_dim)
    value = value.reshape(rows, slots, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    # node by node in slot order: states[:, 0] is the root's starting state, states[:, 1 + i] slot i's
    states = recurrent_state.new_zeros(rows, slots + 1, *recurrent_state.shape[1:], dtype=torch.float32)
    states[:, 0] = recurrent_state
    start = torch.where(root, 0, tree_layout.parents + 1)
    batch = torch.arange(rows, device=device)
    core = []
    for i in range(slots):
        node = slice(i, i + 1)
        out_i, states[:, i + 1] = _recurrent_rule(
            query[:, node], key[:, node], value[:, node], g=g[:, node], beta=beta[:, node],
            initial_state=states[batch, start[:, i]], output_final_state=True, use_qk_l2norm_in_kernel=True)
        core.append(out_i)
    core = torch.cat(core, dim=1)
    count_linear_tokens(layer, slots)

    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(rows, slots, -1))

