"""Batched speculative decoding: left-padded prompts of mixed lengths, ragged acceptance, rows finishing at different
times. Every row must equal that prompt generated alone by plain `generate` (fp32)."""

import pytest
import torch

from hf_diffspec.runtime.drafting import PrefixTreeCandidateGenerator
from helpers import (
    NoisyOracle,
    ProposalRecorder,
    install_oracle,
    marginal_counts,
    oracle_drafter_outputs,
    steer_steps,
    tiny_drafter,
    tiny_dual_drafter,
    tiny_target,
    two_sample_chi2,
)

PAD = 0


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p) :] = p
        mask[row, longest - len(p) :] = 1
    return ids, mask


def mixed_prompts(seed: int, lengths=(3, 14, 7, 1, 10)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g) for n in lengths]


def rows_alone(target, prompts, **kwargs) -> list[list[int]]:
    return [target.generate(p[None], **kwargs)[0].tolist() for p in prompts]


def strip(row: torch.Tensor, prompt_length: int, padded_length: int, pad: int | None) -> list[int]:
    """A batched output row without its left padding and, when `pad` is given, without its right padding."""
    tokens = row[padded_length - prompt_length :].tolist()
    while pad is not None and len(tokens) > prompt_length and tokens[-1] == pad:
        tokens.pop()
    return tokens


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "eager")])
@pytest.mark.parametrize("seed", range(2))
def test_each_row_equals_plain_greedy_alone_with_a_random_drafter(kind, attn, seed):
    target = tiny_target(kind, seed=seed, attn=attn)
    drafter = tiny_drafter(target, block_size=4, seed=seed)
    prompts = mixed_prompts(seed)
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    alone = rows_alone(target, prompts, max_new_tokens=20, do_sample=False)
    assert [strip(out.sequences[r], len(p), ids.shape[1], None) for r, p in enumerate(prompts)] == alone
    assert out.speculation_stats.new_tokens == 20 * len(prompts)


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
@pytest.mark.parametrize("branches", [0, 2])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.every_step_speculates("asserts tau and verified slots of oracle drafts")
def test_ragged_acceptance_and_rows_finishing_early(monkeypatch, kind, attn, branches, seed):
    """An oracle that is right most of the time makes rows accept different numbers of tokens per step (chains and
    trees); an EOS that some rows emit makes them finish at different times."""
    target = tiny_target(kind, seed=seed, attn=attn)
    drafter = tiny_drafter(target, block_size=8)
    prompts = mixed_prompts(seed + 5)
    free = rows_alone(target, prompts, max_new_tokens=30, do_sample=False)
    eos = free[0][len(prompts[0]) + 6]  # row 0 stops after 7 tokens; other rows only if they emit it too
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                  repetition_penalty=1.2 if seed else 1.0)
    alone = rows_alone(target, prompts, **kwargs)
    assert len({len(a) for a in alone}) > 1, "rows should finish at different times"
    oracle = NoisyOracle([torch.tensor(f) for f in rows_alone(target, prompts, **{**kwargs, "eos_token_id": None})],
                         vocab_size=128, noise=0.2, branches=branches, seed=seed)
    install_oracle(monkeypatch, oracle)
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    stats, out = out.speculation_stats, out.sequences
    got = [out[r, ids.shape[1] - len(p) :].tolist()[: len(alone[r])] for r, p in enumerate(prompts)]
    assert got == alone
    for r, a in enumerate(alone):  # what follows a finished row is padding, as plain generate pads it
        assert set(out[r, ids.shape[1] - len(prompts[r]) + len(a) :].tolist()) <= {PAD}
    assert stats.tau > 1.5 and len(set(stats.committed_per_step)) > 1, "acceptance should be high and ragged"
    assert stats.verified_slots >= stats.verified_tokens
    if branches:
        assert any(not t.is_chain for t in oracle.trees)


@pytest.mark.every_step_speculates("asserts which steps were plain (a fixed pattern, not the clock)")
def test_plain_steps_process_rows_of_one_length_together(monkeypatch):
    """Steps without drafts run the logits processors once per group of rows in step (as plain `generate` runs them
    once per batch), not once per row, and still give each row what it gets alone. The oracle's drafts on every
    other step leave rows out of step: then the groups split."""
    from itertools import cycle

    from transformers import RepetitionPenaltyLogitsProcessor

    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=4)
    prompts = mixed_prompts(11, lengths=(6, 6, 6, 6))  # equal lengths: the rows start in step
    kwargs = dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    alone = rows_alone(target, prompts, **kwargs)
    oracle = NoisyOracle([torch.tensor(a) for a in alone], vocab_size=128, noise=0.5, seed=3)
    install_oracle(monkeypatch, oracle)
    steps = cycle([False, False, True])
    steer_steps(monkeypatch, steps)
    rows_seen = []
    penalty = RepetitionPenaltyLogitsProcessor.__call__
    monkeypatch.setattr(RepetitionPenaltyLogitsProcessor, "__call__",
                        lambda self, ids, scores: rows_seen.append(ids.shape[0]) or penalty(self, ids, scores))
    from hf_diffspec.runtime import batch

    group_lengths = []  # the committed lengths of the rows of each group, as the processors get them
    commit = batch.commit_in_step
    monkeypatch.setattr(batch, "commit_in_step", lambda committers, *args, **kwargs: group_lengths.append(
        {c.length for c in committers}) or commit(committers, *args, **kwargs))
    out = target.generate(torch.stack(prompts), assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert out.sequences.tolist() == alone
    # one length a group: the processors read every row's exact prefix (a group of rows out of step would hand
    # them the first row's length: the others' prefixes cut or padded)
    assert group_lengths and all(len(lengths) == 1 for lengths in group_lengths)
    assert 4 in rows_seen  # a plain step while all rows were in step: one call for the batch
    assert any(1 < n < 4 for n in rows_seen), "drafts accepted unevenly should leave groups of rows in step"
    assert out.speculation_stats.plain_steps > 0 and len(set(out.speculation_stats.committed_per_step)) > 1


@pytest.mark.parametrize("variant", ["vp", "resample"])
@pytest.mark.every_step_speculates("asserts the D2SD trees each step verified")
def test_d2sd_trees_in_a_batch(monkeypatch, variant):
    target = tiny_target("qwen3", seed=4, sharpen=4)
    dual = tiny_dual_drafter(target, block_size=8, seed=1, vp_seed=2 if variant == "vp" else None, num_branches=3,
                             tree_budget=10, branches_from_first_pass=variant == "resample")
    prompts = mixed_prompts(7, lengths=(5, 9, 2))
    ids, mask = left_padded(prompts)
    alone = rows_alone(target, prompts, max_new_tokens=24, do_sample=False)
    # the first drafter knows each row's continuation: trees of every row are walked deep, in one batch
    oracle_drafter_outputs(monkeypatch, dual.first, target, alone)
    proposals = ProposalRecorder(monkeypatch, PrefixTreeCandidateGenerator)
    out = target.generate(ids, attention_mask=mask, assistant_model=dual, max_new_tokens=24, do_sample=False,
                          return_dict_in_generate=True)
    assert [strip(out.sequences[r], len(p), ids.shape[1], None) for r, p in enumerate(prompts)] == alone
    assert all(len(trees) == 3 for _, trees in proposals.steps)
    assert any(not t.is_chain for t in proposals.trees)
    assert out.speculation_stats.tau > 3, "the oracle's main chains should be accepted"


def test_batched_sampling_is_exactly_the_targets_distribution(monkeypatch):
    """Each row of a batched sampled generation is distributed as that prompt sampled alone (chi-square on the
    marginals of its 2nd and last new tokens), with drafts drawn and verified by rejection sampling."""
    vocab = 16
    target = tiny_target("llama", seed=12, vocab_size=vocab, sharpen=8)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8)]
    ids, mask = left_padded(prompts)
    kwargs = dict(max_new_tokens=5, do_sample=True, temperature=0.9, top_k=0)
    n = 300
    spec = torch.zeros(len(prompts), 2, vocab)
    for seed in range(n):
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kwargs)
        for r in range(len(prompts)):
            spec[r, 0, out[r, ids.shape[1] + 1]] += 1
            spec[r, 1, out[r, -1]] += 1
    for r, p in enumerate(prompts):
        plain = marginal_counts(target, p[None], vocab, n, 50_000, **kwargs)
        for slot in range(2):
            assert two_sample_chi2(plain[slot], spec[r, slot]) < 40  # 0.999 quantile of chi2(15) ~ 37.7


def test_bad_batches_get_clear_errors_and_right_padding_runs_as_plain():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids, mask = left_padded(mixed_prompts(0, lengths=(4, 6)))
    # right padding is a user error plain generate warns about, yet runs: ours runs it identically
    right = dict(input_ids=ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=6, do_sample=False)
    assert torch.equal(target.generate(**right, assistant_model=drafter), target.generate(**right))
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] are empty"):
        target.generate(ids, attention_mask=empty, assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="output_scores"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, output_scores=True,
                        return_dict_in_generate=True)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                        num_assistant_tokens_schedule="heuristic")
