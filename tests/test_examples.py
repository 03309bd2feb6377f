"""The user examples in examples/ run as a user runs them (subprocesses from the repository root), with short
settings, and print what they promise. published_drafter.py needs the Hub and a GPU for its defaults: here it runs
on the offline SmolLM2 target with the shipped drafter instead."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFTER = ROOT / "checkpoints" / "smollm2-135m-instruct-dflash"

pytestmark = pytest.mark.real_model


def run(*command, check: bool = True, auto_profile: bool = False) -> subprocess.CompletedProcess:
    """Run an example from the repository root, with this interpreter's `hf-diffspec` first on PATH; no verify-cost
    profile is measured (the loop then verifies the drafter's configured length) unless `auto_profile`."""
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if auto_profile:
        env.pop("HF_DIFFSPEC_AUTO_PROFILE", None)
    else:
        env["HF_DIFFSPEC_AUTO_PROFILE"] = "0"
    command = [sys.executable if part == "python" else str(part) for part in command]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def test_generate_prints_the_answer_and_its_speculation_stats():
    out = run("python", "examples/generate.py", "--prompt", "What is 2 + 2?", "--max-new-tokens", "8").stdout
    assert "8 new tokens" in out and "tau" in out and "steps with the drafter" in out and "plain" in out


def test_batched_is_identical_to_plain_generate_in_fp32():
    out = run("python", "examples/batched.py", "--max-new-tokens", "8").stdout
    assert out.count("### ") == 4
    assert "identical to plain generate (float32, 4 rows): True" in out


def test_sampling_prints_a_seeded_sample_and_tau():
    out = run("python", "examples/sampling.py", "--max-new-tokens", "8", "--seed", "3").stdout
    assert "speculative sample:" in out and "plain sample, same seed:" in out
    assert "seed 3: tau" in out and "0 plain steps" in out  # a fixed draft length: every step speculates


def test_published_drafter_says_what_it_needs_and_runs_on_a_local_pair():
    header = ast.get_docstring(ast.parse((ROOT / "examples" / "published_drafter.py").read_text()))
    assert "NEEDS THE NETWORK" in header and "GPU" in header and "not run in CI" in header
    out = run("python", "examples/published_drafter.py", "--target", "smollm2-135m-instruct",
              "--drafter", SHIPPED_DRAFTER, "--device", "cpu", "--max-new-tokens", "4").stdout
    assert "tau" in out and "identical to plain generate:" in out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """examples/train_and_push.sh in its tiny mode: (its output, the runs folder)."""
    runs = tmp_path_factory.mktemp("train_and_push")
    env_script = f"TINY=1 RUNS={runs} bash examples/train_and_push.sh"
    # as a user runs it: on a busy machine its `hf-diffspec profile` saves nothing, and the benchmark after it then
    # measures the profile on first use (with automatic profiling off it would refuse to size drafts)
    return run("bash", "-c", env_script, auto_profile=True).stdout, runs


def test_train_and_push_trains_benchmarks_and_dry_runs_the_push(trained):
    out, runs = trained
    assert "4 samples in" in out and f"drafter saved to {runs}/drafter" in out
    # the profile is saved on a quiet machine; on a busy one it is not, and the script goes on
    assert "generate() now sizes drafts" in out or "generate() measures the profile on first use instead" in out
    bench = json.loads((runs / "bench.json").read_text())["results"]
    assert {row["method"] for row in bench} == {"ar", "dflash"} and "| dflash | 1 | code |" in out
    assert "would upload" in out and "to you/smollm2-135m-instruct-dflash:" in out and "model.safetensors" in out


def test_export_vllm_exports_the_trained_drafter_and_prints_the_serve_command(trained):
    _, runs = trained
    done = run("bash", "examples/export_vllm.sh", runs / "drafter", runs / "vllm")
    assert f"exported for vllm to {runs}/vllm" in done.stdout and (runs / "vllm" / "config.json").is_file()
    assert "learned its own MASK" not in done.stdout + done.stderr  # the refusal a user of the shipped drafter meets
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in done.stdout
    assert '"num_speculative_tokens": 15' in done.stdout and "--speculative-num-draft-tokens 16" in done.stdout
    missing = run("bash", "examples/export_vllm.sh", runs / "nothing-here", check=False)
    assert missing.returncode == 2 and "run examples/train_and_push.sh first" in missing.stderr


def test_gpu_check_runs_end_to_end_on_the_cpu_with_tiny_configs(tmp_path, monkeypatch):
    """examples/gpu_check.sh --tiny: every target family checked or skipped with the loop's refusal, the oracle's
    rows reported with their host synchronisations per step, and fp32 identity with plain generate. Drafting ahead,
    as on a GPU."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")
    report, results = tmp_path / "gpu_check.json", tmp_path / "gpu_check.jsonl"
    out = run("bash", "examples/gpu_check.sh", "--tiny", "--json", report, "--results", results).stdout
    assert "fp32 identity with plain generate: ok" in out
    targets = json.loads(report.read_text())["targets"]
    assert targets["dense (Qwen3-8B-like)"]["fp32_identical"] == {"1": True, "4": True}
    hybrid = targets["hybrid (Qwen3.5-like)"]
    assert hybrid["fp32_identical"] == {"1": True, "4": True}
    assert [r["rows"] for r in hybrid["runs"] if "skipped" not in r] == [1, 1, 1, 4, 4, 4]
    runs = targets["dense (Qwen3-8B-like)"]["runs"]
    assert {(r["rows"], r["oracle_tau"]) for r in runs} == {(rows, tau) for rows in (1, 4) for tau in (2, 4, 8)}
    assert all(r["syncs_per_step_max"] <= 3 for r in runs)
    assert {r["section"] for r in map(json.loads, results.read_text().splitlines()) if "section" in r} >= {
        "runs", "gates", "sampling", "kernels", "identity", "capture", "graphs", "long_context",
        "equal_tau"}  # as they came
    for family in ("gemma4 (Gemma 4-like)", "gpt-oss (gpt-oss-20b-like)"):
        assert targets[family]["fp32_identical"] == {"1": True, "4": True}
    assert not any("error" in entry for entry in targets.values())
    dense = targets["dense (Qwen3-8B-like)"]
    assert {(r["oracle_tau"], r["arm"]) for r in dense["equal_tau"]} >= {(3, "zlab"), (6.5, "ours-block")}
    assert all(r["problems"] == [] and r["identical_to_plain"] for r in dense["equal_tau"])  # fp32: all of them
    assert all(r["chain_after"] > 0 for r in dense["long_context"])
    assert [r[label]["graphs_captured_again"] for r in dense["graphs"] for label in ("static", "static+graphs")] == [
        0, 0, 0, 0]  # (on a GPU: the timed call replays what the warm-up captured)
    assert [(r["rows"], r["captured"]) for r in dense["capture"]] == [(1, "no CUDA graphs on cpu"),
                                                                      (16, "no CUDA graphs on cpu")]


# .device-wheels (transformers, gguf, peft, dflash: 14 MiB, `bash examples/device_slim.sh wheels`) travel with the checkout
DEVICE_WHEELS_MIB = 16
DEVICE_CALL_MIB = 64


def test_what_a_gpu_check_call_carries_fits_the_device_limit():
    """A device call carries the working tree (tracked, and untracked not ignored) and the carried paths, at most
    64 MiB: after `examples/device_slim.sh slim` (its default paths taken out), with the wheels, it must fit."""
    import re

    slim = re.search(r"slim_paths=\$\{SLIM_PATHS:-([^}]*)\}", (ROOT / "examples" / "device_slim.sh").read_text())
    left_out = tuple(path.rstrip("/") + "/" for path in slim.group(1).split())
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    sizes = [(ROOT / f).stat().st_size for f in listed if f and not f.startswith(left_out) and (ROOT / f).is_file()]
    assert sum(sizes) / 2**20 + DEVICE_WHEELS_MIB < DEVICE_CALL_MIB



def campaign_prompts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("campaign_prompts", ROOT / "examples" / "campaign_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_campaign_prompt_lists_grow_by_prefix_and_keep_the_shares():
    """The data stage answers a list and may later ask for a longer one: the longer list must start with the shorter,
    and every prefix must hold the families in their shares until a family runs out."""
    module = campaign_prompts()
    by_family = {name: [{"id": f"{name}/{i}", "domain": name} for i in range(size)]
                 for name, size in (("code", 400), ("math", 30), ("chat", 1000))}
    weights = {"code": 0.3, "math": 0.2, "chat": 0.5}
    short = module.mixed_order(by_family, weights, 100, seed=0)
    long = module.mixed_order(by_family, weights, 1000, seed=0)
    assert long[:100] == short and len({p["id"] for p in long}) == 1000
    assert [sum(p["domain"] == name for p in short) for name in weights] == [30, 20, 50]
    # math runs out at 30: the others fill in, in their own ratio
    counts = {name: sum(p["domain"] == name for p in long) for name in weights}
    assert counts["math"] == 30 and abs(counts["code"] / counts["chat"] - 0.6) < 0.01


def test_campaign_follow_ups_continue_the_targets_own_conversations(real_target, tmp_path):
    """A follow-up turn carries the target's own earlier answers as the assistant's turns (decoded from the shards,
    EOS dropped), goes after its family's first turns, and is answered like any prompt; a turn whose earlier answer
    is missing, or whose prompt is too long, gives none."""
    from hf_diffspec.prompts import chat_prompt
    from hf_diffspec.trainers.data import DrafterDataset, write_generated_data
    from tests.helpers import tiny_target

    module = campaign_prompts()
    tokenizer = real_target[1]
    target = tiny_target("llama", seed=3, vocab_size=len(tokenizer))
    conversations = {
        "a": [{"from": "human", "value": "Write a Python function that adds two numbers."}, {"from": "gpt", "value": "x"},
              {"from": "human", "value": "Now make it add three numbers instead."}, {"from": "gpt", "value": "y"},
              {"from": "human", "value": "And explain how it works, briefly please."}],
        "b": [{"from": "human", "value": "What is the derivative of x squared?"}, {"from": "gpt", "value": "z"},
              {"from": "human", "value": "x" * 3000}],
        "c": [{"from": "human", "value": "Tell me a short story about a cat."}],
    }
    first_turns = {"sharegpt/a/turn0": "code", "sharegpt/b/turn0": "math", "sharegpt/c/turn0": "chat"}
    data = tmp_path / "data"
    prompts = [{"id": rid, "prompt": conversations[rid.split("/")[1]][0]["value"]} for rid in first_turns]
    write_generated_data(target, tokenizer, "tiny", data, num_samples=3, max_new_tokens=6, batch_size=3, prompts=prompts)
    answers = module.answered(data)
    assert set(answers) == set(first_turns)

    after = module.follow_ups(answers, conversations, first_turns, tokenizer, max_prompt_tokens=384)
    assert list(after) == ["code"]  # b's next turn is too long, c has none
    (turn2,) = after["code"]
    assert turn2["id"] == "sharegpt/a/turn0>2" and turn2["domain"] == "code"
    first_answer = answers["sharegpt/a/turn0"]
    first_answer = first_answer[:-1] if first_answer[-1] == tokenizer.eos_token_id else first_answer
    assert [m["role"] for m in turn2["messages"]] == ["user", "assistant", "user"]
    assert turn2["messages"][1]["content"] == tokenizer.decode(first_answer)
    assert turn2["messages"][2]["content"] == "Now make it add three numbers instead."
    with pytest.raises(ValueError, match="end with a user message"):
        chat_prompt(tokenizer, turn2["messages"][:2])

    # the list: follow-ups after their family's first turns, first-turn order untouched
    by_family = {f: [{"id": rid, "domain": f}] for rid, f in first_turns.items()}
    weights = {"code": 0.5, "math": 0.25, "chat": 0.25}
    plain = module.mixed_order(by_family, weights, 10, seed=0)
    mixed = module.mixed_order(by_family, weights, 10, seed=0, after=after)
    assert [p for p in mixed if "messages" not in p] == plain and mixed[-1] is turn2

    # answered like a prompt, its prompt tokens those of the whole conversation; then the third turn follows
    write_generated_data(target, tokenizer, "tiny", data, num_samples=1, max_new_tokens=6, batch_size=1, prompts=[turn2])
    dataset = DrafterDataset(data, tokenizer=tokenizer)
    prompt_ids = chat_prompt(tokenizer, turn2["messages"], tokenize=True)
    assert any(item_prompt == len(prompt_ids) and seq[:item_prompt].tolist() == prompt_ids
               for seq, item_prompt in zip(dataset.sequences, dataset.prompt_lengths))
    deeper = module.follow_ups(module.answered(data), conversations, first_turns, tokenizer, max_prompt_tokens=384)
    assert [p["id"] for p in deeper["code"]] == ["sharegpt/a/turn0>2", "sharegpt/a/turn0>2>4"]  # shallower first
    turn4 = deeper["code"][1]
    answers = module.answered(data)
    second_answer = answers["sharegpt/a/turn0>2"]
    second_answer = second_answer[:-1] if second_answer[-1] == tokenizer.eos_token_id else second_answer
    assert turn4["messages"][:3] == turn2["messages"] and turn4["messages"][3:] == [
        {"role": "assistant", "content": tokenizer.decode(second_answer)},
        {"role": "user", "content": "And explain how it works, briefly please."}]
    finished = {"sharegpt/a/turn0": tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id]}  # an answer that ended: the template closes the turn itself
    (closed,) = module.follow_ups(finished, conversations, first_turns, tokenizer, max_prompt_tokens=384)["code"]
    assert closed["messages"][1]["content"] == "def add(a, b):"
    del answers["sharegpt/a/turn0"]  # an earlier answer missing: no conversation to continue
    assert module.follow_ups(answers, conversations, first_turns, tokenizer, max_prompt_tokens=384) == {}
