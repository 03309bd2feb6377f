"""End-to-end drafter training used by `hf-diffspec train ...` and the examples: build or load the drafter, train it
with a `BlockDiffusionTrainer` (full-parameter, or LoRA through peft), save it atomically with a model card."""

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments, set_seed

from hf_diffspec.modeling import DiffusionDrafter

from .block_diffusion import (
    BlockDiffusionCollator,
    BlockDiffusionTrainer,
    LengthHeadTrainer,
    VariablePrefixTrainer,
    loss_curve_summary,
)
from .data import DrafterDataset
from .model_card import write_model_card

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"]


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    init: str | None = None
    lora: bool = False
    lora_rank: int = 16
    num_layers: int = 2
    block_size: int = 16
    num_anchors: int = 64
    max_length: int = 1024
    epochs: float = 1.0
    max_steps: int = -1
    batch_size: int = 4
    grad_accum: int = 1
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    logging_steps: int = 10
    save_steps: int = 500
    seed: int = 0
    resume: bool = False
    bf16: bool = True
    init_from_target_layers: bool = False
    time_budget_minutes: float | None = None
    # "kd": a first (DFlash) drafter; "vp": a D²SD variable-prefix drafter; "opd": reverse KL; "length-head": the
    # acceptance head of an existing drafter, everything else frozen
    kind: str = "kd"
    prefix_beta: float = 0.9
    opd_alpha: float = 0.8
    kl_clip: float = 0.01
    kl_temperature: float = 1.0
    extra_config: dict = field(default_factory=dict)


def build_drafter(target, cfg: TrainConfig) -> DiffusionDrafter:
    if cfg.init:
        drafter = DiffusionDrafter.from_pretrained(cfg.init, target=target, dtype=torch.float32)
        if drafter.config.block_size != cfg.block_size:
            drafter.config.block_size = cfg.block_size  # a block-diffusion drafter can be trained on other sizes
    else:
        drafter = DiffusionDrafter.from_target(target, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                               **cfg.extra_config).float()
        if cfg.init_from_target_layers:
            copy_target_layers(drafter, target)
    drafter.config.draft_role = "variable_prefix" if cfg.kind == "vp" else "first"
    if cfg.kind == "length-head":
        if not cfg.init:
            raise ValueError("train length-head adds a head to an existing drafter: pass --init DRAFTER")
        drafter.add_length_head()
    return drafter


def copy_target_layers(drafter: DiffusionDrafter, target) -> None:
    """Start drafter layer i from evenly spaced target decoder layers (shared names: attention, MLP, norms)."""
    layers = target.model.layers
    picks = [round(i * (len(layers) - 1) / max(1, len(drafter.layers) - 1)) for i in range(len(drafter.layers))]
    for layer, pick in zip(drafter.layers, picks):
        source = layers[pick].state_dict()
        own = layer.state_dict()
        layer.load_state_dict({k: source[k].to(v.dtype) if k in source and source[k].shape == v.shape else v
                               for k, v in own.items()})


def train_drafter(target, tokenizer, target_name: str, cfg: TrainConfig, command: str | None = None,
                  evaluate=None) -> Path:
    """Train and save a drafter to `cfg.out`; returns that path. `evaluate(drafter) -> dict` fills the model card."""
    set_seed(cfg.seed)
    out = Path(cfg.out)
    dataset = DrafterDataset(cfg.data, tokenizer=tokenizer, max_length=cfg.max_length)
    drafter = build_drafter(target, cfg)
    model = drafter
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        if not cfg.init:
            raise ValueError("--lora fine-tunes an existing drafter: pass --init DRAFTER")
        if cfg.kind == "length-head":
            raise ValueError("the length head is small and trained whole with the drafter frozen: drop --lora")
        model = get_peft_model(drafter, LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank,
                                                   target_modules=LORA_TARGETS, lora_dropout=0.0))
    use_gpu = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay, max_grad_norm=1.0, num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps, logging_steps=cfg.logging_steps, save_steps=cfg.save_steps, save_total_limit=2,
        bf16=cfg.bf16, seed=cfg.seed, report_to=[], dataloader_num_workers=2 if use_gpu else 0,
        remove_unused_columns=False, disable_tqdm=False, use_cpu=not use_gpu,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer_class, extra = BlockDiffusionTrainer, {}
    if cfg.kind == "vp":
        trainer_class, extra = VariablePrefixTrainer, {"prefix_beta": cfg.prefix_beta}
    elif cfg.kind == "length-head":
        trainer_class = LengthHeadTrainer
    elif cfg.kind == "opd":
        from .opd import ReverseKLTrainer

        trainer_class = ReverseKLTrainer
        extra = {"alpha": cfg.opd_alpha, "kl_clip": cfg.kl_clip, "temperature": cfg.kl_temperature}
    trainer = trainer_class(
        model=model, args=args, train_dataset=dataset, target=target, **extra,
        time_budget_s=cfg.time_budget_minutes * 60 if cfg.time_budget_minutes else None,
        data_collator=BlockDiffusionCollator(pad, num_anchors=cfg.num_anchors, seed=cfg.seed),
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=_last_checkpoint(out) if cfg.resume else None)
    seconds = time.perf_counter() - start

    if cfg.lora:
        model.save_pretrained(out / "adapter")  # the adapter alone, loadable with PeftModel.from_pretrained
        drafter = model.merge_and_unload()
    drafter = drafter.to(target.dtype).eval()
    drafter.bind_target(target)
    info = {
        "target": target_name, "data": [{"dir": d, **m} for d, m in zip(cfg.data, dataset.meta)],
        "sequences": len(dataset), "tokens": dataset.num_tokens, "steps": trainer.state.global_step,
        "train_seconds": round(seconds, 1), "device": torch.cuda.get_device_name(0) if use_gpu else "cpu",
        "loss_curve": loss_curve_summary(trainer.state.log_history), "config": cfg.__dict__,
        "command": command or " ".join(sys.argv),
    }
    if cfg.kind == "length-head":
        info["length_head"] = length_head_summary(trainer.state.log_history)
    if evaluate is not None:
        info["evaluation"] = evaluate(drafter)
    save_drafter(drafter, out, info)
    return out


def length_head_summary(history: list[dict]) -> dict:
    """The head's binary cross-entropy at the end of training, next to the drafter's raw confidence used as the
    acceptance probability (the baseline it competes with), and its calibration (mean predicted vs observed)."""
    logs = [h for h in history if "confidence_bce" in h][-3:]  # the last logged points, averaged
    if not logs:
        return {}
    mean = lambda key: round(sum(h[key] for h in logs) / len(logs), 4)  # noqa: E731
    return {"head_bce": mean("loss"), "confidence_bce": mean("confidence_bce"),
            "predicted_acceptance": mean("predicted_rate"), "observed_acceptance": mean("acceptance_rate")}


def _last_checkpoint(out: Path) -> str | None:
    checkpoints = sorted((out / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    if not checkpoints:
        raise FileNotFoundError(f"--resume: no checkpoint under {out / 'checkpoints'} to resume from")
    return str(checkpoints[-1])


def save_drafter(drafter: DiffusionDrafter, out: Path, info: dict) -> None:
    """Save weights + config + remote code + model card + training_info.json into `out`, atomically per file set:
    everything goes to a temporary folder first and is moved in at the end, config.json last."""
    out.mkdir(parents=True, exist_ok=True)
    staging = out / ".saving"
    shutil.rmtree(staging, ignore_errors=True)
    drafter.save_pretrained(staging)
    (staging / "training_info.json").write_text(json.dumps(info, indent=2, default=str))
    write_model_card(staging / "README.md", drafter, info)
    names = sorted(p.name for p in staging.iterdir())
    for name in [n for n in names if n != "config.json"] + ["config.json"]:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        os.replace(staging / name, out / name)
    staging.rmdir()
