"""Randomized differential suite: `target.generate(..., assistant_model=drafter)` against plain `target.generate(...)`.

Plain `generate` is the reference: whatever it does with a combination of options (pads stopped rows or not, shapes
of scores, streamer chunks, batch ids given to `prefix_allowed_tokens_fn`) is what speculative decoding must do.

A seeded generator draws cases (`make_case(seed, number)`, the same case on every machine) over
- targets: tiny random Llama and Qwen3 (`helpers.tiny_target`), sdpa or eager attention, 1-3 layers, vocabularies of
  16-128 tokens, LM head scaled up (sharper logits make random drafts agree with the target more often); in 40% of
  cases instead a 4-layer Gemma 3, Gemma 4, gpt-oss, Qwen3-MoE or Mistral (`helpers.tiny_family_target`: sliding
  windows of 2-6 tokens, exceeded by most cases, and MoE); of the other cases, half get a tiny Qwen3.5 or
  Qwen3.5-MoE (linear attention beside full attention, `helpers.tiny_hybrid_target`, at least 2 layers), with any
  drafter and batch: drawn from a stream of their own, so that the other draws of a case stay as they were;
- drafters: an untrained DFlash drafter (block 2-8), a noisy oracle (the target's own continuation, corrupted at a
  random rate, with wrong sibling branches: a real tree), a D²SD dual drafter (with or without a VP drafter,
  random branches, depth and budget);
- batches of 1-4 rows: equal prompt lengths (with or without an all-ones attention mask; transformers drops it) and
  left-padded prompts with an attention mask (ragged, or equal lengths with extra padding columns);
- runtime: the speculation controller speculates at every step, alternately, or at seeded random steps (plain steps in
  between); draft lengths fixed, or chosen by the cost model from a synthetic verify-cost profile; or, in 15% of
  cases (a stream of their own), a user's first call: the profile measured on first use into an empty cache and the
  live controller (these cases do not rerun step for step: the controller follows the clock); and, in 25% of the cases of
  full-attention targets (a stream of their own), the capture-ready step (`cache_implementation="static"`); and, in
  20% of the greedy cases (a stream of their own), the speculative call in 2-4 threads at once on the same target
  and drafter beside a thread running the plain call, every thread's output compared with plain generate's;
- options: max_new_tokens or max_length, min_new_tokens or min_length, repetition_penalty, no_repeat_ngram_size,
  bad_words_ids, suppress_tokens, begin_suppress_tokens, sequence_bias, exponential_decay_length_penalty,
  forced_eos_token_id, renormalize_logits, eos_token_id (one or two tokens, picked from the plain continuation so
  that rows stop at different steps) or none, pad_token_id or none, user StoppingCriteria subclasses (row by row,
  batch-index aware, stateful), a user EosTokenCriteria, stop strings, user LogitsProcessor subclasses (the same
  three kinds), prefix_allowed_tokens_fn, num_assistant_tokens, return_dict_in_generate with output_scores /
  output_logits, a streamer, use_cache=False; as keywords or (sometimes) as one GenerationConfig.

Greedy cases (fp32) compare sequences (identical), scores and logits when requested (same shapes, same -inf entries,
finite values within 1e-4: the verify forward computes them with another shape) and the streamer's chunks.

Sampling cases (a few per 100) check the EXACT distribution: for a vocabulary of 8-16 tokens and 1-3 new tokens, the
target's distribution over output sequences is enumerated step by step from plain `generate`'s own processed scores
(one step from every possible prefix, so temperature, top-k, top-p, min-p, repetition penalty, ... are transformers'
own), then 400 samples are drawn from the speculative loop (batches of 1, 8 or 20 copies of the prompt, one seed per
call). A sample the exact distribution gives probability 0 fails the case outright. Otherwise Pearson's chi-square
test runs on the whole sequences and on each position's token (the marginals keep power when the joint distribution is
spread thin), each on bins of expected count >= 10 (less likely outcomes pooled into one bin); the case fails when one
of its k tests has p < 1e-5 / k. The tests share a nominal false-alarm rate of 1e-5 per case (union bound); with
expected counts >= 10 the chi-square approximation is accurate to well within a factor of 10 that far in the tail, so
the false-alarm rate stays below 1e-4 per case (a 1,000-case run has ~40 sampling cases: a false alarm in well under 1%
of runs).

Outcomes of a case:
- identical;
- refused: the speculative call raised a `ValueError` that names a feature on `EXPECTED_REFUSALS`, used at batch > 1
  (where plain generate's result cannot be reproduced row by row); counted per feature;
- divergence: any difference from plain generate;
- error: any other exception from the speculative call while plain generate succeeded (including a refusal that is
  not on the list);
- plain error: plain generate itself refused the drawn options (the generator avoids these; counted apart).

Run it (from the repository root):
    python tests/differential.py --cases 1000 --seed 0 --jobs 2
    python tests/differential.py --seed 0 --case 17          # one case again, with its full description
`tests/test_differential.py` runs a fast seeded subset in CI.
"""

import argparse
import contextlib
import dataclasses
import itertools
import logging
import math
import random
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `helpers` when run as a script

import torch  # noqa: E402
from transformers import (  # noqa: E402
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.utils import logging as hf_logging  # noqa: E402

import hf_diffspec  # noqa: E402
from helpers import (  # noqa: E402
    FAMILIES,
    NoisyOracle,
    RecordingStreamer,
    StopOnTokens,
    char_tokenizer,
    install_oracle,
    run_in_threads,
    steer_steps,
    tiny_drafter,
    tiny_dual_drafter,
    tiny_family_target,
    tiny_hybrid_target,
    tiny_target,
)

SAMPLES = 400  # draws per sampling case
FIRST_USE_SHARE = 0.15  # cases that run as a user's first call (first-use profile, live controller)
# cases of full-attention targets whose speculative call passes cache_implementation="static" (the capture-ready step)
STATIC_CACHE_SHARE = 0.25
FULL_ATTENTION_KINDS = ("llama", "qwen3", "qwen3_moe")
# greedy cases whose speculative call runs in 2-4 threads at once on the same target and drafter, beside a thread
# running the plain call (a stream of their own)
THREADS_SHARE = 0.2
# cases that draft each drafter step's successor ahead of its read (`drafting.draft_ahead`, on by default where a read
# waits for the device), whatever the controller expects
DRAFT_AHEAD_SHARE = 0.5
MIN_EXPECTED = 10  # chi-square bins: expected count at least this
P_VALUE_FLOOR = 1e-5  # a sampling case fails below this p-value
SCORE_TOLERANCE = 1e-4

# What the speculative loop may refuse at batch > 1, because plain generate's result there cannot be reproduced row by
# row: name -> (does the case use it, words one of which a clear refusal contains). Any other refusal is an error.
EXPECTED_REFUSALS = {
    "output_scores/output_logits": (lambda o: o.get("output_scores") or o.get("output_logits"),
                                    ("output_scores", "output_logits")),
    "streamer": (lambda o: o.get("streamer"), ("stream",)),
    "user logits processor": (lambda o: o.get("logits_processor"), ("logits processor", "logits_processor")),
    "user stopping criteria": (lambda o: o.get("stop_criterion"), ("stopping criteri",)),
    # a prompt row whose tokens all equal the pad token, passed without a mask: generate masks the whole row (a row
    # with nothing to attend to, which the loop refuses before the first forward)
    "empty prompt row": (lambda o: o.get("pad_token_id") is not None, ("are empty",)),
}


# ----- user-defined generate hooks (what a user would write) --------------------------------------------------------
class StopAtRowLengths(StoppingCriteria):
    """Row i stops once it is `lengths[i]` tokens long: reads the batch index."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([input_ids.shape[1] >= self.lengths[i % len(self.lengths)]
                             for i in range(input_ids.shape[0])], device=input_ids.device)


class StopAfterCalls(StoppingCriteria):
    """Every row stops on the `calls`-th call: keeps state across calls."""

    def __init__(self, calls):
        self.calls, self.seen = calls, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        return torch.full((input_ids.shape[0],), self.seen >= self.calls, dtype=torch.bool, device=input_ids.device)


class BanFollower(LogitsProcessor):
    """Bans token (last + 1) % vocab in every row (row by row, stateless)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        rows = torch.arange(scores.shape[0], device=scores.device)
        scores[rows, (input_ids[:, -1] + 1) % scores.shape[1]] = -float("inf")
        return scores


class RowBias(LogitsProcessor):
    """Favours token (3 + 7 * i) % vocab in row i: reads the batch index."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for i in range(scores.shape[0]):
            scores[i, (3 + 7 * i) % scores.shape[1]] += 5.0
        return scores


class CallCountBias(LogitsProcessor):
    """Favours token (number of calls so far) % vocab: keeps state across calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.calls % scores.shape[1]] += 5.0
        self.calls += 1
        return scores


USER_PROCESSORS = {"ban_follower": BanFollower, "row_bias": RowBias, "call_count_bias": CallCountBias}


class AllowedTokens:
    """A `prefix_allowed_tokens_fn` that depends on the batch id and the last token."""

    def __init__(self, vocab_size: int, modulus: int):
        self.vocab_size, self.modulus = vocab_size, modulus

    def __call__(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        last = int(input_ids[-1])
        return [t for t in range(self.vocab_size) if (t + last + batch_id) % self.modulus == 0] or [batch_id]


def _gate_steps(pattern: str, seed: int):
    """Whether each loop step speculates: always, alternately, or at random (seeded)."""
    if pattern == "always":
        return itertools.repeat(True)
    if pattern == "alternate":
        return itertools.cycle([True, False])
    rng = random.Random(seed)
    return iter(lambda: rng.random() < 0.6, None)


@contextlib.contextmanager
def patched_runtime(case: "Case", target, oracle: NoisyOracle | None):
    """The one place that adapts the runtime to a case, for the speculative calls inside the block:
    - drafting goes to `oracle` when given (`helpers.install_oracle`);
    - verify-cost profiles come from an empty cache of their own (no profile measured, none found from other runs),
      holding the case's synthetic profile if it has one, so the cost model chooses draft lengths;
    - the speculation controller (each step's kind, chosen from wall-clock timings) follows the case's fixed
      pattern instead, so that a case reruns identically;
    - except in first-use cases (gate "live"): then nothing is switched off, as in a user's first call: the profile
      is measured into the empty cache and the live controller chooses each step."""
    import pytest
    from hf_diffspec.runtime.control_profiles import save_profile
    from hf_diffspec.runtime.control_state import reset_speculation_state

    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as cache:
        patch.setenv("HF_DIFFSPEC_CACHE", cache)
        patch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1" if case.runtime.get("draft_ahead") else "0")
        if case.runtime.get("draft_ahead"):
            from hf_diffspec.runtime.control_speculation import SpeculationController

            patch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)
        if case.runtime["gate"] == "live":  # nothing switched off: as a user's first call runs
            patch.delenv("HF_DIFFSPEC_AUTO_PROFILE", raising=False)
            reset_speculation_state()  # no profile or controller from earlier cases in this process
            if oracle is not None:
                install_oracle(patch, oracle)
            yield
            return
        patch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")
        profile = case.runtime["profile"]
        if profile is not None:
            base, per_slot = profile
            save_profile(target, {rows: {n: base + per_slot * n * rows for n in (1, 2, 4, 8, 16)}
                                  for rows in (1, 2, 4, 8)})
        steer_steps(patch, _gate_steps(case.runtime["gate"], case.seed * 31 + case.number))
        if oracle is not None:
            install_oracle(patch, oracle)
        yield


# ----- cases -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    seed: int
    number: int
    sampling: bool
    target: dict  # kind, attn, vocab_size, layers, seed, sharpen
    drafter: dict  # kind (random | oracle | dual), block_size, seed, and the kind's own settings
    prompt_lengths: list[int]
    pass_mask: bool  # give an attention mask even when the prompts need no padding
    extra_padding: int  # left padding columns added to every row (a padded batch even of equal lengths)
    runtime: dict  # gate: always | alternate | seeded; profile: None or (seconds per verify, per verified slot)
    options: dict  # JSON-like; stops that depend on the plain continuation are resolved when the case runs

    @property
    def rows(self) -> int:
        return len(self.prompt_lengths)

    @property
    def padded(self) -> bool:
        return len(set(self.prompt_lengths)) > 1 or self.extra_padding > 0

    def describe(self) -> str:
        t, d = self.target, self.drafter
        drafter = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("kind", "seed"))
        shape = f"batch {self.rows} " + (f"padded {self.prompt_lengths}+{self.extra_padding}" if self.padded else
                                          f"equal {self.prompt_lengths[0]}" + (" +mask" if self.pass_mask else ""))
        options = " ".join(f"{k}={v}" for k, v in self.options.items())
        runtime = f"gate={self.runtime['gate']}" + (f" profile={self.runtime['profile']}"
                                                      if self.runtime["profile"] else "")
        runtime += " static-cache" if self.runtime.get("static_cache") else ""
        runtime += " draft-ahead" if self.runtime.get("draft_ahead") else ""
        runtime += f" threads={self.runtime['threads']}" if self.runtime.get("threads") else ""
        return (f"case {self.number} (seed {self.seed}, {'sampling' if self.sampling else 'greedy'}): "
                f"{t['kind']}/{t['attn']} V={t['vocab_size']} layers={t['layers']} x{t['sharpen']}"
                + (f" window={t['window']}" if "window" in t else "") + " | "
                f"{d['kind']}({drafter}) {runtime} | {shape} | {options}")


def make_case(seed: int, number: int) -> Case:
    """Case `number` of the suite seeded `seed`: a pure function of both."""
    rng = random.Random(f"hf-diffspec differential {seed} {number}")
    sampling = rng.random() < 0.04
    vocab = rng.randint(8, 16) if sampling else rng.randint(16, 128)
    target = dict(kind=rng.choice(["llama", "qwen3"]), attn=rng.choice(["sdpa", "eager"]), vocab_size=vocab,
                  layers=rng.randint(1, 3), seed=rng.randrange(10**6),
                  sharpen=rng.choice([3, 6, 10] if sampling else [1, 1, 2, 4, 8]))
    block = rng.randint(2, 8)
    kind = rng.choices(["random", "oracle", "dual"], weights=[35, 35, 30])[0]
    drafter = dict(kind=kind, block_size=block, seed=rng.randrange(10**6))
    if kind == "oracle":
        drafter.update(noise=rng.choice([0.0, 0.1, 0.3, 0.6]), branches=rng.randint(0, 3))
    if kind == "dual":
        vp = rng.random() < 0.5
        drafter.update(vp=vp, num_branches=rng.randint(1, block - 1),
                       max_depth=rng.choice([None, rng.randint(1, block - 1)]), tree_budget=rng.randint(2, 16),
                       branch_length=rng.randint(1, 4), branches_from_first_pass=not vp and rng.random() < 0.3)
    if sampling:
        rows = rng.choice([1, 8, 20])
        lengths = [rng.randint(2, 6)] * rows
        options = _sampling_options(rng, vocab)
    else:
        rows = rng.randint(1, 4)
        if rng.random() < 0.5:
            lengths = [rng.randint(1, 8)] * rows
        else:
            lengths = [rng.randint(1, 8) for _ in range(rows)]
        options = _greedy_options(rng, vocab, rows)
    pass_mask = not sampling and rng.random() < 0.5
    extra_padding = 0 if sampling or rng.random() < 0.8 else rng.randint(1, 2)
    runtime = dict(gate=rng.choices(["always", "alternate", "seeded"], weights=[70, 15, 15])[0],
                   profile=(round(rng.uniform(1e-3, 1e-2), 4), round(rng.uniform(0, 1e-3), 5))
                   if rng.random() < 0.2 else None)
    if rng.random() < 0.4:  # drawn last: the other draws of a case stay as they were before families were added
        target.update(kind=rng.choice(FAMILIES), layers=4, window=rng.randint(2, 6))
    hybrid = random.Random(f"hf-diffspec differential linear attention {seed} {number}")
    if target["kind"] not in FAMILIES and hybrid.random() < 0.5:
        target["kind"] = hybrid.choice(["qwen3_5", "qwen3_5_moe"])
    # a user's first call: the profile measured on first use into an empty cache, the live gates (a stream of its own)
    if random.Random(f"hf-diffspec differential first use {seed} {number}").random() < FIRST_USE_SHARE:
        runtime = dict(gate="live", profile="first use")
    # the capture-ready step, on targets whose layers all attend fully (a stream of its own)
    if target["kind"] in FULL_ATTENTION_KINDS and \
            random.Random(f"hf-diffspec differential static cache {seed} {number}").random() < STATIC_CACHE_SHARE:
        runtime["static_cache"] = True
    if random.Random(f"hf-diffspec differential draft ahead {seed} {number}").random() < DRAFT_AHEAD_SHARE:
        runtime["draft_ahead"] = True
    # calls in several threads at once (a stream of its own)
    threads = random.Random(f"hf-diffspec differential threads {seed} {number}")
    if not sampling and threads.random() < THREADS_SHARE:
        runtime["threads"] = threads.randint(2, 4)
    return Case(seed, number, sampling, target, drafter, lengths, pass_mask, extra_padding, runtime, options)


def _greedy_options(rng: random.Random, vocab: int, rows: int) -> dict:
    o = {}
    if rng.random() < 0.2:
        o["max_length_extra"] = new = rng.randint(1, 8)  # max_length = padded prompt length + this
    else:
        o["max_new_tokens"] = new = rng.randint(1, 10)

    def token():
        return rng.randrange(2, vocab)

    def from_plain():  # a token of the plain continuation: row, step (resolved when the case runs)
        return [rng.randrange(rows), rng.randrange(new)]

    if rng.random() < 0.25:
        o["repetition_penalty"] = round(rng.uniform(1.05, 2.0) if rng.random() < 0.8 else rng.uniform(0.7, 0.95), 3)
    if rng.random() < 0.15:
        o["no_repeat_ngram_size"] = rng.randint(1, 3)
    if rng.random() < 0.15:
        o["bad_words_ids"] = [[token() for _ in range(rng.randint(1, 2))] for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.15:
        o["suppress_tokens"] = rng.sample(range(2, vocab), rng.randint(1, 3))
    if rng.random() < 0.05:
        o["begin_suppress_tokens"] = rng.sample(range(2, vocab), rng.randint(1, 2))
    if rng.random() < 0.05:
        o["sequence_bias"] = [[[token() for _ in range(rng.randint(1, 2))], round(rng.uniform(-4, 4), 2)]]
    if rng.random() < 0.35:
        o["eos_from_plain"] = from_plain()
        if rng.random() < 0.2:
            o["second_eos"] = token()
        if rng.random() < 0.3:
            o["min_new_tokens"] = rng.randint(1, new)
        elif rng.random() < 0.1:
            o["min_length_extra"] = rng.randint(1, new)  # min_length = padded prompt length + this
        if rng.random() < 0.1:
            o["exponential_decay_length_penalty"] = [rng.randint(0, 3), round(rng.uniform(1.05, 2.0), 2)]
    if rng.random() < 0.04:
        o["forced_eos_token_id"] = token()
    if rng.random() < 0.05:
        o["renormalize_logits"] = True
    if rng.random() < 0.45:
        o["pad_token_id"] = rng.choice([0, token()])
    if rng.random() < 0.15:
        kind = rng.choice(["tokens", "row_lengths", "call_count"])
        if kind == "tokens":
            o["stop_criterion"] = ["tokens", from_plain()]
        elif kind == "row_lengths":
            o["stop_criterion"] = ["row_lengths", [rng.randint(1, new) for _ in range(rows)]]  # new tokens per row
        else:
            o["stop_criterion"] = ["call_count", rng.randint(1, new)]
    if rng.random() < 0.05 and "pad_token_id" in o:  # plain generate needs a pad token with an EOS criterion
        o["eos_criterion_from_plain"] = from_plain()
    if rng.random() < 0.08:
        o["stop_string_from_plain"] = from_plain() + [rng.randint(1, 2)]  # row, step, tokens
    if rng.random() < 0.08:
        o["logits_processor"] = rng.choice(sorted(USER_PROCESSORS))
    if rng.random() < 0.1:
        o["prefix_allowed_modulus"] = rng.randint(2, 4)
    if rng.random() < 0.15:
        o["num_assistant_tokens"] = rng.randint(1, 8)
    if rng.random() < 0.15:
        o["return_dict_in_generate"] = True
        o["output_scores"] = rng.random() < 0.6
        o["output_logits"] = rng.random() < 0.5
    if rng.random() < 0.07:
        o["streamer"] = True
    if rng.random() < 0.02:
        o["use_cache"] = False
    if rng.random() < 0.1:
        o["as_generation_config"] = True  # the options in a GenerationConfig object instead of keywords
    return o


def _sampling_options(rng: random.Random, vocab: int) -> dict:
    o = {"do_sample": True, "max_new_tokens": rng.randint(1, 3), "temperature": round(rng.uniform(0.6, 1.5), 3),
         "top_k": rng.randint(2, vocab - 1) if rng.random() < 0.5 else 0}
    if rng.random() < 0.4:
        o["top_p"] = round(rng.uniform(0.5, 0.95), 3)
    if rng.random() < 0.25:
        o["repetition_penalty"] = round(rng.uniform(1.05, 2.0), 3)
    if rng.random() < 0.15:
        o["no_repeat_ngram_size"] = rng.randint(1, 2)
    if rng.random() < 0.15:
        o["min_p"] = round(rng.uniform(0.02, 0.2), 3)
    if rng.random() < 0.2:
        o["suppress_tokens"] = rng.sample(range(2, vocab), rng.randint(1, 2))
    if rng.random() < 0.3:
        o["eos_token_id"] = rng.randrange(2, vocab)
        o["pad_token_id"] = rng.choice([0, o["eos_token_id"]])
    if rng.random() < 0.15:
        o["num_assistant_tokens"] = rng.randint(1, 6)
    return o


# ----- building what a case runs ------------------------------------------------------------------------------------
def build_target(case: Case):
    t = case.target
    if t["kind"] in FAMILIES:
        return tiny_family_target(t["kind"], seed=t["seed"], vocab_size=t["vocab_size"], window=t["window"],
                                  attn=t["attn"], sharpen=t["sharpen"])
    build = tiny_hybrid_target if t["kind"].startswith("qwen3_5") else tiny_target
    return build(t["kind"], seed=t["seed"], vocab_size=t["vocab_size"], attn=t["attn"], layers=t["layers"],
                       sharpen=t["sharpen"])


def build_drafter(case: Case, target):
    d = case.drafter
    if d["kind"] != "dual":
        return tiny_drafter(target, block_size=d["block_size"], seed=d["seed"])
    return tiny_dual_drafter(
        target, block_size=d["block_size"], seed=d["seed"], vp_seed=d["seed"] + 1 if d["vp"] else None,
        num_branches=d["num_branches"], max_depth=d["max_depth"], tree_budget=d["tree_budget"],
        branch_length=d["branch_length"], branches_from_first_pass=d["branches_from_first_pass"])


def build_inputs(case: Case) -> dict:
    """Prompts of the case's lengths, left-padded with 0 under an attention mask when their lengths differ."""
    vocab = case.target["vocab_size"]
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + case.number)
    longest = max(case.prompt_lengths) + case.extra_padding
    if case.sampling:  # every row the same prompt: every row is a draw from one distribution
        prompt = torch.randint(2, vocab, (longest,), generator=g)
        return {"input_ids": prompt.repeat(case.rows, 1)}
    ids = torch.zeros(case.rows, longest, dtype=torch.long)
    mask = torch.zeros(case.rows, longest, dtype=torch.long)
    for row, n in enumerate(case.prompt_lengths):
        ids[row, longest - n :] = torch.randint(2, vocab, (n,), generator=g)
        mask[row, longest - n :] = 1
    if case.padded or case.pass_mask:
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids}


# options resolved from the plain continuation (without them) of the case
_FROM_PLAIN = ("eos_from_plain", "stop_criterion", "eos_criterion_from_plain", "stop_string_from_plain")


def generate_kwargs(case: Case, inputs: dict, plain_rows: list[list[int]] | None, tokenizer=None) -> dict:
    """Fresh `generate` keyword arguments for one call (stateful hooks are new objects each time). `plain_rows`: the
    new tokens of each row of the plain continuation without stops, to resolve the stops drawn from it; None builds
    the options without those stops."""
    o, vocab = case.options, case.target["vocab_size"]
    prompt_length = inputs["input_ids"].shape[1]
    kwargs = {"do_sample": False}

    def picked(where):
        row, step = where[:2]
        tokens = plain_rows[row]
        return tokens[min(step, len(tokens) - 1)]

    for name in ("max_new_tokens", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                 "begin_suppress_tokens", "pad_token_id", "num_assistant_tokens", "do_sample", "temperature",
                 "top_k", "top_p", "min_p", "eos_token_id", "forced_eos_token_id", "renormalize_logits",
                 "use_cache"):
        if name in o:
            kwargs[name] = o[name]
    if "max_length_extra" in o:
        kwargs["max_length"] = prompt_length + o["max_length_extra"]
    if "sequence_bias" in o:
        kwargs["sequence_bias"] = {tuple(tokens): bias for tokens, bias in o["sequence_bias"]}
    if "logits_processor" in o:
        kwargs["logits_processor"] = LogitsProcessorList([USER_PROCESSORS[o["logits_processor"]]()])
    if "prefix_allowed_modulus" in o:
        kwargs["prefix_allowed_tokens_fn"] = AllowedTokens(vocab, o["prefix_allowed_modulus"])
    if plain_rows is None:
        return as_generation_config(case, kwargs)

    if "eos_from_plain" in o:
        eos = picked(o["eos_from_plain"])
        kwargs["eos_token_id"] = [eos, o["second_eos"]] if "second_eos" in o else eos
        if "min_new_tokens" in o:
            kwargs["min_new_tokens"] = o["min_new_tokens"]
        if "min_length_extra" in o:
            kwargs["min_length"] = prompt_length + o["min_length_extra"]
        if "exponential_decay_length_penalty" in o:
            kwargs["exponential_decay_length_penalty"] = tuple(o["exponential_decay_length_penalty"])
    criteria = StoppingCriteriaList()
    if "stop_criterion" in o:
        kind, arg = o["stop_criterion"]
        if kind == "tokens":
            criteria.append(StopOnTokens([picked(arg)]))
        elif kind == "row_lengths":
            criteria.append(StopAtRowLengths([prompt_length + n for n in arg]))
        else:
            criteria.append(StopAfterCalls(arg))
    if "eos_criterion_from_plain" in o:
        criteria.append(EosTokenCriteria(eos_token_id=picked(o["eos_criterion_from_plain"])))
    if criteria:
        kwargs["stopping_criteria"] = criteria
    if "stop_string_from_plain" in o:
        row, step, count = o["stop_string_from_plain"]
        tokens = plain_rows[row][min(step, len(plain_rows[row]) - 1):][:count]
        kwargs["stop_strings"] = [tokenizer.decode(tokens)]
        kwargs["tokenizer"] = tokenizer
    if o.get("streamer"):
        kwargs["streamer"] = RecordingStreamer()
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):
        if name in o:
            kwargs[name] = o[name]
    return as_generation_config(case, kwargs)


_HOOKS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "streamer", "tokenizer")


def as_generation_config(case: Case, kwargs: dict) -> dict:
    """The case's options as keywords, or for an `as_generation_config` case as one `GenerationConfig` (the objects
    that are not configuration stay keywords)."""
    if not case.options.get("as_generation_config"):
        return kwargs
    hooks = {k: v for k, v in kwargs.items() if k in _HOOKS}
    return {"generation_config": GenerationConfig(**{k: v for k, v in kwargs.items() if k not in _HOOKS}), **hooks}


def new_tokens(sequences: torch.Tensor, prompt_length: int) -> list[list[int]]:
    return [row[prompt_length:].tolist() for row in sequences]


def oracle_for(case: Case, inputs: dict, plain_sequences: torch.Tensor) -> NoisyOracle | None:
    """The noisy oracle of an oracle case: each row's own tokens (no left padding) + its plain continuation."""
    if case.drafter["kind"] != "oracle":
        return None
    mask = inputs.get("attention_mask")
    rows = [seq[int((mask[r] == 0).sum()) :] if mask is not None else seq for r, seq in enumerate(plain_sequences)]
    d = case.drafter
    return NoisyOracle(rows, vocab_size=case.target["vocab_size"], noise=d["noise"], branches=d["branches"],
                       seed=d["seed"])


# ----- outcomes ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    case: Case
    status: str  # identical | refused | divergence | error | plain_error
    reason: str = ""  # refused: the feature; divergence / error: a short cause
    detail: str = ""
    seconds: float = 0.0


def sequences_of(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result.sequences


def first_difference(plain: torch.Tensor, ours: torch.Tensor, prompt_length: int) -> str:
    if plain.shape != ours.shape:
        return (f"shape {tuple(ours.shape)} instead of {tuple(plain.shape)}; plain new tokens "
                f"{new_tokens(plain, prompt_length)}, ours {new_tokens(ours, prompt_length)}")
    rows = [r for r in range(plain.shape[0]) if not torch.equal(plain[r], ours[r])]
    r = rows[0]
    step = int((plain[r] != ours[r]).nonzero()[0]) - prompt_length
    return (f"rows {rows} differ; row {r} from new token {step}: plain {plain[r, prompt_length:].tolist()}, "
            f"ours {ours[r, prompt_length:].tolist()}")


def compare_tensors(name: str, plain, ours) -> str | None:
    if plain is None and ours is None:
        return None
    if plain is None or ours is None:
        return f"{name}: plain {'None' if plain is None else 'given'}, ours {'None' if ours is None else 'given'}"
    if len(plain) != len(ours):
        return f"{name}: {len(ours)} steps instead of {len(plain)}"
    for step, (a, b) in enumerate(zip(plain, ours)):
        if a.shape != b.shape:
            return f"{name}[{step}]: shape {tuple(b.shape)} instead of {tuple(a.shape)}"
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
            return f"{name}[{step}]: different -inf entries"
        if not torch.allclose(a[finite], b[finite], atol=SCORE_TOLERANCE, rtol=SCORE_TOLERANCE):
            return f"{name}[{step}]: max difference {float((a[finite] - b[finite]).abs().max()):.3g}"
    return None


def classify_refusal(case: Case, error: Exception) -> str | None:
    """The EXPECTED_REFUSALS feature a ValueError refuses, or None when the refusal is not an expected one."""
    if not isinstance(error, ValueError) or case.rows == 1:
        return None
    message = str(error).lower()
    for name, (used, words) in EXPECTED_REFUSALS.items():
        if used(case.options) and any(w in message for w in words):
            return name
    return None


def error_summary(error: Exception) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {first_line} (at {Path(frame.filename).name}:{frame.lineno})"


def static_cache(case: Case) -> dict:
    """The speculative call's own keyword for the capture-ready step, when the case draws it."""
    return {"cache_implementation": "static"} if case.runtime.get("static_cache") else {}


def run_greedy(case: Case, target, drafter) -> Outcome:
    inputs = build_inputs(case)
    prompt_length = inputs["input_ids"].shape[1]
    tokenizer = char_tokenizer(case.target["vocab_size"]) if "stop_string_from_plain" in case.options else None
    needs_plain_rows = any(k in case.options for k in _FROM_PLAIN)
    plain_rows = None
    if needs_plain_rows:  # the continuation without stops, to pick stop tokens rows really produce
        try:
            probe = target.generate(**inputs, **generate_kwargs(case, inputs, None))
        except Exception as error:  # noqa: BLE001
            return Outcome(case, "plain_error", error_summary(error))
        plain_rows = new_tokens(probe, prompt_length)
    else:
        plain_rows = [[0]] * case.rows
    plain_kwargs = generate_kwargs(case, inputs, plain_rows, tokenizer)
    try:
        plain = target.generate(**inputs, **plain_kwargs)
    except Exception as error:  # noqa: BLE001
        return Outcome(case, "plain_error", error_summary(error))
    ours_kwargs = generate_kwargs(case, inputs, plain_rows, tokenizer) | static_cache(case)
    try:
        with patched_runtime(case, target, oracle_for(case, inputs, sequences_of(plain))):
            if case.runtime.get("threads"):
                ours, problem = _run_threads(case, target, drafter, inputs, ours_kwargs, sequences_of(plain),
                                             lambda: generate_kwargs(case, inputs, plain_rows, tokenizer))
                if problem:
                    return Outcome(case, "divergence", "threads", problem)
            else:
                ours = target.generate(**inputs, assistant_model=drafter, **ours_kwargs)
    except Exception as error:  # noqa: BLE001
        refused = classify_refusal(case, error)
        if refused is not None:
            return Outcome(case, "refused", refused, str(error).splitlines()[0])
        return Outcome(case, "error", error_summary(error), traceback.format_exc(limit=-4))

    a, b = sequences_of(plain), sequences_of(ours)
    if a.shape != b.shape or not torch.equal(a, b):
        return Outcome(case, "divergence", "sequences", first_difference(a, b, prompt_length))
    if case.options.get("return_dict_in_generate"):
        for name in ("scores", "logits"):
            problem = compare_tensors(name, getattr(plain, name), getattr(ours, name))
            if problem:
                return Outcome(case, "divergence", name, problem)
    if "streamer" in plain_kwargs:
        p, s = plain_kwargs["streamer"], ours_kwargs["streamer"]
        if p.chunks != s.chunks or p.ended != s.ended:
            return Outcome(case, "divergence", "streamer",
                           f"plain chunks {p.chunks} (ended {p.ended}), ours {s.chunks} (ended {s.ended})")
    return Outcome(case, "identical")


def _run_threads(case: Case, target, drafter, inputs: dict, ours_kwargs: dict, plain: torch.Tensor,
                 fresh_kwargs) -> tuple:
    """The case's speculative call in `case.runtime["threads"]` threads at once (the first with `ours_kwargs`, the
    others with fresh hooks of their own from `fresh_kwargs()`), beside one thread running the plain call again:
    (the first thread's result, a problem when another thread's sequences differ from `plain`, else None). An
    exception in a thread is raised here."""
    calls = [lambda: target.generate(**inputs, assistant_model=drafter, **ours_kwargs)]
    calls += [lambda kwargs=fresh_kwargs() | static_cache(case): target.generate(**inputs, assistant_model=drafter,
                                                                                 **kwargs)
              for _ in range(case.runtime["threads"] - 1)]
    # the plain call again, with fresh hooks too (a stateful user processor counts its calls) and no streamer (the
    # streamer records the first call)
    plain_again = {k: v for k, v in fresh_kwargs().items() if k != "streamer"}
    calls.append(lambda: target.generate(**inputs, **plain_again))
    results = run_in_threads(calls)
    for i, result in enumerate(results[1:], start=1):
        sequences = sequences_of(result)
        if sequences.shape != plain.shape or not torch.equal(sequences, plain):
            who = "the plain call" if i == len(results) - 1 else f"thread {i}"
            return results[0], f"{who}: " + first_difference(plain, sequences, inputs["input_ids"].shape[1])
    return results[0], None


# ----- sampling: the exact distribution -----------------------------------------------------------------------------
def exact_distribution(target, prompt: torch.Tensor, kwargs: dict) -> dict[tuple, float]:
    """P(new tokens) under plain sampling, enumerated: one plain `generate` step from every prefix of positive
    probability, reading its processed scores (transformers' own processors and warpers)."""
    steps = kwargs["max_new_tokens"]
    eos = kwargs.get("eos_token_id")
    step_kwargs = {k: v for k, v in kwargs.items() if k != "max_new_tokens"}
    outcomes: dict[tuple, float] = defaultdict(float)
    frontier = {(): 1.0}
    # the prompt's mask as generate infers it (pad tokens masked unless pad is EOS); generated tokens are never
    # masked in plain generate, so prefixes holding the pad token must not be masked here either
    pad = kwargs.get("pad_token_id", target.generation_config.pad_token_id)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    prompt_mask = torch.ones_like(prompt)
    if pad is not None and bool((prompt == pad).any()) and pad not in eos_ids:
        prompt_mask = (prompt != pad).long()
    for step in range(steps):
        prefixes = list(frontier)
        ids = prompt.repeat(len(prefixes), 1)
        mask = prompt_mask.repeat(len(prefixes), 1)
        if step:
            ids = torch.cat([ids, torch.tensor(prefixes)], dim=1)
            mask = torch.cat([mask, torch.ones(len(prefixes), step, dtype=mask.dtype)], dim=1)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=1, return_dict_in_generate=True,
                              output_scores=True, **step_kwargs)
        probs = out.scores[0].double().softmax(-1)
        following = {}
        for i, prefix in enumerate(prefixes):
            for token in probs[i].nonzero().flatten().tolist():
                p = frontier[prefix] * float(probs[i, token])
                sequence = prefix + (token,)
                if token == eos or step == steps - 1:
                    outcomes[sequence] += p
                else:
                    following[sequence] = p
        frontier = following
    return dict(outcomes)


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with `df` degrees of freedom > x), exact for integer df."""
    h = x / 2
    if df % 2 == 0:
        term = total = math.exp(-h)
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return min(total, 1.0)
    total = math.erfc(math.sqrt(h))
    term = math.exp(-h) * math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (df - 1) // 2 + 1):
        total += term
        term *= h / (i + 0.5)
    return min(total, 1.0)


def goodness_of_fit(exact: dict[tuple, float], counts: Counter) -> tuple[float, int, str]:
    """Pearson chi-square of `counts` against `exact` (bins of expected count >= MIN_EXPECTED, the rest pooled):
    (p-value, degrees of freedom, a description). An observation of probability 0 gives p-value 0."""
    n = sum(counts.values())
    impossible = {k: v for k, v in counts.items() if exact.get(k, 0.0) == 0.0}
    if impossible:
        return 0.0, 0, f"sampled sequences of probability 0: {dict(list(impossible.items())[:5])}"
    ranked = sorted(exact, key=exact.get, reverse=True)
    bins = [[k] for k in ranked if n * exact[k] >= MIN_EXPECTED]
    rest = [k for k in ranked if n * exact[k] < MIN_EXPECTED]
    if rest:
        if n * sum(exact[k] for k in rest) >= MIN_EXPECTED or not bins:
            bins.append(rest)
        else:
            bins[-1] += rest
    if len(bins) < 2:
        return 1.0, 0, "one bin: nothing to test beyond the support"
    stat = 0.0
    for keys in bins:
        expected = n * sum(exact[k] for k in keys)
        observed = sum(counts.get(k, 0) for k in keys)
        stat += (observed - expected) ** 2 / expected
    df = len(bins) - 1
    top = [(list(k) if isinstance(k, tuple) else k, round(exact[k], 3), counts.get(k, 0)) for k in ranked[:4]]
    return chi2_sf(stat, df), df, f"chi2={stat:.1f} df={df}; most likely (outcome, p, count of {n}): {top}"


def run_sampling(case: Case, target, drafter) -> Outcome:
    inputs = build_inputs(case)
    prompt = inputs["input_ids"][:1]
    prompt_length = prompt.shape[1]
    kwargs = generate_kwargs(case, inputs, [[0]])
    try:
        exact = exact_distribution(target, prompt, kwargs)
        torch.manual_seed(case.seed * 7919 + case.number)
        reference = target.generate(**inputs, **kwargs)
    except Exception as error:  # noqa: BLE001
        return Outcome(case, "plain_error", error_summary(error))
    eos = kwargs.get("eos_token_id")
    counts: Counter = Counter()
    calls = SAMPLES // case.rows
    try:
        with patched_runtime(case, target, oracle_for(case, inputs, reference)):
            for call in range(calls):
                torch.manual_seed(10**6 * (case.number + 1) + call)
                out = target.generate(**inputs, assistant_model=drafter, **kwargs, **static_cache(case))
                for tokens in new_tokens(out, prompt_length):
                    if eos in tokens:
                        tokens = tokens[: tokens.index(eos) + 1]
                    counts[tuple(tokens)] += 1
    except Exception as error:  # noqa: BLE001
        return Outcome(case, "error", error_summary(error), traceback.format_exc(limit=-4))
    tests = [(name, *goodness_of_fit(*view)) for name, view in views_of(exact, counts, kwargs["max_new_tokens"])]
    name, p_value, _, description = min(tests, key=lambda t: t[1])
    # the tests of one case share the false-alarm budget (union bound)
    if p_value < P_VALUE_FLOOR / len(tests):
        return Outcome(case, "divergence", "sampling distribution", f"{name}: p={p_value:.2g}: {description}")
    return Outcome(case, "identical", detail=f"lowest p {p_value:.3g} ({name}: {description})")


def views_of(exact: dict[tuple, float], counts: Counter, steps: int):
    """The whole sequences, and when longer than one token each position's token (None once a sequence ended):
    a marginal keeps power where the joint distribution is spread over many unlikely sequences."""
    yield "sequences", (exact, counts)
    for position in range(steps if steps > 1 else 0):
        marginal, observed = defaultdict(float), Counter()
        for sequence, p in exact.items():
            marginal[sequence[position] if position < len(sequence) else None] += p
        for sequence, n in counts.items():
            observed[sequence[position] if position < len(sequence) else None] += n
        yield f"token {position}", (dict(marginal), observed)


# ----- running -----------------------------------------------------------------------------------------------------
def run_case(seed: int, number: int) -> Outcome:
    """Run case `number` of the suite seeded `seed`: never raises (a failure to even build it is an error)."""
    case = make_case(seed, number)
    start = time.perf_counter()
    with warnings.catch_warnings(), quiet_logs():
        warnings.simplefilter("ignore")
        try:
            target = build_target(case)
            drafter = build_drafter(case, target)
            outcome = (run_sampling if case.sampling else run_greedy)(case, target, drafter)
        except Exception as error:  # noqa: BLE001
            outcome = Outcome(case, "error", "building the case: " + error_summary(error), traceback.format_exc())
    outcome.seconds = time.perf_counter() - start
    return outcome


@contextlib.contextmanager
def quiet_logs():
    """transformers' generation warnings and the runtime's notes (no verify-cost profile, ...) off, then back."""
    verbosity, ours = hf_logging.get_verbosity(), logging.getLogger("hf_diffspec")
    level = ours.level
    hf_logging.set_verbosity_error()
    ours.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        ours.setLevel(level)


def _worker_init():
    torch.set_num_threads(1)


def _run_pair(pair):
    return run_case(*pair)


def run_suite(seed: int, numbers, jobs: int = 1, progress=None):
    """Outcomes of the given case numbers, in order."""
    pairs = [(seed, n) for n in numbers]
    if jobs <= 1:
        for pair in pairs:
            outcome = run_case(*pair)
            if progress:
                progress(outcome)
            yield outcome
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
        for outcome in pool.imap(_run_pair, pairs, chunksize=4):
            if progress:
                progress(outcome)
            yield outcome


def summarize(outcomes: list[Outcome], seed: int) -> str:
    by_status = Counter(o.status for o in outcomes)
    refused = Counter(o.reason for o in outcomes if o.status == "refused")
    sampling = [o for o in outcomes if o.case.sampling]
    lines = [
        f"cases: {len(outcomes)} (greedy {len(outcomes) - len(sampling)}, sampling {len(sampling)}), "
        f"seed {seed}, {sum(o.seconds for o in outcomes):.0f} s of case time",
        f"identical: {by_status['identical']}",
        f"refused: {by_status['refused']}" + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(refused.items()))})"
                                              if refused else ""),
        f"divergences: {by_status['divergence']}",
        f"unexpected errors: {by_status['error']}",
        "targets: " + ", ".join(f"{kind} {n}" for kind, n in sorted(Counter(o.case.target["kind"]
                                                                              for o in outcomes).items())),
        "first calls (profile measured on first use, live gates): "
        f"{sum(o.case.runtime['gate'] == 'live' for o in outcomes)}",
        f"calls in several threads at once: {sum(bool(o.case.runtime.get('threads')) for o in outcomes)}",
        f"drafting ahead: {sum(bool(o.case.runtime.get('draft_ahead')) for o in outcomes)}",
    ]
    if by_status["plain_error"]:
        lines.append(f"plain generate refused the options (not counted): {by_status['plain_error']}")
    for status in ("divergence", "error", "plain_error"):
        failed = [o for o in outcomes if o.status == status]
        if not failed:
            continue
        lines.append(f"\n{status}s (rerun one with: python tests/differential.py --seed {seed} --case N):")
        for o in failed:
            cause = o.reason
            if status == "divergence":  # what differs, in one line
                cause += ": " + o.detail.strip().splitlines()[0]
            lines.append(f"- {o.case.describe()}\n    {cause}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="number of cases (numbers 0 .. cases-1)")
    parser.add_argument("--seed", type=int, default=0, help="suite seed: the same seed draws the same cases")
    parser.add_argument("--case", type=int, default=None, help="run this one case and print its details")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each uses one thread)")
    parser.add_argument("--targets", default=None,
                        help=f"comma-separated target kinds (llama, qwen3, {', '.join(FAMILIES)}): run the first "
                             "--cases cases whose target is one of them")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.case is not None:
        outcome = run_case(args.seed, args.case)
        print(outcome.case.describe())
        print(f"{outcome.status}: {outcome.reason}\n{outcome.detail}".rstrip())
        return 0 if outcome.status in ("identical", "refused") else 1

    def progress(outcome):
        mark = {"identical": ".", "refused": "r", "divergence": "D", "error": "E", "plain_error": "p"}[outcome.status]
        print(mark, end="", flush=True)
        if (outcome.case.number + 1) % 100 == 0:
            print(f" {outcome.case.number + 1}", flush=True)

    numbers = range(args.cases)
    if args.targets:
        kinds = set(args.targets.split(","))
        matching = (n for n in itertools.count() if make_case(args.seed, n).target["kind"] in kinds)
        numbers = list(itertools.islice(matching, args.cases))
    outcomes = list(run_suite(args.seed, numbers, args.jobs, progress))
    print()
    print(summarize(outcomes, args.seed))
    return 0 if all(o.status in ("identical", "refused", "plain_error") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
