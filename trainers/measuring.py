"""Measuring a drafter while it trains: held-out tau (`HeldOutTauCallback`, decoding held-out prompts with the
drafter's whole block verified) and the offline acceptance length (`OfflineAcceptanceCallback`, without decoding),
each appending one JSON line per measurement on the same schedule; and the drafter as trained so far
(`trained_drafter`) or as deployed (`deployed_drafter`), which they measure. Used by the pipeline and by scripts that
read the curves."""

import copy
import json
import shutil
import time
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback

from hf_diffspec.modeling import DiffusionDrafter
from hf_diffspec.prompts import load_prompts

from .block_diffusion import BlockDiffusionTrainer
from .continuation import ema_callback
from .data import DrafterDataset
from .offline_acceptance import offline_acceptance


def trained_drafter(trainer, folder, base=None) -> DiffusionDrafter | None:
    """The drafter as trained so far, whole and in float32, on the main process (None on the others, which must all
    call this too): written to `folder` by `Trainer.save_model`, which gathers FSDP or DeepSpeed shards, and read back;
    a LoRA adapter is merged into `base()`, the drafter it was trained on, built afresh."""
    if trainer.is_fsdp_enabled:  # one file with the whole drafter, not one shard per process
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(folder))
    if not trainer.is_world_process_zero():
        return None
    if base is None:
        return DiffusionDrafter.from_pretrained(folder, dtype=torch.float32)
    from peft import PeftModel

    return PeftModel.from_pretrained(base(), folder).merge_and_unload()


HELDOUT_TAU_LOG = "heldout_tau.jsonl"


def heldout_tau(target, tokenizer, drafter, prompts: list[dict], max_new_tokens: int) -> dict:
    """Tau with the drafter's whole block verified every step (DFlash's acceptance length, what `hf-diffspec bench
    --methods dflash-block` reports: committed tokens per target forward, over all of a domain's prompts), greedy,
    per domain and over all `prompts` (records with `text` and `domain`)."""
    committed, steps = {}, {}
    for prompt in prompts:
        inputs = tokenizer(prompt["text"], return_tensors="pt", add_special_tokens=False).to(target.device)
        out = target.generate(**inputs, assistant_model=drafter, num_assistant_tokens=drafter.config.block_size - 1,
                              max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        per_step = out.speculation_stats.committed_per_step
        for key in (prompt["domain"], "all"):
            committed[key] = committed.get(key, 0) + sum(per_step)
            steps[key] = steps.get(key, 0) + len(per_step)
    return {key: round(committed[key] / steps[key], 4) for key in committed if steps[key]}


class HeldOutTauCallback(TrainerCallback):
    """Held-out tau on a fixed schedule: at the start of training, every `every` optimizer steps and at the end, a
    copy of the drafter (merged, in the target's dtype) is measured by `heldout_tau` on the same held-out prompts,
    and one JSON line is appended to `path`: step, training tokens seen, tau per domain and over all, seconds taken.
    A resumed run appends to the same file, so the curve outlives the machine that started it (a step measured
    twice, before and after an interruption, keeps its last line; `read_heldout_tau`). Under several processes the
    main one measures and writes; the others wait. `base` builds the drafter a LoRA adapter merges into."""

    def __init__(self, trainer, path, tokenizer, every: int, prompts_per_domain: int, max_new_tokens: int,
                 base=None):
        self.trainer, self.path, self.every, self.max_new_tokens = trainer, Path(path), every, max_new_tokens
        self.tokenizer, self.base = tokenizer, base
        self.prompts = load_prompts(n_per_domain=prompts_per_domain, tokenizer=tokenizer)

    def on_train_begin(self, args, state, control, **kwargs):
        # the main process's reading of the log decides for all (it may be writing to it while another reads)
        measured = broadcast_object_list([self.curve_step(state) in read_heldout_tau(self.path)])[0]
        if not measured:
            self.measure(state)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.measure(state)

    def curve_step(self, state) -> int:
        """The step on the run's curve: this run's optimizer steps after those of the runs it continues."""
        return state.global_step + self.trainer.args.schedule_start

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            self.measure(state)

    @torch.no_grad()
    def measure(self, state) -> None:
        start = time.perf_counter()
        drafter = deployed_drafter(self.trainer, self.base)
        if drafter is not None:
            self.write(drafter, state, start)
        self.trainer.accelerator.wait_for_everyone()

    def write(self, drafter, state, start: float) -> None:
        """Measure `drafter` (on the main process) and append its line."""
        drafter.config.draft_tree_budget = None  # chains of the whole block, whatever the checkpoint's defaults
        drafter.config.prompt_lookup_num_tokens = None
        tau = heldout_tau(self.trainer.target, self.tokenizer, drafter, self.prompts, self.max_new_tokens)
        line = {"step": self.curve_step(state), "training_tokens": state.num_input_tokens_seen, "tau": tau.pop("all"),
                "tau_per_domain": tau, "prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens,
                "seconds": round(time.perf_counter() - start, 1)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as log:  # one whole line per write: a kill leaves earlier lines intact
            log.write(json.dumps(line) + "\n")


def deployed_drafter(trainer, base=None):
    """A copy of the trainer's drafter as it is deployed, on the main process (None on the others, which must all
    call this too): its weight average if it keeps one, merged (peft), in the target's dtype and device, eval mode,
    bound to the target; the trained one is left untouched. Sharded weights (FSDP, DeepSpeed) are gathered by
    `trained_drafter`; whole ones are copied in memory."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        folder = Path(trainer.args.output_dir) / "measured-drafter"
        drafter = trained_drafter(trainer, folder, base)
        if drafter is None:
            return None
        shutil.rmtree(folder)
    elif not trainer.is_world_process_zero():
        return None
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        borrowed = {id(m): m for m in trainer.drafter._borrowed.values()}  # the target's, shared, not copied
        drafter = copy.deepcopy(model, memo=borrowed)
        if (ema := ema_callback(trainer)) is not None and ema.average is not None:
            ema.copy_to(drafter)
        if hasattr(drafter, "merge_and_unload"):  # peft: the adapter merged into the copy, the trained one untouched
            drafter = drafter.merge_and_unload()
    target = trainer.target
    return drafter.to(device=target.device, dtype=target.dtype).eval().bind_target(target)


def read_heldout_tau(path) -> dict[int, dict]:
    """The lines of a held-out tau log by step (the last line of a step measured twice); a line cut short by a kill
    is skipped. {} when the file does not exist."""
    lines = {}
    if Path(path).is_file():
        for text in Path(path).read_text().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            lines[line["step"]] = line
    return lines


class OfflineAcceptanceCallback(HeldOutTauCallback):
    """The offline acceptance length on `HeldOutTauCallback`'s schedule (at the start of training, every `every`
    optimizer steps and at the end) on the same held-out sequences (`data`: data directories, their first
    `max_sequences`): one JSON line per measurement appended to `path` (step, training tokens seen, tau and its
    standard error, decode tau, reach and acceptance per slot, per domain, seconds). A resumed run appends to the
    same file; a step measured twice keeps its last line (`read_heldout_tau` reads it)."""

    def __init__(self, trainer: BlockDiffusionTrainer, path, data: list[str], every: int,
                 max_sequences: int | None = None, tokenizer=None, base=None):
        self.trainer, self.path, self.every, self.max_sequences = trainer, Path(path), every, max_sequences
        self.base = base  # what a LoRA adapter merges into
        self.dataset = DrafterDataset(data, tokenizer=tokenizer)

    def write(self, drafter, state, start: float) -> None:
        report = offline_acceptance(self.trainer, drafter, self.dataset, self.max_sequences)
        report.pop("committed_per_step")
        line = {"step": self.curve_step(state), "training_tokens": state.num_input_tokens_seen, **report,
                "seconds": round(time.perf_counter() - start, 1)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as log:  # one whole line per write: a kill leaves earlier lines intact
            log.write(json.dumps(line) + "\n")
