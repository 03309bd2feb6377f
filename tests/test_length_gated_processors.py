"""Logits processors that act at some prefix lengths only (`batch.LENGTH_GATED_PROCESSORS`): a speculative step
commits several tokens at once on the device only where every such processor is inactive over the step's lengths
(`batch._inactive`); a step whose lengths reach one goes token by token, where the processor sees each exact prefix.

Each processor here binds: the constrained token is the one the target would otherwise pick at the boundary, so a
step that skips the processor there commits another token than plain `generate`. The drafter proposes plain
generate's own constrained continuation (an oracle), so steps accept several tokens and cross the boundary."""

import pytest
import torch
from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

from helpers import oracle_drafter_outputs, random_ids, tiny_drafter, tiny_target

NEW_TOKENS = 12


def _unconstrained(target, ids) -> list[int]:
    """Plain greedy tokens after `ids` without any constraint."""
    out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def _binding_kwargs(name: str, target, ids) -> dict:
    """generate options under which processor `name` changes plain generate's greedy output at its boundary."""
    free = _unconstrained(target, ids)
    length = ids.shape[1]
    if name == "begin_suppress_tokens":  # the first new token (prompt length): suppressed
        return dict(begin_suppress_tokens=[free[0]], eos_token_id=None, pad_token_id=0)
    if name == "min_new_tokens":  # EOS is the token the target would stop with at new token 6
        return dict(min_new_tokens=8, eos_token_id=free[5], pad_token_id=0)
    if name == "min_new_tokens_processor":  # given as a processor: generate turns min_new_tokens into min_length too
        processor = MinNewTokensLengthLogitsProcessor(length, 8, free[5])
        return dict(logits_processor=LogitsProcessorList([processor]), eos_token_id=free[5], pad_token_id=0)
    if name == "min_length":
        return dict(min_length=length + 8, eos_token_id=free[5], pad_token_id=0)
    if name == "forced_eos_token_id":  # the last position (max_length - 1) forced to a token it would not pick
        forced = next(t for t in range(2, 128) if t != free[NEW_TOKENS - 1])
        return dict(forced_eos_token_id=forced, eos_token_id=None, pad_token_id=0)
    if name == "forced_bos_token_id":  # a one-token prompt: the token after it (length 1) forced
        forced = next(t for t in range(2, 128) if t != free[0])
        return dict(forced_bos_token_id=forced, eos_token_id=None, pad_token_id=0)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["begin_suppress_tokens", "min_new_tokens", "min_new_tokens_processor", "min_length",
                                  "forced_eos_token_id", "forced_bos_token_id"])
@pytest.mark.every_step_speculates("the oracle's drafts must be verified at every step to cross the boundary")
def test_a_length_gated_processor_binds_at_its_boundary_token(monkeypatch, name):
    target = tiny_target("llama", seed=6, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    ids = random_ids(6, 1 if name == "forced_bos_token_id" else 7)
    kwargs = _binding_kwargs(name, target, ids)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    assert plain[0, ids.shape[1] :].tolist() != _unconstrained(target, ids)[: plain.shape[1] - ids.shape[1]] or \
        plain.shape[1] != ids.shape[1] + NEW_TOKENS, "the processor must change plain generate's output"
    oracle_drafter_outputs(monkeypatch, drafter, target, plain[0])
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False,
                          num_assistant_tokens=5, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert max(out.speculation_stats.committed_per_step) > 1  # steps committed several tokens at once


@pytest.mark.parametrize("name", ["begin_suppress_tokens", "min_new_tokens", "min_length", "forced_eos_token_id",
                                  "forced_bos_token_id"])
def test_a_length_gated_processor_binds_when_a_step_starts_at_its_boundary(monkeypatch, name):
    """Plain steps only (one token each): some step starts exactly at every boundary, so a processor judged inactive
    one length early or late (the forced EOS at max_length - 2, say) changes the output."""
    import itertools

    from helpers import steer_steps

    steer_steps(monkeypatch, itertools.repeat(False))
    target = tiny_target("llama", seed=6, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    ids = random_ids(6, 1 if name == "forced_bos_token_id" else 7)
    kwargs = _binding_kwargs(name, target, ids)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False,
                          prompt_lookup_num_tokens=0, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert out.speculation_stats.plain_steps == out.speculation_stats.target_forwards - 1


@pytest.mark.parametrize("option", [dict(repetition_penalty=8.0), dict(no_repeat_ngram_size=2)])
@pytest.mark.every_step_speculates("the oracle's drafts must be verified at every step")
def test_a_processor_that_reads_the_prefix_is_applied_at_every_position_of_a_speculative_step(monkeypatch, option):
    """A processor that reads the prefix (not length-gated, not prefix-free) is never judged inactive: steps that
    accept several drafts apply it at each position, token by token. It binds here (plain generate's output differs
    without it), and the oracle proposes plain generate's own continuation."""
    target = tiny_target("llama", seed=6, sharpen=4)
    drafter = tiny_drafter(target, block_size=6, seed=6)
    ids = random_ids(6, 7)
    kwargs = dict(eos_token_id=None, pad_token_id=0, **option)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    assert plain[0, ids.shape[1]:].tolist() != _unconstrained(target, ids), "the processor must bind"
    oracle_drafter_outputs(monkeypatch, drafter, target, plain[0])
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False,
                          num_assistant_tokens=5, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    assert max(out.speculation_stats.committed_per_step) > 1


def test_a_length_gated_processor_is_inactive_exactly_from_the_length_where_transformers_stops_applying_it():
    """`batch._inactive` at each boundary, one length either side: where it says inactive, the processor leaves
    scores unchanged at every length of the span (so those steps may accept on the device, the fast path); where it
    changes them at some length, it says active (the step goes token by token). A processor of any other kind is
    never judged inactive."""
    from transformers import (
        ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, MinLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    )

    from hf_diffspec.runtime.batch import _inactive

    processors = [MinLengthLogitsProcessor(10, 1), MinNewTokensLengthLogitsProcessor(4, 6, 1),
                  SuppressTokensAtBeginLogitsProcessor([5], 10), ForcedBOSTokenLogitsProcessor(5),
                  ForcedEOSTokenLogitsProcessor(10, 1), RepetitionPenaltyLogitsProcessor(2.0)]
    scores = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
    for processor in processors:
        for start in range(0, 14):
            span = range(start, start + 3)
            changes = any(not torch.equal(processor(torch.full((1, n), 7), scores.clone()), scores) for n in span)
            assert _inactive(processor, span) == (not changes), (type(processor).__name__, start)
