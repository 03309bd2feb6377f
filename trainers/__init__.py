"""Drafter training (installed as `hf_diffspec.trainers`): configurations (`TrainingArguments` subclasses), data
shards, Trainer subclasses, and the pipeline above them (`train_drafter`, `run_opd`)."""

from .block_diffusion import (
    BlockDiffusionCollator,
    BlockDiffusionTrainer,
    LengthHeadTrainer,
    ReverseKLTrainer,
    VariablePrefixTrainer,
)
from .configs import (
    DrafterTrainingArguments,
    LengthHeadConfig,
    OnPolicyDistillationConfig,
    ReverseKLConfig,
    VariablePrefixConfig,
)
from .data import DrafterDataset, write_generated_data, write_relabel_data
from .pipeline import run_opd, train_drafter

__all__ = [
    "BlockDiffusionCollator",
    "BlockDiffusionTrainer",
    "DrafterDataset",
    "DrafterTrainingArguments",
    "LengthHeadConfig",
    "LengthHeadTrainer",
    "OnPolicyDistillationConfig",
    "ReverseKLConfig",
    "ReverseKLTrainer",
    "VariablePrefixConfig",
    "VariablePrefixTrainer",
    "run_opd",
    "train_drafter",
    "write_generated_data",
    "write_relabel_data",
]
