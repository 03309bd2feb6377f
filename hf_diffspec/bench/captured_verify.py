"""A CUDA graph captured over the capture-ready verify forward (`cache_implementation="static"`,
`runtime/verify_graphs.py`): whether it can be captured, whether its replay computes what the eager forward computes,
and what replaying it saves per verify step.

The forward is the loop's: a chain of `width` nodes per row (bucketed), verified over a preallocated cache of
`context` random tokens through the runtime's verify attention, its inputs in the persistent buffers the loop fills.
Each step is the forward and the crop back to the context (the cache's lengths, on the device, lowered in place);
eager and replayed steps are timed alike, after the device has run them. On a device without CUDA graphs only the
eager step is timed (it checks that the step runs).

    python -m hf_diffspec.bench.captured_verify --target smollm2-135m-instruct --contexts 1024 --rows 1,16
"""

import argparse

import torch

from ..runtime.device_clock import device_time
from ..runtime.tree import CandidateTree, TreeLayout
from ..runtime.verify_attention import verify_attention
from ..runtime.verify_cache import cached_count, crop_attention, target_cache
from ..runtime.verify_inputs import CaptureReadyInputs, ValidSlots, verify_width


def _median_seconds(step, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = device_time(device)
        step()
        times.append(device_time(device) - start)
    return sorted(times)[len(times) // 2]


def _verify_inputs(target, rows: int, context: int, nodes: int):
    """A static cache prefilled with `context` random tokens per row, and a chain of `nodes` per row in the
    persistent buffers: (cache, (tokens, mask, positions), bucketed width)."""
    device, dtype = target.device, target.dtype
    vocab = target.config.get_text_config().vocab_size
    width = verify_width(nodes)
    cache = target_cache(target.config, static_length=context + width)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, context), generator=generator).to(device)
    target(ids, position_ids=torch.arange(context, device=device).expand(rows, -1), cache=cache, use_cache=True)
    drafts = torch.randint(2, vocab, (rows, nodes), generator=generator).to(device)
    trees = [CandidateTree.chain(row[0], row[1:]) for row in drafts]
    layout = TreeLayout.of(trees, device, width)
    capacity = cache.layers[0].max_cache_len
    valid = ValidSlots(torch.ones(rows, context, dtype=torch.bool, device=device), capacity)
    roots = torch.full((rows,), context, device=device)
    inputs = CaptureReadyInputs(capacity).fill(layout, valid, cached_count(cache).clone(), roots, dtype, rows)
    return cache, inputs, width


@torch.no_grad()
def captured_verify(target, rows: int = 1, context: int = 1024, nodes: int = 16, repeats: int = 20) -> dict:
    """One dict: eager and replayed verify-step milliseconds, their ratio, and how far the replay's logits are from
    the eager forward's (max |difference|, share of equal argmaxes); `captured` says why not where it was not."""
    device = target.device
    cache, (tokens, mask, positions), width = _verify_inputs(target, rows, context, nodes)

    def forward():
        with verify_attention(target):
            return target(tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits

    def eager_step():
        logits = forward()
        crop_attention(cache, width)
        return logits

    eager = eager_step().float()
    row = {"rows": rows, "context": context, "width": width,
           "eager_step_ms": round(1000 * _median_seconds(eager_step, device, repeats), 3)}
    if device.type != "cuda":
        row["captured"] = f"no CUDA graphs on {device.type}"
        return row
    stream = torch.cuda.Stream()  # warm-up on a side stream, as capturing asks
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            eager_step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = forward()  # capturing runs nothing: the cache's lengths are where they were
    except RuntimeError as error:
        row["captured"] = f"failed: {str(error)[:300]}"
        return row

    def replay_step():
        graph.replay()
        crop_attention(cache, width)

    replay_step()
    row.update(captured=True, max_abs_diff=float((captured.float() - eager).abs().max()),
               argmax_agreement=float((captured.argmax(-1) == eager.argmax(-1)).float().mean()),
               replay_step_ms=round(1000 * _median_seconds(replay_step, device, repeats), 3))
    row["eager_over_replay"] = round(row["eager_step_ms"] / row["replay_step_ms"], 3)
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a target name or path")
    parser.add_argument("--contexts", default="1024", help="comma-separated context lengths (tokens)")
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--nodes", type=int, default=16, help="verified nodes per row (bucketed)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    from ..targets import load_target

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype), device=device)
    results = [captured_verify(target, rows, context, args.nodes, args.repeats)
               for context in map(int, args.contexts.split(",")) for rows in map(int, args.rows.split(","))]
    for row in results:
        print(row)
    return results


if __name__ == "__main__":
    main()
