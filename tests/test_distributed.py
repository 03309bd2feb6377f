"""Every trainer under DDP on the CPU: two processes with the gloo backend, started by `torchrun --nproc_per_node 2`
(tests/distributed_worker.py), run `hf-diffspec train kd | vp | length-head | opd`, DFlash 2's selector and `data
generate` on a tiny random target, all in one launch.

Checked: both processes end with the same weights; one process with the doubled batch trains the same drafter (SGD
at a constant rate, so that agreeing gradients give weights that agree to float rounding; every response position
is an anchor, so both runs train on the same blocks); files are written once, by the main process (the other writes
only its Trainer RNG state and its own data shards); processes whose clocks disagree stop a time budget at the same
step, the main process's, with the same learning rates; generation shared out between processes resumes with any
number of them. The launch has a timeout: a process left waiting in a collective fails the test instead of hanging.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_diffspec
from distributed_worker import deterministic_prefix_lengths
from hf_diffspec import cli
from hf_diffspec.trainers.block_diffusion import VariablePrefixTrainer
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter, write_generated_data
from helpers import tiny_target

LAUNCH_TIMEOUT_S = 900
TESTS = Path(__file__).parent
PROMPTS = ["Name three colours.", "Say hello in French.", "Count to five.", "What is a cat?", "Give me a fruit.",
           "Describe the sea."]
# the jobs' own flags; every training job also gets `training_flags`
JOBS = {
    "kd": ["train", "kd", "--heldout-tau-steps", "2", "--heldout-tau-prompts", "1",
           "--heldout-tau-max-new-tokens", "4"],
    "vp": ["train", "vp", "--init", "{init}", "--lora", "true", "--lora-rank", "4"],
    "length-head": ["train", "length-head", "--init", "{init}"],
    "selector": ["train", "kd", "--init", "{init}", "--selector-rank", "8"],
    "opd": ["train", "opd", "--init", "{init}", "--prompts-file", "{prompts}", "--rounds", "1",
            "--samples-per-round", "4", "--gen-max-new-tokens", "8"],
    "budget": ["train", "kd", "--time-budget", "1", "--max-steps", "20"],
}
BUDGET_CLOCKS = {"0": 10.0, "1": 1000.0}  # seconds per reading: the main process spends 1 minute in 6 steps


def training_flags(root: Path, batch_size: int) -> list[str]:
    return ["--target", str(root / "target"), "--dtype", "fp32", "--num-layers", "1", "--block-size", "4",
            "--num-anchors", "64", "--batch-size", str(batch_size), "--max-steps", "3", "--lr", "0.05",
            "--optim", "sgd", "--lr-scheduler-type", "constant", "--warmup-steps", "0", "--bf16", "false",
            "--logging-steps", "1", "--save-steps", "1000", "--disable-tqdm", "true", "--seed", "0"]


def job_argv(name: str, root: Path, out: Path, batch_size: int) -> list[str]:
    argv = [a.format(init=root / "init", prompts=root / "prompts.jsonl") for a in JOBS[name]]
    inputs = [] if name == "opd" else ["--data", str(root / "data")]
    # argparse keeps the last of a repeated flag: the job's own --max-steps wins over the common one
    return argv[:2] + training_flags(root, batch_size) + inputs + ["--out", str(out)] + argv[2:]


def generate_argv(root: Path) -> list[str]:
    return ["data", "generate", "--target", str(root / "target"), "--dtype", "fp32", "--source",
            str(root / "prompts.jsonl"), "--out", str(root / "generated"), "--num-samples", "6",
            "--max-new-tokens", "6", "--batch-size", "2"]


@pytest.fixture(scope="module")
def launch(real_target, tmp_path_factory):
    """The tiny target, its data, the plan, and what each of the two processes recorded per job."""
    tokenizer = real_target[1]
    root = tmp_path_factory.mktemp("distributed")
    target = tiny_target("llama", seed=3, vocab_size=len(tokenizer), layers=4)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(root / "init")
    # the target's own continuations, of lengths that differ from row to row (so do the processes' shares of a batch)
    writer = ShardWriter(root / "data", "tiny", tokenizer, source="generated")
    generator = torch.Generator().manual_seed(0)
    for i in range(8):
        prompt = torch.randint(20, 2000, (1, 4 + i), generator=generator)
        sequence = target.generate(prompt, max_new_tokens=6 + 4 * i, do_sample=False)[0]
        writer.add(f"s{i}", sequence.tolist(), prompt.shape[1], "chat")
    writer.flush()
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": p, "domain": "chat"}) + "\n" for i, p in enumerate(PROMPTS)))
    # an interrupted single-process generation: the shared-out run resumes it
    write_generated_data(target, tokenizer, "tiny", root / "generated", num_samples=2, max_new_tokens=6,
                         prompts=[{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])

    jobs = [{"name": "generate", "argv": generate_argv(root)}]
    for name in JOBS:
        job = {"name": name, "argv": job_argv(name, root, root / "ddp" / name, batch_size=2)}
        job |= {"clock_seconds_per_call": BUDGET_CLOCKS} if name == "budget" else {}
        job |= {"deterministic_prefixes": True} if name == "vp" else {}
        jobs.append(job)
    (root / "results").mkdir()
    (root / "plan.json").write_text(json.dumps({"results": str(root / "results"), "jobs": jobs}))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DIFFSPEC_AUTO_PROFILE": "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TESTS / "distributed_worker.py"), str(root / "plan.json")]
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        output, _ = run.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)  # torchrun and both workers
        output, _ = run.communicate()
        pytest.fail(f"the 2-process run did not finish in {LAUNCH_TIMEOUT_S} s (a process waiting in a collective?)"
                    f"\n{output[-6000:]}")
    assert run.returncode == 0, output[-6000:]
    results = {job["name"]: [torch.load(root / "results" / f"{job['name']}-rank{rank}.pt") for rank in (0, 1)]
               for job in jobs}
    return root, tokenizer, results


def written_under(record: dict, folder: Path) -> set[str]:
    return {os.path.relpath(path, folder) for path in record["written"] if Path(path).is_relative_to(folder)}


def check_processes_agree_and_one_writes(results, out: Path, drafter_dir: Path) -> None:
    """Same weights, steps and learning rates in both processes; only the main one writes the drafter and logs."""
    first, second = results
    assert len(first["trained"]) == len(second["trained"]) > 0
    for ours, theirs in zip(first["trained"], second["trained"]):
        assert ours["step"] == theirs["step"] and ours["learning_rates"] == theirs["learning_rates"]
        assert ours["weights"].keys() == theirs["weights"].keys()
        assert all(torch.equal(ours["weights"][k], theirs["weights"][k]) for k in ours["weights"])
    main_files, other_files = written_under(first, out), written_under(second, out)
    assert os.path.relpath(drafter_dir / "model.safetensors", out) in main_files
    others = {Path(f).name for f in other_files}
    assert all(name == "rng_state_1.pth" or name.lstrip(".").startswith("shard-rank1-") for name in others), others


def check_same_as_one_process(root: Path, name: str, drafter_dir: Path, relative: str, monkeypatch) -> None:
    """One process with the doubled batch trains the same drafter as the two processes."""
    if name == "vp":
        monkeypatch.setattr(VariablePrefixTrainer, "prefix_lengths", deterministic_prefix_lengths)
    single = root / "single" / name
    cli.main(job_argv(name, root, single, batch_size=4))
    ddp, one = load_file(drafter_dir / "model.safetensors"), load_file(single / relative / "model.safetensors")
    init = load_file(root / "init" / "model.safetensors")
    assert ddp.keys() == one.keys()
    for key in ddp:
        difference = (ddp[key] - one[key]).abs().max()
        trained = (one[key] - init[key]).abs().max() if key in init and name != "kd" else one[key].abs().max()
        assert difference <= 1e-4 * trained + 1e-7, (key, float(difference), float(trained))


@pytest.mark.parametrize("name", ["kd", "vp", "length-head", "selector", "opd"])
def test_two_processes_train_as_one_with_the_doubled_batch(launch, name, monkeypatch):
    root, _, results = launch
    out = root / "ddp" / name
    relative = "round-0/drafter" if name == "opd" else "."
    drafter_dir = out / relative
    check_processes_agree_and_one_writes(results[name], out, drafter_dir)
    check_same_as_one_process(root, name, drafter_dir, relative, monkeypatch)
    assert json.loads((drafter_dir / "training_info.json").read_text())["processes"] == 2
    if name == "kd":  # measured and logged by the main process only: one line per measured step
        log = (out / "heldout_tau.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in log] == [0, 2, 3]
    if name == "opd":  # both processes decoded their share of the round's prompts
        data = out / "round-0" / "data"
        assert sorted(p.name for p in data.glob("*.json")) == [
            "meta.json", "shard-rank0-00000.json", "shard-rank1-00000.json"]
        history = json.loads((out / "opd_history.json").read_text())
        assert [sorted(h) for h in history] == [["init", "round", "tau_while_generating"]]


def test_processes_whose_clocks_disagree_stop_at_the_same_step(launch):
    root, _, results = launch
    first, second = results["budget"]
    # the main process's clock: 6 readings of 10 s after the start spend the 1-minute budget (the other process's
    # own clock would have stopped it after one step, leaving the main one waiting in the next all-reduce)
    assert first["trained"][0]["step"] == second["trained"][0]["step"] == 6
    check_processes_agree_and_one_writes(results["budget"], root / "ddp" / "budget", root / "ddp" / "budget")


def test_generation_shared_out_between_processes_resumes_with_any_number(launch):
    root, tokenizer, results = launch
    generated = root / "generated"
    files = sorted(p.name for p in generated.iterdir())
    # the interrupted run's shard (p0, p1), then each process's share of the rest (p2 and p3-p5)
    assert files == ["meta.json", "shard-00000.json", "shard-00000.npz", "shard-rank0-00000.json",
                     "shard-rank0-00000.npz", "shard-rank1-00000.json", "shard-rank1-00000.npz"]
    ids = [sorted(json.loads((generated / f).read_text())["ids"]) for f in files
           if f.startswith("shard-") and f.endswith("json")]
    assert ids == [["p0", "p1"], ["p2"], ["p3", "p4", "p5"]]
    assert all(not written_under(record, generated) & {"meta.json"} for record in results["generate"])
    assert len(DrafterDataset(generated, tokenizer=tokenizer)) == 6
    # one process resumes what two wrote: nothing is left to write
    target, _ = hf_diffspec.load_target(root / "target", dtype=torch.float32)
    prompts = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    assert write_generated_data(target, tokenizer, "tiny", generated, num_samples=6, max_new_tokens=6,
                                prompts=prompts) == 6
    assert sorted(p.name for p in generated.iterdir()) == files
