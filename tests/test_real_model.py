"""A few checks on the real SmolLM2-135M-Instruct target (fp32 for exact greedy equality)."""

import json

import pytest
import torch

import hf_diffspec
from hf_diffspec.cli import main
from hf_diffspec.drafters import SHIPPED_DRAFTERS

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


@pytest.mark.every_step_speculates("asserts the shipped drafter's tau, which the gates' timings would change")
def test_greedy_identical_on_smollm2_and_the_shipped_drafter_keeps_its_tau(real_target):
    target, tok = real_target
    assert (SHIPPED_DRAFTERS["smollm2-135m-instruct"] / "config.json").exists()  # checkpoints/ is in the repository
    drafter = drafter_for(target)
    inputs = chat_inputs(tok, "Write a Python function that returns the sum of a list.")
    ref = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=48, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    # measured 3.13 every run (47 tokens in 15 steps; fp32, every step drafting at a fixed length, no profile): the
    # band leaves room for other CPUs' rounding; with randomised weights the drafter reaches 1.07, with its weights
    # scaled by 30% noise 2.35
    assert 2.7 <= out.speculation_stats.tau <= 3.6
    if drafter.config.prompt_lookup_num_tokens:  # the shipped drafter also verifies prompt-lookup drafts
        assert out.speculation_stats.lookup_tokens > 0


def test_stop_strings_and_eos_on_smollm2(real_target):
    target, tok = real_target
    drafter = drafter_for(target)
    inputs = chat_inputs(tok, "What is the capital of France? Answer in one sentence.")
    kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=["Paris"], tokenizer=tok)
    ref = target.generate(**inputs, **kwargs)
    out = target.generate(**inputs, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    assert tok.decode(out[0, inputs["input_ids"].shape[1]:]).endswith("Paris")


def test_bench_cli_writes_json_with_honest_fields(tmp_path, real_target, capsys, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "1")  # `dflash` sizes drafts with the cost model, as users get it
    out = tmp_path / "bench.json"
    main(["bench", "--drafter", "random", "--domains", "code", "--prompts", "2", "--max-new-tokens", "8",
          "--dtype", "fp32", "--batch-sizes", "1,2", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {(r["method"], r["batch_size"], r["domain"]): r for r in payload["results"]}
    assert set(rows) == {(m, b, d) for m in ("ar", "dflash") for b, d in [(1, "code"), (1, "all"), (2, "code"),
                                                                          (2, "all")]}
    assert rows[("ar", 1, "code")]["speedup_vs_ar"] == 1.0 and rows[("ar", 2, "all")]["speedup_vs_ar"] == 1.0
    for batch in (1, 2):  # fp32: lossless means identical, row by row, at every batch size
        assert rows[("dflash", batch, "code")]["identical_to_ar"] is True
        assert 1.0 <= rows[("dflash", batch, "code")]["tau"] < 1.5  # an untrained drafter earns (almost) nothing
    assert rows[("dflash", 2, "all")]["prompts"] == 2
    assert {"cpu", "torch"} <= set(payload["machine"]) and payload["config"]["max_new_tokens"] == 8
    assert "| dflash | 2 | code |" in capsys.readouterr().out


def test_batched_rows_equal_each_prompt_alone_on_smollm2(real_target):
    """Left-padded chat prompts of very different lengths, the shipped drafter, fp32: every row of the batch is the
    prompt's own plain greedy output, and rows end (EOS) at different times."""
    target, tok = real_target
    drafter = drafter_for(target)
    texts = ["Hi!", "Write a Python function that checks whether a number is prime, with a docstring.",
             "What is 7 times 8? Answer with the number only."]
    templated = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    tok.padding_side = "left"
    try:
        batch = tok(templated, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = "right"
    out = target.generate(**batch, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    width = batch["input_ids"].shape[1]
    lengths = []
    for row, text in enumerate(templated):
        alone = tok(text, return_tensors="pt", add_special_tokens=False)
        ref = target.generate(**alone, max_new_tokens=40, do_sample=False)[0, alone["input_ids"].shape[1]:].tolist()
        got = out[row, width:].tolist()
        assert got[: len(ref)] == ref
        assert all(t == tok.pad_token_id for t in got[len(ref):])
        lengths.append(len(ref))
    assert len(set(lengths)) > 1
