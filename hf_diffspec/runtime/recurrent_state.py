"""Targets with linear-attention layers (Qwen3.5 / Qwen3.6 Gated DeltaNet, dense and MoE): rolling their recurrent
and convolution states back to the accepted tokens.

A linear-attention layer keeps no per-token K/V: it carries a recurrent state and the last inputs of its causal
convolution, and a verify forward advances both through every token it verifies, rejected drafts included. Cropping
the cache, which rolls full-attention K/V back, cannot undo that. So every step:

- before the verify forward, the linear layers' states are saved, and each layer's input is recorded during it;
- when the target accepts the whole chain, the states the forward left are the right ones;
- otherwise the saved states are put back and each linear layer alone advances them through the accepted tokens,
  from the inputs it was given in the verify forward. Those inputs are exact: the drafts form a chain, so a token's
  input depends only on the tokens before it. Only the linear layers run again (no attention, MLP/MoE or LM head).

Chains only: a linear layer reads its input as one sequence and ignores the tree mask, so a tree's sibling branches
would flow into each other's state. Batch size 1 only: a batch verifies rows of different lengths in one padded
rectangle (the padding would enter the shorter rows' states) and rows accept different numbers of tokens.

Imports: torch/transformers only (this file travels in `custom_generate/`).
"""

from contextlib import contextmanager, nullcontext
from functools import partial

# text configs whose linear-attention layers (Qwen3.5 GatedDeltaNet) this module rolls back
ROLLBACK_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def layer_types(config) -> set[str]:
    return set(getattr(config.get_text_config(), "layer_types", None) or [])


def has_linear_attention(config) -> bool:
    """Whether the target has linear-attention layers: it then verifies chains only (see the module docstring)."""
    return "linear_attention" in layer_types(config)


def linear_attention_supported(config) -> bool:
    """Linear-attention and full-attention layers only, of a model whose linear layers we know how to roll back."""
    return (config.get_text_config().model_type in ROLLBACK_MODEL_TYPES
            and layer_types(config) <= {"linear_attention", "full_attention"})


def refuse_unsupported_recurrent(model, drafter, rows: int) -> None:
    """Raise ValueError, before the first forward, for what a linear-attention target cannot run losslessly."""
    if not has_linear_attention(model.config):
        return
    name = type(model).__name__
    if rows > 1:
        raise ValueError(
            f"{name} has linear-attention layers, whose recurrent state a batch cannot roll back row by row (rows "
            "accept different numbers of drafts, and a padded row's padding would enter its state): speculative "
            "decoding runs it at batch size 1. Generate the rows one at a time."
        )
    if drafter.config.model_type == "dual_diffusion_drafter":
        raise ValueError(
            f"{name} has linear-attention layers, so its drafts are verified as chains, never trees: a D²SD dual "
            "drafter's prefix trees cannot run on it. Pass the dual drafter's DFlash drafter (drafter.first) instead."
        )


class RecurrentStates:
    """The linear-attention layers of a target and their states in `cache`; a target without such layers has none,
    and then every method does nothing. `replays` counts the steps whose states were rolled back and advanced again."""

    def __init__(self, model, cache):
        self.cache = cache
        # Qwen3.5's GatedDeltaNet modules carry their layer's type and index
        self.layers = {module.layer_idx: module for module in model.modules()
                       if getattr(module, "layer_type", None) == "linear_attention" and hasattr(module, "layer_idx")}
        self.saved: dict[int, tuple] = {}  # layer index: (conv states, recurrent states, token count or None)
        self.inputs: dict[int, object] = {}
        self.replays = 0

    def recording(self, layout):
        """Around the verify forward of the trees laid out in `layout` (a `TreeLayout`): save every linear layer's
        states and record the input it is given. A step of one token (a plain step) cannot be cut, so it saves
        nothing. Raises RuntimeError for several rows or a tree, which these layers would decode wrongly without a
        word (the candidate generator and `refuse_unsupported_recurrent` keep them from getting here)."""
        rows, num_slots = layout.tokens.shape
        if not self.layers or num_slots == 1:
            return nullcontext()
        if rows > 1 or not layout.chains:
            raise RuntimeError(
                f"a linear-attention target was handed {rows} rows of {'chains' if layout.chains else 'trees'} to "
                "verify; its recurrent states roll back one chain of one row only. This is a bug in the candidate "
                "generator or the refusals: please report it.")
        return self._recording()

    @contextmanager
    def _recording(self):
        for index in self.layers:
            layer = self.cache.layers[index]
            # transformers >= 5.25 also counts the tokens a linear layer has seen (its `get_seq_length`)
            length = getattr(layer, "cumulative_length_linear", None)
            self.saved[index] = ({k: s.clone() for k, s in layer.conv_states.items() if s is not None},
                                 {k: s.clone() for k, s in layer.recurrent_states.items() if s is not None},
                                 None if length is None else length.clone())

        def record(index, module, args, kwargs):
            self.inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        handles = [module.register_forward_pre_hook(partial(record, index), with_kwargs=True)
                   for index, module in self.layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def keep_accepted(self, paths: list[list[int]], num_slots: int) -> None:
        """After a chain of `num_slots` tokens was verified and the first `len(paths[0])` accepted (the anchor and
        the drafts the target agreed with), leave the linear layers' states as if only those had been seen."""
        accepted, inputs, saved = len(paths[0]), self.inputs, self.saved
        self.inputs, self.saved = {}, {}
        if not self.layers or accepted == num_slots:
            return
        for index, module in self.layers.items():
            layer = self.cache.layers[index]
            conv, recurrent, length = saved[index]
            layer.conv_states.update(conv)
            layer.recurrent_states.update(recurrent)
            if length is not None:
                layer.cumulative_length_linear.copy_(length)
            module(hidden_states=inputs[index][:, :accepted], cache=self.cache)
        self.replays += 1
