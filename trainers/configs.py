"""Training configurations: `TrainingArguments` subclasses with only each method's own fields (as TRL's `SFTConfig`,
`GKDConfig`), so `HfArgumentParser` turns them into `hf-diffspec train kd | vp | length-head | opd` flags.

Fields that `TrainingArguments` already has are re-declared only where a drafter wants another default (learning
rate, batch size, bf16, cosine schedule...) or where the command line keeps a shorter flag (`--out`, `--lr`,
`--epochs`, `--batch-size`, `--grad-accum`, `--time-budget`).
"""

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import SchedulerType

from hf_diffspec.machine import fast_bf16


@dataclass
class DrafterTrainingArguments(TrainingArguments):
    """Block-diffusion distillation of a first (DFlash) drafter from a frozen target (`BlockDiffusionTrainer`)."""

    kind: ClassVar[str] = "kd"

    # ----- TrainingArguments fields with a drafter's defaults (and the command line's short flags) ---------------
    output_dir: str | None = field(
        default=None,
        metadata={"help": "Folder of the trained drafter; Trainer checkpoints go to OUT/checkpoints.",
                  "aliases": ["--out"], "required": True},
    )
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak learning rate.", "aliases": ["--lr"]})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the data.", "aliases": ["--epochs"]})
    per_device_train_batch_size: int = field(
        default=4, metadata={"help": "Sequences per batch (per device).", "aliases": ["--batch-size"]}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Batches per optimizer step.", "aliases": ["--grad-accum"]}
    )
    lr_scheduler_type: SchedulerType | str = field(default="cosine", metadata={"help": "Learning-rate schedule after warmup."})
    warmup_steps: float = field(
        default=0.04, metadata={"help": "Warmup: a number of steps, or below 1 a fraction of the training."}
    )
    logging_steps: float = field(default=10, metadata={"help": "Log loss, train_tau and accuracy every N steps."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Trainer checkpoints kept under OUT/checkpoints."})
    bf16: bool | None = field(
        default=None,
        metadata={"help": "Train in bfloat16 mixed precision (default: where bf16 is native: a CUDA GPU that supports "
                          "it, a CPU with AVX512-BF16/AMX; elsewhere torch emulates it and training is over 10x "
                          "slower than fp32)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the weights' initialisation, the anchors and the data order."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers to log to."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the collator's columns are not forward arguments."}
    )
    disable_tqdm: bool | None = field(default=False, metadata={"help": "Hide the progress bar."})
    use_cpu: bool | None = field(
        default=None, metadata={"help": "Train on the CPU (default: when no CUDA GPU is available)."}
    )
    dataloader_num_workers: int = field(
        default_factory=lambda: 2 if torch.cuda.is_available() else 0,
        metadata={"help": "Data-loading worker processes (default: 2 with a GPU, else 0)."},
    )

    # ----- the drafter ---------------------------------------------------------------------------------------------
    init: str | None = field(
        default=None, metadata={"help": "Start from this drafter checkpoint instead of a new drafter."}
    )
    num_layers: int = field(default=2, metadata={"help": "Decoder layers of a new drafter."})
    init_from_target_layers: bool = field(
        default=False, metadata={"help": "Start a new drafter's layers from evenly spaced target decoder layers."}
    )
    block_conv: bool = field(
        default=False,
        metadata={"help": "DFlash 2's causal convolution over block positions: in a new drafter, or added to --init "
                          "as an exact no-op that training then shapes."},
    )
    selector_rank: int | None = field(
        default=None,
        metadata={"help": "DFlash 2's candidate selector with token codebooks of this rank (DFlash 2: 256), trained "
                          "with a k-way cross-entropy over each slot's top-k candidates: in a new drafter, or added to "
                          "--init as an exact no-op that training then shapes."},
    )
    mask_token_id: str | None = field(
        default=None,
        metadata={"help": "Embed MASK as this target token (an id, or 'auto': a token the target never reads, see "
                          "`hf_diffspec.targets.unused_target_token`) instead of a drafter-owned embedding, so the "
                          "drafter also runs in vLLM, SGLang, z-lab's loop and transformers' DFlash path. With --init "
                          "of a drafter that owns its MASK, that embedding is dropped and training adapts the drafter."},
    )
    train_only_added: bool = field(
        default=False,
        metadata={"help": "With --init: train only the DFlash 2 parts that --selector-rank / --block-conv add, the "
                          "drafter itself frozen (no backward through it, so a step costs a fraction of a full one)."},
    )
    lora: bool = field(default=False, metadata={"help": "LoRA fine-tuning of --init through peft."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (alpha is twice the rank)."})

    # ----- blocks and loss -----------------------------------------------------------------------------------------
    block_size: int = field(default=16, metadata={"help": "Tokens per block: the anchor and block_size - 1 drafts."})
    num_anchors: int = field(default=64, metadata={"help": "Blocks (random anchors on response tokens) per sequence."})
    max_length: int = field(default=1024, metadata={"help": "Sequences are cut to this many tokens."})
    blocks_per_row: int = field(
        default=16,
        metadata={"help": "Blocks of a sequence that share one attention row of the drafter's forward. A block sees "
                          "the context before its anchor and itself whatever the value (the loss is the same); each "
                          "row repeats the context's keys/values and every query scans the keys of its row's blocks. "
                          "0: all blocks of a sequence in one row (one dense mask, cost quadratic in --num-anchors)."},
    )
    loss_decay: float | None = field(
        default=None,
        metadata={"help": "Decay of the position weights exp(-(k-1)/decay) (default: DFlash's for the block size)."},
    )
    loss_depth: int | None = field(
        default=None,
        metadata={"help": "Leave block slots deeper than this out of the loss (slots acceptance rarely reaches: with "
                          "tau ~1.5, slot 4 almost never; default: every slot)."},
    )
    cached_features: bool = field(
        default=False,
        metadata={"help": "Read the target's features and argmax from what `hf-diffspec data features` cached in each "
                          "data directory instead of running the target in every step (the target's forward is "
                          "about half a step on a CPU at 64 anchors per sequence)."},
    )
    target_consistent_labels: bool = field(
        default=True,
        metadata={"help": "Supervise a block slot only while the text from the anchor to it is the target's own greedy "
                          "continuation: deeper slots after the first disagreement are labelled with the target's "
                          "choice after text it would not have written, which verification never accepts "
                          "(--no-target-consistent-labels keeps them, as DFlash does)."},
    )

    # ----- running ------------------------------------------------------------------------------------------------
    time_budget_minutes: float | None = field(
        default=None,
        metadata={"help": "Stop after this many minutes, with warmup + cosine following the fraction of the budget "
                          "spent. Each run has its own budget: with --resume, the learning rate warms up again and "
                          "follows a new cosine over the new budget (a restart, as in SGDR); with --schedule-steps "
                          "the budget only stops each run. Under several processes the main process's clock decides "
                          "for all of them.",
                  "aliases": ["--time-budget"]},
    )
    schedule_steps: int | None = field(
        default=None,
        metadata={"help": "One warmup + cosine over this many optimizer steps in total, kept by every --resume of "
                          "this run (restored from the checkpoint, whatever a later run passes), while each run stops "
                          "at its own --max_steps or --time-budget: one curve across machines."},
    )
    schedule_start: int = field(
        default=0,
        metadata={"help": "Optimizer steps that earlier runs (on other machines) took on the --schedule-steps curve, "
                          "continued here from the drafter they left (--init): the cosine and the logged steps count "
                          "on from there. Adam's moments start afresh (they are twice the drafter's size, so they do "
                          "not travel). With --resume the checkpoint's own value is kept."},
    )
    tokens_seen_start: int = field(
        default=0, metadata={"help": "Training tokens those earlier runs saw (with --schedule-start): the logged "
                                     "training tokens count on from there."}
    )
    ema_decay: float = field(
        default=0.0,
        metadata={"help": "Keep an exponential moving average of the weights with this decay per optimizer step "
                          "(e.g. 0.99), saved in every checkpoint and restored on --resume; the average is what is "
                          "measured on the schedules and saved at the end (0: no average)."},
    )
    resume: bool = field(default=False, metadata={"help": "Continue from the last checkpoint in OUT/checkpoints."})
    eval_prompts: int = field(
        default=0,
        metadata={"help": "Held-out prompts per domain on which tau and speedup are measured for the model card "
                          "(0: none)."},
    )
    eval_max_new_tokens: int = field(default=64, metadata={"help": "New tokens per held-out prompt."})
    heldout_tau_steps: int = field(
        default=0,
        metadata={"help": "Every N optimizer steps (and at the start and the end), measure held-out tau with the whole "
                          "block verified and append it, with the training tokens seen, to OUT/heldout_tau.jsonl "
                          "(0: never)."},
    )
    heldout_tau_prompts: int = field(default=2, metadata={"help": "Held-out prompts per domain for that tau."})
    heldout_tau_max_new_tokens: int = field(default=96, metadata={"help": "New tokens per prompt for that tau."})
    offline_acceptance_steps: int = field(
        default=0,
        metadata={"help": "Every N optimizer steps (and at the start and the end), measure the offline acceptance "
                          "length (the drafter at every anchor of the target's own held-out sequences, no decoding) "
                          "on --offline-acceptance-data and append it to OUT/offline_acceptance.jsonl (0: never)."},
    )
    offline_acceptance_data: list[str] | None = field(
        default=None, metadata={"help": "Data directories of held-out sequences the target wrote (greedy), e.g. "
                                        "data/heldout-smollm2; never trained on."}
    )
    offline_acceptance_sequences: int | None = field(
        default=64, metadata={"help": "The offline acceptance length reads the first N of those sequences."}
    )

    def __post_init__(self):
        if self.use_cpu is None:
            self.use_cpu = not torch.cuda.is_available()
        if self.bf16 is None:
            self.bf16 = fast_bf16("cpu" if self.use_cpu else None)
        if (self.schedule_start or self.tokens_seen_start) and not self.schedule_steps:
            raise ValueError("--schedule-start / --tokens-seen-start continue a --schedule-steps curve: pass "
                             "--schedule-steps (the curve's total length) too")
        if self.offline_acceptance_steps > 0 and not self.offline_acceptance_data:
            raise ValueError("--offline-acceptance-steps measures on held-out sequences: pass --offline-acceptance-data "
                             "DIR (e.g. data/heldout-smollm2, written by examples/drafter_campaign_cpu.sh heldout)")
        super().__post_init__()


@dataclass
class VariablePrefixConfig(DrafterTrainingArguments):
    """A D²SD variable-prefix (VP) drafter (`VariablePrefixTrainer`): blocks start with the anchor plus l real
    tokens, Pr(l) ∝ prefix_beta^l."""

    kind: ClassVar[str] = "vp"

    prefix_beta: float = field(default=0.9, metadata={"help": "Prior of the prefix length l: Pr(l) ∝ beta^l."})


@dataclass
class LengthHeadConfig(DrafterTrainingArguments):
    """The acceptance (length) head of an existing drafter, everything else frozen (`LengthHeadTrainer`)."""

    kind: ClassVar[str] = "length-head"

    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate.", "aliases": ["--lr"]})
    init: str | None = field(
        default=None,
        metadata={"help": "The drafter whose length head to train (frozen; a head is added if it has none).",
                  "required": True},
    )


@dataclass
class ReverseKLConfig(DrafterTrainingArguments):
    """AdaFlash's loss (`ReverseKLTrainer`): alpha * CE + (1 - alpha) * the reverse KL to the target, clipped per
    position."""

    kind: ClassVar[str] = "opd"

    alpha: float = field(default=0.8, metadata={"help": "Weight of the CE term (1 - alpha: the reverse KL)."})
    kl_clip: float = field(default=0.01, metadata={"help": "Clip of each position's share of the reverse KL."})
    temperature: float = field(default=1.0, metadata={"help": "Temperature of both distributions in the reverse KL."})

    def __post_init__(self):
        super().__post_init__()
        if self.cached_features:
            raise ValueError("--cached-features keeps the target's features and argmax only, and the reverse KL needs "
                             "its whole distribution at every slot: drop --cached-features for opd")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


@dataclass
class OnPolicyDistillationConfig(ReverseKLConfig):
    """AdaFlash on-policy distillation (`run_opd`): rounds of decoding prompts with the live speculative system, then
    training the drafter on its own trajectories with the reverse-KL loss. OUT holds one folder per round."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak learning rate.", "aliases": ["--lr"]})
    num_train_epochs: float = field(default=2.0, metadata={"help": "Passes over each round's data.",
                                                           "aliases": ["--epochs"]})
    init: str | None = field(default=None, metadata={"help": "The drafter to improve.", "required": True})
    rounds: int = field(default=2, metadata={"help": "Rounds of decode-then-train."})
    samples_per_round: int = field(default=128, metadata={"help": "Prompts decoded per round."})
    max_new_tokens: int = field(
        default=256, metadata={"help": "New tokens per trajectory.", "aliases": ["--gen-max-new-tokens"]}
    )


__all__ = [
    "DrafterTrainingArguments",
    "LengthHeadConfig",
    "OnPolicyDistillationConfig",
    "ReverseKLConfig",
    "VariablePrefixConfig",
]
