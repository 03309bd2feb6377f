"""vLLM's side of the vLLM peer, run by the interpreter of vLLM's own venv (it imports neither hf_diffspec nor our
transformers): one in-process engine, with or without a DFlash drafter, answering one request per stdin line.

    python vllm_worker.py --model TARGET_DIR [--drafter EXPORT_DIR --k K] --dtype float32 --threads 1

A request is `{"prompts": [[token ids], ...], "max_new_tokens": N}` plus optional sampling fields (`temperature`,
`top_k`, `top_p`, `seed`), decoded as one batch; the answer, one JSON line on the stdout it was started with, is
`{"output_ids": [[...], ...], "seconds": wall time of the call, "drafts": drafting steps, "accepted": accepted
drafts}`. vLLM's own logging goes to stderr.
The first line it writes is `{"ready": true, "vllm": version, "k": drafts per step}` once the engine is up.
"""

import argparse
import json
import os
import sys
import time


def engine_environment(threads: int) -> None:
    """One process (no engine-core subprocess busy-polling the cores), pinned to `threads` cores."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def spec_counters(llm) -> tuple[int, int]:
    """(drafting steps, accepted drafts) so far, from the engine's metrics."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return int(values.get("vllm:spec_decode_num_drafts") or 0), \
        int(values.get("vllm:spec_decode_num_accepted_tokens") or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target's folder")
    parser.add_argument("--drafter", help="a drafter exported with `hf-diffspec export --format vllm`")
    parser.add_argument("--k", type=int, help="num_speculative_tokens (default: the drafter's block size - 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    engine_environment(args.threads)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever vLLM prints goes to stderr; answers keep the original stdout to themselves

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if args.drafter:
        with open(os.path.join(args.drafter, "config.json")) as f:
            block = json.load(f)["block_size"]
        speculative = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.k or block - 1}
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=args.max_model_len, speculative_config=speculative, disable_log_stats=False,
              seed=0)
    answers.write(json.dumps({"ready": True, "vllm": vllm.__version__,
                              "k": speculative["num_speculative_tokens"] if speculative else 0}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        temperature = request.get("temperature") or 0.0
        params = SamplingParams(
            max_tokens=request["max_new_tokens"], temperature=temperature,
            top_k=(request.get("top_k") or 0) if temperature else 0,  # 0: no top-k
            top_p=(request.get("top_p") or 1.0) if temperature else 1.0,
            seed=request.get("seed"),
        )
        drafts, accepted = spec_counters(llm) if speculative else (0, 0)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        drafts_after, accepted_after = spec_counters(llm) if speculative else (0, 0)
        answers.write(json.dumps({"output_ids": [list(o.outputs[0].token_ids) for o in out], "seconds": seconds,
                                  "drafts": drafts_after - drafts, "accepted": accepted_after - accepted}) + "\n")


if __name__ == "__main__":
    main()
