"""Shared test helpers: tiny random targets and a noisy-oracle drafting policy.

The oracle stands in for a well-trained drafter so that tests exercise acceptance (long accepted paths, branches,
bonus tokens): it proposes the target's own greedy continuation, corrupted at random, optionally with wrong sibling
branches. The loop must be lossless for ANY proposals, so this is a fair test of verification, not of drafting.
"""

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.runtime.tree import CandidateTree


def tiny_target(kind: str = "llama", seed: int = 0, vocab_size: int = 128, attn: str = "sdpa", layers: int = 4):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(kind)
    model.set_attn_implementation(attn)
    # generate() must not stop at the random model's EOS unless a test asks for it
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def tiny_drafter(target, block_size: int = 4, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=block_size, **kw)


class NoisyOracle:
    """A `propose` replacement: the reference continuation with each token corrupted with probability `noise`,
    plus, when `branches` > 0, up to that many wrong siblings per depth (a real tree).

    `reference`: a (1, length) tensor, or one 1-D sequence per row of a batch (each row's own prompt + plain
    continuation, without padding: a row's root position indexes it directly)."""

    def __init__(self, reference, vocab_size: int, noise: float = 0.3, branches: int = 0, seed: int = 0):
        rows = reference if isinstance(reference, list) else list(reference)
        self.references = [torch.as_tensor(r).tolist() for r in rows]
        self.vocab_size = vocab_size
        self.noise = noise
        self.branches = branches
        self.rng = random.Random(seed)
        self.trees: list[CandidateTree] = []
        self.active = list(range(len(self.references)))

    def propose(self, generator, root_tokens, root_positions, max_depths):
        return [self.tree(generator, self.references[row], root, position, depth)
                for row, root, position, depth in zip(self.active, root_tokens, root_positions, max_depths)]

    def tree(self, generator, reference, root_token: int, root_position: int, max_depth: int) -> CandidateTree:
        max_depth = min(max_depth, generator.block_size - 1)
        truth = reference[root_position + 1 : root_position + 1 + max_depth]
        tokens, parents = [root_token], [-1]
        parent = 0
        for tok in truth:
            if self.rng.random() < self.noise:
                tok = self.rng.randrange(self.vocab_size)
            siblings = {tok}
            for _ in range(self.branches):
                wrong = self.rng.randrange(self.vocab_size)
                if wrong not in siblings:
                    siblings.add(wrong)
                    tokens.append(wrong)
                    parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        tree = CandidateTree(torch.tensor(tokens), parents)
        self.trees.append(tree)
        return tree


def install_oracle(monkeypatch, oracle: NoisyOracle):
    """Route every `DiffusionCandidateGenerator.propose` to `oracle`, tracking which rows are still decoding."""
    init, select_rows = DiffusionCandidateGenerator.__init__, DiffusionCandidateGenerator.select_rows

    def fresh(self, *args, **kwargs):
        init(self, *args, **kwargs)
        oracle.active = list(range(len(oracle.references)))

    def select(self, keep):
        select_rows(self, keep)
        oracle.active = [oracle.active[i] for i in keep.tolist()]

    monkeypatch.setattr(DiffusionCandidateGenerator, "__init__", fresh)
    monkeypatch.setattr(DiffusionCandidateGenerator, "select_rows", select)
    monkeypatch.setattr(DiffusionCandidateGenerator, "propose",
                        lambda self, *args: oracle.propose(self, *args))


def two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square statistic of two count vectors over the same categories (bins empty in both are dropped)."""
    total = a + b
    keep = total > 0
    expected = total[keep] / 2
    return float((((a[keep] - expected) ** 2 + (b[keep] - expected) ** 2) / expected).sum())


def marginal_counts(target, ids, vocab, n, seed_offset, **kwargs) -> torch.Tensor:
    """Counts of (2nd, last) generated tokens over n seeded runs: a (2, vocab) tensor."""
    counts = torch.zeros(2, vocab)
    for seed in range(n):
        torch.manual_seed(seed_offset + seed)
        out = target.generate(ids, **kwargs)
        counts[0, out[0, ids.shape[1] + 1]] += 1
        counts[1, out[0, -1]] += 1
    return counts


def assert_sampling_matches_plain(target, ids, vocab, drafter, limit: float, n: int = 300, drafter_kwargs=None,
                                  **kwargs) -> None:
    """Plain sampling against sampling with `drafter` (`drafter_kwargs` added), independent seeds: the 2nd and the
    last generated token's marginals must pass a two-sample chi-square at `limit` (~ its 0.999 quantile)."""
    plain = marginal_counts(target, ids, vocab, n, 0, **kwargs)
    ours = marginal_counts(target, ids, vocab, n, 90_000, assistant_model=drafter, **(drafter_kwargs or {}), **kwargs)
    for slot in range(2):
        assert two_sample_chi2(plain[slot], ours[slot]) < limit
