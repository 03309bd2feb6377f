"""Replay the drafter's per-slot marginals offline: what a tree width, a node budget or a reduced draft vocabulary
would have accepted, without decoding again for each setting.

    python examples/benchmarks/draft_replay.py --prompts 6 --max-new-tokens 192 --vocab-sizes 4096,8192,16384 \
        --data data/regen-smollm2

The prompts are decoded once with the whole block verified every step (greedy, bf16). Each step records the
drafter's 16 largest logits per slot and the tokens the target then committed. For each setting, a step counts the
tokens it would have committed: the anchor plus the deepest node on the target's path. The settings are a chain of
n drafts, or a best-first tree of B drafted nodes at width w (built by `best_first_shape`, as in `generate`). Either
may be restricted to the V most frequent response tokens (chosen as `hf-diffspec convert --reduce-vocab` does:
ShareGPT answers plus `--data`). Tau here assumes every step verifies that setting; in `generate` the cost model
picks the size per step.
"""

import argparse

import torch

from hf_diffspec import load_target
from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime.drafting_best_first import best_first_shape
from hf_diffspec.trainers.draft_vocabulary import count_response_tokens, special_token_ids, top_tokens

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--target", default="smollm2-135m-instruct")
parser.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
parser.add_argument("--prompts", type=int, default=6, help="prompts per domain")
parser.add_argument("--max-new-tokens", type=int, default=192)
parser.add_argument("--budgets", default="3,7,15,31")
parser.add_argument("--widths", default="2,4,8")
parser.add_argument("--vocab-sizes", default="", help="e.g. 4096,8192,16384 (empty: full vocabulary only)")
parser.add_argument("--data", nargs="*", default=[], help="drafter data directories counted for --vocab-sizes")
parser.add_argument("--sharegpt-responses", type=int, default=20000)
args = parser.parse_args()

target, tokenizer = load_target(args.target, dtype=torch.bfloat16)
drafter = load_drafter(args.drafter, target, args.target, length_head=False, draft_tree_budget=None)
block = drafter.config.block_size

# the top-16 probabilities and ids per slot of every whole-block drafting pass, in step order
steps, pending = [], []
compute_logits = drafter.compute_logits


def recording_compute_logits(hidden_states):
    logits = compute_logits(hidden_states)
    if hidden_states.shape[1] == block - 1:  # a whole-block drafting pass (not a chunk): keep it
        top = logits[0].float().log_softmax(-1).topk(16, dim=-1)
        pending.append((top.values.exp(), top.indices))
    return logits


drafter.compute_logits = recording_compute_logits
for prompt in load_prompts(n_per_domain=args.prompts, tokenizer=tokenizer):
    inputs = tokenizer(prompt["text"], return_tensors="pt")
    out = target.generate(**inputs, assistant_model=drafter, num_assistant_tokens=block - 1, do_sample=False,
                          max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    sequence = out.sequences[0].tolist()
    # the prefill commits the first token (the first anchor); each step then commits `committed` more
    anchor = inputs["input_ids"].shape[1]
    for (probs, ids), committed in zip(pending, out.speculation_stats.committed_per_step):
        labels = sequence[anchor + 1 : anchor + block]
        if len(labels) == block - 1:
            steps.append((probs, ids, labels))
        anchor += committed
    pending.clear()
print(f"{len(steps)} drafting steps recorded")


def tau(width: int, budget: int | None, keep: torch.Tensor | None = None) -> float:
    """Mean tokens committed per step: a chain of `budget` drafts when width is 1, else the best-first tree."""
    total = 0
    for probs, ids, labels in steps:
        if keep is not None:  # tokens outside the draft vocabulary are never drafted
            inside = keep[ids]
            order = torch.argsort((~inside).int(), dim=-1, stable=True)
            probs, ids = torch.where(inside, probs, 0).gather(-1, order), ids.gather(-1, order)
        reached, best = {(): True}, 0
        for path, _ in best_first_shape(probs[:, :width].tolist(), budget):
            depth = len(path) - 1
            reached[path] = reached[path[:-1]] and int(ids[depth, path[-1]]) == labels[depth]
            best = max(best, len(path)) if reached[path] else best
        total += 1 + best
    return total / len(steps)


budgets = [int(b) for b in args.budgets.split(",")]
widths = [int(w) for w in args.widths.split(",")]
vocabularies = {"full": None}
if args.vocab_sizes:
    counts = count_response_tokens(args.data or None, tokenizer=tokenizer, sharegpt_responses=args.sharegpt_responses,
                                   vocab_size=target.config.get_text_config().vocab_size)
    eos = target.generation_config.eos_token_id
    special = special_token_ids(tokenizer) + (eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for size in [int(v) for v in args.vocab_sizes.split(",")]:
        keep = torch.zeros(len(counts), dtype=torch.bool)
        keep[torch.as_tensor(top_tokens(counts, size, special))] = True
        vocabularies[str(size)] = keep
print("| vocabulary | shape | " + " | ".join(f"{b} drafted nodes" for b in budgets) + " |")
print("|---|---|" + "---|" * len(budgets))
for name, keep in vocabularies.items():
    shapes = [("chain", 1)] + [(f"tree, width {w}", w) for w in widths]
    for label, width in shapes if keep is None else [("chain", 1), (f"tree, width {max(widths)}", max(widths))]:
        print(f"| {name} | {label} | " + " | ".join(f"{tau(width, b, keep):.3f}" for b in budgets) + " |")
