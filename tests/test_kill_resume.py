"""Training and data generation survive a kill: runs are SIGKILLed mid-generation, mid-write of a shard, before a
shard's sidecar, mid-step, mid-checkpoint-save and mid-round of on-policy distillation, then resumed; the result must
be complete and valid, and nothing partial may look complete at any point.

A killed run is a subprocess that stops itself at the chosen point (it writes a marker file, then sleeps), so the kill
lands exactly there whatever the machine's load; SIGKILL leaves no chance to clean up. Resuming runs in this process.
"""

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerState

import hf_diffspec
from hf_diffspec.prompts import chat_prompt
from hf_diffspec.trainers.configs import DrafterTrainingArguments, OnPolicyDistillationConfig
from hf_diffspec.trainers.data import DrafterDataset, write_generated_data
from hf_diffspec.trainers.pipeline import last_complete_checkpoint, run_opd, train_drafter
from differential import char_tokenizer
from helpers import tiny_target

pytestmark = [pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX"),
              pytest.mark.usefixtures("one_torch_thread")]

TESTS = Path(__file__).resolve().parent
VOCAB = 96
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}={% endif %}"
PROMPTS = [{"id": f"p{i:02d}", "prompt": "abcdefgh"[i % 8] * (1 + i % 5) + f"x{i}", "domain": "chat"}
           for i in range(16)]
# 16 records in shards of 4, two per generate call: every kill point below falls inside a run
DATA = dict(num_samples=16, shard_size=4, batch_size=2, max_new_tokens=12)
TRAIN = dict(num_layers=1, block_size=4, num_anchors=8, per_device_train_batch_size=2, learning_rate=1e-3,
             logging_steps=1, bf16=False, disable_tqdm=True)
TRAIN_STEPS, SAVE_STEPS = 6, 2


def chat_tokenizer():
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.pad_token = "a"  # no EOS: every response has all its new tokens
    return tokenizer


def make_target():
    return tiny_target("llama", seed=3, vocab_size=VOCAB, layers=2)


def train_config(out, **kw) -> DrafterTrainingArguments:
    return DrafterTrainingArguments(output_dir=str(out), max_steps=TRAIN_STEPS, save_steps=SAVE_STEPS, **TRAIN, **kw)


def opd_config(out, init) -> OnPolicyDistillationConfig:
    return OnPolicyDistillationConfig(output_dir=str(out), init=str(init), rounds=2, samples_per_round=2,
                                      max_new_tokens=8, max_steps=2, save_steps=1, **TRAIN)


# ----- the killed runs (subprocesses) -------------------------------------------------------------------------------
def child(job_json: str) -> None:
    """Entry point of a killed run: `job["kind"]` is data, train or opd; it stops at `job["stop"]`."""
    torch.set_num_threads(1)
    job = json.loads(job_json)
    {"data": _child_data, "train": _child_train, "opd": _child_opd}[job["kind"]](job)


def _stop_here(job: dict) -> None:
    """Tell the test that the kill point is reached, then wait for the kill."""
    Path(job["marker"]).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


def _child_data(job: dict) -> None:
    from hf_diffspec.trainers import data

    target, stop, nth = make_target(), job["stop"], job["nth"]
    calls = []
    if stop == "generating":  # at the nth batch: earlier records are buffered for the next shard, not yet written
        generate = target.generate

        def generate_then_stop(*args, **kwargs):
            calls.append(1)
            if len(calls) == nth:
                _stop_here(job)
            return generate(*args, **kwargs)

        target.generate = generate_then_stop
    elif stop == "writing-arrays":  # the nth shard's arrays half written
        savez = np.savez_compressed

        def half_written(file, **arrays):
            calls.append(1)
            if len(calls) < nth:
                return savez(file, **arrays)
            whole = io.BytesIO()
            savez(whole, **arrays)
            file.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            file.flush()
            _stop_here(job)

        np.savez_compressed = half_written
    elif stop == "before-sidecar":  # the nth shard's arrays in place, its sidecar not written
        atomic_write = data.atomic_write

        def stop_at_sidecar(path, content):
            if Path(path).name.startswith("shard-") and Path(path).suffix == ".json":
                calls.append(1)
                if len(calls) == nth:
                    _stop_here(job)
            return atomic_write(path, content)

        data.atomic_write = stop_at_sidecar
    write_generated_data(target, chat_tokenizer(), "tiny", job["out"], prompts=PROMPTS, **DATA)


def _stop_in_training(job: dict, in_folder: str = "") -> None:
    """Stop when `job["step"]` optimizer steps are done: "mid-step" inside the next step (forward and backward done,
    optimizer step not), "mid-save" while checkpoint-STEP is saved (its trainer_state.json, written last, cut short)."""
    step = job["step"]
    if job["stop"] == "mid-step":
        training_step = Trainer.training_step

        def step_then_stop(self, *args, **kwargs):
            loss = training_step(self, *args, **kwargs)
            if self.state.global_step == step and in_folder in self.args.output_dir:
                _stop_here(job)
            return loss

        Trainer.training_step = step_then_stop
    elif job["stop"] == "mid-save":
        save_to_json = TrainerState.save_to_json

        def cut_short(self, json_path):
            if Path(json_path).parent.name == f"checkpoint-{step}" and in_folder in json_path:
                text = json.dumps(dataclasses.asdict(self), indent=2)
                Path(json_path).write_text(text[: len(text) // 2])
                _stop_here(job)
            return save_to_json(self, json_path)

        TrainerState.save_to_json = cut_short


def _child_train(job: dict) -> None:
    _stop_in_training(job)
    train_drafter(make_target(), chat_tokenizer(), "tiny", [job["data"]],
                  train_config(job["out"], resume=job["resume"]), command="test")


def _child_opd(job: dict) -> None:
    _stop_in_training(job, in_folder="round-1")
    run_opd(make_target(), chat_tokenizer(), "tiny", PROMPTS, opd_config(job["out"], job["init"]), command="test")


def run_until_killed(tmp_path: Path, kind: str, **job) -> None:
    """Start a `kind` run in a subprocess, wait until it reaches its kill point, and SIGKILL it there."""
    marker = tmp_path / f"reached-{kind}-{job['stop']}-{time.time_ns()}"
    log = marker.with_suffix(".log")
    job = {"kind": kind, "marker": str(marker), **job}
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_kill_resume as t; t.child(sys.argv[1])"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as output:
        run = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], stdout=output,
                               stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300  # generous: only a broken run gets here
        while not marker.exists():
            if run.poll() is not None:
                pytest.fail(f"the {kind} run ended (exit {run.returncode}) before its kill point "
                            f"{job['stop']}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the {kind} run did not reach {job['stop']} in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=60) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


# ----- checks --------------------------------------------------------------------------------------------------------
def shard_files(data_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """(sidecars, arrays, hidden files) in `data_dir`; anything else there fails the test."""
    names = sorted(p.name for p in data_dir.iterdir())
    sidecars = [n for n in names if n.startswith("shard-") and n.endswith(".json")]
    arrays = [n for n in names if n.startswith("shard-") and n.endswith(".npz")]
    hidden = [n for n in names if n.startswith(".")]
    assert set(names) == {"meta.json", *sidecars, *arrays, *hidden}, names
    return sidecars, arrays, hidden


def loaded_ids(data_dir: Path, tokenizer) -> list[str]:
    """The ids of the complete shards, checked to be unique and each loaded by `DrafterDataset` with its own prompt."""
    sidecars, arrays, _ = shard_files(data_dir)
    assert {s.removesuffix(".json") for s in sidecars} <= {a.removesuffix(".npz") for a in arrays}
    ids = [i for s in sidecars for i in json.loads((data_dir / s).read_text())["ids"]]
    assert len(ids) == len(set(ids))
    dataset = DrafterDataset(data_dir, tokenizer=tokenizer)
    assert len(dataset) == len(ids)  # the loader reads the shards in name order, as listed here
    prompts = {p["id"]: p["prompt"] for p in PROMPTS}
    for i, record_id in enumerate(ids):
        item = dataset[i]
        assert item["input_ids"][: item["prompt_length"]].tolist() == chat_prompt(tokenizer, prompts[record_id],
                                                                                  tokenize=True)
        assert len(item["input_ids"]) == item["prompt_length"] + DATA["max_new_tokens"]
    return ids


def checkpoint_folders(out: Path) -> dict[str, bool]:
    """checkpoint-N folder name -> whether its trainer_state.json parses."""
    found = {}
    for folder in (out / "checkpoints").glob("checkpoint-*"):
        try:
            json.loads((folder / "trainer_state.json").read_text())
            found[folder.name] = True
        except (OSError, ValueError):
            found[folder.name] = False
    return found


@pytest.fixture
def count_steps(monkeypatch):
    """Optimizer steps run in this process (one training_step each: no gradient accumulation)."""
    steps = []
    training_step = Trainer.training_step

    def counted(self, *args, **kwargs):
        steps.append(self.state.global_step)
        return training_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", counted)
    return steps


# ----- data generation --------------------------------------------------------------------------------------------
def test_data_generation_killed_three_times_resumes_to_complete_valid_shards(tmp_path):
    data, tokenizer = tmp_path / "data", chat_tokenizer()

    # 1. killed while the second shard's arrays are half written: its temporary file is hidden and never read
    run_until_killed(tmp_path, "data", out=str(data), stop="writing-arrays", nth=2)
    _, arrays, hidden = shard_files(data)
    assert arrays == ["shard-00000.npz"] and len(hidden) == 1 and "shard-00001.npz" in hidden[0]
    assert len(loaded_ids(data, tokenizer)) == 4

    # 2. rerun, killed between a shard's arrays and its sidecar: arrays without a sidecar are not a shard
    run_until_killed(tmp_path, "data", out=str(data), stop="before-sidecar", nth=2)
    _, arrays, hidden = shard_files(data)
    assert hidden == []  # the dead run's temporary file was removed
    assert "shard-00002.npz" in arrays and not (data / "shard-00002.json").exists()
    assert len(loaded_ids(data, tokenizer)) == 8

    # 3. rerun, killed mid-generation with records buffered for the next shard: they are generated again
    run_until_killed(tmp_path, "data", out=str(data), stop="generating", nth=4)
    sidecars, arrays, hidden = shard_files(data)
    assert hidden == [] and len(arrays) == len(sidecars) == 3  # shard 2's lone arrays were written again, whole
    assert len(loaded_ids(data, tokenizer)) == 12

    # 4. rerun to completion: exactly the records asked for, every shard complete, nothing else left
    assert write_generated_data(make_target(), tokenizer, "tiny", data, prompts=PROMPTS, **DATA) == 16
    sidecars, arrays, hidden = shard_files(data)
    assert hidden == [] and [a.removesuffix(".npz") for a in arrays] == [s.removesuffix(".json") for s in sidecars]
    assert sorted(loaded_ids(data, tokenizer)) == sorted(p["id"] for p in PROMPTS)


# ----- training ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("kill") / "data"
    write_generated_data(make_target(), chat_tokenizer(), "tiny", data, prompts=PROMPTS, **DATA)
    return data


def test_training_killed_mid_save_and_mid_step_resumes_to_the_planned_steps(train_data, tmp_path, count_steps):
    out, tokenizer = tmp_path / "drafter", chat_tokenizer()
    job = dict(data=str(train_data), out=str(out))

    # 1. killed while saving checkpoint-4: the newest checkpoint is partial (trainer_state.json cut short)
    run_until_killed(tmp_path, "train", **job, resume=False, stop="mid-save", step=4)
    assert checkpoint_folders(out) == {"checkpoint-2": True, "checkpoint-4": False}
    assert last_complete_checkpoint(out / "checkpoints") == out / "checkpoints" / "checkpoint-2"
    assert not (out / "config.json").exists()  # no drafter looks complete

    # 2. resumed from checkpoint-2 (not the partial one), killed mid-step after saving checkpoint-4 again
    run_until_killed(tmp_path, "train", **job, resume=True, stop="mid-step", step=4)
    assert checkpoint_folders(out) == {"checkpoint-2": True, "checkpoint-4": True}
    assert not (out / "config.json").exists()

    # 3. resumed to completion: only the steps after checkpoint-4 run, and the drafter folder is complete
    train_drafter(make_target(), tokenizer, "tiny", [str(train_data)], train_config(out, resume=True), command="test")
    assert count_steps == [4, 5]
    info = json.loads((out / "training_info.json").read_text())
    assert info["steps"] == TRAIN_STEPS
    assert not (out / ".saving").exists()
    assert all(checkpoint_folders(out).values())
    target = make_target()
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(out, target=target)
    prompt = torch.tensor([chat_prompt(tokenizer, PROMPTS[0]["prompt"], tokenize=True)])
    assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False),
                       target.generate(prompt, max_new_tokens=6, do_sample=False))

    # 4. a newest checkpoint without trainer_state.json (deleted) is skipped too: resume from the one before it
    newest = max((out / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    (newest / "trainer_state.json").unlink()
    count_steps.clear()
    train_drafter(make_target(), tokenizer, "tiny", [str(train_data)], train_config(out, resume=True), command="test")
    assert count_steps == list(range(TRAIN_STEPS - SAVE_STEPS, TRAIN_STEPS))
    assert json.loads((out / "training_info.json").read_text())["steps"] == TRAIN_STEPS


def test_last_complete_checkpoint_skips_partial_folders_and_resume_says_when_none_is_left(train_data, tmp_path):
    checkpoints = tmp_path / "out" / "checkpoints"
    for name, state in [("checkpoint-2", "{}"), ("checkpoint-9", '{"global_st'), ("checkpoint-10", None),
                        ("checkpoint-x", "{}")]:
        (checkpoints / name).mkdir(parents=True)
        if state is not None:
            (checkpoints / name / "trainer_state.json").write_text(state)
    (checkpoints / "checkpoint-11").write_text("a file, not a checkpoint")
    assert last_complete_checkpoint(checkpoints) == checkpoints / "checkpoint-2"  # 10 > 9 > 2: numbers, not names

    (checkpoints / "checkpoint-2" / "trainer_state.json").unlink()
    assert last_complete_checkpoint(checkpoints) is None
    with pytest.raises(FileNotFoundError, match=r"no checkpoint under .*checkpoints.*trainer_state\.json.*drop --resume"):
        train_drafter(make_target(), chat_tokenizer(), "tiny", [str(train_data)],
                      train_config(tmp_path / "out", resume=True))


# ----- on-policy distillation ----------------------------------------------------------------------------------------
def test_opd_killed_mid_round_keeps_finished_rounds_and_resumes_the_rounds_training(tmp_path, count_steps):
    out, init = tmp_path / "opd", tmp_path / "init"
    target = make_target()
    torch.manual_seed(0)
    hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(init)

    # killed in round 1's second training step, after its checkpoint-1
    run_until_killed(tmp_path, "opd", out=str(out), init=str(init), stop="mid-step", step=1)
    assert (out / "round-0" / "round.json").exists() and not (out / "round-1" / "round.json").exists()
    assert checkpoint_folders(out / "round-1" / "drafter") == {"checkpoint-1": True}
    assert not (out / "round-1" / "drafter" / "config.json").exists() and not (out / "opd_history.json").exists()
    kept = [out / "round-0" / "round.json", out / "round-0" / "drafter" / "model.safetensors",
            *sorted((out / "round-1" / "data").glob("shard-*"))]
    stamps = [p.stat().st_mtime_ns for p in kept]

    final = run_opd(target, chat_tokenizer(), "tiny", PROMPTS, opd_config(out, init), command="test")
    assert final == out / "round-1" / "drafter"
    assert count_steps == [1]  # round 0 is not redone; round 1 continues from its checkpoint
    assert [p.stat().st_mtime_ns for p in kept] == stamps  # nor its data regenerated
    history = json.loads((out / "opd_history.json").read_text())
    assert [h["round"] for h in history] == [0, 1]
    assert json.loads((final / "training_info.json").read_text())["steps"] == 2
    hf_diffspec.DiffusionDrafter.from_pretrained(final, target=target)
