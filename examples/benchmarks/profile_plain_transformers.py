# run in our venv: per-op profile of transformers' plain decoding (bf16, batch 1)
import sys, json, time, torch
from hf_diffspec.targets import load_target
ids = torch.tensor([json.load(open(sys.argv[1]))])
target, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
target.generate(ids, **kw)
t = time.perf_counter(); target.generate(ids, **kw); wall = time.perf_counter() - t
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    target.generate(ids, **kw)
print(f"transformers plain: {wall / 64 * 1000:.1f} ms/token (64 tokens, unprofiled), {torch.get_num_threads()} threads")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
