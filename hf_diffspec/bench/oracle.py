"""Loop efficiency (`oracle_methods`, `oracle_efficiency`): an oracle drafter proposes the target's own greedy
continuation, corrupted so that tau is about 2, 4 or 8, through our loop; the achieved speedup over `ar` divided by
the speedup the verify-cost profile predicts for the achieved tau shows the loop's own overhead, apart from
drafting."""

import random
import zlib
from contextlib import contextmanager

import torch

from ..modeling import DiffusionDrafter
from ..runtime.control_policy import speculation_policy
from ..runtime.drafting import DiffusionCandidateGenerator
from ..runtime.tree import CandidateTree
from .counting import StepCounts
from .method import Method


def oracle_acceptance(tau: float, drafts: int) -> float:
    """The probability q with which each of `drafts` draft positions is kept right (else replaced by a wrong token),
    independently, so that a step commits tau tokens on average: 1 + q + q^2 + ... + q^drafts = tau (the anchor's
    target token, then each draft reached and right). Bisection; 1.0 when tau >= drafts + 1."""
    if tau < 1:
        raise ValueError(f"an oracle tau must be >= 1 (one token per step at least), got {tau}")
    if tau >= drafts + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(drafts + 1)) < tau else (lo, q)
    return (lo + hi) / 2


class OracleCandidateGenerator(DiffusionCandidateGenerator):
    """Benchmark only: drafts each row's reference continuation (the target's own greedy output), each position kept
    with probability `acceptance` and otherwise replaced by another token, as a chain of the policy's fixed length.
    Reads no target features and runs no drafter forward: what is timed is our loop alone (verify, walk, commit,
    cache upkeep), so its efficiency shows apart from drafter quality. Lossless like any drafting: the target picks.

    `references`: per row of the batch, its prompt without padding followed by its reference continuation, so that a
    row's anchor position indexes it directly."""

    def __init__(self, drafter, target, references: list[list[int]], acceptance: float, drafts: int, seed: int = 0):
        super().__init__(drafter, target, speculation_policy(drafter, target, fixed=drafts))
        self.references = references
        self.acceptance = acceptance
        self.rows = list(range(len(references)))  # batch row of each row still decoding
        self.rng = random.Random(seed)
        self.vocab_size = target.config.get_text_config().vocab_size

    def add_context(self, *args, **kwargs) -> None:
        pass  # no drafter reads target features

    def select_rows(self, keep: torch.Tensor, moves=None) -> None:
        self.rows = [self.rows[i] for i in keep.tolist()]

    def can_draft_ahead(self, rows: int) -> bool:
        return False  # no drafter pass to run

    def propose(self, root_tokens: list[int], root_positions: list[int], remaining: list[int],
                ahead=None) -> list[CandidateTree]:
        trees = []
        for row, root, position, left in zip(self.rows, root_tokens, root_positions, remaining):
            depth = self.policy.depth_limit(position, left)
            truth = self.references[row][position + 1 : position + 1 + depth]
            drafts = [token if self.rng.random() < self.acceptance else self._wrong(token) for token in truth]
            # tokens on the host: the batch's trees go to the device in one copy
            trees.append(CandidateTree([root, *drafts], list(range(-1, len(drafts))), device=self.drafter.device))
        return trees

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size


@contextmanager
def _loop_drafting(make_generator):
    """Within the block, our loop drafts with `make_generator(drafter, target, policy, sampling)` instead of the
    drafter's own candidate generator (the loop resolves `generator_class` by name in its module at each call)."""
    from ..runtime import decoding

    if not hasattr(decoding, "generator_class"):
        raise RuntimeError("the oracle benchmark replaces runtime.decoding.generator_class, which the loop no "
                           "longer has: update bench.oracle._loop_drafting to the loop's new drafting hook")

    class Oracle:  # what the loop builds its drafting from (with the loop's policy and sampling laws)
        def __new__(cls, drafter, target, *args, **kwargs):
            return make_generator(drafter, target, *args, **kwargs)

    original = decoding.generator_class
    decoding.generator_class = lambda drafter: Oracle
    try:
        yield
    finally:
        decoding.generator_class = original


def _batch_key(inputs) -> tuple:
    ids = inputs["input_ids"]
    return tuple(ids.shape), ids.cpu().numpy().tobytes()


class OracleRunner:
    """Our loop with an `OracleCandidateGenerator` aiming at `tau`: `drafts` per step (a fixed length, so every step
    speculates), each kept right with `oracle_acceptance(tau, drafts)`. `prepare` computes the references with plain
    greedy `generate`, once per batch, shared by every runner given the same `references` dict."""

    def __init__(self, target, tau: float, drafts: int, references: dict, seed: int = 0):
        self.tau = tau
        self.drafts = drafts
        self.acceptance = oracle_acceptance(tau, drafts)
        self.references = references
        self.seed = seed
        # only routes generate() into our loop and sets the block (drafts + 1); its weights never run
        self.carrier = DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=drafts + 1)

    def prepare(self, target, batches: list, max_new_tokens: int) -> None:
        for inputs in batches:
            key = _batch_key(inputs)
            if key in self.references:
                continue
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            prompt_length = inputs["input_ids"].shape[1]
            mask = inputs.get("attention_mask")
            self.references[key] = [
                (row[:prompt_length] if mask is None else row[:prompt_length][mask[r].bool()]).tolist()
                + row[prompt_length:].tolist() for r, row in enumerate(out)]

    def __call__(self, target, inputs, max_new_tokens: int, **generate_kwargs):
        """(sequences, `StepCounts`) of our loop on `inputs`; `generate_kwargs` go to `generate` (e.g.
        cache_implementation="static")."""
        key = _batch_key(inputs)
        if key not in self.references:
            raise RuntimeError("OracleRunner.prepare was not called for this batch: the oracle needs its reference")
        references = self.references[key]
        seed = zlib.crc32(key[1], self.seed)  # corruption independent across batches, the same at every repeat

        def make(drafter, model, *_):  # the oracle has its own fixed-length policy
            return OracleCandidateGenerator(drafter, model, references, self.acceptance, self.drafts, seed)

        with _loop_drafting(make):
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  assistant_model=self.carrier, num_assistant_tokens=self.drafts,
                                  return_dict_in_generate=True, **generate_kwargs)
        return out.sequences, StepCounts.of(out.speculation_stats)


def oracle_drafts_for(tau: float) -> int:
    """Drafts per step for an oracle tau when not set: 2 * ceil(tau) - 1, so that n = 2 tau tokens are verified per
    step (the right draft falls about half way into the block, as with a real drafter)."""
    return max(2 * int(-(-tau // 1)) - 1, 1)


def oracle_methods(target, taus: list[float], drafts: int | None = None, seed: int = 0) -> dict[str, Method]:
    """`oracle-<tau>` -> a `Method` running an `OracleRunner` (drafts per step: `drafts`, else `oracle_drafts_for`)."""
    references: dict = {}
    methods = {}
    for tau in taus:
        runner = OracleRunner(target, tau, drafts or oracle_drafts_for(tau), references, seed=seed)
        methods[f"oracle-{tau:g}"] = Method(runner=runner)
    return methods


def oracle_efficiency(rows: list[dict], methods: dict[str, Method], verify_cost) -> list[dict]:
    """Per oracle method and batch size (the `all` rows of `summarize`): requested and achieved tau, throughput, the
    speedup over `ar`, and the loop's efficiency on the decoding phase, where the loop's overhead lives. The prefill
    is the same forward for both (our loop measures it) and is taken out of both times: decode speedup =
    ((ar seconds - prefill) / ar tokens) / ((oracle seconds - prefill) / oracle tokens); the profile predicts
    tau * T_verify(1, rows) / T_verify(n, rows) for it, with n the tokens verified per row per step; efficiency =
    decode speedup / predicted. `verify_cost`: a `VerifyCost` (None: no prediction)."""
    ar = {r["batch_size"]: r for r in rows if r["method"] == "ar" and r["domain"] == "all" and not r.get("skipped")}
    table = []
    for r in rows:
        method = methods.get(r["method"])
        if method is None or not isinstance(method.runner, OracleRunner) or r["domain"] != "all" or r.get("skipped"):
            continue
        runner, batch, n = method.runner, r["batch_size"], r["nodes_per_step"]
        decode = None
        base, prefill = ar.get(batch), r["prefill_seconds"]
        if base is not None and r["seconds"] > prefill and base["seconds"] > prefill:
            decode = round((base["seconds"] - prefill) / base["new_tokens"]
                           / ((r["seconds"] - prefill) / r["new_tokens"]), 3)
        predicted = None
        if verify_cost is not None:
            predicted = round(r["tau"] * verify_cost(1, batch) / verify_cost(n, batch), 3)
        table.append({
            "oracle_tau": runner.tau, "drafts_per_step": runner.drafts, "acceptance": round(runner.acceptance, 3),
            "batch_size": batch, "achieved_tau": r["tau"], "verified_per_step": n, "tokens_per_s": r["tokens_per_s"],
            "speedup_vs_ar": r["speedup_vs_ar"], "decode_speedup_vs_ar": decode, "predicted_speedup": predicted,
            "efficiency": round(decode / predicted, 3) if predicted and decode else None,
            "identical_to_ar": r["identical_to_ar"],
        })
    return table


def oracle_markdown_table(table: list[dict]) -> str:
    lines = ["| oracle tau | batch | drafts/step | achieved tau | tokens verified/step | tokens/s | vs ar | "
             "decode vs ar | predicted decode vs ar | efficiency | identical to ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        x = lambda value: "-" if value is None else f"{value:.2f}x"  # noqa: E731
        efficiency = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {r['oracle_tau']:g} | {r['batch_size']} | {r['drafts_per_step']} | {r['achieved_tau']:.2f} | "
                     f"{r['verified_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{x(r['decode_speedup_vs_ar'])} | {x(r['predicted_speedup'])} | {efficiency} | "
                     f"{'yes' if r['identical_to_ar'] else 'no'} |")
    return "\n".join(lines)
