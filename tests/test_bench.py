"""The benchmark's peers, its oracle (loop efficiency) mode and its machine record, on tiny random targets.

Every assertion is about what was run and reported (identity with plain generate, tau, reasons for skipping, the
fields of the record); speed ratios are measured, never asserted.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding

from hf_diffspec.bench import (
    PEER_METHODS, MaskVectorRow, Method, markdown_table, oracle_acceptance, oracle_efficiency, oracle_markdown_table,
    oracle_methods, peer_methods, run_benchmark, summarize,
)
from hf_diffspec.machine import ISA_FLAGS, machine_description, machine_markdown
from hf_diffspec.runtime.control_profiles import save_profile, verify_cost_for
from helpers import tiny_drafter, tiny_target

PROMPTS = [
    {"domain": "code", "text": "def add(a, b): return a + b  # add two numbers, then"},
    {"domain": "chat", "text": "Hello! How are you today? I am fine, thank you. How"},
    {"domain": "code", "text": "for i in range(10): print(i)"},
]


class CharTokenizer:
    """As much of a tokenizer as the benchmark uses: one token per character (ids 2..127), padding with id 1."""

    padding_side = "right"
    pad_token_id = 1

    def __len__(self):
        return 128

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=False):
        ids = [[2 + ord(c) % 126 for c in text] for text in texts]
        width = max(len(r) for r in ids)
        rows, masks = [], []
        for r in ids:
            pad = [1] * (width - len(r))
            left = self.padding_side == "left"
            rows.append(pad + r if left else r + pad)
            masks.append([0] * len(pad) + [1] * len(r) if left else [1] * len(r) + [0] * len(pad))
        return BatchEncoding({"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks)})


def target_for_bench(seed=0, vocab_size=128):
    target = tiny_target("qwen3", seed=seed, layers=6, vocab_size=vocab_size)
    target.generation_config.pad_token_id = 1  # padded batches
    return target


def by_method(rows, batch=1, domain="all"):
    return {r["method"]: r for r in rows if r["batch_size"] == batch and r["domain"] == domain}


def test_peers_run_identical_to_plain_generate_or_say_why_not():
    target = target_for_bench()
    drafter = tiny_drafter(target, mask_token_id=3, block_size=4)  # MASK is a target token: peers can load it
    assistant = tiny_target("qwen3", seed=1, layers=2)
    peers = peer_methods(list(PEER_METHODS), target, "tiny", drafter, assistant_model=assistant)
    methods = {"dflash": Method(drafter, {"num_assistant_tokens": 3}), **peers}
    rows = summarize(run_benchmark(target, CharTokenizer(), methods, PROMPTS, max_new_tokens=12, progress=False))
    table = by_method(rows)

    zlab_installed = importlib.util.find_spec("dflash") is not None
    must_run = ["pld", "hf-dflash", "ar-assistant"] + (["zlab"] if zlab_installed else [])
    for name in must_run:
        assert not table[name].get("skipped"), (name, table[name].get("skipped"))
        assert table[name]["identical_to_ar"], name
        assert table[name]["tau"] >= 1.0 and table[name]["prompts"] == len(PROMPTS)
        assert table[name]["speedup_vs_ar"] is not None
    if not zlab_installed:
        assert "pip install" in table["zlab"]["skipped"]
    # the DFlash peers draft with the same weights as ours, so they verify whole blocks: tokens per step > 1
    assert table["hf-dflash"]["nodes_per_step"] == pytest.approx(4.0, abs=0.5)
    assert table["ar"]["tau"] == 1.0
    assert "| pld | 1 | all |" in markdown_table(rows)


def test_bench_samples_every_method_alike_when_asked(monkeypatch):
    """`sampling`: every method's generate call samples with the same settings (a loop that decodes greedily only
    is skipped, saying so); greedy otherwise."""
    target = target_for_bench()
    drafter = tiny_drafter(target, mask_token_id=3, block_size=4)
    peers = peer_methods(["pld", "zlab"], target, "tiny", drafter)
    seen = []
    generate = type(target).generate

    def recording(self, *args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("do_sample", "temperature", "top_k", "top_p")})
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", recording)
    sampling = dict(temperature=0.6, top_k=20, top_p=0.95)
    rows = summarize(run_benchmark(target, CharTokenizer(), {"dflash": Method(drafter), "pld": peers["pld"],
                                                             "zlab": peers["zlab"]},
                                   PROMPTS[:2], max_new_tokens=6, progress=False, rounds=1, sampling=sampling))
    assert seen and all(call == dict(do_sample=True, **sampling) for call in seen)
    assert "greedily only" in by_method(rows)["zlab"]["skipped"]
    assert by_method(rows)["dflash"]["tau"] >= 1.0
    seen.clear()
    run_benchmark(target, CharTokenizer(), {"dflash": Method(drafter)}, PROMPTS[:1], max_new_tokens=4,
                  progress=False, rounds=1)
    assert seen and all(call["do_sample"] is False for call in seen)


def test_peers_that_cannot_run_are_skipped_with_the_reason():
    target = target_for_bench()
    owned_mask = tiny_drafter(target)  # learned its own MASK embedding: no target token stands for it
    peers = peer_methods(list(PEER_METHODS), target, "tiny", owned_mask)
    assert "MASK embedding" in peers["hf-dflash"].skip_reason
    if importlib.util.find_spec("dflash") is not None:
        assert "MASK embedding" in peers["zlab"].skip_reason
    assert "no smaller sibling" in peers["ar-assistant"].skip_reason

    results = run_benchmark(target, CharTokenizer(), peers, PROMPTS[:2], max_new_tokens=6, batch_size=2,
                            progress=False)
    rows = summarize(results)
    skipped = {r["method"]: r["skipped"] for r in rows if r.get("skipped")}
    assert set(skipped) == set(PEER_METHODS)
    assert "batch size 1" in skipped["pld"]  # runnable, but not on two rows at once
    assert by_method(rows, batch=2)["ar"]["prompts"] == 2
    table = markdown_table(rows)
    assert "skipped: " + skipped["hf-dflash"] in table
    json.dumps(rows)  # what --json writes


def test_a_drafter_with_its_own_mask_vector_runs_in_the_dflash_peers_from_an_unused_token_row():
    target = target_for_bench(vocab_size=136)  # rows 128.. lie beyond the tokenizer: the target never reads them
    drafter = tiny_drafter(target, block_size=4)  # learned its own MASK vector
    mask_row = MaskVectorRow(target, 128, drafter.mask_embedding)
    twin = mask_row.drafter(drafter)
    assert twin.config.mask_token_id == 128 and twin.mask_embedding is None
    assert drafter.config.mask_token_id is None  # the user's drafter is left as it was
    ids = torch.tensor([[5, 9, 30, 2, 77]])
    with torch.no_grad():
        before = target(ids).logits
        original = target.get_input_embeddings()
        with mask_row.applied(target):
            twin.bind_target(target)
            assert torch.equal(twin.mask_embeds(2, 3), drafter.mask_embeds(2, 3))  # the drafter's own vector
            assert torch.equal(target(ids).logits, before)  # the target computes what it did
        assert target.get_input_embeddings() is original
        assert not torch.equal(original.weight[128], drafter.mask_embedding)  # its own row is untouched

    peers = peer_methods(["hf-dflash", "zlab"], target, "tiny", drafter, tokenizer=CharTokenizer())
    rows = summarize(run_benchmark(target, CharTokenizer(), peers, PROMPTS, max_new_tokens=12, progress=False))
    table = by_method(rows)
    for name in ["hf-dflash"] + (["zlab"] if importlib.util.find_spec("dflash") is not None else []):
        assert not table[name].get("skipped"), (name, table[name].get("skipped"))
        assert table[name]["identical_to_ar"], name
    assert target.get_input_embeddings() is original


def test_a_peer_failing_at_warm_up_is_reported_not_fatal():
    target = target_for_bench()

    def broken(target, inputs, max_new_tokens):
        raise RuntimeError("this loop needs another transformers")

    rows = summarize(run_benchmark(target, CharTokenizer(), {"broken": Method(runner=broken, peer=True)}, PROMPTS[:1],
                                   max_new_tokens=4, progress=False))
    assert by_method(rows)["broken"]["skipped"] == "failed here: RuntimeError: this loop needs another transformers"


def test_batch_size_64_cycles_the_prompts():
    target = target_for_bench()
    drafter = tiny_drafter(target, block_size=4)
    methods = {"dflash": Method(drafter, {"num_assistant_tokens": 3}), **peer_methods(["pld"], target, "tiny")}
    rows = summarize(run_benchmark(target, CharTokenizer(), methods, PROMPTS, max_new_tokens=4, batch_size=64,
                                   progress=False))
    table = by_method(rows, batch=64)
    assert table["ar"]["prompts"] == 64 and table["dflash"]["prompts"] == 64
    assert table["dflash"]["identical_to_ar"]
    assert "batch size 1" in table["pld"]["skipped"]


def test_by_default_every_method_gets_three_timed_calls_per_batch_size_and_its_first_round_apart():
    target = target_for_bench()
    methods = {"dflash": Method(tiny_drafter(target, block_size=4), {"num_assistant_tokens": 3})}
    once = run_benchmark(target, CharTokenizer(), methods, PROMPTS[:2], max_new_tokens=4, progress=False, rounds=1)
    default = run_benchmark(target, CharTokenizer(), methods, PROMPTS[:2], max_new_tokens=4, progress=False)
    four_rows = run_benchmark(target, CharTokenizer(), methods, PROMPTS[:4], max_new_tokens=4, progress=False,
                              batch_size=4)  # one batch: three rounds of it
    for key, run in once.items():  # two one-row batches: two rounds; times and tokens add up, prompts do not
        assert default[key].counts.steps == 2 * run.counts.steps and default[key].prompts == run.prompts
        assert default[key].identical == run.identical
        assert default[key].first_round_tokens == run.new_tokens == default[key].new_tokens / 2
        assert 0 < default[key].first_round_seconds < default[key].seconds
    for run in four_rows.values():
        assert run.new_tokens == 3 * run.first_round_tokens and run.prompts == 4
    rows = summarize(four_rows)
    assert all(r["first_round_speedup_vs_ar"] > 0 for r in rows)
    assert next(r for r in rows if r["method"] == "ar")["first_round_speedup_vs_ar"] == 1.0


def test_oracle_reaches_the_requested_tau_and_reports_an_efficiency(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # keep the synthetic profile as saved: never re-measured
    target = target_for_bench()
    save_profile(target, {1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}})
    methods = oracle_methods(target, [2, 4, 8])
    rows = summarize(run_benchmark(target, CharTokenizer(), methods, PROMPTS, max_new_tokens=96, progress=False))
    table = oracle_efficiency(rows, methods, verify_cost_for(target))
    assert [r["oracle_tau"] for r in table] == [2, 4, 8]
    for r in table:
        assert r["identical_to_ar"]  # any drafts, even corrupted ones: the target picks every token
        assert 0.75 * r["oracle_tau"] <= r["achieved_tau"] <= 1.25 * r["oracle_tau"], r
        # a full block per step, shorter only where the tokens left to generate cap the drafts
        assert 0.85 * (r["drafts_per_step"] + 1) <= r["verified_per_step"] <= r["drafts_per_step"] + 1
        n = r["verified_per_step"]
        cost = verify_cost_for(target)
        assert r["predicted_speedup"] == pytest.approx(r["achieved_tau"] * cost(1, 1) / cost(n, 1), rel=1e-2)
        # the prefill (the same forward for both, measured by our loop) is out of the decode speedup
        run, ar = (next(x for x in rows if x["method"] == m and x["domain"] == "all") for m in (r_name(r), "ar"))
        assert 0 < run["prefill_seconds"] < run["seconds"]
        decode = ((ar["seconds"] - run["prefill_seconds"]) / ar["new_tokens"]
                  / ((run["seconds"] - run["prefill_seconds"]) / run["new_tokens"]))
        assert r["decode_speedup_vs_ar"] == pytest.approx(decode, rel=1e-2)
        assert r["efficiency"] == pytest.approx(r["decode_speedup_vs_ar"] / r["predicted_speedup"], rel=1e-2)
    assert "| 8 | 1 | 15 |" in oracle_markdown_table(table)


def r_name(row: dict) -> str:
    return f"oracle-{row['oracle_tau']:g}"


def test_oracle_corruption_rate_gives_the_expected_tau():
    for tau, drafts in [(2, 3), (4, 7), (8, 15), (2.5, 3)]:
        q = oracle_acceptance(tau, drafts)
        assert sum(q**i for i in range(drafts + 1)) == pytest.approx(tau, rel=1e-6)
    assert oracle_acceptance(5, 3) == 1.0  # more than the block can give: every draft right
    with pytest.raises(ValueError, match=">= 1"):
        oracle_acceptance(0.5, 3)


def test_machine_record_names_isa_features_and_the_verify_cost_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # keep the synthetic profile as saved: never re-measured
    target = target_for_bench()
    save_profile(target, {1: {1: 0.010, 2: 0.0127, 4: 0.0214, 8: 0.0362, 16: 0.0513}})
    machine = machine_description(target)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set()
        for line in cpuinfo.read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                flags = set(line.split(":", 1)[1].split())
                break
        assert machine["isa_flags"] == [f for f in ISA_FLAGS if f in flags]
        assert machine["avx512"] == ("avx512f" in flags)
        assert machine["native_bf16"] == bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)
    assert machine["dtype"] == "float32" and machine["torch_threads"] == torch.get_num_threads()
    assert machine["verify_cost_curve"]["ratio"] == {"1": 1.0, "2": 1.27, "4": 2.14, "8": 3.62, "16": 5.13}
    text = machine_markdown(machine)
    assert "AVX-512" in text and "native bf16" in text and "AMX" in text and "n=16: 5.13" in text
    json.dumps(machine)


def test_machine_record_says_when_no_profile_was_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # what this test is about: automatic profiling off
    machine = machine_description(target_for_bench())
    assert machine["verify_cost_curve"] is None
    assert "not measured" in machine_markdown(machine)


@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    """`hf-diffspec bench` on a tiny target: the loaders the command calls return the tiny target and prompts."""
    import hf_diffspec
    import hf_diffspec.prompts

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # the tests save synthetic profiles: kept as saved
    target = target_for_bench()
    monkeypatch.setattr(hf_diffspec, "load_target", lambda name, dtype=None, **kwargs: (target, CharTokenizer()))
    monkeypatch.setattr(hf_diffspec.prompts, "load_prompts", lambda *args, **kwargs: PROMPTS[:2])
    return target


def test_bench_cli_prints_the_machine_first_and_reports_peers(tiny_cli, tmp_path, capsys):
    from hf_diffspec.cli import main

    save_profile(tiny_cli, {1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}})  # `dflash` sizes drafts with it
    out = tmp_path / "bench.json"
    main(["bench", "--target", "tiny", "--drafter", "random", "--methods", "ar,dflash," + ",".join(PEER_METHODS),
          "--max-new-tokens", "6", "--batch-sizes", "1,2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.index("**Machine:**") < printed.index("| method |")
    payload = json.loads(out.read_text())
    rows = {(r["method"], r["batch_size"], r["domain"]): r for r in payload["results"]}
    assert rows[("pld", 1, "all")]["identical_to_ar"] and "batch size 1" in rows[("pld", 2, "all")]["skipped"]
    assert "MASK embedding" in rows[("hf-dflash", 1, "all")]["skipped"]  # a random drafter owns its MASK too
    assert "no smaller sibling" in rows[("ar-assistant", 1, "all")]["skipped"]
    assert "vLLM" in rows[("vllm", 1, "all")]["skipped"] and "vLLM" in rows[("vllm-dflash", 1, "all")]["skipped"]
    assert {"isa_flags", "native_bf16", "avx512", "amx", "dtype", "verify_cost_curve"} <= set(payload["machine"])


#: what `hf-diffspec bench --json` writes, pinned: the sections, a result row's keys in order (a skipped method's
#: row has only `SKIPPED_ROW`), the machine record, the config (the command's options) and an oracle row
JSON_SECTIONS = ["results", "machine", "config"]
RESULT_ROW = ["method", "batch_size", "domain", "prompts", "tau", "tokens_per_s", "speedup_vs_ar",
              "speedup_interval", "first_round_speedup_vs_ar", "identical_to_ar", "identical_fraction", "nodes_per_step",
              "slots_per_forward", "new_tokens", "seconds", "prefill_seconds", "steps_by_kind"]
SKIPPED_ROW = ["method", "batch_size", "domain", "skipped"]
MACHINE = ["cpu", "cpu_count", "isa_flags", "avx512", "native_bf16", "amx", "gpu", "device", "torch_threads", "python",
           "torch", "transformers", "platform", "target_device", "dtype", "verify_cost_curve"]
CONFIG = {"command", "target", "drafter", "methods", "assistant_model", "pld_tokens", "oracle_taus", "oracle_drafts",
          "vp_drafter", "branches", "tree_budget", "tree_depth", "branch_length", "domains", "prompts", "prompts_file",
          "max_new_tokens", "context_tokens", "batch_sizes", "rounds", "dflash_length", "dtype", "device", "seed",
          "do_sample", "temperature", "top_k", "top_p",
          "json", "plot"}
ORACLE_ROW = ["oracle_tau", "drafts_per_step", "acceptance", "batch_size", "achieved_tau", "verified_per_step",
              "tokens_per_s", "speedup_vs_ar", "decode_speedup_vs_ar", "predicted_speedup", "efficiency",
              "identical_to_ar"]


def test_bench_json_keeps_its_schema(tiny_cli, tmp_path):
    from hf_diffspec.cli import main

    save_profile(tiny_cli, {1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}})
    out = tmp_path / "bench.json"
    main(["bench", "--target", "tiny", "--drafter", "random", "--methods", "ar,dflash,pld", "--max-new-tokens", "4",
          "--batch-sizes", "1,2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert list(payload) == JSON_SECTIONS
    assert [r["domain"] for r in payload["results"] if r["method"] == "dflash"] == ["code", "chat", "all", "all"]
    assert {tuple(r) for r in payload["results"]} == {tuple(RESULT_ROW), tuple(SKIPPED_ROW)}  # pld at batch 2
    assert list(payload["machine"]) == MACHINE
    curve = payload["machine"]["verify_cost_curve"]
    assert list(curve) == ["ms_one_token", "ratio", "profile"] and list(curve["ratio"]) == ["1", "2", "4", "8", "16"]
    assert set(payload["config"]) == CONFIG and payload["config"]["command"] == "bench"


def test_bench_seed_draws_the_prompts(tiny_cli, monkeypatch):
    """`--seed` reaches the prompt draw: a rule tuned on the first prompts of each domain can be judged on others."""
    import hf_diffspec.prompts
    from hf_diffspec.cli import main

    asked = {}
    monkeypatch.setattr(hf_diffspec.prompts, "load_prompts", lambda *args, **kwargs: asked.update(kwargs) or PROMPTS[:1])
    main(["bench", "--target", "tiny", "--methods", "ar", "--max-new-tokens", "2", "--seed", "7"])
    assert asked["seed"] == 7


def test_bench_cli_oracle_mode(tiny_cli, tmp_path, capsys):
    from hf_diffspec.cli import main

    save_profile(tiny_cli, {1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}})
    out = tmp_path / "oracle.json"
    main(["bench", "--target", "tiny", "--oracle-taus", "2", "--max-new-tokens", "12", "--json", str(out)])
    assert "| oracle tau |" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert list(payload) == [*JSON_SECTIONS, "oracle"] and set(payload["config"]) == CONFIG
    oracle = payload["oracle"]
    assert [list(r) for r in oracle] == [ORACLE_ROW]
    assert [r["oracle_tau"] for r in oracle] == [2.0] and oracle[0]["efficiency"] is not None
    with pytest.raises(SystemExit, match="oracle-taus"):
        main(["bench", "--target", "tiny", "--oracle-taus", "two"])
    with pytest.raises(SystemExit, match="--top-k applies to sampling; add --do-sample"):
        main(["bench", "--target", "tiny", "--top-k", "20"])


def test_the_vllm_peers_say_why_they_cannot_run(tmp_path, monkeypatch):
    """Without vLLM's venv both vLLM peers are skipped naming the script that makes it; with one, a drafter the
    export refuses (a D²SD variable-prefix drafter) is skipped with the export's reason before any engine starts,
    while plain vLLM is ready to start (its engine starts in the bench's untimed `prepare`)."""
    import sys

    from hf_diffspec.bench.vllm_peer import VLLM_PYTHON_ENV, VllmRunner, vllm_methods

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    target.name_or_path = str(tmp_path / "target")  # what from_pretrained sets
    vp = tiny_drafter(target, mask_token_id=3, draft_role="variable_prefix")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "no-venv" / "python"))
    missing = vllm_methods(["vllm", "vllm-dflash"], target, vp)
    assert all("examples/vllm_round_trip.sh --setup" in m.skip_reason for m in missing.values())
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    methods = vllm_methods(["vllm", "vllm-dflash"], target, vp)
    assert "variable_prefix" in methods["vllm-dflash"].skip_reason
    assert methods["vllm"].skip_reason is None and isinstance(methods["vllm"].runner, VllmRunner)
    assert methods["vllm"].runner.worker is None


def test_the_speedup_interval_is_a_paired_bootstrap_over_timed_calls():
    """Each timed call is paired with ar's on the same batch: calls twice as fast in every pair give exactly 2x; a
    spread gives an interval around the ratio of totals; under three calls, none."""
    from hf_diffspec.bench.report import speedup_interval

    ar = ((10, 1.0), (10, 2.0), (10, 1.5), (10, 1.0))
    assert speedup_interval(tuple((t, s / 2) for t, s in ar), ar) == [2.0, 2.0]
    spread = ((10, 0.4), (10, 1.5), (10, 0.5), (10, 0.6))
    low, high = speedup_interval(spread, ar)
    point = (40 / sum(s for _, s in spread)) / (40 / sum(s for _, s in ar))
    assert low < point < high and high - low > 0.2
    assert speedup_interval(spread[:2], ar[:2]) is None
