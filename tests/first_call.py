"""A user's first and second speculative calls on one target family, in this process, with nothing switched off.

Run in a fresh process on an empty cache directory (`tests/test_first_call.py` does, one process per case):
    HF_DIFFSPEC_CACHE=$(mktemp -d) python tests/first_call.py gemma4_conditional

It builds a tiny random fp32 target of the case's class and a tiny random drafter with the runtime's defaults (best-
first trees, prompt lookup), then checks, greedily:
1. the first speculative call measures the verify-cost profile (none is cached yet), caches it in the cache directory
   (unless the measurement was disturbed: a busy machine), speculates, and returns plain `generate`'s output;
2. a second call, after `reset_speculation_state()` (what a new process starts from: the cached profile, no gates),
   reads the cached profile without measuring again and returns plain `generate`'s output.
It prints one JSON line: the case, the class, whether each call was identical, the profile's state (where it was
cached, what the first call logged about it), the steps and drafts of each call.
"""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `helpers` when run as a script

import torch  # noqa: E402

import hf_diffspec  # noqa: E402
from hf_diffspec.runtime import control_profiles as cost_model, control_policy as policy  # noqa: E402
from hf_diffspec.runtime.control_state import reset_speculation_state  # noqa: E402
from helpers import (FAMILIES, MULTIMODAL, random_ids, tiny_family_target, tiny_hybrid_target,  # noqa: E402
                     tiny_multimodal_target, tiny_target)

WINDOW = 8  # shorter than the first-use profile's context and than prompt + generation

CASES = {
    "llama": lambda: tiny_target("llama", seed=1, sharpen=3),
    "qwen3": lambda: tiny_target("qwen3", seed=1, sharpen=3),
    **{family: (lambda f=family: tiny_family_target(f, seed=1, window=WINDOW, sharpen=3)) for family in FAMILIES},
    "qwen3_5": lambda: tiny_hybrid_target("qwen3_5", seed=1, sharpen=3),
    "qwen3_5_moe": lambda: tiny_hybrid_target("qwen3_5_moe", seed=1, sharpen=3),
    **{f"{kind}_conditional": (lambda k=kind: tiny_multimodal_target(k, seed=1, window=WINDOW, sharpen=3))
       for kind in MULTIMODAL},
}


class Warnings(logging.Handler):
    """The runtime's warnings, as a user's log shows them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run(case: str) -> dict:
    if os.environ.get("HF_DIFFSPEC_AUTO_PROFILE") is not None:
        raise SystemExit("HF_DIFFSPEC_AUTO_PROFILE is set: this check runs with nothing switched off")
    measured, node_counts = [], []
    original = cost_model.measure_verify_cost
    cost_model.measure_verify_cost = lambda *a, **kw: measured.append(1) or original(*a, **kw)
    # the cost model's choice of slots for the drafter's drafts (chains and trees, root included), every time it
    # chooses; the sizing of prompt-lookup drafts is not counted (steps without a drafter forward verify those)
    tree_node_count, chain_lengths = policy.DraftLengthPolicy.tree_node_count, policy.DraftLengthPolicy.chain_lengths

    def counted_tree(self, *args, **kwargs):  # (not the drafting price's measured passes: a fixed length)
        count = tree_node_count(self, *args, **kwargs)
        if self.uses_cost_model:
            node_counts.append(count)
        return count

    def counted_chains(self, *args, **kwargs):
        lengths = chain_lengths(self, *args, **kwargs)
        if self.uses_cost_model:
            node_counts.append(1 + max(lengths, default=0))
        return lengths

    policy.DraftLengthPolicy.tree_node_count, policy.DraftLengthPolicy.chain_lengths = counted_tree, counted_chains
    warnings = Warnings()
    logging.getLogger("hf_diffspec").addHandler(warnings)
    target = CASES[case]()
    torch.manual_seed(0)
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8,
                                                       **hf_diffspec.DiffusionDrafterConfig.RUNTIME_DEFAULTS)
    # a phrase repeated: prompt lookup finds drafts the target accepts
    phrase = random_ids(7, 6, vocab=100)
    ids = torch.cat([random_ids(1, 10, vocab=100), phrase, random_ids(2, 4, vocab=100), phrase], dim=1)
    settings = dict(max_new_tokens=40, do_sample=False)
    plain = target.generate(ids, **settings)
    result = {"case": case, "class": type(target).__name__}
    path = cost_model.profile_path(target)
    result["profile_path"] = str(path)
    for call in ("first", "second"):
        if call == "second":
            reset_speculation_state()
            # by the first call, measured on a quiet machine (a disturbed one serves this process alone)
            result["profile_cached"] = path.is_file() and "disturbed" not in json.loads(path.read_text())
            # and the drafting pass's price, cached only when measured with the cores free of other processes
            result["drafting_price_cached"] = any(path.parent.glob("drafting-*.json"))
            result["cached_profile_problem"] = cost_model.read_profile(path)[1] if path.is_file() else None
            mtime = path.stat().st_mtime_ns if path.is_file() else None
        measured.clear()
        node_counts.clear()
        warnings.messages.clear()
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **settings)
        stats = out.speculation_stats
        result[call] = {"identical": torch.equal(out.sequences, plain), "profile_measurements": len(measured),
                        "steps": len(stats.committed_per_step), "tau": round(stats.tau, 3),
                        "draft_steps": stats.draft_steps, "lookup_steps": stats.lookup_steps,
                        "plain_steps": stats.plain_steps, "draft_forwards": stats.draft_forwards,
                        "drafted_tokens": stats.drafted_tokens, "lookup_tokens": stats.lookup_tokens,
                        "node_counts": list(node_counts), "warnings": list(warnings.messages)}
    result["profile_rewritten_by_second_call"] = path.is_file() and path.stat().st_mtime_ns != mtime
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    print(json.dumps(run(sys.argv[1])))
