"""Per-step memory that does not scale with vocabulary x verified slots beyond the logits themselves: at 64 rows x 16
slots the step's extra allocations (CPU allocator events, counted by the profiler: load-independent) stay a small
fraction of the verify logits."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_diffspec.runtime import drafting
from hf_diffspec.runtime.batch import BatchState
from helpers import random_ids, tiny_drafter, tiny_target

ROWS, SLOTS, VOCAB = 64, 16, 1024


def peak_extra_bytes(fn):
    """(fn(), the most bytes allocated by `fn` and alive at once) from the profiler's allocation and free events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for _, size in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                          if e.self_cpu_memory_usage):
        live += size
        peak = max(peak, live)
    return result, peak


@pytest.fixture
def bf16_pair():
    target = tiny_target("llama", seed=5, vocab_size=VOCAB, layers=1).to(torch.bfloat16)
    return target, tiny_drafter(target, block_size=SLOTS, seed=5).to(torch.bfloat16)


@pytest.mark.every_step_speculates("every step verifies 64 rows x 16 slots")
def test_greedy_acceptance_makes_no_copy_of_the_verify_logits(bf16_pair, monkeypatch):
    target, drafter = bf16_pair
    accept, measured = BatchState.accept, []

    def measuring(self, trees, logits, layout=None):
        if measured or logits.shape[1] < SLOTS:
            return accept(self, trees, logits, layout)
        paths, peak = peak_extra_bytes(lambda: accept(self, trees, logits, layout))
        measured.append(peak / logits.nbytes)
        return paths

    monkeypatch.setattr(BatchState, "accept", measuring)
    ids = random_ids(5, 8, vocab=VOCAB, rows=ROWS)
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=SLOTS + 1,
                    num_assistant_tokens=SLOTS - 1, do_sample=False)
    assert measured and max(measured) < 0.05  # a float32 copy would be 2x the bf16 logits


def test_drafter_logits_of_a_small_batch_take_one_pass_of_the_lm_head():
    """Growing chunks (4, 8, 15 slots) until the cost model has what it needs bound a large batch's memory; a small
    one takes every slot in one pass (one read of the LM head's weights)."""
    target = tiny_target("llama", seed=6)
    generator = drafting.candidate_generator_for(tiny_drafter(target, block_size=SLOTS, seed=6), target)
    drafter, calls = generator.first.drafter, []
    compute = drafter.compute_logits
    drafter.compute_logits = lambda hidden: calls.append(hidden.shape[:2]) or compute(hidden)
    hidden_size = target.config.hidden_size
    for rows in (2, 64):
        logits = generator._slot_logits(torch.randn(rows, SLOTS - 1, hidden_size), SLOTS - 1, lambda logits: True)
        assert logits.shape[:2] == (rows, SLOTS - 1)
    assert calls == [(2, 15), (64, 4), (64, 4), (64, 7)]
