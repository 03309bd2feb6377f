"""Which drafter a command runs: a fresh untrained one, a checkpoint directory, or the drafter shipped for a
built-in target.

The shipped drafters live in the repository's `checkpoints/` folder, found beside the package through an editable
install or a checkout.
"""

from pathlib import Path

import torch

from .modeling import DiffusionDrafter

__all__ = ["SHIPPED_DRAFTERS", "SHIPPED_VP_DRAFTERS", "load_drafter"]

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
#: built-in target name -> its first (DFlash) drafter
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": CHECKPOINTS / "smollm2-135m-instruct-dflash"}
#: built-in target name -> its D²SD variable-prefix drafter
SHIPPED_VP_DRAFTERS = {"smollm2-135m-instruct": CHECKPOINTS / "smollm2-135m-instruct-d2sd-vp"}


def shipped_drafter(target_name: str, variable_prefix: bool = False) -> Path | None:
    """The shipped drafter checkpoint for built-in target `target_name` (its D²SD VP drafter with
    `variable_prefix=True`), or None when there is none in this install."""
    path = (SHIPPED_VP_DRAFTERS if variable_prefix else SHIPPED_DRAFTERS).get(target_name)
    return path if path is not None and (path / "config.json").is_file() else None


def load_drafter(spec: str | None, target, target_name: str, block_size: int = 16, seed: int = 0,
                 **config_overrides) -> DiffusionDrafter:
    """The drafter `spec` names, bound to `target`.

    Args:
        spec: `"random"` for a new untrained drafter (one layer, `block_size`, weights drawn with `seed`; tau ~ 1),
            a checkpoint directory, or None for the drafter shipped for `target_name`.
        target: the target model the drafter reads features from.
        target_name: the name `target` was loaded by (a built-in name has a shipped drafter).
        config_overrides: passed to `DiffusionDrafter.from_pretrained` (e.g. `length_head=False`).

    Raises:
        FileNotFoundError: no shipped drafter for `target_name`, or `spec` is not a directory.
    """
    if spec == "random":
        torch.manual_seed(seed)
        return DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=block_size, **config_overrides)
    if spec is None:
        shipped = shipped_drafter(target_name)
        if shipped is None:
            raise FileNotFoundError(
                f"no shipped drafter for target {target_name!r}: pass a trained drafter's directory "
                "(--drafter PATH) or 'random' (an untrained drafter, tau ~ 1)"
            )
        spec = str(shipped)
    if not Path(spec).is_dir():
        raise FileNotFoundError(f"drafter {spec!r} is neither 'random' nor a drafter checkpoint directory")
    return DiffusionDrafter.from_pretrained(spec, target=target, **config_overrides)
