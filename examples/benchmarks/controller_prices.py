"""Live steps of chains with an untrained drafter at batch 1: what each step kind takes against the controller's price
for it, then whole calls against plain `generate`, per token (SmolLM2-135M-Instruct, bf16, prompts of the built-in
sets drawn with seed 11).

    python examples/benchmarks/controller_prices.py
"""

import statistics
import time
from contextlib import contextmanager

import torch

import hf_diffspec
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind


@contextmanager
def priced_steps():
    """Every step the controller records, with the controller's price for it: (kind, seconds taken, seconds
    priced), appended to the list yielded."""
    steps, record = [], SpeculationController.record

    def priced(self, step, ngrams=None, accepted=None):
        steps.append((step.kind, step.seconds, self._step_cost(step.kind, step.rows, step.slots)))
        return record(self, step, ngrams, accepted)

    SpeculationController.record = priced
    try:
        yield steps
    finally:
        SpeculationController.record = record


def main() -> None:
    target, tok = hf_diffspec.load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    drafter = hf_diffspec.load_drafter("random", target, "smollm2-135m-instruct")
    prompts = [p["prompt"] for p in load_prompts(n_per_domain=22, seed=11)][:6]
    inputs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True) for p in prompts]
    with priced_steps() as steps:
        for enc in inputs:
            target.generate(**enc, max_new_tokens=128, do_sample=False, assistant_model=drafter)
        for kind in (StepKind.PLAIN, StepKind.DRAFT):
            taken = [(seconds, price) for k, seconds, price in steps if k is kind]
            if taken:
                print(f"{kind.value}: {len(taken)} steps, {1000 * statistics.mean(s for s, _ in taken):.1f} ms taken, "
                      f"{1000 * statistics.mean(p for _, p in taken):.1f} ms priced")
        for enc in inputs[:4]:
            prompt_length = enc["input_ids"].shape[1]
            start = time.perf_counter()
            plain = target.generate(**enc, max_new_tokens=128, do_sample=False)
            plain_s, plain_n = time.perf_counter() - start, plain.shape[1] - prompt_length
            steps.clear()
            start = time.perf_counter()
            ours = target.generate(**enc, max_new_tokens=128, do_sample=False, assistant_model=drafter)
            ours_s, ours_n = time.perf_counter() - start, ours.shape[1] - prompt_length
            drafts = sum(k is StepKind.DRAFT for k, _, _ in steps)
            print(f"call: plain {1000 * plain_s / plain_n:.1f} ms a token ({plain_n} tokens), ours "
                  f"{1000 * ours_s / ours_n:.1f} ms a token ({ours_n} tokens, {len(steps)} steps, {drafts} drafter)")


if __name__ == "__main__":
    main()
