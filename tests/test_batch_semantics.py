"""Batch > 1 semantics equal to plain `generate` (issue 11, cases A and B), as regression tests.

A: a batch whose prompts all have the same length needs no padding, and transformers then drops the all-ones attention
   mask: batch checks and per-row state must follow the number of rows, never the mask.
B: rows stopped by a stopping criterion with no EOS criterion: plain `generate` pads finished rows only when an EOS
   criterion exists; otherwise it keeps generating them until every row has stopped, and needs no pad token.
"""

import pytest
import torch
from transformers import EosTokenCriteria, StoppingCriteria, StoppingCriteriaList

from differential import RecordingStreamer, char_tokenizer
from helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128


@pytest.fixture(scope="module")
def models(one_torch_thread):
    target = tiny_target("llama", seed=0, vocab_size=VOCAB)
    return target, tiny_drafter(target, block_size=4)


def prompts(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


class StopOnToken(StoppingCriteria):
    """A user's criterion: a row stops after emitting `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


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


def test_a_scores_at_batch_2_without_padding_have_the_batch_shape_or_are_refused(models):
    target, drafter = models
    ids = prompts(2, 5)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    plain = target.generate(ids, **kwargs)
    try:
        ours = target.generate(ids, assistant_model=drafter, **kwargs)
    except ValueError as error:  # a refusal must say what it refuses
        assert "output_scores" in str(error) or "output_logits" in str(error)
        return
    assert ours.sequences.tolist() == plain.sequences.tolist()
    for name in ("scores", "logits"):
        mine, reference = getattr(ours, name), getattr(plain, name)
        assert len(mine) == len(reference) == 4
        for a, b in zip(mine, reference):
            assert a.shape == b.shape == (2, VOCAB)
            assert torch.allclose(a, b, atol=1e-4)


def _streamed(target, drafter, ids, mask):
    streamer = RecordingStreamer()
    kwargs = dict(max_new_tokens=4, do_sample=False, streamer=streamer)
    if mask is not None:
        kwargs["attention_mask"] = mask
    try:
        target.generate(ids, assistant_model=drafter, **kwargs)
    except ValueError as error:
        return "refused", str(error)
    return "streamed", streamer.chunks


def _plain_chunks(target, ids, mask):
    streamer = RecordingStreamer()
    target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, streamer=streamer)
    return streamer.chunks


def test_a_streamer_at_batch_2_is_treated_the_same_with_and_without_padding(models):
    """Refused in both cases (with a message that names streaming), or streamed exactly as plain generate streams."""
    target, drafter = models
    equal = prompts(2, 5)
    padded, mask = equal.clone(), torch.ones_like(equal)
    padded[1, :2], mask[1, :2] = 0, 0
    without, with_padding = _streamed(target, drafter, equal, None), _streamed(target, drafter, padded, mask)
    assert without[0] == with_padding[0], f"without padding: {without}; with padding: {with_padding}"
    if without[0] == "refused":
        assert "stream" in without[1] and "stream" in with_padding[1]
    else:
        assert without[1] == _plain_chunks(target, equal, None)
        assert with_padding[1] == _plain_chunks(target, padded, mask)


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


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_b_custom_criterion_stopping_rows_at_different_steps_matches_plain(models, pad_token_id):
    """A user's StoppingCriteria, no EOS, no pad token: plain generate keeps the stopped rows going and works. Ours
    gives the same tokens, or refuses user criteria at batch > 1 with a message that names them (such a criterion
    could read the whole batch, which a row-by-row loop cannot reproduce)."""
    target, drafter = models
    ids = prompts(3, 4, seed=3)
    free = target.generate(ids, max_new_tokens=8, do_sample=False)[:, 4:].tolist()
    token = free[0][2]
    assert any(token not in row for row in free[1:]), "pick another seed: every row stops at the same step"
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=pad_token_id)
    plain = target.generate(ids, stopping_criteria=StoppingCriteriaList([StopOnToken(token)]), **kwargs)
    try:
        ours = target.generate(ids, assistant_model=drafter,
                               stopping_criteria=StoppingCriteriaList([StopOnToken(token)]), **kwargs)
    except ValueError as error:
        assert "StopOnToken" in str(error) or "stopping criteri" in str(error).lower()
        assert "pad_token_id" not in str(error)
        return
    assert ours.tolist() == plain.tolist()


# ----- C --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_c_a_prompt_ending_in_a_masked_token_continues_from_generates_positions(seed):
    """Right padding, or a prompt that ends in the pad token with no attention mask (transformers then masks it): plain
    `generate` gives masked slots position 0 and continues from the last prompt position, not from the count of
    real tokens. Ours must decode what it decodes. (A sharpened LM head makes a wrong position change the tokens.)"""
    target = tiny_target("qwen3", seed=seed, vocab_size=VOCAB, attn="eager")
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
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
