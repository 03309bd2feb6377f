"""The D²SD dual drafter: a first DFlash drafter plus a variable-prefix (VP) drafter, saved and loaded as one model.

`target.generate(**inputs, assistant_model=dual_drafter)` drafts a block with the first drafter, picks the K prefix
lengths where rejection is likeliest, re-drafts all K branches with the VP drafter in one batched pass, and verifies
the resulting prefix tree in one target forward (the tree building lives in hf_diffspec's runtime).

Self-contained (torch/transformers + single-dot relative imports) for `trust_remote_code` loading.
"""

from transformers import PreTrainedModel

from .configuration_dual_drafter import DualDiffusionDrafterConfig
from .modeling_diffusion_drafter import DiffusionDrafter


class DualDiffusionDrafter(PreTrainedModel):
    r"""
    Holds `first` (a DFlash [`DiffusionDrafter`]) and `vp` (a variable-prefix [`DiffusionDrafter`], or `None` to reuse
    the first drafter as the second). Bind it to a target with `from_drafters(...)` or
    `from_pretrained(path, target=target)`, like a single drafter.
    """

    config_class = DualDiffusionDrafterConfig
    base_model_prefix = "dual"
    main_input_name = "noise_embeds"
    _no_split_modules = ["DiffusionDrafterDecoderLayer"]
    accepts_loss_kwargs = False

    def __init__(self, config: DualDiffusionDrafterConfig):
        super().__init__(config)
        self.first = DiffusionDrafter(config.first_config)
        self.vp = DiffusionDrafter(config.vp_config) if config.vp_config is not None else None
        self.post_init()

    def _init_weights(self, module):
        pass  # the two drafters initialise their own modules

    @property
    def second(self) -> DiffusionDrafter:
        """The drafter that re-drafts branches: the VP drafter, or the first one when none was given."""
        return self.vp if self.vp is not None else self.first

    def bind_target(self, target) -> "DualDiffusionDrafter":
        self.first.bind_target(target)
        if self.vp is not None:
            self.vp.bind_target(target)
        return self

    @property
    def is_bound(self) -> bool:
        return self.first.is_bound and (self.vp is None or self.vp.is_bound)

    @classmethod
    def from_drafters(cls, first: DiffusionDrafter, vp: DiffusionDrafter | None = None, num_branches: int = 4,
                      max_depth: int | None = None, tree_budget: int = 16,
                      branch_length: int = 4, branches_from_first_pass: bool = False) -> "DualDiffusionDrafter":
        """Combine trained drafters (keeping their weights and their binding to the target)."""
        config = DualDiffusionDrafterConfig(
            first_config=first.config.to_dict(), vp_config=vp.config.to_dict() if vp is not None else None,
            num_branches=num_branches, max_depth=max_depth, tree_budget=tree_budget,
            branch_length=branch_length, branches_from_first_pass=branches_from_first_pass,
        )
        dual = cls(config).to(device=first.device, dtype=first.dtype)
        dual.first.load_state_dict(first.state_dict())
        if vp is not None:
            dual.vp.load_state_dict(vp.state_dict())
        if first.is_bound:
            dual.first._borrowed = dict(first._borrowed)
            if vp is not None:
                dual.vp._borrowed = dict(first._borrowed)
        return dual

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, target=None, **kwargs):
        if target is not None:
            kwargs.setdefault("dtype", target.dtype)
        dual = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if target is not None:
            dual = dual.to(target.device).bind_target(target)
        return dual

    @property
    def target_feature_layers(self) -> list[int]:
        """The first drafter's target layers (both drafters read the same ones; the config checks it)."""
        return self.first.target_feature_layers

    def gather_target_features(self, hidden_states):
        """The features both drafters read, from a target forward's `hidden_states` (see `DiffusionDrafter`)."""
        return self.first.gather_target_features(hidden_states)

    def forward(self, *args, **kwargs):
        """The first drafter's forward (the DFlash contract); branch drafting goes through `second`."""
        return self.first(*args, **kwargs)


__all__ = ["DualDiffusionDrafter"]
