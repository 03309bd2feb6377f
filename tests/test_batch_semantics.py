"""Batch > 1 semantics equal to plain `generate` (issue 11, cases A and B), as regression tests.

A: a batch whose prompts all have the same length needs no padding, and transformers then drops the all-ones attention
   mask: batch checks and per-row state must follow the number of rows, never the mask.
B: rows stopped by a stopping criterion with no EOS criterion: plain `generate` pads finished rows only when an EOS
   criterion exists; otherwise it keeps generating them until every row has stopped, and needs no pad token.
"""

import pytest
import torch
from transformers import EosTokenCriteria, StoppingCriteriaList

from helpers import (
    RecordingStreamer,
    StopOnTokens,
    char_tokenizer,
    oracle_drafter_outputs,
    random_ids,
    tiny_drafter,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128


@pytest.fixture(scope="module")
def models(one_torch_thread):
    target = tiny_target("llama", seed=0, vocab_size=VOCAB)
    return target, tiny_drafter(target, block_size=4)


def prompts(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return random_ids(seed, length, VOCAB, rows)


def refused_before_any_forward(target, drafter, ids, match: str, **kwargs) -> None:
    """The speculative call raises a ValueError matching `match` before the target runs a single forward."""
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(ids, assistant_model=drafter, **kwargs)
    finally:
        hook.remove()
    assert not forwards, "a refusal must come before the first forward"


def allowed_by_row(batch_id: int, input_ids: torch.Tensor) -> list[int]:
    """Disjoint token ranges per batch id: a row constrained with another row's id is visibly wrong."""
    return list(range(2 + 30 * batch_id, 32 + 30 * batch_id))


# ----- A --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_new_tokens", [1, 6])
def test_a_prefix_allowed_tokens_fn_gets_each_rows_batch_id_without_padding(models, max_new_tokens):
    """4 rows of 3 tokens (no padding, so no attention mask reaches the loop): row r is constrained with batch id r."""
    target, drafter = models
    ids = prompts(4, 3)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, prefix_allowed_tokens_fn=allowed_by_row)
    plain = target.generate(ids, **kwargs)
    ours = target.generate(ids, assistant_model=drafter, **kwargs)
    for row in range(4):
        assert set(plain[row, 3:].tolist()) <= set(allowed_by_row(row, None))
    assert ours.tolist() == plain.tolist()


def test_a_scores_at_batch_2_without_padding_are_refused(models):
    """Rows commit different numbers of tokens per step, so per-step scores of the batch do not exist: refused at
    batch 2 from the number of rows, although no attention mask reaches the loop."""
    target, drafter = models
    ids = prompts(2, 5)
    for option in ("output_scores", "output_logits"):
        kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **{option: True})
        plain = getattr(target.generate(ids, **kwargs), option.removeprefix("output_"))
        assert len(plain) == 4 and plain[0].shape == (2, VOCAB)  # what plain generate gives and we cannot
        refused_before_any_forward(target, drafter, ids, "output_scores/output_logits are only available at batch "
                                   "size 1.*one at a time", **kwargs)


def test_a_streamer_at_batch_2_is_refused_with_and_without_padding(models):
    """Streaming needs batch size 1 (as in transformers): refused with a message that says so, whether or not the
    prompts need padding (without padding transformers drops the attention mask)."""
    target, drafter = models
    equal = prompts(2, 5)
    padded, mask = equal.clone(), torch.ones_like(equal)
    padded[1, :2], mask[1, :2] = 0, 0
    streamer = RecordingStreamer()
    refused_before_any_forward(target, drafter, equal, "streaming needs batch size 1", max_new_tokens=4,
                               do_sample=False, streamer=streamer)
    refused_before_any_forward(target, drafter, padded, "streaming needs batch size 1", attention_mask=mask,
                               max_new_tokens=4, do_sample=False, streamer=streamer)
    # generate streams each prompt before handing over to the loop; no generated token was streamed
    assert streamer.chunks == [equal.tolist(), padded.tolist()] and not streamer.ended


# ----- B --------------------------------------------------------------------------------------------------------
def _stop_string_batch(target):
    """3 rows with no EOS; a stop string that row 0 produces early and the other rows do not produce at all."""
    tokenizer = char_tokenizer(VOCAB)
    ids = prompts(3, 4, seed=3)
    free = target.generate(ids, max_new_tokens=8, do_sample=False)[:, 4:].tolist()
    stop = tokenizer.decode(free[0][1:3])
    assert all(stop not in tokenizer.decode(row) for row in free[1:]), "pick another seed: other rows stop too"
    return ids, tokenizer, stop


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_b_stop_string_without_eos_keeps_generating_the_stopped_row_like_plain(models, pad_token_id):
    target, drafter = models
    ids, tokenizer, stop = _stop_string_batch(target)
    assert target.generation_config.eos_token_id is None
    kwargs = dict(max_new_tokens=8, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                  pad_token_id=pad_token_id)
    plain = target.generate(ids, **kwargs)
    assert plain.shape == (3, 12)  # row 0 stopped after 3 tokens, but plain generate goes on with it
    ours = target.generate(ids, assistant_model=drafter, **kwargs)
    assert ours.tolist() == plain.tolist()


def test_b_stop_string_with_an_eos_criterion_pads_the_stopped_row_like_plain(models):
    """The contrast: an EOS criterion (here a user-passed EosTokenCriteria of a token no row emits) makes plain
    generate pad rows that stopped."""
    target, drafter = models
    ids, tokenizer, stop = _stop_string_batch(target)
    unused = next(t for t in range(2, VOCAB) if t not in target.generate(ids, max_new_tokens=8)[:, 4:])
    kwargs = dict(max_new_tokens=8, do_sample=False, stop_strings=[stop], tokenizer=tokenizer, pad_token_id=0,
                  stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos_token_id=unused)]))
    plain = target.generate(ids, **kwargs)
    assert plain[0, 7:].tolist() == [0] * 5
    ours = target.generate(ids, assistant_model=drafter, **kwargs)
    assert ours.tolist() == plain.tolist()


@pytest.mark.every_step_speculates("counts committed and verified tokens per speculative step")
def test_b_rows_cut_back_to_the_last_stop_leave_the_speculation_stats_adding_up(models, monkeypatch):
    """Without an EOS criterion, rows that stopped generate on until the last one stops, and are then cut back to
    its length: the tokens cut were committed by some steps, and leave those steps' counts."""
    target, drafter = models
    tokenizer = char_tokenizer(VOCAB)
    ids = prompts(3, 4, seed=5)
    free = target.generate(ids, max_new_tokens=14, do_sample=False)
    new = free[:, 4:].tolist()
    stops = [tokenizer.decode(new[r][2 * r + 1 : 2 * r + 4]) for r in range(3)]  # rows stop 4, 6 and 8 tokens in
    oracle_drafter_outputs(monkeypatch, drafter, target, list(free))  # long accepted paths: rows overshoot
    kwargs = dict(max_new_tokens=14, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
    plain = target.generate(ids, **kwargs)
    assert plain.shape[1] < free.shape[1], "pick another seed: no row stopped"
    out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=3, return_dict_in_generate=True,
                          **kwargs)
    assert out.sequences.tolist() == plain.tolist()
    stats = out.speculation_stats
    assert stats.new_tokens == 3 * (plain.shape[1] - 4)
    assert sum(stats.committed_per_step) + 3 == stats.new_tokens  # + the prefill's token of each row
    assert stats.verified_tokens >= sum(stats.committed_per_step)


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_b_custom_criterion_at_batch_3_is_refused_naming_it(models, pad_token_id):
    """A user's StoppingCriteria, no EOS, no pad token: plain generate keeps the stopped rows going and works. Ours
    refuses user criteria at batch > 1 with a message that names them (such a criterion could read the whole batch,
    which a row-by-row loop cannot reproduce), not for want of a pad token."""
    target, drafter = models
    ids = prompts(3, 4, seed=3)
    free = target.generate(ids, max_new_tokens=8, do_sample=False)[:, 4:].tolist()
    token = free[0][2]
    assert any(token not in row for row in free[1:]), "pick another seed: every row stops at the same step"
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=pad_token_id)
    plain = target.generate(ids, stopping_criteria=StoppingCriteriaList([StopOnTokens([token])]), **kwargs)
    assert plain.shape == (3, 12)  # works, generating every row to the end
    refused_before_any_forward(target, drafter, ids, r"custom logits processors / stopping criteria \(StopOnTokens\) "
                               "at batch size > 1", stopping_criteria=StoppingCriteriaList([StopOnTokens([token])]),
                               **kwargs)


# ----- C --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_c_a_prompt_ending_in_a_masked_token_continues_from_generates_positions(seed):
    """Right padding, or a prompt that ends in the pad token with no attention mask (transformers then masks it): plain
    `generate` gives masked slots position 0 and continues from the last prompt position, not from the count of
    real tokens. Ours must decode what it decodes. (A sharpened LM head makes a wrong position change the tokens.)"""
    target = tiny_target("qwen3", seed=seed, vocab_size=VOCAB, attn="eager", sharpen=4)
    drafter = tiny_drafter(target, block_size=4)
    ids = prompts(2, 6, seed=seed)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # row 0 right-padded; row 1 not
    kwargs = dict(max_new_tokens=16, do_sample=False)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    assert target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs).tolist() == plain.tolist()
    pad = int(ids[0, -1])  # no mask: transformers masks the prompt's last token, being the pad token
    plain = target.generate(ids[:1], pad_token_id=pad, **kwargs)
    assert target.generate(ids[:1], pad_token_id=pad, assistant_model=drafter, **kwargs).tolist() == plain.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_scores_choose_the_first_maximum_as_plain_generates_argmax(dtype):
    """Greedy acceptance takes each node's first maximal score, as plain `generate`'s argmax does: with every score
    tied (an LM head of zeros), speculative and plain greedy write the same tokens, in fp32 and bf16 alike."""
    target = tiny_target("llama", seed=3).to(dtype)
    with torch.no_grad():
        target.lm_head.weight.zero_()
    drafter = tiny_drafter(target, block_size=5).to(dtype)
    ids = random_ids(2, 7, rows=2)
    reference = target.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=1)
    assert (reference[:, 7:] == 0).all()  # every score tied: the first token
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=False, pad_token_id=1)
    assert torch.equal(out, reference)
