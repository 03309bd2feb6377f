"""The engine round trip: our drafters exported for vLLM (`hf-diffspec export --format vllm`) and served by vLLM's
CPU build in its own venv, in-process, against transformers' plain `generate` and our own loop, fp32 greedy.

    python examples/vllm_round_trip.py --vllm-python .venv-vllm/bin/python [--cases shipped,random]
        [--domains code,math,chat] [--prompts 2] [--max-new-tokens 64] [--report out.json]

Cases: `shipped`, the SmolLM2 drafter shipped in checkpoints/ (it learned its own MASK vector: exported as an unused
target token plus mask_embedding.pt, with its reduced draft vocabulary as lm_head rows + d2t); `random`, a one-layer
random drafter embedding MASK as a target token. For each, it asserts that vLLM's output with the drafter equals
vLLM's without it and transformers' plain output, token for token, and reports vLLM's acceptance length beside our
loop's with the same weights, prompts and draft length (k = the block - 1: vLLM drafts k + 1 slots, as our loop
drafts the whole block); `shipped` also asserts they are within --tolerance. Exit 1 on any mismatch.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_diffspec import DiffusionDrafter
from hf_diffspec.bench.vllm_peer import VllmWorker
from hf_diffspec.drafters import load_drafter
from hf_diffspec.formats import export_for_engine
from hf_diffspec.prompts import load_prompts
from hf_diffspec.targets import load_target, unused_target_token

TARGET = "smollm2-135m-instruct"


def up_to_eos(tokens: list[int], eos: set[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def our_loop(target, drafter, prompts, max_new_tokens, k, eos):
    """Our loop at a fixed draft length k (chains, no lookup): (rows, tau)."""
    rows, committed, steps = [], 0, 0
    for ids in prompts:
        out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              assistant_model=drafter, num_assistant_tokens=k, return_dict_in_generate=True)
        rows.append(up_to_eos(out.sequences[0, len(ids):].tolist(), eos))
        committed += sum(out.speculation_stats.committed_per_step)
        steps += len(out.speculation_stats.committed_per_step)
    return rows, committed / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--cases", default="shipped,random")
    parser.add_argument("--domains", default="code,math,chat")
    parser.add_argument("--prompts", type=int, default=2, help="per domain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=None,
                        help="drafts per step on both sides (default: the block - 1, the only k at which vLLM "
                             "drafts the block the drafter was trained on; the tolerance applies there only)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="|vLLM's acceptance - ours|, shipped drafter")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--report", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    target, tokenizer = load_target(TARGET, dtype=torch.float32)
    folder = Path(target.name_or_path)
    eos = {target.generation_config.eos_token_id} if isinstance(target.generation_config.eos_token_id, int) \
        else set(target.generation_config.eos_token_id)
    records = load_prompts(args.domains.split(","), n_per_domain=args.prompts, tokenizer=tokenizer)
    prompts = [tokenizer(r["text"], add_special_tokens=False)["input_ids"] for r in records]
    plain = [up_to_eos(target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                       do_sample=False)[0, len(ids):].tolist(), eos) for ids in prompts]

    failures, report = [], {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": "float32",
                            "threads": args.threads, "cases": {}}
    engine = VllmWorker(folder, dtype="float32", threads=args.threads, python=args.vllm_python)
    report["vllm"] = engine.version
    served = [up_to_eos(o, eos) for o in engine.generate(prompts, args.max_new_tokens)["output_ids"]]
    engine.close()
    if served != plain:
        failures.append(f"vLLM without speculation differs from transformers on {_differing(served, plain)}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for case in args.cases.split(","):
            if case == "shipped":
                drafter = load_drafter(None, target, TARGET, draft_tree_budget=None, prompt_lookup_num_tokens=None,
                                       length_head=False)
            elif case == "random":
                torch.manual_seed(0)
                drafter = DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8,
                                                       mask_token_id=unused_target_token(tokenizer, target.vocab_size))
            else:
                raise SystemExit(f"unknown case {case!r}: choose from shipped, random")
            drafter = drafter.to(torch.float32).eval()
            drafter.save_pretrained(tmp / case)
            exported, notes = export_for_engine(tmp / case, tmp / f"{case}-vllm", "vllm", target=folder,
                                                draft_vocabulary=True)
            k = min(args.k or drafter.config.block_size - 1, drafter.config.block_size - 1)
            ours, our_tau = our_loop(target, drafter, prompts, args.max_new_tokens, k, eos)
            engine = VllmWorker(folder, exported, k=k, dtype="float32", threads=args.threads, python=args.vllm_python)
            answer = engine.generate(prompts, args.max_new_tokens)
            engine.close()
            rows = [up_to_eos(o, eos) for o in answer["output_ids"]]
            vllm_tau = 1 + answer["accepted"] / max(answer["drafts"], 1)
            report["cases"][case] = {"k": k, "vllm_acceptance": round(vllm_tau, 3), "our_acceptance": round(our_tau, 3),
                                     "identical": rows == plain, "ours_identical": ours == plain, "notes": notes}
            print(f"{case}: k={k}, acceptance vLLM {vllm_tau:.3f}, ours {our_tau:.3f}; vLLM output "
                  f"{'identical' if rows == plain else 'DIFFERENT'}, ours {'identical' if ours == plain else 'DIFFERENT'}")
            if rows != plain:
                failures.append(f"{case}: vLLM with the drafter differs from plain output on {_differing(rows, plain)}")
            if ours != plain:
                failures.append(f"{case}: our loop differs from plain output on {_differing(ours, plain)}")
            if case == "shipped" and k == drafter.config.block_size - 1 and abs(vllm_tau - our_tau) > args.tolerance:
                failures.append(f"shipped: vLLM's acceptance {vllm_tau:.3f} is not within {args.tolerance} of ours "
                                f"({our_tau:.3f})")
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["failures"] = failures
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _differing(rows, reference) -> str:
    bad = [i for i, (a, b) in enumerate(zip(rows, reference)) if a != b]
    return f"prompts {bad} of {len(reference)}" if bad else "the number of rows"


if __name__ == "__main__":
    sys.exit(main())
