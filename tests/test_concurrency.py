"""Several calls at once on one target and one drafter, as a chat app or a server makes them: every output is what
plain `generate` gives, and nothing the calls shared outlives them (the models are freed with their last reference).

The speculative calls draft a fixed length every step (`num_assistant_tokens`), or, in the `live` case, with the
defaults (live gates and cost model, each call on copies of its own); each thread decodes a prompt of its own, its
drafter pointing at that prompt's plain continuation (`oracle_drafter_outputs` with a `PerThreadReference`), so
every thread's drafts are accepted and the threads' verify forwards (tree masks, windows, recurrent-state recording)
overlap, counted in the verify attention. The freed-models test runs with the defaults on: the first call measures a
verify-cost profile and the live gates choose each step.
"""

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from hf_diffspec.runtime.verify_attention import VerifyAttention
from helpers import PerThreadReference, oracle_drafter_outputs, random_ids, run_in_threads, tiny_drafter, \
    tiny_dual_drafter, tiny_family_target, tiny_hybrid_target, tiny_target

THREADS = 4
ROUNDS = 3
NEW_TOKENS = 24


def _setup(case: str):
    """(target, drafter, generate kwargs of the speculative calls) for one kind of call."""
    if case.startswith("hybrid"):
        target = tiny_hybrid_target(seed=1, sharpen=4)
    elif case == "sliding_window":
        target = tiny_family_target("mistral", seed=2, window=4, sharpen=4)
    else:
        target = tiny_target("llama", seed=3, sharpen=4)
    # a fixed draft length: every step drafts whatever this machine's load makes the cost model choose (on a busy
    # machine it may verify no drafts at all), so verify forwards with drafts overlap the other threads' forwards
    kwargs = {"num_assistant_tokens": 4}
    if case == "d2sd":
        drafter = tiny_dual_drafter(target, block_size=8, vp_seed=7, num_branches=3, tree_budget=10, max_depth=6)
    elif case in ("trees", "hybrid_trees", "live_trees"):
        drafter = tiny_drafter(target, block_size=8, draft_tree_budget=10, draft_tree_width=3)
    else:
        drafter = tiny_drafter(target, block_size=8)
    if case == "lookup":
        kwargs["prompt_lookup_num_tokens"] = 6
    if case.startswith("live"):  # the defaults: live gates and cost model, each call on copies of its own
        kwargs = {}
    return target, drafter, kwargs


def _prompts(count: int) -> list[torch.Tensor]:
    # repeated text, so that prompt lookup finds matches; one length per prompt, so the threads' shapes differ
    return [random_ids(seed, 4 + seed % 3).repeat(1, 3) for seed in range(count)]


class VerifyOverlap:
    """How many calls were inside a verify forward at once, at most (counted in the verify attention's `switched`,
    which wraps each verify forward)."""

    def __init__(self, monkeypatch):
        self.inside = self.most = 0
        self.lock = threading.Lock()
        switched = VerifyAttention.switched
        overlap = self

        @contextlib.contextmanager
        def counting(attention):
            with switched(attention):
                with overlap.lock:
                    overlap.inside += 1
                    overlap.most = max(overlap.most, overlap.inside)
                try:
                    yield
                finally:
                    with overlap.lock:
                        overlap.inside -= 1

        monkeypatch.setattr(VerifyAttention, "switched", counting)


@pytest.mark.parametrize("case", ["chains", "trees", "lookup", "d2sd", "hybrid", "hybrid_trees", "sliding_window",
                                  "live_trees"])
def test_concurrent_speculative_calls_match_plain_generate(monkeypatch, case):
    """Calls in threads at once on one target and drafter, each on a prompt of its own with an oracle drafter for
    that prompt (so drafts are accepted in every thread), beside a plain call: each gets plain generate's tokens, and
    verify forwards of several threads overlapped. `live_trees`: the defaults (live gates and cost model, the
    call's own copies of both)."""
    target, drafter, kwargs = _setup(case)
    if case.startswith("live"):
        # the drafting pass priced as a quiet machine prices this one-layer drafter: measured here, beside four
        # threads and a plain call, on a busy machine, it can come out dear enough that no first call tries the
        # drafter (the full suite beside four background jobs failed round 0 so: 0 of 4 accepted, as a price of 30
        # does), which is the price's measurement, not what this test is about
        from hf_diffspec.runtime import control_policy

        monkeypatch.setattr(control_policy, "drafting_price_for", lambda *args: 0.3)
    prompts = _prompts(THREADS * ROUNDS + 1)
    plain = [target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in prompts]
    reference = PerThreadReference()
    oracle_drafter_outputs(monkeypatch, drafter.first if case == "d2sd" else drafter, target, reference)
    overlap = VerifyOverlap(monkeypatch)

    def speculative(i):
        reference.use(plain[i][0])
        return target.generate(prompts[i], assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False,
                               return_dict_in_generate=True, **kwargs)

    for round_ in range(ROUNDS):
        chosen = range(round_ * THREADS, (round_ + 1) * THREADS)
        # and one plain call at the same time, on the same target
        outs = run_in_threads([*[lambda i=i: speculative(i) for i in chosen],
                               lambda: target.generate(prompts[-1], max_new_tokens=NEW_TOKENS, do_sample=False)])
        accepting = 0
        for i, out in zip(chosen, outs):
            assert torch.equal(out.sequences, plain[i]), f"round {round_}, prompt {i}"
            stats = out.speculation_stats
            accepting += sum(stats.committed_per_step) > len(stats.committed_per_step)
        # every thread's drafts were accepted (its own oracle), not one thread's. With the live controller, in the
        # first round: each call starts from a controller of its own that never saw the drafter, so it drafts first;
        # later calls start from what one of them kept, and draft as this machine's timings say (with several
        # threads on a busy machine, Python's share of a drafting pass can price it out)
        if not case.startswith("live") or round_ == 0:
            assert accepting == THREADS, f"round {round_}"
        assert torch.equal(outs[-1], plain[-1]), f"round {round_}: the plain call beside the speculative ones"
    assert overlap.most >= 2  # verify forwards of several threads ran at the same time


@pytest.mark.parametrize("case", ["trees", "hybrid_d2sd"])
def test_models_are_freed_after_speculative_calls(case):
    """With the defaults on (a verify-cost profile measured and kept for later calls, gates kept), dropping the last
    reference to the target and the drafter frees them."""
    # architectures no other test measures: this target's own first call measures its profile
    if case == "trees":
        target = tiny_target("qwen3", seed=4, layers=3)
        drafter = tiny_drafter(target, block_size=8, draft_tree_budget=10, draft_tree_width=3)
    else:
        target = tiny_hybrid_target(seed=4, layers=3)
        drafter = tiny_dual_drafter(target, block_size=8, vp_seed=5, num_branches=2, tree_budget=8)
    ids = random_ids(0, 6)
    for _ in range(2):
        target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    refs = [weakref.ref(target), weakref.ref(drafter)]
    del target, drafter
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def _model_as_seen(model) -> dict:
    """What a call must leave as it found it: every config's class and attributes, every module's class and forward."""
    configs = {name: (type(m.config), dict(vars(m.config))) for name, m in model.named_modules()
               if hasattr(m, "config")}
    modules = {name: (type(m), m.forward.__func__, vars(m).get("forward")) for name, m in model.named_modules()}
    return {"configs": configs, "modules": modules, "model_config": (type(model.config), dict(vars(model.config)))}


@pytest.mark.parametrize("case", ["trees", "hybrid"])
def test_calls_leave_the_model_as_they_found_it(case):
    """After one speculative call, and after several at once beside a plain one, the target's configs have their own
    classes and attributes back, and every module its own class and forward: nothing of the runtime stays on it
    (the verify attention switches the configs' class while calls hold them)."""
    target, drafter, kwargs = _setup(case)
    before = _model_as_seen(target)
    prompts = _prompts(THREADS + 1)
    target.generate(prompts[0], assistant_model=drafter, max_new_tokens=8, do_sample=False, **kwargs)
    assert _model_as_seen(target) == before
    run_in_threads([*[lambda ids=ids: target.generate(ids, assistant_model=drafter, max_new_tokens=8,
                                                     do_sample=False, **kwargs) for ids in prompts[:THREADS]],
                    lambda: target.generate(prompts[-1], max_new_tokens=8, do_sample=False)])
    assert _model_as_seen(target) == before
