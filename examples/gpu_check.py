"""One check of the decoding loop on a real-shaped target, with random weights built on the device from configs (no
network, no checkpoint): an oracle drafter (`hf_diffspec/bench/oracle.py`) at tau 2, 4 and 8 through our loop at
batch 1, 16 and 64, reporting the loop's efficiency (achieved / profile-predicted speedup over plain generate), host
time per step apart from the forwards, host synchronisations per step, and fp32 identity with plain generate.

Targets: a Qwen3-8B-like dense model; a Qwen3.5-like hybrid (linear attention) and a Qwen3-MoE-like model, each
skipped with the loop's refusal message where this version does not decode it losslessly.

    bash examples/gpu_check.sh            # on a GPU (< 10 minutes on an H200)
    TINY=1 bash examples/gpu_check.sh     # tiny configs on the CPU, under a minute (run in CI)
"""

import argparse
import json
import os
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_diffspec
from hf_diffspec.bench.host_syncs import HostSyncCounter
from hf_diffspec.bench.host_time import ForwardClock
from hf_diffspec.bench.oracle import OracleRunner, oracle_drafts_for
from hf_diffspec.runtime.cost_model import measure_verify_cost


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


def build(cls, config, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


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


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def check(name, target, args, taus, batches) -> list[dict]:
    vocab = target.config.get_text_config().vocab_size
    rows_out = []
    longest = max(oracle_drafts_for(t) for t in taus) + 1
    costs = measure_verify_cost(target, sizes=tuple(sorted({1, *range(2, longest + 1)})), batches=tuple(batches),
                                context_length=args.prompt_length, repeats=2)
    for rows in batches:
        inputs = prompts(rows, args.prompt_length, vocab, target.device)
        references: dict = {}
        def plain():
            return target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)

        plain()  # warm-up
        _, plain_seconds = timed(plain)
        for tau in taus:
            runner = OracleRunner(target, tau, oracle_drafts_for(tau), references)
            runner.carrier.to(target.device)
            runner.prepare(target, [inputs], args.max_new_tokens)
            try:
                runner(target, inputs, args.max_new_tokens)  # warm-up
            except ValueError as refused:  # e.g. a hybrid target at several rows: refused before its first forward
                rows_out.append({"target": name, "rows": rows, "skipped": str(refused)})
                print(json.dumps(rows_out[-1]), flush=True)
                break
            counter = HostSyncCounter(target)
            with counter, ForwardClock(target) as clock:
                (sequences, steps), seconds = timed(lambda: runner(target, inputs, args.max_new_tokens))
            n = oracle_drafts_for(tau) + 1
            achieved = round(steps.committed / max(steps.steps, 1), 3)  # tokens per row and step
            speedup = plain_seconds / seconds
            predicted = None
            if achieved:
                predicted = achieved * costs[rows][1] / costs[rows][n]
            rows_out.append({
                "target": name, "rows": rows, "oracle_tau": tau, "achieved_tau": achieved,
                "speedup_vs_plain": round(speedup, 3),
                "efficiency": round(speedup / predicted, 3) if predicted else None,
                "host_ms_per_step": round(1000 * (seconds - clock.seconds) / max(clock.target_forwards, 1), 3),
                "syncs_per_step_max": max(counter.per_step_syncs[1:] or [0]),
            })
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def identity(name, cls, config, args, device) -> dict:
    """fp32: our loop (oracle tau 4, and the best-first tree drafter with prompt lookup) against plain generate."""
    target = build(cls, config, device, torch.float32)
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
        trees = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.identity_tokens,
                                do_sample=False, prompt_lookup_num_tokens=4)
        results[rows] = bool(torch.equal(plain, oracle) and torch.equal(plain, trees))
    del target
    print(json.dumps({"target": name, "fp32_identical": results}), flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("TINY") == "1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tiny = args.tiny
    args.prompt_length = 16 if tiny else 128
    args.max_new_tokens = 16 if tiny else 64
    args.identity_tokens = 12 if tiny else 32
    taus = (2, 4, 8)
    batches = (1, 4) if tiny else (1, 16, 64)
    dtype = torch.float32 if tiny or args.device == "cpu" else torch.bfloat16
    os.environ.setdefault("HF_DIFFSPEC_AUTO_PROFILE", "0")  # the oracle drafts a fixed length: no profile needed
    report = {"device": args.device, "tiny": tiny, "targets": {}}
    families = [("dense (Qwen3-8B-like)", Qwen3ForCausalLM, dense_config(tiny)),
                ("moe (Qwen3-MoE-like)", Qwen3MoeForCausalLM, moe_config(tiny))]
    try:
        families.append(("hybrid (Qwen3.5-like)", *hybrid_model(tiny)))
    except ImportError as error:
        report["targets"]["hybrid (Qwen3.5-like)"] = {"skipped": f"transformers lacks Qwen3.5: {error}"}
    for name, cls, config in families:
        target = build(cls, config, args.device, dtype)
        reason = refusal(target)
        if reason is not None:
            print(json.dumps({"target": name, "skipped": reason}), flush=True)
            report["targets"][name] = {"skipped": reason}
            del target
            continue
        runs = check(name, target, args, taus, batches)
        del target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        same = identity(name, cls, config, args, args.device)
        report["targets"][name] = {"runs": runs, "fp32_identical": same}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = [n for n, r in report["targets"].items() if "fp32_identical" in r and not all(r["fp32_identical"].values())]
    print("fp32 identity with plain generate:", "FAILED for " + ", ".join(failed) if failed else "ok")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
