"""Trace replay: what every kind of decoding step would have committed at every position of recorded greedy decodes,
and the speculation controller deciding steps over them.

Greedy decoding is deterministic, so the counterfactuals are exact: a prompt is decoded once, plainly, in fp32; then at
every position of the output (the committed prefix, its last token the anchor) the recorder logs

- the prompt-lookup drafts found there (`PromptLookup.find`, the loop's own) and the length of the match;
- the drafter's whole best-first tree there (`BestFirstTreeCandidateGenerator.propose` on the target's features of
  the committed prefix, every node of the budget, in best-first order with their scores), so a tree verified at any
  node count n is its first n nodes.

From these a step of any kind and size commits exactly what the live loop's would: a plain step 1 token; lookup drafts
alone, verified k deep, 1 + their accepted prefix; a drafter step, its tree at n nodes with the lookup drafts grafted
on, 1 + the deepest accepted node. A replayed batch is several traces decoded side by side, one row each; a step's
time is the verify-cost profile's at its rows and width (plus the measured drafting pass for a drafter step), times
uniform noise of ±10% (the spread of repeated timings on the 2-core machine of docs/results.md).

    python -m hf_diffspec.bench.replay record --out runs/replay/traces.jsonl          # minutes per prompt
    python -m hf_diffspec.bench.replay costs --out runs/replay/costs.json             # on a quiet machine
    python examples/benchmarks/controller_replay.py ...                                # the replay table

Traces are appended one prompt at a time: an interrupted recording goes on where it stopped.
"""

import argparse
import gzip
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HELD_OUT_SHARE = 0.5  # of every domain's prompts, by a hash of the prompt's id fixed before any tuning


def split_of(prompt_id: str) -> str:
    """"held-out" or "tuning", fixed by the prompt's id alone (so adding prompts never moves one across)."""
    return "held-out" if zlib.crc32(prompt_id.encode()) % 1000 < HELD_OUT_SHARE * 1000 else "tuning"


# ----- recording -------------------------------------------------------------------------------------------------
def prompt_pool(tokenizer, per_domain: int, seed: int, unseen: Path | None, long_prompts: int,
                long_tokens: int) -> list[dict]:
    """The built-in domains drawn by `seed`, the unseen-family file, and long-context prompts (a ShareGPT answer of
    about `long_tokens` tokens to summarise)."""
    from ..prompts import DOMAINS, iter_sharegpt, load_prompts, load_prompts_file

    pool = load_prompts(DOMAINS, n_per_domain=per_domain, tokenizer=tokenizer, seed=seed)
    if unseen is not None:
        pool += load_prompts_file(unseen, tokenizer=tokenizer)
    for record in iter_sharegpt():
        if long_prompts <= 0:
            break
        answers = [t.get("value") or "" for t in record.get("conversations") or [] if t.get("from") == "gpt"]
        ids = tokenizer(max(answers, key=len, default=""), add_special_tokens=False)["input_ids"]
        if len(ids) < long_tokens:
            continue
        prompt = f"Here is a document:\n\n{tokenizer.decode(ids[:long_tokens])}\n\nSummarize the document above."
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        pool.append({"id": f"long/{record.get('id')}", "domain": "long", "prompt": prompt, "text": text})
        long_prompts -= 1
    return pool


@torch.no_grad()
def record_trace(target, drafter, tokenizer, prompt: dict, max_new_tokens: int, lookup_tokens: int = 10) -> dict:
    """One prompt's trace (see the module docstring)."""
    from ..runtime.control_policy import DraftLengthPolicy
    from ..runtime.drafting import BestFirstTreeCandidateGenerator
    from ..runtime.drafting_lookup import PromptLookup

    ids = tokenizer(prompt["text"], return_tensors="pt", add_special_tokens=False).input_ids
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    sequence = out[0].tolist()
    prompt_length = ids.shape[1]
    hidden = target(out, output_hidden_states=True).hidden_states
    config = drafter.config
    policy = DraftLengthPolicy(config.block_size, tree_depth=config.block_size - 1)  # no cost model: every node
    generator = BestFirstTreeCandidateGenerator(drafter, target, policy)
    lookup = PromptLookup(lookup_tokens, 3)
    array = np.asarray(sequence)
    positions, cached = [], 0
    for j in range(prompt_length + 1, len(sequence)):  # committed prefix sequence[:j], anchor sequence[j - 1]
        if j - 1 > cached:  # the drafter's context: every committed token before the anchor
            generator.add_context(tuple(h[:, cached : j - 1] for h in hidden), slice(None),
                                  torch.arange(cached, j - 1)[None])
            cached = j - 1
        remaining = len(sequence) - j - 1  # drafts the row may still verify (after its anchor's token)
        drafts, ngram = lookup.find(array[:j], min(lookup_tokens, remaining, config.block_size - 1))
        if remaining > 0:
            tree = generator.propose([sequence[j - 1]], [j - 1], [remaining])[0]
            tokens, parents = tree.token_list[1:], tree.parents[1:]
            scores = [round(float(s), 5) for s in tree.confidences]
        else:
            tokens, parents, scores = [], [], []
        positions.append({"lookup": [int(t) for t in drafts], "ngram": ngram, "tokens": tokens, "parents": parents,
                          "scores": scores})
    return {"id": prompt["id"], "domain": prompt["domain"], "split": split_of(prompt["id"]),
            "prompt_length": prompt_length, "sequence": sequence, "positions": positions}


def record(args) -> None:
    from ..drafters import load_drafter
    from ..targets import load_target

    torch.manual_seed(0)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    # an untrained drafter gets the shipped one's tree settings (the default method drafts best-first trees)
    trees = dict(draft_tree_budget=15, draft_tree_width=8) if args.drafter == "random" else {}
    drafter = load_drafter(args.drafter, target, args.target, **trees).float()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.is_file():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    pool = prompt_pool(tokenizer, args.per_domain, args.seed, Path(args.unseen) if args.unseen else None,
                       args.long_prompts, args.long_tokens)
    for prompt in pool:
        if prompt["id"] in done:
            continue
        start = time.perf_counter()
        trace = record_trace(target, drafter, tokenizer, prompt, args.max_new_tokens)
        with out.open("a") as f:  # one whole line per prompt: an interrupted run leaves no partial trace
            f.write(json.dumps(trace) + "\n")
        print(f"{prompt['id']} ({trace['split']}): {len(trace['positions'])} positions, "
              f"{time.perf_counter() - start:.0f} s", flush=True)


@torch.no_grad()
def measure_costs(args) -> None:
    """The step costs the replay charges: the target's verify-cost profile (`verify_cost_for`, bf16, as the bench
    runs) and the seconds of one drafting pass (drafter forward and best-first trees) at each batch size, on a
    context of 256 tokens."""
    from ..drafters import load_drafter
    from ..runtime.control_policy import DraftLengthPolicy
    from ..runtime.control_profiles import verify_cost_for
    from ..runtime.drafting import BestFirstTreeCandidateGenerator
    from ..targets import load_target

    target, _ = load_target(args.target)
    drafter = load_drafter(args.drafter, target, args.target)
    cost = verify_cost_for(target)
    config = drafter.config
    drafting = {}
    for rows in (1, 4, 16, 64):
        ids = torch.randint(100, 1000, (rows, 257))
        hidden = target(ids, output_hidden_states=True).hidden_states
        policy = DraftLengthPolicy(config.block_size, tree_depth=config.block_size - 1)
        generator = BestFirstTreeCandidateGenerator(drafter, target, policy)
        generator.add_context(tuple(h[:, :256] for h in hidden), slice(None), torch.arange(256)[None].repeat(rows, 1))
        times = []
        for _ in range(6):
            start = time.perf_counter()
            generator.propose(ids[:, 256].tolist(), [256] * rows, [64] * rows)
            times.append(time.perf_counter() - start)
        drafting[rows] = sorted(times[1:])[2]
        print(f"drafting pass, {rows} rows: {drafting[rows] * 1e3:.1f} ms", flush=True)
    Path(args.out).write_text(json.dumps({"verify": {str(r): {str(n): s for n, s in row.items()}
                                                     for r, row in cost.costs.items()},
                                          "drafting": {str(r): s for r, s in drafting.items()},
                                          "threads": torch.get_num_threads()}, indent=1))


# ----- replaying -------------------------------------------------------------------------------------------------
@dataclass
class Position:
    """What each kind of step commits at one position of a trace (see the module docstring)."""

    lookup: list[int]  # the lookup drafts found (possibly none)
    ngram: int
    lookup_accepted: int  # how many of them the target's continuation agrees with
    tokens: list[int]  # the drafter's tree, best-first: node i + 1's token, parent (0: the anchor), score
    parents: list[int]
    scores: list[float]
    accepted: list[bool]  # node i + 1 lies on the target's continuation
    depths: list[int]
    next_tokens: list[int]  # what the target commits from here (as far as a step can reach)

    def tree_accepted(self, nodes: int) -> int:
        """Drafts accepted when the tree is verified at `nodes` nodes (anchor included)."""
        return max((d for d, ok in zip(self.depths[: nodes - 1], self.accepted[: nodes - 1]) if ok), default=0)


def positions_of(trace: dict) -> list[Position]:
    """A trace's positions, each with what every kind of step commits there (a row is done at the sequence's end)."""
    sequence, out = trace["sequence"], []
    for j, p in enumerate(trace["positions"], start=trace["prompt_length"] + 1):
        if j >= len(sequence):
            break
        continuation = sequence[j:]
        remaining = len(continuation) - 1  # drafts that can still be accepted: the last token is a bonus at most
        lookup = p["lookup"][:remaining]
        lookup_accepted = 0
        for draft, token in zip(lookup, continuation):
            if draft != token:
                break
            lookup_accepted += 1
        depths, accepted = [], []
        for token, parent in zip(p["tokens"], p["parents"]):
            depth = 1 if parent == 0 else depths[parent - 1] + 1
            ok = ((parent == 0 or accepted[parent - 1]) and depth <= remaining and continuation[depth - 1] == token)
            depths.append(depth)
            accepted.append(ok)
        out.append(Position(lookup, p["ngram"], lookup_accepted, p["tokens"], p["parents"], p["scores"], accepted,
                            depths, continuation[:16]))
    return out


def load_traces(path: Path, split: str | None = None) -> list[dict]:
    """The traces of a recording (JSONL, or gzipped JSONL as committed in examples/benchmarks/results/), of `split`
    ("tuning", "held-out"; None: all)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    traces = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [t for t in traces if split is None or t["split"] == split]


class ReplayCosts:
    """Seconds of a replayed step: the profile's verify cost at its rows and slots (interpolated as `VerifyCost`
    does), plus a drafting pass (interpolated between the batch sizes measured) for a drafter step, times noise."""

    def __init__(self, costs: dict, noise: float = 0.1, scale: float = 1.0):
        from ..runtime.control_cost import VerifyCost

        self.verify = VerifyCost({int(r): {int(n): s for n, s in row.items()} for r, row in costs["verify"].items()})
        self.drafting = {int(r): s for r, s in costs["drafting"].items()}
        self.noise = noise
        self.scale = scale  # drafting passes this many times dearer (a slower drafter, or where verifying is cheap)

    def draft_seconds(self, rows: int) -> float:
        from ..runtime.control_cost import _interpolate

        return self.scale * _interpolate(self.drafting, rows)

    def step(self, rng: random.Random, rows: int, slots: int, drafted: bool) -> tuple[float, float, float]:
        """(the step's seconds, its verify seconds, its drafting seconds)."""
        verify = self.verify.profiled(slots, rows) * rng.uniform(1 - self.noise, 1 + self.noise)
        draft = self.draft_seconds(rows) * rng.uniform(1 - self.noise, 1 + self.noise) if drafted else 0.0
        return draft + verify, verify, draft


@dataclass
class CallResult:
    """One replayed call: tokens committed, seconds taken, the kinds of its steps and what each committed, in order."""

    tokens: int
    seconds: float
    kinds: list
    committed: list

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def replay_call(controller, rows: list[list[Position]], costs: ReplayCosts, rng: random.Random,
                oracle: bool = False) -> CallResult:
    """Decode `rows` (one trace's positions each) side by side to their ends, each step's kind decided by
    `controller` (`decide`, `observe_lookups`, `record`, as the live loop calls them); the drafter's trees sized by
    the cost model from their own scores, as `DraftLengthPolicy.tree_node_count` does. `oracle`: each step takes the
    kind that commits the most per expected second at this step (the controller only learns)."""
    from ..runtime.control_speculation import StepKind, StepRecord

    at = [0] * len(rows)
    active = list(range(len(rows)))
    tokens, seconds, kinds, per_step = 0, 0.0, [], []
    while active:
        n_rows = len(active)
        here = [rows[r][at[r]] for r in active]
        ngrams = [p.ngram if p.lookup else 0 for p in here]
        lengths = [len(p.lookup) for p in here]
        kind, k = controller.decide(n_rows, ngrams, lengths)
        if oracle:  # every kind at every lookup depth, the one committing the most per expected second
            options = {(o, depth): _outcome(o, depth, here, costs, n_rows)
                       for o in (StepKind.PLAIN, StepKind.LOOKUP, StepKind.DRAFT)
                       for depth in range(max(lengths, default=0) + 1)}
            def rate(key):
                drafted = key[0] is StepKind.DRAFT
                return options[key][0] / (costs.verify.profiled(options[key][1], n_rows)
                                          + costs.draft_seconds(n_rows) * drafted)

            kind, k = max(options, key=rate)
            outcome = options[kind, k]
        else:
            outcome = _outcome(kind, k, here, costs, n_rows)
        committed, slots, accepted = outcome
        took, verify, drafting = costs.step(rng, n_rows, slots, kind is StepKind.DRAFT)
        per_row = [1 + a for a in accepted]
        controller.observe_lookups(ngrams, [p.lookup for p in here], [p.next_tokens[:c] for p, c in zip(here, per_row)])
        controller.record(StepRecord(kind, n_rows, max(ngrams, default=0), committed, took, slots, verify,
                                     drafting), ngrams, accepted)
        tokens, seconds = tokens + committed, seconds + took
        kinds.append(kind)
        per_step.append(committed)
        for r, c in zip(active, per_row):
            at[r] += c
        active = [r for r in active if at[r] < len(rows[r])]
    return CallResult(tokens, seconds, kinds, per_step)


def _outcome(kind, lookup_count: int, here: list[Position], costs: ReplayCosts, n_rows: int):
    """(tokens committed, slots per row, drafts accepted per row) of a step of `kind` over the rows at `here`."""
    from ..runtime.control_cost import best_node_count
    from ..runtime.control_speculation import StepKind

    accepted, slots = [], 1
    for p in here:
        k = min(lookup_count, len(p.lookup))
        looked = min(p.lookup_accepted, k)
        if kind is StepKind.PLAIN:
            accepted.append(0)
        elif kind is StepKind.LOOKUP:
            accepted.append(looked)
            slots = max(slots, 1 + k)
        else:
            n = best_node_count([p.scores], lambda n: costs.verify.profiled(n, n_rows), costs.draft_seconds(n_rows))
            accepted.append(max(p.tree_accepted(n), looked))
            slots = max(slots, n + k)  # the lookup chain after the tree's nodes (`CandidateTree.lookup`)
    return len(here) + sum(accepted), slots, accepted


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record fp32 greedy traces (appends; resumable)")
    rec.add_argument("--out", required=True)
    rec.add_argument("--target", default="smollm2-135m-instruct")
    rec.add_argument("--drafter", default=None, help="a drafter directory, 'random', or the shipped one (default)")
    rec.add_argument("--per-domain", type=int, default=12)
    rec.add_argument("--seed", type=int, default=7, help="draws the built-in domains' prompts")
    rec.add_argument("--unseen", default="examples/benchmarks/prompts/unseen_families.jsonl")
    rec.add_argument("--long-prompts", type=int, default=4)
    rec.add_argument("--long-tokens", type=int, default=1024)
    rec.add_argument("--max-new-tokens", type=int, default=256)
    costs = sub.add_parser("costs", help="measure the step costs the replay charges (quiet machine)")
    costs.add_argument("--out", required=True)
    costs.add_argument("--target", default="smollm2-135m-instruct")
    costs.add_argument("--drafter", default=None)
    args = parser.parse_args(argv)
    record(args) if args.command == "record" else measure_costs(args)


if __name__ == "__main__":
    main()
