"""A measured cost model: how long one target forward takes to verify n tokens on this machine, and which candidate
nodes are worth verifying.

Speculation pays per step (1 + expected accepted drafts) / (T_draft + T_verify(n)). Each candidate node carries an
estimate of the probability that verification reaches it (products of drafter confidences); the expected number of
accepted drafts when verifying the n most probable nodes is the sum of their probabilities. `best_node_count` picks
the n that maximises expected tokens per second, so the verified length follows the drafter's confidence step by step
and the machine's real cost curve, instead of a fixed length or a hand-set concurrency gate.

`hf-diffspec profile` measures T_verify(n) once per (target, device, dtype, threads) and caches it as JSON; without a
profile, drafts are verified at the drafter's configured length.
"""

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from transformers import DynamicCache

PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def profile_key(target) -> str:
    """Identifies what the cost depends on: the target's architecture, its device and dtype, and the thread count."""
    config = target.config.get_text_config().to_json_string(use_diff=False)
    arch = hashlib.sha256(config.encode()).hexdigest()[:12]
    device = str(target.device)
    if target.device.type == "cuda":
        device = torch.cuda.get_device_name(target.device)
    threads = torch.get_num_threads() if target.device.type == "cpu" else 0
    raw = f"{arch}|{device}|{target.dtype}|{threads}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_dir() -> Path:
    root = os.environ.get("HF_DIFFSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_diffspec")
    return Path(root) / "profiles"


@torch.no_grad()
def measure_verify_cost(target, sizes=PROFILE_SIZES, context_length: int = 256, repeats: int = 7) -> dict[int, float]:
    """Median seconds of a target forward over n new tokens on top of a cached context of `context_length`."""
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context_length), device=device)
    cache = DynamicCache()
    target(ids, cache=cache)
    times = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up
        for n in sizes:
            new = torch.randint(0, vocab, (1, n), device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            target(new, cache=cache, position_ids=torch.arange(context_length, context_length + n, device=device)[None])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[n].append(time.perf_counter() - start)
            cache.crop(-n)
    return {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}


def save_profile(target, costs: dict[int, float]) -> Path:
    path = profile_dir() / f"{profile_key(target)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"key": profile_key(target), "model_type": target.config.get_text_config().model_type,
               "device": str(target.device), "dtype": str(target.dtype), "threads": torch.get_num_threads(),
               "verify_seconds": {str(n): t for n, t in costs.items()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)
    return path


class VerifyCost:
    """T_verify(n) interpolated from a measured profile."""

    def __init__(self, costs: dict[int, float]):
        self.sizes = sorted(costs)
        self.costs = costs

    @classmethod
    def for_target(cls, target) -> "VerifyCost | None":
        """The cached profile for this target/device/dtype/threads, or None (run `hf-diffspec profile`)."""
        path = profile_dir() / f"{profile_key(target)}.json"
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls({int(n): float(t) for n, t in data["verify_seconds"].items()})

    def __call__(self, n: int) -> float:
        sizes = self.sizes
        if n <= sizes[0]:
            return self.costs[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if n <= hi:
                return self.costs[lo] + (self.costs[hi] - self.costs[lo]) * (n - lo) / (hi - lo)
        last, before = sizes[-1], sizes[-2]  # extrapolate linearly beyond the profile
        return self.costs[last] + (self.costs[last] - self.costs[before]) * (n - last) / (last - before)


def best_node_count(reach_probs: list[float], verify_cost: VerifyCost, draft_seconds: float) -> int:
    """How many of the candidate nodes (sorted by reach probability, ancestors first) to verify, root included:
    argmax over n of (1 + sum of the first n-1 reach probabilities) / (draft_seconds + T_verify(n))."""
    best_n, best_rate, expected = 1, 1.0 / (draft_seconds + verify_cost(1)), 1.0
    for i, p in enumerate(reach_probs, start=2):
        expected += p
        rate = expected / (draft_seconds + verify_cost(i))
        if rate > best_rate:
            best_n, best_rate = i, rate
    return best_n
