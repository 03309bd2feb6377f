"""End-to-end drafter training used by `hf-diffspec train ...` and the examples, above the Trainers.

`train_drafter` builds or loads the drafter, trains it with the Trainer its configuration names (full-parameter, or
LoRA through peft), optionally measures it on held-out prompts, and saves it with `hf_diffspec.save_drafter`.
`run_opd` runs AdaFlash's on-policy distillation: rounds of "decode prompts with the live speculative system, then
train on what it produced" with the reverse-KL loss, each round through `train_drafter`.

Under `torchrun` / `accelerate launch` every process runs these functions (DDP or FSDP through the Trainer): the
trained drafter is gathered with `Trainer.save_model` by all of them, and the main process alone merges, measures
and writes it while the others wait; OPD rounds decode their prompts shared out, one shard set per process.
"""

import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import set_seed
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_diffspec.hub import save_drafter
from hf_diffspec.modeling import DiffusionDrafter
from hf_diffspec.prompts import chat_prompt, eval_prompt_texts, load_prompts, load_prompts_file
from hf_diffspec.runtime.files import atomic_write, pad_token_id
from hf_diffspec.targets import unused_target_token

from .block_diffusion import (
    BlockDiffusionCollator,
    BlockDiffusionTrainer,
    LengthHeadTrainer,
    ReverseKLTrainer,
    VariablePrefixTrainer,
    loss_curve_summary,
)
from .configs import DrafterTrainingArguments, LengthHeadConfig, OnPolicyDistillationConfig, VariablePrefixConfig
from .continuation import ContinuedRun, EMACallback
from .data import DrafterDataset, classify_domain, process_shard_writer, sharegpt_exchanges
from .measuring import HELDOUT_TAU_LOG, HeldOutTauCallback, OfflineAcceptanceCallback, trained_drafter
from .offline_acceptance import OFFLINE_ACCEPTANCE_LOG

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"]
# most specific configuration first: each Trainer declares the configuration class it reads
TRAINERS = [LengthHeadTrainer, ReverseKLTrainer, VariablePrefixTrainer, BlockDiffusionTrainer]


def trainer_class_for(args: DrafterTrainingArguments) -> type[BlockDiffusionTrainer]:
    return next(trainer for trainer in TRAINERS if isinstance(args, trainer.config_class))


def build_drafter(target, args: DrafterTrainingArguments, mask_token_id: int | None = None) -> DiffusionDrafter:
    """The drafter to train: `args.init` loaded, or a new one sized to `target`, in float32; with `mask_token_id`,
    embedding MASK as that target token."""
    if args.init:
        overrides = {"block_conv": True} if args.block_conv else {}
        if args.selector_rank is not None:
            overrides["selector_rank"] = args.selector_rank
        drafter = DiffusionDrafter.from_pretrained(args.init, target=target, dtype=torch.float32, **overrides)
        if drafter.config.block_size != args.block_size:
            drafter.config.block_size = args.block_size  # a block-diffusion drafter can be trained on other sizes
        if mask_token_id is not None and drafter.config.mask_token_id != mask_token_id:
            drafter.use_mask_token(mask_token_id)
    else:
        drafter = DiffusionDrafter.from_target(target, num_hidden_layers=args.num_layers, block_size=args.block_size,
                                               block_conv=args.block_conv, selector_rank=args.selector_rank,
                                               mask_token_id=mask_token_id).float()
        if args.init_from_target_layers:
            copy_target_layers(drafter, target)
    drafter.config.draft_role = "variable_prefix" if isinstance(args, VariablePrefixConfig) else "first"
    if isinstance(args, LengthHeadConfig):
        if not args.init:
            raise ValueError("train length-head adds a head to an existing drafter: pass --init DRAFTER")
        drafter.add_length_head()
    return drafter


def added_modules(drafter: DiffusionDrafter, args: DrafterTrainingArguments) -> list[str]:
    """Names of the drafter's DFlash 2 modules that the command names (`--selector-rank`, `--block-conv`): trained
    whole, also under LoRA (where peft would otherwise freeze them at their no-op initialisation)."""
    names = []
    for name, module in drafter.named_modules():
        parent, _, leaf = name.rpartition(".")
        if (leaf == "selector" and args.selector_rank is not None) or (
                parent.endswith("block_convs") and args.block_conv):  # each convolution (peft wraps modules it calls)
            names.append(name)
    return names


def resolve_mask_token_id(value: str | int | None, tokenizer, vocab_size: int) -> int | None:
    """`--mask-token-id`: None, an id, or "auto" (`unused_target_token`)."""
    if value is None:
        return None
    if str(value) == "auto":
        return unused_target_token(tokenizer, vocab_size)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--mask-token-id takes a token id or 'auto', got {value!r}") from None


def copy_target_layers(drafter: DiffusionDrafter, target) -> None:
    """Start drafter layer i from evenly spaced target decoder layers (shared names: attention, MLP, norms)."""
    layers = target.model.layers
    picks = [round(i * (len(layers) - 1) / max(1, len(drafter.layers) - 1)) for i in range(len(drafter.layers))]
    for layer, pick in zip(drafter.layers, picks):
        source = layers[pick].state_dict()
        own = layer.state_dict()
        layer.load_state_dict({k: source[k].to(v.dtype) if k in source and source[k].shape == v.shape else v
                               for k, v in own.items()})


def train_drafter(target, tokenizer, target_name: str, data: list[str], args: DrafterTrainingArguments,
                  command: str | None = None) -> Path:
    """Train a drafter on the data directories `data` and save it to `args.output_dir` (Trainer checkpoints under
    its `checkpoints/`); returns that folder. The configuration's class picks the Trainer: `DrafterTrainingArguments`
    (KD), `VariablePrefixConfig`, `LengthHeadConfig` or `ReverseKLConfig`. With `args.resume`, training continues
    from the newest complete checkpoint there (`last_complete_checkpoint`). Under several processes all of them call
    it and all return once the main process has written the drafter."""
    set_seed(args.seed)
    out = Path(args.output_dir)
    resume_from = resume_point(args, out)
    vocab_size = target.get_input_embeddings().num_embeddings
    mask_token_id = resolve_mask_token_id(args.mask_token_id, tokenizer, vocab_size)
    drafter = build_drafter(target, args, mask_token_id)
    dataset = DrafterDataset(data, tokenizer=tokenizer, max_length=args.max_length,
                             cached_features=(target, drafter.target_feature_layers) if args.cached_features else None)
    model = trainable_model(drafter, args)
    pad = pad_token_id(tokenizer)
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad batches with: set its pad_token")
    collator = BlockDiffusionCollator(pad, num_anchors=args.num_anchors, seed=args.seed,
                                      process_index=args.process_index)
    trainer = trainer_class_for(args)(
        model=model, args=replace(args, output_dir=str(out / "checkpoints")), train_dataset=dataset, target=target,
        data_collator=collator,
    )
    base = (lambda: build_drafter(target, args, mask_token_id)) if args.lora else None  # what LoRA merges into
    add_callbacks(trainer, args, out, tokenizer, base)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - start

    # with LoRA the adapter alone is kept (loadable with PeftModel.from_pretrained); full weights are only read back
    saved = out / "adapter" if args.lora else out / "checkpoints" / "trained"
    drafter = trained_drafter(trainer, saved, base)
    if trainer.is_world_process_zero():
        if not args.lora:
            shutil.rmtree(saved)
        drafter = drafter.to(target.dtype).eval()
        drafter.bind_target(target)
        info = training_info(trainer, args, target_name, data, dataset, seconds, command)
        if args.eval_prompts > 0:
            info["evaluation"] = evaluate_drafter(target, tokenizer, drafter, args.eval_prompts,
                                                  args.eval_max_new_tokens)
        save_drafter(drafter, out, training_info=info)
    trainer.accelerator.wait_for_everyone()
    return out


def resume_point(args: DrafterTrainingArguments, out: Path) -> Path | None:
    """With `args.resume`, the checkpoint to continue from (refused when there is none), and `args.schedule_start`
    as that run had it; else None."""
    if not args.resume:
        return None
    resume_from = last_complete_checkpoint(out / "checkpoints")
    if resume_from is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint under {out / 'checkpoints'} to resume from (only a checkpoint-N folder "
            "whose trainer_state.json exists and parses is complete); drop --resume to train from the start"
        )
    # a run that continued another machine's (--schedule-start) keeps its place on the curve: the logged steps
    # count from there (its cosine is in the scheduler state that the checkpoint restores)
    saved = torch.load(resume_from / "training_args.bin", weights_only=False)  # written by the Trainer, above
    args.schedule_start = getattr(saved, "schedule_start", 0)
    return resume_from


def trainable_model(drafter: DiffusionDrafter, args: DrafterTrainingArguments):
    """What the Trainer trains: `drafter` with only the parts the command trains left trainable, or wrapped in a
    LoRA adapter (peft)."""
    if drafter.length_head is not None and not isinstance(args, LengthHeadConfig):
        # only `train length-head` trains it (no other loss reaches it; DDP then needs no unused-parameter search)
        drafter.length_head.requires_grad_(False)
    added = added_modules(drafter, args)
    if args.train_only_added:
        if not args.init or not added:
            raise ValueError("--train-only-added trains what --selector-rank / --block-conv add to an --init drafter: "
                             "pass --init DRAFTER and at least one of them")
        drafter.requires_grad_(False)
        for name in added:
            drafter.get_submodule(name).requires_grad_(True)
    if not args.lora:
        return drafter
    from peft import LoraConfig, get_peft_model

    if not args.init:
        raise ValueError("--lora fine-tunes an existing drafter: pass --init DRAFTER")
    if isinstance(args, LengthHeadConfig):
        raise ValueError("the length head is small and trained whole with the drafter frozen: drop --lora")
    return get_peft_model(drafter, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                              target_modules=LORA_TARGETS, lora_dropout=0.0,
                                              modules_to_save=added or None))


def add_callbacks(trainer, args: DrafterTrainingArguments, out: Path, tokenizer, base) -> None:
    """The callbacks the configuration asks for, in the order they must run: the tokens seen and the weight average
    before the measuring callbacks (which log the one and measure the other)."""
    if args.tokens_seen_start:
        trainer.add_callback(ContinuedRun(args.tokens_seen_start))
    if args.ema_decay:
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
            raise ValueError("--ema-decay averages whole weights on every process; under FSDP or DeepSpeed they are "
                             "sharded: train without --ema-decay there, or with DDP")
        trainer.add_callback(EMACallback(args.ema_decay))
    if args.heldout_tau_steps > 0:
        trainer.add_callback(HeldOutTauCallback(trainer, out / HELDOUT_TAU_LOG, tokenizer, args.heldout_tau_steps,
                                                args.heldout_tau_prompts, args.heldout_tau_max_new_tokens, base))
    if args.offline_acceptance_steps > 0:
        trainer.add_callback(OfflineAcceptanceCallback(
            trainer, out / OFFLINE_ACCEPTANCE_LOG, args.offline_acceptance_data, args.offline_acceptance_steps,
            args.offline_acceptance_sequences, tokenizer, base))


def training_info(trainer, args: DrafterTrainingArguments, target_name: str, data: list[str], dataset,
                  seconds: float, command: str | None) -> dict:
    """The training record saved with the drafter (`training_info.json`): data, steps, time, device, loss curve,
    configuration and command."""
    info = {
        "target": target_name, "data": [{"dir": d, **m} for d, m in zip(data, dataset.meta)],
        "sequences": len(dataset), "tokens": dataset.num_tokens, "steps": trainer.state.global_step,
        "train_seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name(0) if trainer.args.device.type == "cuda" else "cpu",
        "processes": trainer.accelerator.num_processes,
        "loss_curve": loss_curve_summary(trainer.state.log_history),
        "config": {"kind": args.kind, **args.to_dict()}, "command": command or " ".join(sys.argv),
    }
    if isinstance(args, LengthHeadConfig):
        info["length_head"] = length_head_summary(trainer.state.log_history)
    return info


def evaluate_drafter(target, tokenizer, drafter, prompts_per_domain: int, max_new_tokens: int) -> dict:
    """tau and speedup per domain on held-out evaluation prompts (the benchmark, small), for the model card."""
    from hf_diffspec.bench import machine_description, run_benchmark, summarize  # the benchmark, on demand only

    prompts = load_prompts(n_per_domain=prompts_per_domain, tokenizer=tokenizer)
    rows = summarize(run_benchmark(target, tokenizer, {"dflash": drafter}, prompts, max_new_tokens, progress=False))
    machine = machine_description()
    return {
        "rows": [r for r in rows if r["method"] == "dflash"],
        "command": f"hf-diffspec bench --prompts {prompts_per_domain} --max-new-tokens {max_new_tokens} "
                   f"--dtype {str(target.dtype).replace('torch.', '')}",
        "machine": f"{machine['device']} / {machine['cpu']} ({machine['torch_threads']} threads)",
    }


def length_head_summary(history: list[dict]) -> dict:
    """The head's binary cross-entropy at the end of training, next to the drafter's raw confidence used as the
    acceptance probability (the baseline it competes with), and its calibration (mean predicted vs observed)."""
    # the last logged points, averaged; the closing summary carries the metrics of the steps since the last point
    # but no "loss" of its own
    logs = [h for h in history if "confidence_bce" in h and "loss" in h][-3:]
    if not logs:
        return {}
    mean = lambda key: round(sum(h[key] for h in logs) / len(logs), 4)  # noqa: E731
    return {"head_bce": mean("loss"), "confidence_bce": mean("confidence_bce"),
            "predicted_acceptance": mean("predicted_rate"), "observed_acceptance": mean("acceptance_rate")}


def last_complete_checkpoint(checkpoints_dir) -> Path | None:
    """The highest-numbered complete Trainer checkpoint (`checkpoint-N`) in `checkpoints_dir`, or None.

    A checkpoint is complete when its `trainer_state.json` exists and parses: the Trainer writes that file last, after
    the weights, optimizer, scheduler and RNG states, and not atomically. A run killed while saving leaves a newer
    folder without it or with it cut short; such a folder is skipped (the resumed run saves that step again over it).
    """
    numbered = []
    for folder in Path(checkpoints_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = folder.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if folder.is_dir() and step.isdigit():
            numbered.append((int(step), folder))
    for _, folder in sorted(numbered, reverse=True):
        if _read_json(folder / TRAINER_STATE_NAME) is not None:
            return folder
    return None


def _read_json(path: Path):
    """The parsed content of `path`, or None when it is missing or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----- on-policy distillation (AdaFlash OPD) -----------------------------------------------------------------------
def on_policy_prompts(prompts_file: str | None = None, seed: int = 0, skip: int = 0) -> list[dict]:
    """Prompts for OPD rounds: a JSONL prompts file, or ShareGPT first turns in a seeded order from the `skip`-th on;
    evaluation prompts are removed from either."""
    exclude = eval_prompt_texts()
    if prompts_file:
        return [p for p in load_prompts_file(prompts_file) if p["prompt"] not in exclude]
    return [{"id": i, "prompt": p, "domain": classify_domain(p)}
            for i, p, _ in sharegpt_exchanges(seed, exclude)[skip:]]


@torch.no_grad()
def write_trajectories(target, tokenizer, drafter, prompts: list[dict], out_dir, target_name: str,
                       max_new_tokens: int, do_sample: bool = False) -> dict:
    """Decode `prompts` with the speculative system and store prompt + response as shards; returns tau per domain.
    Under several processes each decodes its share into its own shard set, and all return the tau of all shares
    once every share is written."""
    state = PartialState()
    writer = process_shard_writer(out_dir, target_name, tokenizer, source="on-policy")
    committed, steps = Counter(), Counter()
    with state.split_between_processes(prompts) as share:
        for record in tqdm(share, desc="on-policy trajectories"):
            if record["id"] in writer.done_ids:
                continue
            ids = torch.tensor([chat_prompt(tokenizer, record["prompt"], tokenize=True)], device=target.device)
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                  return_dict_in_generate=True)
            domain = record.get("domain") or classify_domain(record["prompt"])
            writer.add(record["id"], out.sequences[0].tolist(), ids.shape[1], domain)
            per_step = out.speculation_stats.committed_per_step
            committed[domain] += sum(per_step)
            steps[domain] += len(per_step)
    writer.flush()
    all_committed, all_steps = Counter(), Counter()
    for share_committed, share_steps in gather_object([(committed, steps)]):  # every process's (all wait for all)
        all_committed.update(share_committed)
        all_steps.update(share_steps)
    return {d: all_committed[d] / all_steps[d] for d in all_committed if all_steps[d]}


def run_opd(target, tokenizer, target_name: str, prompts: list[dict], args: OnPolicyDistillationConfig,
            command: str | None = None) -> Path:
    """`args.rounds` OPD rounds starting from the drafter at `args.init`, each decoding the next
    `args.samples_per_round` of `prompts`; returns the folder of the final drafter.

    A round generates trajectories with `target.generate(..., assistant_model=current_drafter)` (our own loop, so the
    data is exactly what the deployed system produces), writes them as data shards under `OUT/round-N/data`, and
    trains the drafter on them with the reverse-KL loss into `OUT/round-N/drafter`; the next round decodes with the
    updated drafter. `round.json` is written last and marks a round finished: an interrupted run resumes at the first
    round without it, keeping that round's data shards and continuing its training from its newest complete
    checkpoint. Under several processes the rounds' prompts are decoded shared out (`write_trajectories`) and the
    main process writes `round.json` and `opd_history.json`.
    """
    if not args.init:
        raise ValueError("on-policy distillation improves an existing drafter: pass --init DRAFTER")
    out = Path(args.output_dir)
    current = Path(args.init)
    needed = args.rounds * args.samples_per_round
    if len(prompts) < needed:
        raise ValueError(f"{args.rounds} rounds x {args.samples_per_round} samples need {needed} prompts, "
                         f"got {len(prompts)}")
    main = PartialState().is_main_process
    history = []
    for r in range(args.rounds):
        round_dir = out / f"round-{r}"
        drafter_dir = round_dir / "drafter"
        finished = _read_json(round_dir / "round.json")
        if finished is not None:
            current = drafter_dir
            history.append(finished)
            continue
        drafter = DiffusionDrafter.from_pretrained(current, target=target)
        batch = prompts[r * args.samples_per_round : (r + 1) * args.samples_per_round]
        tau = write_trajectories(target, tokenizer, drafter, batch, round_dir / "data", target_name,
                                 args.max_new_tokens)
        last = r == args.rounds - 1
        resume = last_complete_checkpoint(drafter_dir / "checkpoints") is not None  # killed while training
        round_args = replace(args, output_dir=str(drafter_dir), init=str(current), resume=resume,
                             eval_prompts=args.eval_prompts if last else 0)
        train_drafter(target, tokenizer, target_name, [str(round_dir / "data")], round_args, command=command)
        info = {"round": r, "tau_while_generating": tau, "init": str(current)}
        if main:
            atomic_write(round_dir / "round.json", json.dumps(info, indent=2))
        history.append(info)
        current = drafter_dir
    if main:
        atomic_write(out / "opd_history.json", json.dumps(history, indent=2))
    return current
