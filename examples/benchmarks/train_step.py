"""Blocks per second of the block-diffusion KD training step (forward and backward: target, drafter, LM head, loss)
on the SmolLM2 target with the shipped drafter, per anchors per sequence, with blocks in rows of N blocks
(`--blocks-per-row`; 0 is one row per sequence, the dense mask the step used before rows), the settings interleaved
repetition by repetition; then the peak memory of one step of each setting at the largest anchor count, each in a
fresh process.

    python examples/benchmarks/train_step.py --anchors 32,128,512 --blocks-per-row 0,16 --reps 3

Sequences are random tokens (`--seq-len`, a `--prompt-len` prompt, the rest response) with every slot of every block
supervised (no target-consistent labels): the LM head's worst case, the same in every setting. Prints one line per
setting, then a JSON summary.
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

DRAFTER = "checkpoints/smollm2-135m-instruct-dflash"


def setup(args):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    target, _ = load_target("smollm2-135m-instruct", dtype=dtype)
    drafter = DiffusionDrafter.from_pretrained(DRAFTER, target=target, length_head=False)
    config = DrafterTrainingArguments(output_dir=tempfile.mkdtemp(), bf16=False, report_to=[], disable_tqdm=True,
                                      target_consistent_labels=False, loss_depth=args.loss_depth)
    trainer = BlockDiffusionTrainer(model=drafter, args=config, train_dataset=[], target=target)
    generator = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(2, target.config.vocab_size, (args.seq_len,), generator=generator),
                "prompt_length": args.prompt_len} for _ in range(args.batch_size)]
    return trainer, records


def step(trainer, batch, per_row: int) -> float:
    trainer.args.blocks_per_row = per_row
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    trainer.compute_loss(trainer.model, batch).backward()
    return time.perf_counter() - start


def peak_memory(args, anchors: int, per_row: int) -> dict:
    """One step in a fresh process: its peak resident memory and the increase over what it held before the step."""
    command = [sys.executable, __file__, "--memory-of", f"{anchors},{per_row}", "--seq-len", str(args.seq_len),
               "--prompt-len", str(args.prompt_len), "--batch-size", str(args.batch_size), "--dtype", args.dtype]
    if args.loss_depth:
        command += ["--loss-depth", str(args.loss_depth)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", default="32,128,512", help="anchors (blocks) per sequence, comma-separated")
    parser.add_argument("--blocks-per-row", default="0,16", help="settings compared; 0: one row per sequence")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per setting before them")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--loss-depth", type=int, default=None)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--json", default=None, help="also write the summary here")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # ANCHORS,PER_ROW: one step, in a child
    args = parser.parse_args()
    trainer, records = setup(args)

    if args.memory_of:
        anchors, per_row = map(int, args.memory_of.split(","))
        batch = BlockDiffusionCollator(1, num_anchors=anchors, seed=0)(records)
        before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
        step(trainer, batch, per_row)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        print(json.dumps({"peak_rss_mib": round(peak / 1024), "step_increase_mib": round((peak - before) / 1024)}))
        return

    settings = [int(x) for x in args.blocks_per_row.split(",")]
    results = []
    for anchors in [int(x) for x in args.anchors.split(",")]:
        batch = BlockDiffusionCollator(1, num_anchors=anchors, seed=0)(records)
        blocks = int(batch["anchor_mask"].sum())
        times = {per_row: [] for per_row in settings}
        for _ in range(args.warmup):  # untimed: first-call allocations
            for per_row in settings:
                step(trainer, batch, per_row)
        for _ in range(args.reps):
            for per_row in settings:
                times[per_row].append(step(trainer, batch, per_row))
        for per_row in settings:
            median = statistics.median(times[per_row])
            row = {"anchors": anchors, "blocks_per_row": per_row, "blocks": blocks, "median_s": round(median, 3),
                   "blocks_per_s": round(blocks / median, 1), "times_s": [round(t, 3) for t in times[per_row]]}
            results.append(row)
            print(json.dumps(row), flush=True)
    largest = max(r["anchors"] for r in results)
    memory = {} if args.no_memory else {str(per_row): peak_memory(args, largest, per_row) for per_row in settings}
    for per_row, record in memory.items():
        print(json.dumps({"anchors": largest, "blocks_per_row": int(per_row), **record}), flush=True)
    summary = {"config": {k: v for k, v in vars(args).items() if k != "memory_of"}, "torch_threads":
               torch.get_num_threads(), "machine": machine_description(), "steps": results,
               "peak_memory_at_largest": memory}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
