"""Drafter training (installed as `hf_diffspec.trainers`): data shards, Trainer subclasses, the training pipeline."""

from .block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer, VariablePrefixTrainer
from .data import DrafterDataset, write_generated_data, write_relabel_data
from .opd import ReverseKLTrainer, run_opd
from .pipeline import TrainConfig, train_drafter

__all__ = [
    "BlockDiffusionCollator",
    "BlockDiffusionTrainer",
    "DrafterDataset",
    "ReverseKLTrainer",
    "TrainConfig",
    "VariablePrefixTrainer",
    "run_opd",
    "train_drafter",
    "write_generated_data",
    "write_relabel_data",
]
