# run in the vLLM venv: per-op profile of plain decoding (bf16, batch 1)
import os, sys, json, time
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads-1}"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
ids = json.load(open(sys.argv[1]))
llm = LLM(model=os.path.expanduser("~/.cache/hf_diffspec/models/smollm2-135m-instruct"), dtype="bfloat16",
          enforce_eager=True, distributed_executor_backend="uni", max_model_len=2048)
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=ids)], p, use_tqdm=False)
t = time.perf_counter(); llm.generate([TokensPrompt(prompt_token_ids=ids)], p, use_tqdm=False); wall = time.perf_counter() - t
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    llm.generate([TokensPrompt(prompt_token_ids=ids)], p, use_tqdm=False)
print(f"vLLM plain: {wall / 64 * 1000:.1f} ms/token (64 tokens, unprofiled)")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
