"""Our loop's own cost on plain decode steps: plain `generate` against our loop with speculation switched off (every
step the anchors alone, no drafter forward), the same rows held to the same length.

    python examples/benchmarks/plain_step_overhead.py --rows 16 --tokens 48 [--hold eos] [--profile]

`--hold min-new-tokens` (the default) holds the rows with `min_new_tokens`, which adds a logits processor;
`--hold eos` instead makes the end-of-sequence token one the target never writes (`<empty_output>`), so no processor
runs and the stopping criteria are the default ones: greedy decoding as the benchmark runs it.

Prints the median time of each over 8 interleaved pairs and the median of the pairs' ratios (ours / plain); with
`--profile`, the cumulative profile of one call of each, restricted to the loop's and the processors' functions.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from hf_diffspec import load_target
from hf_diffspec.bench import encode_batches
from hf_diffspec.drafters import load_drafter
from hf_diffspec.prompts import load_prompts
from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--hold", choices=["min-new-tokens", "eos"], default="min-new-tokens")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    target, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    drafter = load_drafter(None, target, "smollm2-135m-instruct", length_head=False, draft_tree_budget=None,
                           prompt_lookup_num_tokens=None)  # the shipped drafter; it never drafts here
    SpeculationController.decide = lambda self, rows, ngrams, lengths: (StepKind.PLAIN, 0)  # plain steps only
    inputs = encode_batches(tok, load_prompts(n_per_domain=5, tokenizer=tok), args.rows, target.device)[0][1]
    common = dict(**inputs, max_new_tokens=args.tokens, do_sample=False)
    if args.hold == "eos":
        common.update(eos_token_id=tok.convert_tokens_to_ids("<empty_output>"), pad_token_id=tok.pad_token_id)
    else:
        common.update(min_new_tokens=args.tokens)
    runs = {"plain": lambda: target.generate(**common), "ours": lambda: target.generate(**common,
                                                                                        assistant_model=drafter)}
    for run in runs.values():  # warm-up
        run()
    times = {name: [] for name in runs}
    for i in range(args.pairs):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(o / p for o, p in zip(times["ours"], times["plain"]))
    print({name: round(statistics.median(t), 3) for name, t in times.items()}, f"ours / plain: {ratio:.3f}")
    if args.profile:
        for name, run in runs.items():
            profile = cProfile.Profile()
            profile.runcall(run)
            print(f"--- {name}")
            pstats.Stats(profile).sort_stats("cumulative").print_stats("hf_diffspec|logits_process|stopping", 15)


if __name__ == "__main__":
    main()
