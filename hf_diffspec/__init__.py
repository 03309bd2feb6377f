"""hf-diffspec: lossless speculative decoding for Hugging Face transformers with block-diffusion drafters.

    import hf_diffspec
    target, tok = hf_diffspec.load_target("smollm2-135m-instruct")
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=16)
    out = target.generate(**tok(prompt, return_tensors="pt"), assistant_model=drafter, max_new_tokens=128)

Importing the package registers the drafter with the Auto classes and routes `generate(assistant_model=drafter)` to
the speculative loop (see `hf_diffspec.generation`). What the loop measures outlives a call (speculation gates,
verify-cost corrections; `hf_diffspec.runtime.control_state`); `hf_diffspec.reset_speculation_state()` forgets it.
"""

from .modeling import DiffusionDrafter, DiffusionDrafterConfig, DualDiffusionDrafter, DualDiffusionDrafterConfig
from .runtime.tree import CandidateTree
from .runtime.drafting import DiffusionCandidateGenerator, PrefixTreeCandidateGenerator
from .runtime.control_policy import DraftLengthPolicy, FixedLength
from .runtime.control_state import reset_speculation_state
from .runtime.decoding import SpeculationStats, SpeculativeDecoderOnlyOutput, speculative_generate
from . import generation  # noqa: F401  (installs the generate dispatcher)
from .generation import assisted_generate_with_stock_loop
from .hub import save_drafter

__version__ = "0.1.0"


def __getattr__(name):
    # targets pulls in pip/zip/hub helpers that decoding does not need: import on first use
    if name == "load_target":
        from .targets import load_target

        return load_target
    if name == "load_drafter":
        from .drafters import load_drafter

        return load_drafter
    raise AttributeError(f"module 'hf_diffspec' has no attribute {name!r}")

__all__ = [
    "CandidateTree",
    "DiffusionCandidateGenerator",
    "DraftLengthPolicy",
    "DiffusionDrafter",
    "DiffusionDrafterConfig",
    "DualDiffusionDrafter",
    "DualDiffusionDrafterConfig",
    "FixedLength",
    "PrefixTreeCandidateGenerator",
    "SpeculationStats",
    "SpeculativeDecoderOnlyOutput",
    "assisted_generate_with_stock_loop",
    "load_drafter",
    "load_target",
    "reset_speculation_state",
    "save_drafter",
    "speculative_generate",
]
