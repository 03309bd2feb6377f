"""What one call on a lent GPU can tell us about the decoding loop, in under 10 minutes, on real-shaped targets with
random weights built on the device from configs (no network, no checkpoint).

Targets: Qwen3-8B-like dense, Qwen3-MoE-like, a Qwen3.5-like hybrid (Gated DeltaNet), Gemma 4-like (sliding and full
layers, per-layer inputs) and gpt-oss-20b-like (sliding layers, attention sinks, MoE; eager attention); each skipped
with the loop's refusal where this version refuses it. Per target, in sections that each have a deadline:

- runs: an oracle drafter (`hf_diffspec/bench/oracle.py`) at tau 2, 4 and 8, batch 1, 16 and 64, on the target made
  decisive (`decisive`: random weights tie their logits, and bf16 verify forwards break the ties otherwise than plain
  `generate`, which the oracle follows): bare timed calls
  (speedup over bare plain `generate`, the loop's efficiency against the verify cost's prediction, peak device
  memory of each), then separate instrumented calls (host ms per step apart from the forwards, host synchronisations
  per step, and `torch.cuda.set_sync_debug_mode("warn")` warnings per call);
- gates: the default path (a random drafter, measured verify-cost profile and live gates on): what the gates chose;
- sampling: the same drafter with do_sample=True;
- kernels: which kernels one verify step ran (profiler), and which Gated DeltaNet implementation the linear layers use;
- identity: fp32 with TF32 off, our loop (oracle chains, best-first trees with prompt lookup, D²SD with a VP
  drafter, DFlash 2's selector trees, and the best-first trees again through the capture-ready step,
  `cache_implementation="static"`, where the target takes it, also replayed as CUDA graphs,
  `HF_DIFFSPEC_CUDA_GRAPHS=1`) against plain `generate` at 1 and 4 rows, which sets the exit status;
- bf16: the first position where our loop and plain `generate` differ in bf16 (None: identical).

On the dense target also: z-lab's loop against ours at equal tau 3 and 6.5 (`hf_diffspec.bench.equal_tau`: both run
the drafter, an oracle sets its drafts per position; plain `generate` dynamic, static and compiled beside them), a CUDA
graph captured over the capture-ready verify forward (`hf_diffspec.bench.
captured_verify`: captured or why not, replay against eager, ms per verify step each), the oracle at tau 4 through
the dynamic cache, the static cache and the static cache replayed as graphs (`graph_runs`), and the verify/plain
step-cost ratio at 16k tokens of context (`hf_diffspec.bench.long_context`), before and after the runtime's verify
attention. Identity comes first for each target (it decides the exit status), then speed. An error in one target's
sections is recorded and the next target goes on. Every result is appended to the results file as it comes (JSON
lines), so a call cut short still returns what it measured.

    bash examples/gpu_check.sh --results $OUT/gpu_check.jsonl   # on a GPU (< 10 minutes on an H200)
    TINY=1 bash examples/gpu_check.sh     # tiny configs on the CPU (CI): gates, sampling, kernels for the first only
"""

import argparse
import contextlib
import copy
import json
import os
import time
import traceback
import warnings

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_diffspec
from hf_diffspec.bench.captured_verify import captured_verify
from hf_diffspec.bench.equal_tau import EQUAL_TAU_ARMS, check_equal_tau, equal_tau_rows
from hf_diffspec.bench.host_syncs import HostSyncCounter
from hf_diffspec.bench.host_time import ForwardClock
from hf_diffspec.bench.long_context import verify_plain_ratios
from hf_diffspec.bench.oracle import OracleRunner, oracle_drafts_for
from hf_diffspec.bench.peers import zlab_method
from hf_diffspec.runtime import device_clock
from hf_diffspec.runtime.control_profiles import measure_verify_cost

# seconds each section may start new work in, per target (GPU); the whole call stops starting work at --budget-s
SECTION_SECONDS = {"identity": 20, "bf16": 8, "runs": 30, "gates": 12, "sampling": 8, "kernels": 6, "capture": 20,
                   "graphs": 30, "long_context": 40, "equal_tau": 60}


def dense_config(tiny: bool) -> Qwen3Config:
    if tiny:
        return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1_000_000.0, tie_word_embeddings=False)


def moe_config(tiny: bool) -> Qwen3MoeConfig:
    size = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    if not tiny:
        size = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    num_experts=128, num_experts_per_tok=8)
    return Qwen3MoeConfig(max_position_embeddings=4096, **size)


def hybrid_model(tiny: bool):
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16) if tiny else \
        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
             num_attention_heads=16, num_key_value_heads=4, head_dim=256)
    config = Qwen3_5Config(text_config=text)
    return Qwen3_5ForCausalLM, config.get_text_config()


def gemma4_model(tiny: bool):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    if tiny:
        config = Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                                  sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                  num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                                  vocab_size_per_layer_input=256, max_position_embeddings=1024)
    else:  # transformers' defaults: 30 layers, 5 sliding (window 512) to 1 full, 262k vocabulary
        config = Gemma4TextConfig()
    return Gemma4ForCausalLM, config


def gpt_oss_model(tiny: bool):
    from transformers import GptOssConfig, GptOssForCausalLM

    size = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=1024) if tiny else \
        dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4)  # gpt-oss-20b's shapes
    config = GptOssConfig(**size)
    config._attn_implementation = "eager"  # no SDPA (attention sinks)
    return GptOssForCausalLM, config


class Results:
    """Appends each result to a JSON-lines file as it comes (flushed), and prints it."""

    def __init__(self, path):
        self.path = path
        self.records = []
        if path:
            open(path, "w").close()

    def add(self, record: dict) -> dict:
        self.records.append(record)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record


class Deadlines:
    """The call's budget and each section's: `open(name)` starts a section; `left()` says whether it may start more."""

    def __init__(self, budget_s: float, scale: float):
        self.end = time.monotonic() + budget_s
        self.scale = scale
        self.section_end = self.end

    def open(self, name: str) -> bool:
        self.section_end = min(self.end, time.monotonic() + SECTION_SECONDS[name] * self.scale)
        return self.left()

    def left(self) -> bool:
        return time.monotonic() < self.section_end

    def call_left(self) -> bool:
        """Whether the call's budget allows more work at all."""
        return time.monotonic() < self.end


def build(cls, config, device, dtype):
    torch.manual_seed(0)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: a 30B MoE made in float32 first fills the H200 (2026-12-04)
    try:
        with torch.device(device):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.set_attn_implementation(attention)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def decisive(model, scale: float = 30.0):
    """Random weights give near-tied logits, and in bf16 a verify forward over q tokens picks another of the tied
    tokens than a one-token step: the oracle, which drafts plain `generate`'s continuation, then stops matching
    (tau 1.1-1.5 where 2-8 was asked, H200, 2026-12-04). With the LM head made the input embeddings and the
    embeddings scaled up, each next token is decided by a wide margin (the model repeats its last token), so the
    oracle reaches its tau (bf16, CPU: 4.6 and 8.2 for 4 and 8, against 2.0 and 2.6). Costs do not depend on the
    values of dense weights."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if head.data_ptr() != embeddings.data_ptr():
        head.copy_(embeddings)
    embeddings.mul_(scale)


def fewer_layers(config, layers: int):
    """A copy of `config` with its first `layers` layers (the same shapes per layer: for fp32, which doubles memory)."""
    config = copy.deepcopy(config)
    if config.num_hidden_layers > layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        if getattr(config, "num_kv_shared_layers", 0):
            config.num_kv_shared_layers = min(config.num_kv_shared_layers, layers // 2)
    return config


def refusal(target) -> str | None:
    """The loop's refusal for this target (before any forward), or None."""
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    ids = torch.ones(1, 4, dtype=torch.long, device=target.device)
    try:
        target.generate(ids, assistant_model=drafter, max_new_tokens=2, do_sample=False)
    except ValueError as error:
        return str(error)
    return None


def prompts(rows: int, length: int, vocab: int, device) -> dict:
    ids = torch.randint(2, vocab, (rows, length), generator=torch.Generator().manual_seed(rows)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def timed(fn, device):
    """(fn(), seconds until the device has run it, peak device memory in MiB or None), nothing else measured."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = device_clock.device_time(device)
    out = fn()
    seconds = device_clock.device_time(device) - start
    peak = round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if cuda else None
    return out, seconds, peak


@contextlib.contextmanager
def sync_warnings(device):
    """Counts `torch.cuda.set_sync_debug_mode("warn")` warnings while entered (CUDA only: None elsewhere)."""
    counted = {"count": None}
    if device.type != "cuda":
        yield counted
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted["count"] = sum("synchroniz" in str(w.message) for w in caught)


def runs(name, target, args, deadlines, results) -> list[dict]:
    vocab = target.config.get_text_config().vocab_size
    device = target.device
    out = []
    longest = max(oracle_drafts_for(t) for t in args.taus) + 1
    try:
        costs = measure_verify_cost(target, sizes=tuple(sorted({1, *range(2, longest + 1)})),
                                    batches=tuple(args.batches), context_length=args.prompt_length, repeats=2)
    except RuntimeError as error:  # a sliding-window target before the profile measured in the loop's own cache
        costs = None
        results.add({"target": name, "section": "runs", "verify_cost": f"not measured: {error}"})
    for rows in args.batches:
        if not deadlines.left():
            out.append(results.add({"target": name, "section": "runs", "rows": rows, "skipped": "deadline"}))
            continue
        inputs = prompts(rows, args.prompt_length, vocab, device)
        references: dict = {}

        def plain():
            return target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)

        plain()  # warm-up
        _, plain_seconds, plain_peak = timed(plain, device)
        for tau in args.taus:
            runner = OracleRunner(target, tau, oracle_drafts_for(tau), references)
            runner.carrier.to(device)
            runner.prepare(target, [inputs], args.max_new_tokens)
            try:
                runner(target, inputs, args.max_new_tokens)  # warm-up
            except ValueError as refused:  # e.g. a hybrid target at several rows: refused before its first forward
                out.append(results.add({"target": name, "rows": rows, "skipped": str(refused)}))
                break
            (_, steps), seconds, peak = timed(lambda: runner(target, inputs, args.max_new_tokens), device)  # bare
            counter = HostSyncCounter(target)  # instrumented, apart: its hooks and counting cost host time
            with sync_warnings(device) as sync_debug, counter, ForwardClock(target) as clock:
                _, instrumented, _ = timed(lambda: runner(target, inputs, args.max_new_tokens), device)
            n = oracle_drafts_for(tau) + 1
            achieved = round(steps.committed / max(steps.steps, 1), 3)  # tokens per row and step
            speedup = plain_seconds / seconds
            predicted = achieved * costs[rows][1] / costs[rows][n] if achieved and costs else None
            out.append(results.add({
                "target": name, "section": "runs", "rows": rows, "oracle_tau": tau, "achieved_tau": achieved,
                "speedup_vs_plain": round(speedup, 3),
                "efficiency": round(speedup / predicted, 3) if predicted else None,
                "peak_mib": peak, "plain_peak_mib": plain_peak,
                "host_ms_per_step": round(1000 * (instrumented - clock.seconds) / max(clock.target_forwards, 1), 3),
                "syncs_per_step_max": max(counter.per_step_syncs[1:] or [0]),
                "sync_debug_warnings": sync_debug["count"],
            }))
    return out


def default_path(name, target, args, sample: bool) -> dict:
    """A random drafter through the default path (profile and gates on): what the gates chose, and its speed."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8).to(device)
    inputs = prompts(1, args.prompt_length, vocab, device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=sample)
    target.generate(**inputs, assistant_model=drafter, **kwargs)  # the first call measures the profile
    _, plain_seconds, _ = timed(lambda: target.generate(**inputs, **kwargs), device)
    out, seconds, peak = timed(lambda: target.generate(**inputs, assistant_model=drafter,
                                                       return_dict_in_generate=True, **kwargs), device)
    stats = out.speculation_stats
    return {"target": name, "section": "sampling" if sample else "gates", "speedup_vs_plain":
            round(plain_seconds / seconds, 3), "peak_mib": peak, "target_forwards": stats.target_forwards,
            "draft_steps": stats.draft_steps, "lookup_steps": stats.lookup_steps, "plain_steps": stats.plain_steps,
            "draft_forwards": stats.draft_forwards, "tau": round(stats.tau, 3)}


def kernels(name, target, args) -> dict:
    """Kernels one verify step ran (CUDA kernels, or the CPU's attention ops), and the Gated DeltaNet functions."""
    from torch.profiler import ProfilerActivity, profile

    device = target.device
    vocab = target.config.get_text_config().vocab_size
    runner = OracleRunner(target, 4, oracle_drafts_for(4), {})
    runner.carrier.to(device)
    inputs = prompts(1, args.prompt_length, vocab, device)
    runner.prepare(target, [inputs], 8)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            runner(target, inputs, 8)
    except ValueError as refused:
        return {"target": name, "section": "kernels", "skipped": str(refused)}
    words = ("attention", "flash", "fmha", "attn", "delta", "chunk", "recurrent", "conv1d")
    names = {}
    for event in prof.key_averages():
        if any(w in event.key.lower() for w in words):
            names[event.key[:120]] = event.count
    linear = sorted({f"{type(m).__name__}: {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)}"
                     for m in target.modules() for attr in ("chunk_gated_delta_rule", "causal_conv1d_fn")
                     if (fn := getattr(m, attr, None)) is not None})
    return {"target": name, "section": "kernels", "kernels": names, "gated_deltanet": linear or None}


@contextlib.contextmanager
def fp32_exact():
    """TF32 off: float32 matmuls and convolutions exactly as on the CPU, for the identity check."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def cuda_graphs():
    """The loop's verify forward replayed as CUDA graphs (with cache_implementation="static")."""
    os.environ["HF_DIFFSPEC_CUDA_GRAPHS"] = "1"
    try:
        yield
    finally:
        del os.environ["HF_DIFFSPEC_CUDA_GRAPHS"]


def graphs_kept(target) -> int:
    """CUDA graphs the capture-ready steps kept on `target` hold (`verify_graphs.StaticStep`)."""
    from hf_diffspec.runtime.control_state import memory_of

    return sum(len(step.graphs.graphs) for step in memory_of(target).static_steps.values() if step.graphs)


def graph_runs(name, target, args) -> list[dict]:
    """The oracle at tau 4 through the default cache, the static cache, and the static cache replayed as CUDA graphs
    (CUDA only; elsewhere the last is the static cache again): speed over plain `generate`, bare timed."""
    device, vocab = target.device, target.config.get_text_config().vocab_size
    out = []
    for rows in (1, 16):
        inputs = prompts(rows, args.prompt_length, vocab, device)
        runner = OracleRunner(target, 4, oracle_drafts_for(4), {})
        runner.carrier.to(device)
        runner.prepare(target, [inputs], args.max_new_tokens)
        _, plain_seconds, _ = timed(lambda: target.generate(**inputs, max_new_tokens=args.max_new_tokens,
                                                            do_sample=False), device)
        row = {"target": name, "section": "graphs", "rows": rows}
        for label, kwargs, graphs in (("dynamic", {}, False), ("static", {"cache_implementation": "static"}, False),
                                      ("static+graphs", {"cache_implementation": "static"}, True)):
            with cuda_graphs() if graphs else contextlib.nullcontext():
                runner(target, inputs, args.max_new_tokens, **kwargs)  # warm-up (and the graphs' captures)
                captured = graphs_kept(target)
                (_, steps), seconds, peak = timed(lambda: runner(target, inputs, args.max_new_tokens, **kwargs),
                                                  device)
            row[label] = {"speedup_vs_plain": round(plain_seconds / seconds, 3), "peak_mib": peak,
                          "achieved_tau": round(steps.committed / max(steps.steps, 1), 3),
                          # graphs the timed call captured beyond the warm-up's (kept across calls: 0 expected)
                          "graphs_captured_again": graphs_kept(target) - captured}
        out.append(row)
    return out


def equal_tau(name, target, args) -> list[dict]:
    """z-lab's loop against ours at equal tau 3 and 6.5, batch 1 (`hf_diffspec.bench.equal_tau`): a random drafter
    whose drafts the oracle sets, so both loops do the same drafter work and face the same accepts."""
    vocab = target.config.get_text_config().vocab_size
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=16,
                                                       mask_token_id=vocab - 1).to(target.device)
    zlab = zlab_method(drafter, target)
    if zlab.skip_reason:
        return [{"target": name, "section": "equal_tau", "skipped": zlab.skip_reason}]
    inputs = prompts(1, args.equal_tau_prompt, vocab, target.device)
    rows = equal_tau_rows(target, drafter, zlab, inputs, args.equal_tau_tokens, [3, 6.5],
                          [*EQUAL_TAU_ARMS, "ours-live", "ours-live-at-each-step", "plain", "plain-static"]
                          + (["plain-compiled"] if target.device.type == "cuda" else []),  # a CPU compile: minutes
                          repeats=1 if args.tiny else 2, progress=lambda _: None)
    problems = check_equal_tau(rows)
    return [{"target": name, "section": "equal_tau", "problems": problems, **row} for row in rows]


def identity(name, cls, config, args, device, dtype=torch.float32) -> dict:
    """Our loop (oracle tau 4, the best-first tree drafter with prompt lookup, D²SD, selector trees, and the
    best-first drafter through the capture-ready step where the target takes it) against plain generate: per rows, True / False in fp32; in bf16 the
    first position (new tokens) where they differ, None when they do not."""
    with fp32_exact():
        target = build(cls, fewer_layers(config, args.identity_layers), device, dtype)
        vocab = config.vocab_size
        results = {}
        for rows in (1, 4):
            inputs = prompts(rows, args.prompt_length, vocab, device)
            plain = target.generate(**inputs, max_new_tokens=args.identity_tokens, do_sample=False)
            runner = OracleRunner(target, 4, oracle_drafts_for(4), {})
            runner.carrier.to(device)
            runner.prepare(target, [inputs], args.identity_tokens)
            try:
                oracle, _ = runner(target, inputs, args.identity_tokens)
            except ValueError as refused:  # refused before the first forward: nothing to compare at this batch size
                results[rows] = f"skipped: {refused}"
                continue
            drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8,
                                                               draft_tree_budget=8).to(device)
            tree_kwargs = dict(assistant_model=drafter, max_new_tokens=args.identity_tokens, do_sample=False,
                               prompt_lookup_num_tokens=4)
            outputs = [oracle, target.generate(**inputs, **tree_kwargs)]
            # D²SD (a VP drafter of its own cache) and DFlash 2's selector trees: on a GPU both are drafted ahead
            chain = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8).to(device)
            others = [hf_diffspec.DualDiffusionDrafter.from_drafters(chain, copy.deepcopy(chain), num_branches=2),
                      hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8,
                                                               draft_tree_budget=8, selector_rank=4,
                                                               selector_top_k=4).to(device)]
            outputs += [target.generate(**inputs, assistant_model=other, max_new_tokens=args.identity_tokens,
                                        do_sample=False) for other in others]
            try:
                outputs.append(target.generate(**inputs, cache_implementation="static", **tree_kwargs))
                if device.type == "cuda":  # and replayed as CUDA graphs
                    with cuda_graphs():
                        outputs.append(target.generate(**inputs, cache_implementation="static", **tree_kwargs))
            except ValueError:  # sliding or linear-attention layers: the capture-ready step is refused for them
                pass
            if dtype == torch.float32:
                results[rows] = all(torch.equal(plain, ours) for ours in outputs)
            else:
                start = inputs["input_ids"].shape[1]
                differs = [(ours[:, start:] != plain[:, start:]).any(0).nonzero().flatten().tolist()
                           for ours in outputs]
                results[rows] = min((d[0] for d in differs if d), default=None)
    del target
    return results


def check_target(name, cls, config, entry, args, device, dtype, deadlines, results, dense: bool) -> None:
    """One target's sections: identity first, then (the dense target's) the captured verify step and long context,
    then the runs and the default path."""
    tiny = args.tiny
    if deadlines.open("identity"):
        entry["fp32_identical"] = identity(name, cls, config, args, device)
        results.add({"target": name, "section": "identity", "fp32_identical": entry["fp32_identical"]})
    if deadlines.open("bf16") and dtype == torch.bfloat16:
        entry["bf16_first_divergence"] = identity(name, cls, config, args, device, torch.bfloat16)
        results.add({"target": name, "section": "bf16", "first_divergence": entry["bf16_first_divergence"]})
    if not deadlines.call_left():
        entry["skipped"] = results.add({"target": name, "skipped": "deadline"})["skipped"]
        return
    target = build(cls, config, device, dtype)
    decisive(target)  # the speed sections' oracle must reach its tau in bf16
    reason = refusal(target)
    if reason is not None:
        entry["skipped"] = results.add({"target": name, "skipped": reason})["skipped"]
        return
    if dense and deadlines.open("capture"):
        entry["capture"] = [results.add({"target": name, "section": "capture", **captured_verify(
            target, rows, context=64 if tiny else 1024, repeats=3 if tiny else 20)}) for rows in (1, 16)]
    if dense and deadlines.open("equal_tau"):
        with torch.inference_mode():
            entry["equal_tau"] = [results.add(row) for row in equal_tau(name, target, args)]
    if dense and deadlines.open("graphs"):
        entry["graphs"] = [results.add(row) for row in graph_runs(name, target, args)]
    if dense and deadlines.open("long_context"):
        contexts = (64,) if tiny else (16384,)
        entry["long_context"] = [results.add({"section": "long_context", **row}) for row in
                                 verify_plain_ratios(target, contexts, (4, 16), repeats=1 if tiny else 3)]
    if not deadlines.open("runs"):
        entry["skipped"] = results.add({"target": name, "skipped": "deadline"})["skipped"]
        return
    entry["runs"] = runs(name, target, args, deadlines, results)
    sections = (("gates", lambda: default_path(name, target, args, sample=False)),
                ("sampling", lambda: default_path(name, target, args, sample=True)),
                ("kernels", lambda: kernels(name, target, args)))
    for section, measure in sections if not tiny or dense else ():  # tiny: CI's minutes
        if deadlines.open(section):
            entry[section] = results.add(measure())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("TINY") == "1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="the whole report as one JSON file at the end")
    parser.add_argument("--results", default=os.environ.get("GPU_CHECK_RESULTS"),
                        help="JSON lines, one per result, written as they come")
    parser.add_argument("--budget-s", type=float, default=540.0, help="no new work starts after this many seconds")
    args = parser.parse_args()
    tiny = args.tiny
    device = torch.device(args.device)
    args.prompt_length = 16 if tiny else 128
    args.max_new_tokens = 16 if tiny else 64
    args.identity_tokens = 12 if tiny else 32
    args.identity_layers = 4 if tiny else 8
    args.taus = (2, 4, 8)
    args.equal_tau_prompt = 32 if tiny else 512
    args.equal_tau_tokens = 24 if tiny else 128  # a GPU call's minutes: 2 taus x 7 arms x (settling + 2 repeats)
    args.batches = (1, 4) if tiny else (1, 16, 64)
    dtype = torch.float32 if tiny or device.type == "cpu" else torch.bfloat16
    results = Results(args.results)
    deadlines = Deadlines(args.budget_s, scale=100.0 if tiny else 1.0)  # tiny: sections never cut short
    report = {"device": args.device, "tiny": tiny, "targets": {}}
    families = [("dense (Qwen3-8B-like)", Qwen3ForCausalLM, dense_config(tiny)),
                ("moe (Qwen3-MoE-like)", Qwen3MoeForCausalLM, moe_config(tiny))]
    for name, builder in (("hybrid (Qwen3.5-like)", hybrid_model), ("gemma4 (Gemma 4-like)", gemma4_model),
                          ("gpt-oss (gpt-oss-20b-like)", gpt_oss_model)):
        try:
            families.append((name, *builder(tiny)))
        except ImportError as error:
            report["targets"][name] = results.add({"target": name, "skipped": f"transformers lacks it: {error}"})
    for name, cls, config in families:
        entry = report["targets"][name] = {}
        try:
            check_target(name, cls, config, entry, args, device, dtype, deadlines, results,
                         dense=name == families[0][0])
        except Exception as error:  # noqa: BLE001 - one target's failure must not cost the others' results
            entry["error"] = results.add({"target": name, "error": f"{type(error).__name__}: {error}",
                                          "traceback": traceback.format_exc()[-3000:]})["error"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    failed = [n for n, r in report["targets"].items() if "fp32_identical" in r
              and not all(v is True or str(v).startswith("skipped") for v in r["fp32_identical"].values())]
    errors = [n for n, r in report["targets"].items() if "error" in r]
    print("fp32 identity with plain generate:", "FAILED for " + ", ".join(failed) if failed else "ok")
    if errors:
        print("errors (see the results file) in:", ", ".join(errors))
    raise SystemExit(1 if failed or errors else 0)


if __name__ == "__main__":
    main()
