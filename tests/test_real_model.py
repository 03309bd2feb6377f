"""A few checks on the real SmolLM2-135M-Instruct target (fp32 for exact greedy equality)."""

import json

import pytest
import torch

import hf_diffspec
from hf_diffspec.cli import SHIPPED_DRAFTERS, main

pytestmark = pytest.mark.real_model


def chat_inputs(tok, text):
    templated = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(templated, return_tensors="pt", add_special_tokens=False)


def drafter_for(target):
    shipped = SHIPPED_DRAFTERS["smollm2-135m-instruct"]
    if (shipped / "config.json").exists():
        return hf_diffspec.DiffusionDrafter.from_pretrained(shipped, target=target)
    torch.manual_seed(0)
    return hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=16)


def test_greedy_identical_on_smollm2(real_target):
    target, tok = real_target
    drafter = drafter_for(target)
    inputs = chat_inputs(tok, "Write a Python function that returns the sum of a list.")
    ref = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=48, do_sample=False)
    assert torch.equal(out, ref)
    assert drafter.last_generation_stats.tau >= 1.0


def test_stop_strings_and_eos_on_smollm2(real_target):
    target, tok = real_target
    drafter = drafter_for(target)
    inputs = chat_inputs(tok, "What is the capital of France? Answer in one sentence.")
    kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=["Paris"], tokenizer=tok)
    ref = target.generate(**inputs, **kwargs)
    out = target.generate(**inputs, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    assert tok.decode(out[0, inputs["input_ids"].shape[1]:]).endswith("Paris")


def test_bench_cli_writes_json_with_honest_fields(tmp_path, real_target, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--drafter", "random", "--domains", "code", "--prompts", "1", "--max-new-tokens", "8",
          "--dtype", "fp32", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {(r["method"], r["domain"]): r for r in payload["results"]}
    assert set(rows) == {("ar", "code"), ("ar", "all"), ("dflash", "code"), ("dflash", "all")}
    assert rows[("ar", "code")]["speedup_vs_ar"] == 1.0
    assert rows[("dflash", "code")]["identical_to_ar"] is True  # fp32: lossless means identical
    assert 1.0 <= rows[("dflash", "code")]["tau"] < 1.5  # an untrained drafter earns (almost) nothing
    assert {"cpu", "torch"} <= set(payload["machine"]) and payload["config"]["max_new_tokens"] == 8
    assert "| dflash | code |" in capsys.readouterr().out


def test_d2sd_greedy_identical_on_smollm2(real_target):
    from hf_diffspec.cli import SHIPPED_VP_DRAFTERS

    target, tok = real_target
    first = drafter_for(target)
    vp_path = SHIPPED_VP_DRAFTERS["smollm2-135m-instruct"]
    vp = hf_diffspec.DiffusionDrafter.from_pretrained(vp_path, target=target) if (vp_path / "config.json").exists() \
        else None
    dual = hf_diffspec.DualDiffusionDrafter.from_drafters(first, vp, num_branches=4, max_depth=8, tree_budget=12)
    inputs = chat_inputs(tok, "Explain what a binary search does.")
    ref = target.generate(**inputs, max_new_tokens=40, do_sample=False)
    out = target.generate(**inputs, assistant_model=dual, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, ref)
