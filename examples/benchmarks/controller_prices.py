"""Live steps of chains with an untrained drafter at batch 1: what each step kind takes against the controller's price
for it, then whole calls against plain `generate` (SmolLM2-135M-Instruct, bf16, prompts of the built-in sets drawn
with seed 11).

    python examples/benchmarks/controller_prices.py
"""
import statistics
import time

import torch

from hf_diffspec.prompts import load_prompts
import hf_diffspec
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind
target, tok = hf_diffspec.load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
drafter = hf_diffspec.load_drafter("random", target, "smollm2-135m-instruct")
log = []
record = SpeculationController.record
def rec(self, step, ngrams=None, accepted=None):
    log.append((step.kind.value, step.seconds, step.verify_seconds, step.draft_seconds, step.slots,
                self._step_cost(step.kind, step.rows, step.slots), self._step_cost(StepKind.PLAIN, step.rows, 1),
                self.loop.mean("loop", 0.0) * self._unit(step.rows)))
    return record(self, step, ngrams, accepted)
SpeculationController.record = rec
msgs = [p["prompt"] for p in load_prompts(n_per_domain=22, seed=11)][:6]
for m in msgs:
    enc = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    target.generate(**enc, max_new_tokens=128, do_sample=False, assistant_model=drafter)
for kind in ("plain", "draft"):
    rows = [r for r in log if r[0] == kind]
    if rows:
        f = lambda i: statistics.mean(r[i] for r in rows) * 1000
        print(kind, len(rows), "ms: step %.1f verify %.1f draft %.1f rest %.1f | priced %.1f (plain priced %.1f, loop priced %.1f) slots %.1f" % (
            f(1), f(2), f(3), f(1) - f(2) - f(3), f(5), f(6), f(7), statistics.mean(r[4] for r in rows)))
for m in msgs[:4]:
    enc = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    start = time.perf_counter()
    plain = target.generate(**enc, max_new_tokens=128, do_sample=False)
    plain_s, plain_n = time.perf_counter() - start, plain.shape[1] - enc["input_ids"].shape[1]
    log.clear()
    start = time.perf_counter()
    out = target.generate(**enc, max_new_tokens=128, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    ours_s, ours_n = time.perf_counter() - start, out.sequences.shape[1] - enc["input_ids"].shape[1]
    print("call: plain %d tokens in %.3f s (%.1f ms a token), ours %d in %.3f s (%.1f ms a token; steps %.3f s, %d of "
          "them, %d drafter steps; prefill %.3f s)" % (plain_n, plain_s, 1000 * plain_s / plain_n, ours_n, ours_s,
                                                      1000 * ours_s / ours_n, sum(r[1] for r in log), len(log),
                                                      sum(r[0] == "draft" for r in log),
                                                      out.speculation_stats.prefill_time_s))
