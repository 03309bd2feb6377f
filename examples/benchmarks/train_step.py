"""Blocks per second of the block-diffusion KD training step (forward and backward: target, drafter, LM head, loss)
on the SmolLM2 target with the shipped drafter, per anchors per sequence and per setting of the step, the settings
interleaved repetition by repetition; then the peak memory of one step of each setting at the largest anchor count,
each in a fresh process.

    python examples/benchmarks/train_step.py --anchors 64,512 --settings 0:live,16:live,16:cached,16:cached:8 --reps 3

A setting is ROWS:FEATURES[:DEPTH[:VOCAB]]: ROWS blocks per attention row (`--blocks-per-row`; 0 is one row per
sequence, the dense mask the step used before rows), FEATURES `live` (a target forward in the step) or `cached` (the
target's features and argmax read from the batch, as `--cached-features` gives them; computed once here, untimed),
DEPTH the `--loss-depth` (default, or 0: every slot), VOCAB a reduced draft vocabulary of that many target tokens (the
most frequent response tokens of data/regen-smollm2, as `hf-diffspec convert --reduce-vocab` picks them; default:
the full vocabulary). Sequences are random tokens (`--seq-len`, a `--prompt-len` prompt, the rest
response) with every slot of every block supervised (no target-consistent labels): the LM head's worst case, the
same in every setting. Prints one line per setting, then a JSON summary.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hf_diffspec import DiffusionDrafter, load_target
from hf_diffspec.machine import machine_description
from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer
from hf_diffspec.trainers.configs import DrafterTrainingArguments
from hf_diffspec.trainers.draft_vocabulary import most_frequent_tokens

DRAFTER = "checkpoints/smollm2-135m-instruct-dflash"


def setup(args):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
    drafter = DiffusionDrafter.from_pretrained(DRAFTER, target=target, length_head=False)
    config = DrafterTrainingArguments(output_dir=tempfile.mkdtemp(), bf16=False, report_to=[], disable_tqdm=True,
                                      target_consistent_labels=False)
    trainer = BlockDiffusionTrainer(model=drafter, args=config, train_dataset=[], target=target)
    vocabularies = {}  # size -> the draft vocabulary's ids, built once per size

    def draft_vocabulary(size: int) -> torch.Tensor:
        if size not in vocabularies:
            vocabularies[size] = most_frequent_tokens(["data/regen-smollm2"], size, tokenizer=tokenizer)
        return vocabularies[size]

    trainer.draft_vocabulary = draft_vocabulary
    generator = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(2, target.config.vocab_size, (args.seq_len,), generator=generator),
                "prompt_length": args.prompt_len} for _ in range(args.batch_size)]
    return trainer, records


def parse_setting(text: str) -> dict:
    rows, features, *rest = text.split(":")
    if features not in ("live", "cached") or len(rest) > 2:
        raise SystemExit(f"a setting is ROWS:live|cached[:DEPTH[:VOCAB]], got {text!r}")
    depth, vocab = (int(x) or None for x in (rest + ["0", "0"])[:2])
    return {"blocks_per_row": int(rows), "features": features, "loss_depth": depth, "draft_vocab": vocab}


def use_draft_vocabulary(trainer, size: int | None) -> None:
    """Train over the `size` most frequent response tokens, or the full vocabulary (None)."""
    trainer.model.set_draft_vocabulary(None if size is None else trainer.draft_vocabulary(size))


def with_cached_features(trainer, batch) -> dict:
    """`batch` with the target's features and argmax, as the collator gives them from `hf-diffspec data features`."""
    features, argmax, _ = trainer.target_outputs(batch)
    return {**batch, "target_features": features, "target_argmax": argmax}


def step(trainer, batches, setting: dict) -> float:
    trainer.args.blocks_per_row = setting["blocks_per_row"]
    trainer.args.loss_depth = setting["loss_depth"]
    use_draft_vocabulary(trainer, setting["draft_vocab"])
    batch = batches[setting["features"]]
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    trainer.compute_loss(trainer.model, batch).backward()
    return time.perf_counter() - start


def peak_memory(args, anchors: int, setting: str) -> dict:
    """One step in a fresh process: its peak resident memory and the increase over what it held before the step."""
    command = [sys.executable, __file__, "--memory-of", f"{anchors}/{setting}", "--seq-len", str(args.seq_len),
               "--prompt-len", str(args.prompt_len), "--batch-size", str(args.batch_size), "--dtype", args.dtype]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", default="32,128,512", help="anchors (blocks) per sequence, comma-separated")
    parser.add_argument("--settings", default="0:live,16:live,16:cached,16:cached:8",
                        help="settings compared, comma-separated ROWS:live|cached[:DEPTH] (see above)")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per setting before them")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--json", default=None, help="also write the summary here")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # ANCHORS/SETTING: one step, in a child
    args = parser.parse_args()
    trainer, records = setup(args)

    if args.memory_of:
        anchors, setting = args.memory_of.split("/")
        batch = BlockDiffusionCollator(1, num_anchors=int(anchors), seed=0)(records)
        batches = {"live": batch, "cached": with_cached_features(trainer, batch) if "cached" in setting else None}
        before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
        step(trainer, batches, parse_setting(setting))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        print(json.dumps({"peak_rss_mib": round(peak / 1024), "step_increase_mib": round((peak - before) / 1024)}))
        return

    settings = {text: parse_setting(text) for text in args.settings.split(",")}
    results = []
    for anchors in [int(x) for x in args.anchors.split(",")]:
        batch = BlockDiffusionCollator(1, num_anchors=anchors, seed=0)(records)
        batches = {"live": batch, "cached": with_cached_features(trainer, batch)}
        blocks = int(batch["anchor_mask"].sum())
        times = {text: [] for text in settings}
        for _ in range(args.warmup):  # untimed: first-call allocations
            for setting in settings.values():
                step(trainer, batches, setting)
        for _ in range(args.reps):
            for text, setting in settings.items():
                times[text].append(step(trainer, batches, setting))
        for text, setting in settings.items():
            median = statistics.median(times[text])
            row = {"anchors": anchors, "setting": text, **setting, "blocks": blocks, "median_s": round(median, 3),
                   "blocks_per_s": round(blocks / median, 2), "times_s": [round(t, 3) for t in times[text]]}
            results.append(row)
            print(json.dumps(row), flush=True)
    largest = max(r["anchors"] for r in results)
    memory = {} if args.no_memory else {text: peak_memory(args, largest, text) for text in settings}
    for text, record in memory.items():
        print(json.dumps({"anchors": largest, "setting": text, **record}), flush=True)
    summary = {"config": {k: v for k, v in vars(args).items() if k != "memory_of"}, "torch_threads":
               torch.get_num_threads(), "machine": machine_description(), "steps": results,
               "peak_memory_at_largest": memory}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
