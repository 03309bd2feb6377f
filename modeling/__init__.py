"""Drafter models (installed as `hf_diffspec.modeling`). Importing registers them with the Auto classes."""

from transformers import AutoConfig, AutoModel

from .configuration_diffusion_drafter import DiffusionDrafterConfig, default_target_layer_ids, published_layout
from .configuration_dual_drafter import DualDiffusionDrafterConfig
from .modeling_diffusion_drafter import (
    DiffusionDrafter,
    check_target_compatible,
    drafter_config_for_target,
)
from .modeling_dual_drafter import DualDiffusionDrafter

for _config, _model in [(DiffusionDrafterConfig, DiffusionDrafter), (DualDiffusionDrafterConfig, DualDiffusionDrafter)]:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    # save_pretrained copies the modeling files and writes `auto_map`, so checkpoints load with trust_remote_code alone
    _config.register_for_auto_class()
    _model.register_for_auto_class("AutoModel")

__all__ = [
    "DiffusionDrafter",
    "DiffusionDrafterConfig",
    "DualDiffusionDrafter",
    "DualDiffusionDrafterConfig",
    "check_target_compatible",
    "default_target_layer_ids",
    "drafter_config_for_target",
    "published_layout",
]
