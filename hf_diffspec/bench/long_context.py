"""Verify cost at long context: a verify step over a cache of 4k-16k tokens against a plain decode step over the same
cache, with transformers' SDPA path (before) and with the runtime's verify attention (after, `verify_attention.py`).

The verify-cost profile is measured at a context of 256 tokens; there a verify step of a few tokens costs about what
a plain step costs. At long context SDPA's own path copies the KV cache per query head group for every verify step
(it takes a mask for q > 1 over a cache), and the gates would turn speculation off without saying why. This prints,
per context length and verify width, seconds per plain step and the verify/plain ratio of a chain (no mask) and of a
tree (an explicit mask, as trees and ragged rows verify), before and after. What attention costs depends on the
context's length, not its tokens: the contexts are random tokens.

    python -m hf_diffspec.bench.long_context --target smollm2-135m-instruct --contexts 4096,8192,16384
    python -m hf_diffspec.bench.long_context --target tiny --contexts 256,512 --repeats 1   # a check that it runs

Run it on a quiet machine (one process): it times forwards.
"""

import argparse
import contextlib

import torch
from transformers import DynamicCache

from ..runtime.device_clock import device_time
from ..runtime.verify_attention import verify_attention


def _tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32768)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


def _seconds(forward, device, repeats: int) -> float:
    """Median seconds of `forward()` over `repeats` timed calls after one warm-up."""
    times = []
    for _ in range(repeats + 1):
        start = device_time(device)
        forward()
        times.append(device_time(device) - start)
    times = sorted(times[1:])
    return times[len(times) // 2]


@torch.no_grad()
def verify_plain_ratios(target, contexts=(4096, 8192, 16384), widths=(4, 16), rows: int = 1, repeats: int = 5,
                        prefill_chunk: int = 2048) -> list[dict]:
    """One dict per (context, width): plain step seconds and verify/plain ratios, chain and tree, before and after."""
    device, dtype = target.device, target.dtype
    vocab = target.config.get_text_config().vocab_size
    results = []
    for context in contexts:
        cache = DynamicCache(config=target.config)
        for start in range(0, context, prefill_chunk):  # chunks: the prefill's attention scores stay small
            ids = torch.randint(0, vocab, (rows, min(prefill_chunk, context - start)), device=device)
            positions = torch.arange(start, start + ids.shape[1], device=device).expand(rows, -1)
            target(ids, position_ids=positions, cache=cache)

        def step(n, mask, switch):
            ids = torch.randint(0, vocab, (rows, n), device=device)
            positions = torch.arange(context, context + n, device=device).expand(rows, -1)
            with verify_attention(target) if switch else contextlib.nullcontext():
                target(ids, attention_mask=mask, position_ids=positions, cache=cache)
            cache.crop(-n)

        plain = _seconds(lambda: step(1, None, False), device, repeats)
        for n in widths:
            allowed = torch.ones(n, context + n, dtype=torch.bool, device=device)
            allowed[:, context:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
            mask = mask.expand(rows, 1, -1, -1)
            row = {"context": context, "width": n, "rows": rows, "plain_step_s": plain}
            for kind, kind_mask in (("chain", None), ("tree", mask)):
                for label, switch in (("before", False), ("after", True)):
                    row[f"{kind}_{label}"] = _seconds(lambda: step(n, kind_mask, switch), device, repeats) / plain
            results.append(row)
    return results


def format_ratios(results: list[dict]) -> str:
    lines = ["| context | width | rows | plain step (ms) | chain before | chain after | tree before | tree after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['context']} | {r['width']} | {r['rows']} | {1000 * r['plain_step_s']:.2f} | "
                     f"{r['chain_before']:.2f} | {r['chain_after']:.2f} | {r['tree_before']:.2f} | "
                     f"{r['tree_after']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a target name or path, or 'tiny'")
    parser.add_argument("--contexts", default="4096,8192,16384", help="comma-separated context lengths (tokens)")
    parser.add_argument("--widths", default="4,16", help="comma-separated verify widths (tokens per row)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bfloat16 on a GPU, else float32)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.target == "tiny":
        target = _tiny_target().to(device=device, dtype=dtype)
    else:
        from ..targets import load_target

        target, _ = load_target(args.target, dtype=dtype, device=device)
    results = verify_plain_ratios(target, [int(c) for c in args.contexts.split(",")],
                                  [int(w) for w in args.widths.split(",")], args.rows, args.repeats)
    print(f"verify/plain step cost, {args.target} on {device} in {dtype} (ratios: verify step seconds / plain step "
          "seconds; before: transformers' SDPA path, after: the runtime's verify attention)")
    print(format_ratios(results))
    return results


if __name__ == "__main__":
    main()
