"""Equal tau: our loop against z-lab's `dflash_generate` where both face the same accepts, so that the ratio of their
speeds is the loops' own cost, with the same drafter work in both.

Both loops run the real drafter (its forward and its LM head, every step); then an oracle replaces the drafted
tokens: the draft at (row, absolute position) is the target's own token there with probability q, else a fixed wrong
token, decided once per position (`PositionOracle`). With the whole block verified every step (15 drafts for a block
of 16), both loops therefore commit the same tokens in the same steps, and their taus agree (checked). Arms:

- `zlab`: z-lab's loop (batch size 1, its own dynamic caches);
- `ours-block`: our loop verifying the whole block every step (the equal-tau arm), with `generate`'s dynamic cache;
- `ours-block-static`: the same with `cache_implementation="static"` (the capture-ready path);
- `ours-live`: our chains as the `dflash` method runs them (no length head), the cost model choosing each step's
  length from confidences set to q (the oracle's true acceptance) and the controller deciding whether to
  speculate: its own tau, not an equal one (where a read waits for the device, each drafter step drafts the next
  ahead, `drafting.draft_ahead`);
- `ours-live-at-each-step`: the same, every drafting pass at its own step (`HF_DIFFSPEC_DRAFT_AHEAD=0`; on a CPU
  that is `ours-live` itself): on a GPU, what drafting ahead saves;
- `plain`, `plain-static`: `generate` without a drafter, dynamic and static cache (`disable_compile=True`);
  `plain-compiled` (not run by default: on the CPU a compile takes minutes), the static cache as transformers compiles
  it, its first call (the compile) reported apart.

Greedy, EOS off (every call makes exactly `--max-new-tokens`). The oracle's reference is what that arm commits
under the oracle: a first run starts from plain `generate`'s output and later runs from the previous one's, until
a run commits its reference (bf16 near-ties break otherwise: a verify forward of 16 tokens may round a near-tie
the other way than plain decoding, and every draft after it would be wrong).

    python -m hf_diffspec.bench.equal_tau --taus 3,6.5 --max-new-tokens 256 --context-tokens 512 --repeats 3
    python -m hf_diffspec.bench.equal_tau --target tiny --taus 3 --max-new-tokens 32 --repeats 1   # it runs

Run it on a quiet machine (one process): it times calls.
"""

import argparse
import json
import random
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from ..runtime.device_clock import device_time
from ..runtime.drafting import DiffusionCandidateGenerator
from .counting import StepCounts, TargetForwardCounter
from .host_syncs import drafting_ahead
from .oracle import _loop_drafting, oracle_acceptance

ARMS = ("zlab", "ours-block", "ours-block-static", "ours-live", "ours-live-at-each-step", "plain", "plain-static")
PLAIN_ARMS = ("plain", "plain-static", "plain-compiled")  # plain-compiled: transformers compiles the static step
EQUAL_TAU_ARMS = ("zlab", "ours-block", "ours-block-static")


class PositionOracle:
    """The drafts an oracle proposes: at absolute position `p` of row `row`, `references[row][p]` with probability
    `acceptance`, else a wrong token, each decided once from (`seed`, row, p) so that every loop drafting position p
    gets the same token. `table(row, device)`: the row's tokens for every position, as a tensor to gather from (on
    the device, without a host read)."""

    def __init__(self, references: list[list[int]], acceptance: float, vocab_size: int, extra: int, seed: int = 0):
        self.references = references
        self.acceptance = acceptance
        self.tables = []
        for row, reference in enumerate(references):
            rng = random.Random(f"{seed}:{row}")
            tokens = []
            for position in range(len(reference) + extra):
                right = rng.random() < acceptance
                shift = 1 + rng.randrange(vocab_size - 1)
                truth = reference[position] if position < len(reference) else 0
                tokens.append(truth if right and position < len(reference) else (truth + shift) % vocab_size)
            self.tables.append(torch.tensor(tokens))

    def table(self, row: int, device) -> torch.Tensor:
        if self.tables[row].device != torch.device(device):
            self.tables[row] = self.tables[row].to(device)
        return self.tables[row]


class EqualTauDrafts(DiffusionCandidateGenerator):
    """Our chains with the drafter run as usual (forward, LM head, picks), then its tokens replaced by the oracle's
    for the drafted positions; its confidences, wherever the loop reads them (how many slots' logits to compute, how
    long a chain to verify), are the oracle's acceptance, so a live cost model sizes the chains from the drafts' true
    odds."""

    def __init__(self, drafter, target, policy, sampling, oracle: PositionOracle):
        super().__init__(drafter, target, policy, sampling)
        self.oracle = oracle
        self.rows = list(range(len(oracle.references)))
        self._root_positions = None

    def select_rows(self, keep: torch.Tensor, moves=None) -> None:
        super().select_rows(keep, moves)
        self.rows = [self.rows[i] for i in keep.tolist()]

    def propose(self, root_tokens, root_positions, remaining, ahead=None):
        self._root_positions = root_positions
        return super().propose(root_tokens, root_positions, remaining, ahead)

    def _ahead_pass(self, roots, positions, draft_hidden, span, row_ends):
        self._root_positions = positions  # (on the device: a pass run ahead reads nothing)
        return super()._ahead_pass(roots, positions, draft_hidden, span, row_ends)

    def _pick(self, draft_hidden, logits, roots):
        drafts, confidences, probs = super()._pick(draft_hidden, logits, roots)
        slots = torch.arange(1, drafts.shape[1] + 1, device=drafts.device)
        drafts = torch.stack([self.oracle.table(row, drafts.device)[position + slots]
                              for row, position in zip(self.rows, self._root_positions)]).to(drafts.dtype)
        return drafts, self._confidences(logits), probs

    def _confidences(self, logits):
        return torch.full(logits.shape[:2], self.oracle.acceptance, device=logits.device)


@contextmanager
def zlab_oracle(model, oracle: PositionOracle):
    """z-lab's drafter with its drafts replaced by the oracle's: its forward's position ids say where the block is;
    its logits (computed as usual) get the oracle's token as their maximum. Batch size 1, as z-lab's loop."""
    where = {}

    def record(module, args, kwargs):
        where["positions"] = kwargs["position_ids"]

    compute_logits = model.compute_logits

    def oracle_logits(hidden, head):
        logits = compute_logits(hidden, head)
        positions = where["positions"][0, -hidden.shape[1]:]
        tokens = oracle.table(0, logits.device)[positions]
        return logits.scatter(-1, tokens.view(1, -1, 1), torch.finfo(logits.dtype).max)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    model.compute_logits = oracle_logits
    try:
        yield
    finally:
        handle.remove()
        del model.compute_logits


class EqualTauBench:
    """The arms on one batch of `inputs` (1 row: z-lab's loop decodes one) at one oracle tau; `zlab`: z-lab's peer
    `Method` (`peers.peer_methods`)."""

    def __init__(self, target, drafter, zlab, inputs, max_new_tokens: int, tau: float, seed: int = 0):
        self.target, self.drafter, self.zlab = target, drafter, zlab
        self.inputs, self.max_new_tokens, self.seed = inputs, max_new_tokens, seed
        self.block = drafter.config.block_size
        self.acceptance = oracle_acceptance(tau, self.block - 1)
        self.vocab_size = target.config.get_text_config().vocab_size
        self.plain_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)  # EOS off

    def oracle(self, reference: list[int]) -> PositionOracle:
        return PositionOracle([reference], self.acceptance, self.vocab_size, self.block, self.seed)

    def run(self, arm: str, reference: list[int] | None):
        """(sequence, `StepCounts`, seconds) of one call of `arm` (its oracle built on `reference`)."""
        ids = self.inputs["input_ids"]
        kwargs = dict(self.plain_kwargs)
        start = device_time(ids.device)
        if arm in PLAIN_ARMS:
            if arm != "plain":
                kwargs.update(cache_implementation="static", disable_compile=arm == "plain-static")
            out, counts = self.target.generate(**self.inputs, **kwargs), StepCounts()
        elif arm == "zlab":
            runner = self.zlab.runner
            patch = self.zlab.target_patch(self.target) if self.zlab.target_patch else nullcontext()
            with patch, zlab_oracle(runner.model, self.oracle(reference)), TargetForwardCounter(self.target) as counter:
                out = runner.generate(runner.model, self.target, ids, self.max_new_tokens, None)
            counts = counter.counts(out.shape[1] - ids.shape[1])
        else:
            oracle = self.oracle(reference)

            def make(drafter, target, policy, sampling):
                return EqualTauDrafts(drafter, target, policy, sampling, oracle)

            if not arm.startswith("ours-live"):
                kwargs["num_assistant_tokens"] = self.block - 1  # the whole block, every step
            if arm == "ours-block-static":
                kwargs["cache_implementation"] = "static"
            at_each_step = drafting_ahead(False) if arm == "ours-live-at-each-step" else nullcontext()
            with _loop_drafting(make), at_each_step:
                out = self.target.generate(**self.inputs, **kwargs, assistant_model=self.drafter,
                                           return_dict_in_generate=True)
            out, counts = out.sequences, StepCounts.of(out.speculation_stats)
        seconds = device_time(ids.device) - start
        return out[0].tolist(), counts, seconds

    def settle(self, arm: str, plain: list[int], rounds: int = 4) -> tuple[list[int], bool, float]:
        """The reference `arm` commits under its own oracle: from plain decoding's output, run again on what the
        last run committed until a run commits its reference (at most `rounds` runs). (reference, settled, the
        first run's seconds); a plain arm has no oracle: one warm-up run."""
        if arm in PLAIN_ARMS:
            return None, True, self.run(arm, None)[2]
        reference, first = plain, None
        for _ in range(rounds):
            out, _, seconds = self.run(arm, reference)
            first = seconds if first is None else first
            if out == reference:
                return reference, True, first
            reference = out
        return reference, False, first


def equal_tau_rows(target, drafter, zlab, inputs, max_new_tokens: int, taus: list[float], arms: list[str],
                   repeats: int = 3, seed: int = 0, progress=print) -> list[dict]:
    """One row per (tau, arm): median seconds of `repeats` interleaved timed calls (after the untimed runs that
    settle the references), tokens, steps, tau, ms per token, whether the output is plain `generate`'s (in fp32 it
    must be; in bf16 a near-tie may differ), and the speed against z-lab's loop and against plain `generate`."""
    rows = []
    for tau in taus:
        bench = EqualTauBench(target, drafter, zlab, inputs, max_new_tokens, tau, seed)
        plain, _, _ = bench.run("plain", None)
        references, settled, first = {}, {}, {}
        for arm in arms:
            references[arm], settled[arm], first[arm] = bench.settle(arm, plain)
        times = {arm: [] for arm in arms}
        counts, outputs = {}, {}
        for repeat in range(repeats):
            for arm in (arms if repeat % 2 == 0 else arms[::-1]):  # interleaved, the order alternating
                outputs[arm], counts[arm], seconds = bench.run(arm, references[arm])
                times[arm].append(seconds)
            progress(f"tau {tau:g}: repeat {repeat + 1}/{repeats} done")
        prompt = inputs["input_ids"].shape[1]
        for arm in arms:
            seconds = statistics.median(times[arm])
            rows.append({"oracle_tau": tau, "arm": arm, "acceptance": round(bench.acceptance, 4),
                         "tau": round(counts[arm].tau, 3) if counts[arm].steps else 1.0, "steps": counts[arm].steps,
                         "new_tokens": max_new_tokens, "prompt_tokens": prompt, "seconds": round(seconds, 4),
                         "seconds_each": [round(s, 4) for s in times[arm]], "first_call_seconds": round(first[arm], 4),
                         "ms_per_token": round(1000 * seconds / max_new_tokens, 3), "settled": settled[arm],
                         "identical_to_plain": outputs[arm] == plain})
        by_arm = {r["arm"]: r for r in rows if r["oracle_tau"] == tau}
        for r in by_arm.values():
            for base in ("zlab", "plain"):
                if base in by_arm:
                    r[f"vs_{base}"] = round(by_arm[base]["seconds"] / r["seconds"], 3)
    return rows


def check_equal_tau(rows: list[dict], tolerance: float = 0.03) -> list[str]:
    """What breaks equal tau: an equal-tau arm whose tau is off z-lab's by more than `tolerance` (relative), or
    whose reference did not settle. Empty when the comparison holds."""
    problems = []
    for tau in sorted({r["oracle_tau"] for r in rows}):
        by_arm = {r["arm"]: r for r in rows if r["oracle_tau"] == tau}
        zlab = by_arm.get("zlab")
        for arm in EQUAL_TAU_ARMS:
            r = by_arm.get(arm)
            if r is None:
                continue
            if not r["settled"]:
                problems.append(f"tau {tau:g}, {arm}: its reference did not settle")
            if zlab is not None and abs(r["tau"] - zlab["tau"]) > tolerance * zlab["tau"]:
                problems.append(f"tau {tau:g}, {arm}: tau {r['tau']} against z-lab's {zlab['tau']}")
    return problems


def markdown(rows: list[dict]) -> str:
    lines = ["| oracle tau | arm | tau | steps | ms/token | vs z-lab | vs plain | output = plain's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = lambda key: f"{r[key]:.2f}x" if key in r else "-"  # noqa: E731
        lines.append(f"| {r['oracle_tau']:g} | {r['arm']} | {r['tau']:.2f} | {r['steps']} | {r['ms_per_token']:.2f} "
                     f"| {x('vs_zlab')} | {x('vs_plain')} | {'yes' if r['identical_to_plain'] else 'no'} |")
    return "\n".join(lines)


def _tiny():
    """A tiny random Qwen3 target, a drafter for it and a one-row prompt: a check that the bench runs."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..modeling import DiffusionDrafter

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    target = Qwen3ForCausalLM(config).eval()
    drafter = DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=16, mask_token_id=3)
    drafter.bind_target(target)
    return target, None, drafter, {"input_ids": torch.randint(4, 250, (1, 48))}


def _real(args):
    from ..drafters import load_drafter
    from ..prompts import load_prompts, with_context
    from ..targets import load_target

    target, tok = load_target(args.target, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    # chains sized by the drafter's confidences (the `dflash` method): a length head would size them from what it
    # learned of the drafter's own acceptance, not the oracle's
    drafter = load_drafter(args.drafter, target, args.target, length_head=False, draft_tree_budget=None,
                           prompt_lookup_num_tokens=None)
    prompt = load_prompts(["chat"], n_per_domain=1, tokenizer=tok, seed=args.seed)
    if args.context_tokens:
        prompt = with_context(prompt, args.context_tokens, tok)
    return target, tok, drafter, dict(tok(prompt[0]["text"], return_tensors="pt", add_special_tokens=False))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a built-in target, or `tiny`")
    parser.add_argument("--drafter", default=None, help="a drafter checkpoint (default: the shipped one)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--taus", default="3,6.5")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--context-tokens", type=int, default=512, help="the prompt's length, about")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from .peers import peer_methods

    target, tok, drafter, inputs = _tiny() if args.target == "tiny" else _real(args)
    zlab = peer_methods(["zlab"], target, args.target, drafter, tokenizer=tok)["zlab"]
    if zlab.skip_reason:
        raise SystemExit(zlab.skip_reason)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS) - set(PLAIN_ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: choose among {', '.join(ARMS + PLAIN_ARMS[2:])}")
    taus = [float(t) for t in args.taus.split(",")]
    with torch.inference_mode():
        rows = equal_tau_rows(target, drafter, zlab, inputs, args.max_new_tokens, taus, arms,
                              repeats=args.repeats, seed=args.seed)
    print(markdown(rows))
    problems = check_equal_tau(rows)
    for problem in problems:
        print("NOT EQUAL:", problem)
    if args.json:
        from ..machine import machine_description

        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "machine": machine_description(target), "rows": rows,
                       "problems": problems, "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
