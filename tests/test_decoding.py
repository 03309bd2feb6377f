"""Lossless speculative decoding through `target.generate(assistant_model=drafter)` on tiny random models (fp32)."""

import sys

import pytest
import torch
from transformers import StoppingCriteriaList

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from helpers import (
    NoisyOracle,
    RecordingStreamer,
    StopOnTokens,
    install_oracle,
    random_ids,
    tiny_drafter,
    tiny_dual_drafter,
    tiny_target,
    two_sample_chi2,
)


def prompt(seed: int, length: int = 12, vocab: int = 128) -> torch.Tensor:
    return random_ids(seed, length, vocab)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_identical_with_random_drafter(kind, block_size, seed):
    target = tiny_target(kind, seed=seed)
    drafter = tiny_drafter(target, block_size=block_size, seed=seed)
    ids = prompt(seed)
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats
    assert stats.new_tokens == 24
    assert sum(stats.committed_per_step) + 1 == stats.new_tokens  # +1: the token emitted by the prefill


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("qwen3", "eager")])
@pytest.mark.parametrize("branches", [0, 2])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.every_step_speculates("asserts tau and forwards of oracle drafts")
def test_greedy_identical_with_oracle_chains_and_trees(monkeypatch, kind, attn, branches, seed):
    target = tiny_target(kind, seed=seed, attn=attn)
    drafter = tiny_drafter(target, block_size=8)
    ids = prompt(seed + 10)
    kwargs = dict(max_new_tokens=40, do_sample=False, repetition_penalty=1.3 if seed % 2 else 1.0)
    ref = target.generate(ids, **kwargs)
    oracle = NoisyOracle(ref, vocab_size=128, noise=0.15, branches=branches, seed=seed)
    install_oracle(monkeypatch, oracle)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats
    assert stats.tau > 1.5, "the oracle's drafts should mostly be accepted"
    assert stats.target_forwards < 40
    if branches:
        assert any(not t.is_chain for t in oracle.trees)


def test_eos_inside_an_accepted_block_stops_exactly(monkeypatch):
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=8)
    ids = prompt(3)
    free = target.generate(ids, max_new_tokens=30, do_sample=False)
    eos = int(free[0, ids.shape[1] + 9])  # a token the target emits mid-way
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert ref.shape[1] < free.shape[1]
    install_oracle(monkeypatch, NoisyOracle(free, vocab_size=128, noise=0.0))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("return_dict, output_scores", [(True, True), (True, False), (False, False)])
@pytest.mark.every_step_speculates("asserts that speculative steps ran (the live controller may choose none on a busy "
                                   "machine: a fresh clone's run beside two busy loops failed so)")
def test_a_stopping_criterion_gets_the_scores_plain_generate_hands_it(monkeypatch, return_dict, output_scores):
    """A criterion receives what `_sample` passes: the scores collected so far when they are returned, else None,
    at every token, also inside a speculative step (which then commits token by token)."""
    from transformers import StoppingCriteria

    class ScoresSeen(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(None if scores is None else len(scores))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    target = tiny_target("qwen3", seed=5)
    drafter = tiny_drafter(target, block_size=6)
    ids = prompt(5)
    free = target.generate(ids, max_new_tokens=16, do_sample=False)
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=return_dict,
                  output_scores=output_scores)
    plain, ours = ScoresSeen(), ScoresSeen()
    target.generate(ids, stopping_criteria=StoppingCriteriaList([plain]), **kwargs)
    install_oracle(monkeypatch, NoisyOracle(free, vocab_size=128, noise=0.1))
    out = target.generate(ids, assistant_model=drafter, stopping_criteria=StoppingCriteriaList([ours]), **kwargs)
    assert ours.seen == plain.seen and len(plain.seen) == 16
    if return_dict:
        assert max(out.speculation_stats.committed_per_step) > 1  # speculative steps too


def test_a_bf16_targets_scores_and_logits_come_back_in_float32_as_plain_generates_do(monkeypatch):
    """Plain `generate` processes a bf16 target's logits in float32 (a copy), and returns them so; so do steps that
    commit token by token."""
    target = tiny_target("qwen3", seed=5).to(torch.bfloat16)
    drafter = tiny_drafter(target, block_size=6).to(torch.bfloat16)
    ids = prompt(5)
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, no_repeat_ngram_size=3)  # a processor that reads the prefix: token by token
    ref = target.generate(ids, **kwargs)
    install_oracle(monkeypatch, NoisyOracle(ref.sequences, vocab_size=128, noise=0.1))
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert {t.dtype for t in (*ref.scores, *ref.logits)} == {torch.float32}
    assert {t.dtype for t in (*out.scores, *out.logits)} == {torch.float32}


def test_custom_stopping_criteria_streamer_and_scores_match_plain_generate(monkeypatch):
    target = tiny_target("qwen3", seed=5)
    drafter = tiny_drafter(target, block_size=6)
    ids = prompt(5)
    free = target.generate(ids, max_new_tokens=30, do_sample=False)
    stop = StoppingCriteriaList([StopOnTokens([int(free[0, ids.shape[1] + 12])])])
    kwargs = dict(max_new_tokens=30, do_sample=False, stopping_criteria=stop, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, no_repeat_ngram_size=3)
    ref_streamer, streamer = RecordingStreamer(), RecordingStreamer()
    ref = target.generate(ids, streamer=ref_streamer, **kwargs)
    install_oracle(monkeypatch, NoisyOracle(free, vocab_size=128, noise=0.1))
    out = target.generate(ids, assistant_model=drafter, streamer=streamer, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits)
    for a, b in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)  # allclose alone broadcasts an empty one
    assert streamer.chunks == ref_streamer.chunks and streamer.ended
    assert isinstance(out, hf_diffspec.SpeculativeDecoderOnlyOutput)
    assert out.speculation_stats.new_tokens == out.sequences.shape[1] - ids.shape[1]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_tiny_budgets_are_never_exceeded(monkeypatch, max_new_tokens):
    target = tiny_target("llama", seed=7)
    drafter = tiny_drafter(target, block_size=16)
    ids = prompt(7)
    ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(target.generate(ids, max_new_tokens=20), vocab_size=128, noise=0.0))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
    assert torch.equal(out, ref)


def test_zero_new_tokens_is_refused_like_plain_generate():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.generate(prompt(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.generate(prompt(0), assistant_model=drafter, max_new_tokens=0)


def test_left_padded_prompt_matches_plain_generate():
    target = tiny_target("llama", seed=8)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.cat([torch.ones(1, 3, dtype=torch.long), prompt(8)], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.every_step_speculates("asserts that the candidate generator drafted")
def test_stock_assisted_decoding_runs_our_candidate_generator(monkeypatch):
    """transformers' own `_assisted_decoding` asks our `DiffusionCandidateGenerator` for every step's candidates
    (our loop never runs), and the instance-level `_get_candidate_generator` is gone afterwards, also after a
    failure inside generation."""
    target = tiny_target("llama", seed=9)
    drafter = tiny_drafter(target, block_size=4)
    ids = prompt(9)
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)

    def fail(*a, **k):
        raise AssertionError("hf_diffspec's loop must not run inside transformers' assisted decoding")

    monkeypatch.setattr(hf_diffspec.generation, "run_speculative", fail)
    callers, drafted = [], []
    get_candidates = DiffusionCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        callers.append(sys._getframe(1).f_code.co_name)
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafted.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    monkeypatch.setattr(DiffusionCandidateGenerator, "get_candidates", spy)
    drafter_forwards = []
    drafter.register_forward_hook(lambda *args: drafter_forwards.append(1))
    out = hf_diffspec.assisted_generate_with_stock_loop(target, drafter, inputs=ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    assert callers and set(callers) == {"_assisted_decoding"}
    assert max(drafted) > 0 and len(drafter_forwards) >= sum(n > 0 for n in drafted)
    assert "_get_candidate_generator" not in target.__dict__

    def broken(self, *args, **kwargs):
        raise RuntimeError("drafting failed")

    monkeypatch.setattr(DiffusionCandidateGenerator, "get_candidates", broken)
    with pytest.raises(RuntimeError, match="drafting failed"):
        hf_diffspec.assisted_generate_with_stock_loop(target, drafter, inputs=ids, max_new_tokens=20, do_sample=False)
    assert "_get_candidate_generator" not in target.__dict__


@pytest.mark.every_step_speculates("compares the drafts of every step")
def test_the_stock_loop_drafts_and_verifies_what_our_loop_does(monkeypatch):
    """In transformers' `_assisted_decoding` our candidate generator drafts from what our loop drafts from at the
    same point: the same anchor token at the same position, the same tokens left, the drafter's context holding the
    target's features at the same positions. At a fixed `num_assistant_tokens` (which the stock loop honours as
    `generate` does), fp32 greedy, both loops verify the same drafts at every step (the last steps' cut by the tokens
    left included) and commit plain `generate`'s tokens."""
    # (a small vocabulary, where this random drafter's drafts are accepted at some steps)
    target = tiny_target("llama", seed=12, vocab_size=16, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=5, seed=4)
    ids = prompt(12, vocab=16)
    kwargs = dict(max_new_tokens=19, do_sample=False, num_assistant_tokens=3)
    drafted, verified, context = {"stock": [], "ours": []}, [], {}
    add_context, get_candidates = DiffusionCandidateGenerator.add_context, DiffusionCandidateGenerator.get_candidates
    propose = DiffusionCandidateGenerator.propose

    def recording_context(self, hidden_states, index, positions, valid=None, all_valid=None):
        seen = positions[0] if valid is None else positions[0][valid[0].bool()]
        context.setdefault(id(self), []).extend(seen.tolist())
        return add_context(self, hidden_states, index, positions, valid, all_valid)

    def stock(self, input_ids, *args, **kw):
        candidates, logits = get_candidates(self, input_ids, *args, **kw)
        if candidates.shape[1] > input_ids.shape[1]:
            verified.append((input_ids.shape[1] - 1, candidates[0, input_ids.shape[1] - 1 :].tolist()))
        return candidates, logits

    def recording_propose(self, root_tokens, root_positions, remaining, *args, **kw):
        trees = propose(self, root_tokens, root_positions, remaining, *args, **kw)
        loop = "stock" if sys._getframe(1).f_code.co_name == "get_candidates" else "ours"
        drafted[loop].append((root_tokens[0], root_positions[0], remaining[0], sorted(context.get(id(self), [])),
                              trees[0].tokens.tolist()))
        return trees

    monkeypatch.setattr(DiffusionCandidateGenerator, "add_context", recording_context)
    monkeypatch.setattr(DiffusionCandidateGenerator, "get_candidates", stock)
    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", recording_propose)
    reference = target.generate(ids, max_new_tokens=19, do_sample=False)
    assert torch.equal(hf_diffspec.assisted_generate_with_stock_loop(target, drafter, inputs=ids, **kwargs), reference)
    assert torch.equal(target.generate(ids, assistant_model=drafter, prompt_lookup_num_tokens=0, **kwargs), reference)
    assert drafted["stock"] == drafted["ours"]
    # the stock loop verified every tree drafted (a tree of the anchor alone is no candidate)
    assert verified == [(position, tokens) for _, position, _, _, tokens in drafted["ours"] if len(tokens) > 1]
    lengths = [len(tokens) - 1 for *_, tokens in drafted["ours"]]
    assert lengths[0] == 3 and 1 in lengths and len(lengths) > 5, lengths
    # drafts were accepted at some steps (commits of several tokens)
    positions = [position for _, position, *_ in drafted["ours"]]
    assert any(b - a > 1 for a, b in zip(positions, positions[1:])), positions


def test_the_stock_loop_refuses_trees_naming_the_fix():
    """transformers' assisted decoding verifies chains only: a best-first tree drafter in it, or a dual drafter's
    generator asked for candidates, is refused with the way out (our `generate`, or chains)."""
    from hf_diffspec.runtime.drafting import candidate_generator_for

    target = tiny_target("llama", seed=13)
    trees = tiny_drafter(target, block_size=4, seed=13, draft_tree_budget=6)
    ids = prompt(13)
    with pytest.raises(ValueError, match=r"^transformers' assisted decoding verifies chains only; use generate\(\) for "
                                         r"draft trees \(or set drafter.config.draft_tree_budget = None\)$"):
        hf_diffspec.assisted_generate_with_stock_loop(target, trees, inputs=ids, max_new_tokens=4, do_sample=False)
    dual = tiny_dual_drafter(target, block_size=6, seed=13)
    with pytest.raises(ValueError, match=r"^transformers' assisted decoding verifies chains only; use generate\(\) for D²SD trees$"):
        hf_diffspec.assisted_generate_with_stock_loop(target, dual, inputs=ids, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match=r"^transformers' assisted decoding verifies chains only; use generate\(\) for D²SD trees$"):
        candidate_generator_for(dual, target, num_draft_tokens=3).get_candidates(ids)


def test_other_assistants_keep_transformers_behaviour(monkeypatch):
    target = tiny_target("llama", seed=10)
    assistant = tiny_target("llama", seed=11, layers=1)
    ids = prompt(10)

    def fail(*a, **k):
        raise AssertionError("hf_diffspec's loop must not run for a plain assistant model")

    monkeypatch.setattr(hf_diffspec.generation, "run_speculative", fail)
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=assistant, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.every_step_speculates("asserts drafts were accepted at every step")
def test_sampling_is_exactly_the_targets_distribution(monkeypatch):
    """Same seed -> same samples as plain sampling (the loop consumes randomness like `_sample`), and the marginal
    of a later token matches plain sampling across many seeds."""
    vocab = 16
    target = tiny_target("llama", seed=12, vocab_size=vocab, sharpen=8)  # so that drafts are sometimes accepted
    drafter = tiny_drafter(target, block_size=4)
    ids = prompt(12, vocab=vocab)
    greedy = target.generate(ids, max_new_tokens=8, do_sample=False)
    oracle = NoisyOracle(greedy, vocab_size=vocab, noise=0.0)
    install_oracle(monkeypatch, oracle)
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=0.9, top_k=0)
    n, same = 400, 0
    plain_counts, spec_counts = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for seed in range(n):
        torch.manual_seed(seed)
        ref = target.generate(ids, **kwargs)
        torch.manual_seed(seed)
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
        same += torch.equal(ref, out.sequences)
        accepted += sum(c - 1 for c in out.speculation_stats.committed_per_step)
        torch.manual_seed(10_000 + seed)  # independent draws for the distribution comparison
        plain_counts[target.generate(ids, **kwargs)[0, -1]] += 1
        spec_counts[out.sequences[0, -1]] += 1
    assert accepted > 50, "the check is only meaningful if drafts get accepted"
    # same seed, same samples: 400 of 400 measured (a sampling temperature 1% off leaves 7 of 400 different)
    assert same == n
    # two-sample chi-square on the last token's marginal (df <= 15); 40 is beyond the 0.999 quantile (~37.7)
    chi2 = two_sample_chi2(plain_counts, spec_counts)
    assert chi2 < 40, f"chi2={chi2:.1f}"


def test_beam_search_is_rejected():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="beam search"):
        target.generate(prompt(0), assistant_model=drafter, max_new_tokens=4, num_beams=2)


def test_prompt_at_the_context_limit_is_rejected():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(2, 128, (1, target.config.max_position_embeddings))
    with pytest.raises(ValueError, match="context"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4)


def test_drafter_for_another_target_is_rejected():
    target = tiny_target("llama")
    other = tiny_target("llama", vocab_size=96)
    drafter = tiny_drafter(other)
    with pytest.raises(ValueError, match="different target"):
        target.generate(prompt(0), assistant_model=drafter, max_new_tokens=4)
