"""What a long continuation of a trained drafter needs beyond the Trainer: an exponential moving average of the
weights (what ships), and one warmup + cosine learning-rate curve whose length is fixed when the run starts and kept
by every resumed run, whatever each run's own budget (`DrafterTrainingArguments.ema_decay`, `schedule_steps`).

Both survive a move to another machine with the Trainer checkpoint: the average as `ema.safetensors` inside it, the
schedule's length inside the scheduler state that the Trainer saves and restores (`WarmupCosine` is a callable
object, whose attributes `torch.optim.lr_scheduler.LambdaLR` saves, unlike a function's).
"""

import logging
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_diffspec.runtime.files import atomic_write

EMA_FILE = "ema.safetensors"

logger = logging.getLogger(__name__)


class WarmupCosine:
    """Learning-rate factor at optimizer step `step`: linear warmup over `warmup_steps`, then a cosine to 0 at
    `total_steps` (and 0 after it). `start`: steps earlier runs took on this curve (a run that continues another
    machine's from its drafter): this run's step 0 is the curve's step `start`."""

    def __init__(self, total_steps: int, warmup_steps: int, start: int = 0):
        if total_steps < 1:
            raise ValueError(f"the schedule needs at least one step, got {total_steps}")
        self.total_steps, self.warmup_steps = total_steps, min(warmup_steps, total_steps - 1)
        self.start = start

    def __call__(self, step: int) -> float:
        step += self.start
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * frac))


class ContinuedRun(TrainerCallback):
    """A run that continues another machine's (`--schedule-start`, `--tokens-seen-start`): its training tokens count
    on from the earlier runs' total, so the logged curve is one curve."""

    def __init__(self, tokens_seen_start: int):
        self.tokens_seen_start = tokens_seen_start

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:  # a resumed run has the count in its checkpoint already
            state.num_input_tokens_seen = self.tokens_seen_start


class EMACallback(TrainerCallback):
    """An exponential moving average of the trainable weights, updated after every optimizer step with
    `min(decay, (1 + step) / (10 + step))` (the usual warm start, so early weights do not dominate), saved as
    `ema.safetensors` in each Trainer checkpoint and restored from it on resume. At the end of training the model's
    weights are replaced by the average, so that what is saved is the average; the checkpoints keep both."""

    def __init__(self, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.average: dict[str, torch.Tensor] | None = None

    @staticmethod
    def trainable(model) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        saved = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / EMA_FILE
        weights = self.trainable(model)
        if state.global_step and saved.is_file():
            self.average = {k: v.to(weights[k].device) for k, v in load_file(saved).items()}
            return
        if state.global_step:
            logger.warning(f"resuming at step {state.global_step} without {saved}: the weight average restarts "
                           "from the current weights")
        self.average = {name: p.detach().float().clone() for name, p in weights.items()}

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        decay = min(self.decay, (1 + state.global_step) / (10 + state.global_step))
        for name, p in self.trainable(model).items():
            self.average[name].lerp_(p.detach().float(), 1 - decay)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            atomic_write(folder / EMA_FILE, lambda path: save_file(self.average, str(path)))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.copy_to(model)

    @torch.no_grad()
    def copy_to(self, model) -> None:
        """Write the average into `model`'s weights (the trained model, or a copy of it with the same names)."""
        weights = dict(model.named_parameters())
        for name, value in self.average.items():
            weights[name].copy_(value)


def ema_callback(trainer) -> EMACallback | None:
    """The trainer's `EMACallback`, if it has one."""
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, EMACallback)), None)
