"""Host time per decoding step, apart from the model forwards: what a loop adds to every step around its target's and
drafter's forwards (accepting, committing, bookkeeping, building the next inputs, and waiting on the device where it
synchronises).

`ForwardClock` times the top-level forwards of the models it is given (on CUDA it synchronises around each, so a
forward's time is the device's and the loop's own waits are not hidden in it); a loop's host time per step is then
(wall time - time in forwards) / target forwards. With a tiny target (a forward of ~1 ms) the loop dominates, which is
what `compare_host_time` measures: our loop (chains, trees, trees with prompt lookup) against z-lab's `dflash_generate`
and transformers' assisted decoding, at the batch sizes each supports. Timings on a shared machine are indicative:
compare ratios within one run.
"""

import time

import torch

from .host_syncs import HostSyncCounter
from .peers import zlab_method


class ForwardClock:
    """Seconds spent in the top-level forwards of `models` and the number of `target` forwards, while entered."""

    def __init__(self, target, models=()):
        self.target = target
        self.models = [target, *[m for m in models if m is not None]]
        self.seconds = 0.0
        self.target_forwards = 0
        self._depth = 0
        self._start = 0.0
        self._handles = []

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _enter(self, *_):
        if self._depth == 0:
            self._sync()
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, is_target: bool):
        self._depth -= 1
        if self._depth == 0:
            self._sync()
            self.seconds += time.perf_counter() - self._start
            self.target_forwards += is_target

    def __enter__(self):
        for model in self.models:
            is_target = model is self.target
            self._handles.append(model.register_forward_pre_hook(self._enter))
            self._handles.append(model.register_forward_hook(lambda *_, t=is_target: self._leave(t)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def host_time_per_step(run, target, models=(), repeats: int = 3) -> dict:
    """Run `run()` (one generate call) `repeats` times after a warm-up; the median host seconds per target forward
    apart from the forwards, the median forward seconds per step, and (from the warm-up, counted) the torch calls
    per step outside the forwards, the first window after the prefill left out."""
    with HostSyncCounter(target, models) as counter:
        run()
    calls = counter.per_step_calls[1:] or counter.per_step_calls
    host, forward = [], []
    for _ in range(repeats):
        with ForwardClock(target, models) as clock:
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            start = time.perf_counter()
            run()
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            wall = time.perf_counter() - start
        steps = max(clock.target_forwards, 1)
        host.append((wall - clock.seconds) / steps)
        forward.append(clock.seconds / steps)
    return {"host_ms_per_step": 1000 * sorted(host)[len(host) // 2],
            "forward_ms_per_step": 1000 * sorted(forward)[len(forward) // 2],
            "torch_calls_per_step": round(sum(calls) / max(len(calls), 1), 1)}


def compare_host_time(target, drafter, prompts: torch.Tensor, max_new_tokens: int = 64, batches=(1, 16),
                      tree_budget: int = 8, lookup_tokens: int = 4, assistant=None, repeats: int = 3,
                      sampling: dict | None = None) -> list[dict]:
    """Host time per step of our loop (chains, trees, trees + prompt lookup), z-lab's `dflash_generate` (batch 1,
    greedy only; needs PyPI `dflash` and a drafter whose MASK is a target token) and transformers' assisted decoding
    with `assistant` (batch 1), on rows of `prompts` (rows, length; no padding): greedy, or sampled with `sampling`
    (generate's `temperature`, `top_k`, `top_p`). Rows of dicts."""
    results = []
    sample = dict(do_sample=False) if sampling is None else dict(do_sample=True, **sampling)
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **sample)
    budget = drafter.config.draft_tree_budget
    drafts = drafter.config.block_size - 1
    for rows in batches:
        ids = prompts[:rows]
        for name, tree, lookup in (("ours: chains", None, 0), ("ours: trees", tree_budget, 0),
                                   ("ours: trees + lookup", tree_budget, lookup_tokens)):
            def run(tree=tree, lookup=lookup):
                drafter.config.draft_tree_budget = tree
                try:
                    # a fixed draft length: every step drafts, no verify-cost profile or gates in the way
                    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                    prompt_lookup_num_tokens=lookup, num_assistant_tokens=drafts, **kwargs)
                finally:
                    drafter.config.draft_tree_budget = budget
            results.append({"method": name, "rows": rows, **host_time_per_step(run, target, [drafter], repeats)})
        if rows == 1:
            zlab = zlab_method(drafter, target)
            if sampling is not None:
                results.append({"method": "z-lab dflash_generate", "rows": rows, "skipped": "greedy only"})
            elif zlab.skip_reason:
                results.append({"method": "z-lab dflash_generate", "rows": rows, "skipped": zlab.skip_reason})
            else:
                def run_zlab():
                    zlab.runner(target, {"input_ids": ids}, max_new_tokens)
                results.append({"method": "z-lab dflash_generate", "rows": rows,
                                **host_time_per_step(run_zlab, target, [zlab.runner.model], repeats)})
            if assistant is not None:
                def run_assisted():
                    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, **kwargs)
                results.append({"method": "transformers assisted", "rows": rows,
                                **host_time_per_step(run_assisted, target, [assistant], repeats)})
    return results


def host_time_markdown(results: list[dict]) -> str:
    lines = ["| method | rows | host ms / step | forward ms / step | torch calls / step |", "|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['method']} | {r['rows']} | skipped: {r['skipped']} | | |")
        else:
            lines.append(f"| {r['method']} | {r['rows']} | {r['host_ms_per_step']:.3f} | "
                         f"{r['forward_ms_per_step']:.3f} | {r['torch_calls_per_step']:.0f} |")
    return "\n".join(lines)
