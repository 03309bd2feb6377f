"""Configuration of the D²SD dual drafter (a first DFlash drafter + a variable-prefix drafter) as one checkpoint.

Self-contained (torch/transformers + single-dot relative imports) for `trust_remote_code` loading.
"""

from transformers import PreTrainedConfig

from .configuration_diffusion_drafter import DiffusionDrafterConfig


class DualDiffusionDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of [`DualDiffusionDrafter`].

    Args:
        first_config (`dict`): config of the first (DFlash) drafter.
        vp_config (`dict`, *optional*): config of the variable-prefix drafter; `None` reuses the first drafter as the
            second (the paper's "DFlash -> DFlash" ablation).
        num_branches (`int`): K, the prefix lengths re-drafted from (top-K of the rejection-boundary posterior).
        max_depth (`int`, *optional*): deepest tree level verified (default: the first drafter's block_size - 1).
        tree_budget (`int`): most tree nodes (root included) sent to the target per step; nodes are kept by their
            estimated probability of being reached (product of confidences along the path).
        branch_length (`int`): tokens each branch proposes from its branch point on (deeper nodes are rarely worth
            verifying, and each costs an LM-head row).
        branches_from_first_pass (`bool`): ablation without any second pass: branch alternatives and continuations
            come from the first drafter's own block distributions (the paper's "+ K resampled branches").
    """

    model_type = "dual_diffusion_drafter"
    sub_configs = {"first_config": DiffusionDrafterConfig, "vp_config": DiffusionDrafterConfig}

    def __init__(self, first_config=None, vp_config=None, num_branches: int = 4, max_depth: int | None = None,
                 tree_budget: int = 16, branch_length: int = 4, branches_from_first_pass: bool = False, **kwargs):
        if isinstance(first_config, dict):
            first_config = DiffusionDrafterConfig(**first_config)
        if isinstance(vp_config, dict):
            vp_config = DiffusionDrafterConfig(**vp_config)
        self.first_config = first_config if first_config is not None else DiffusionDrafterConfig()
        self.vp_config = vp_config
        block = self.first_config.block_size
        if not 1 <= num_branches <= block - 1:
            raise ValueError(
                f"num_branches={num_branches}: a block of {block} has only {block - 1} prefix lengths to branch from"
            )
        if vp_config is not None:
            mismatched = [name for name in ("hidden_size", "vocab_size", "num_target_layers", "target_layer_ids",
                                            "block_size") if getattr(vp_config, name) != getattr(self.first_config, name)]
            if mismatched:
                raise ValueError(
                    f"the VP drafter does not match the first drafter in {mismatched}: it was trained for another "
                    "target or block size; train it on this first drafter's target with the same block size"
                )
        self.num_branches = num_branches
        self.max_depth = max_depth if max_depth is not None else block - 1
        if not 1 <= self.max_depth <= block - 1:
            raise ValueError(f"max_depth must be between 1 and {block - 1}, got {self.max_depth}")
        if tree_budget < 2:
            raise ValueError(f"tree_budget must be >= 2 (the root and one draft), got {tree_budget}")
        self.tree_budget = tree_budget
        self.branches_from_first_pass = branches_from_first_pass
        if branch_length < 1:
            raise ValueError(f"branch_length must be >= 1, got {branch_length}")
        self.branch_length = branch_length
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["first_config"] = self.first_config.to_dict()
        out["vp_config"] = self.vp_config.to_dict() if self.vp_config is not None else None
        return out


__all__ = ["DualDiffusionDrafterConfig"]
