"""One process of the 2-process CPU runs of tests/test_distributed.py, started by `torchrun --nproc_per_node 2`.

    torchrun --standalone --nproc_per_node 2 tests/distributed_worker.py PLAN.json

PLAN.json: {"results": DIR, "jobs": [{"name", "argv", "clock_seconds_per_call"?, "deterministic_prefixes"?}]}. Each
job is an `hf-diffspec` command line run through `hf_diffspec.cli.main`. Per job this process saves
DIR/NAME-rankR.pt: what each `Trainer.train` of the job left in this process (weights, global step, logged learning
rates) and every path this process wrote, renamed or removed (Python's audit events; the test keeps those under the
job's output folder).

`clock_seconds_per_call` replaces the trainers' clock with one that advances by that many seconds per reading, per
process ({"0": ..., "1": ...}): processes whose clocks disagree. `deterministic_prefixes` makes the VP trainer's
prefix lengths a function of the anchors, so that one process with the doubled batch draws the same ones.
"""

import json
import os
import sys
import time
import types

import torch

touched: list[str] = []


def record_writes(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        if args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC):
            touched.append(os.path.abspath(os.fsdecode(args[0])))
    elif event == "os.rename":
        touched.extend([os.path.abspath(os.fsdecode(args[0])), os.path.abspath(os.fsdecode(args[1]))])
    elif event in ("os.remove", "shutil.rmtree"):
        touched.append(os.path.abspath(os.fsdecode(args[0])))


class CountingClock:
    """A clock that advances by `seconds` at every reading."""

    def __init__(self, seconds: float):
        self.seconds, self.now = seconds, 0.0

    def perf_counter(self) -> float:
        self.now += self.seconds
        return self.now


def deterministic_prefix_lengths(self, anchors):
    return anchors % (self.block_size - 1)


def main(plan_path: str) -> None:
    from hf_diffspec import cli
    from hf_diffspec.trainers import block_diffusion

    plan = json.loads(open(plan_path).read())
    rank = int(os.environ["RANK"])
    trained = []
    train = block_diffusion.BlockDiffusionTrainer.train

    def train_and_record(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        trained.append({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                        "step": self.state.global_step,
                        "learning_rates": [h["learning_rate"] for h in self.state.log_history if "learning_rate" in h]})
        return result

    block_diffusion.BlockDiffusionTrainer.train = train_and_record
    sys.addaudithook(record_writes)
    for job in plan["jobs"]:
        trained.clear()
        touched.clear()
        clocks = job.get("clock_seconds_per_call")
        block_diffusion.time = types.SimpleNamespace(perf_counter=CountingClock(clocks[str(rank)]).perf_counter) \
            if clocks else time
        prefixes = block_diffusion.VariablePrefixTrainer.prefix_lengths
        if job.get("deterministic_prefixes"):
            block_diffusion.VariablePrefixTrainer.prefix_lengths = deterministic_prefix_lengths
        cli.main(job["argv"])
        block_diffusion.VariablePrefixTrainer.prefix_lengths = prefixes
        written = list(touched)
        torch.save({"trained": trained, "written": written},
                   os.path.join(plan["results"], f"{job['name']}-rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
