"""Drafter models (installed as `hf_diffspec.modeling`). Importing registers them with the Auto classes."""

from transformers import AutoConfig, AutoModel

from .configuration_diffusion_drafter import DiffusionDrafterConfig, default_target_layer_ids
from .modeling_diffusion_drafter import (
    DiffusionDrafter,
    check_target_compatible,
    drafter_config_for_target,
)

AutoConfig.register(DiffusionDrafterConfig.model_type, DiffusionDrafterConfig, exist_ok=True)
AutoModel.register(DiffusionDrafterConfig, DiffusionDrafter, exist_ok=True)
# save_pretrained copies the modeling files and writes `auto_map`, so checkpoints load with trust_remote_code alone
DiffusionDrafterConfig.register_for_auto_class()
DiffusionDrafter.register_for_auto_class("AutoModel")

__all__ = [
    "DiffusionDrafter",
    "DiffusionDrafterConfig",
    "check_target_compatible",
    "default_target_layer_ids",
    "drafter_config_for_target",
]
