"""The laws tokens are sampled from when decoding samples, kept compact.

When sampling, the target picks each token from its processed law: the call's logits processors, then generate's
warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta). The drafter's law at a draft slot passes through
the same processors, so that its drafts are drawn where the target puts its mass. After top-k (transformers' default
is 50; Qwen3 ships 20) a law gives mass to at most k tokens: `CompactLaw` holds such a law as its K candidates' ids
and probabilities, and rejection sampling (`verification.py`) works on those, a few dozen numbers per position
instead of the whole vocabulary (49,152 for SmolLM2: a top-p sort over it costs ~1.5 ms per position here).

Compaction is exact: the candidates are the top k + `TIE_SLACK` scores after the processors that come before top-k,
top-k and every later processor run on them alone (tokens outside are -inf after top-k, and add nothing to a
softmax), and a law whose k-th score ties the last candidate's (top-k then keeps more tokens than the candidates) is
reported (`exact` False), so that its position is decided by the full-vocabulary rule instead. Without a top-k
warper, laws stay dense (`ids` None).
"""

from dataclasses import dataclass

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# generate's warpers (applied when sampling): each reads the scores alone, never the prefix
WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
           EpsilonLogitsWarper, EtaLogitsWarper)
# candidates kept beyond top-k, so that a tie at the k-th score rarely spills past them
TIE_SLACK = 4


@dataclass
class CompactLaw:
    """Laws over the vocabulary, one per leading index: `probs` (..., K) of the tokens `ids` (..., K); an id of -1
    carries no mass (a point mass is [x, -1, ...] with [1, 0, ...]). `ids` None: dense, `probs` (..., vocab)."""

    ids: torch.Tensor | None
    probs: torch.Tensor

    def __getitem__(self, index) -> "CompactLaw":
        return CompactLaw(None if self.ids is None else self.ids[index], self.probs[index])

    @property
    def width(self) -> int:
        return self.probs.shape[-1]

    def max(self) -> torch.Tensor:
        """The largest probability of each law (the drafter's confidence): it does not depend on any draw."""
        return self.probs.max(-1).values

    def dense(self, vocab: int) -> torch.Tensor:
        """(..., vocab) probabilities."""
        if self.ids is None:
            return self.probs
        out = self.probs.new_zeros((*self.probs.shape[:-1], vocab + 1))  # the last column takes the -1 ids
        return out.scatter_(-1, self.ids.masked_fill(self.ids < 0, vocab), self.probs)[..., :vocab]

    def at(self, tokens: torch.Tensor) -> torch.Tensor:
        """Probability of `tokens` (...,) under each law (...)."""
        if self.ids is None:
            return self.probs.gather(-1, tokens[..., None]).squeeze(-1)
        return ((self.ids == tokens[..., None]) * self.probs).sum(-1)

    def on(self, ids: torch.Tensor) -> torch.Tensor:
        """Probabilities of each law at `ids` (..., K'): (..., K')."""
        if self.ids is None:
            return self.probs.gather(-1, ids.clamp(min=0)) * (ids >= 0)
        return ((self.ids[..., None, :] == ids[..., :, None]) * self.probs[..., None, :]).sum(-1)

    def sample(self) -> torch.Tensor:
        """One token per law (...), drawn on the device without a host read (the exponential race: argmax p / E,
        E ~ Exp(1), picks index i with probability p_i)."""
        race = torch.empty_like(self.probs, dtype=torch.float32).exponential_().clamp_(min=1e-30)
        index = (self.probs.float() / race).argmax(-1, keepdim=True)
        return index.squeeze(-1) if self.ids is None else self.ids.gather(-1, index).squeeze(-1)

    @staticmethod
    def point_masses(tokens: torch.Tensor, width: int) -> "CompactLaw":
        """The law of deterministic drafts `tokens` (...,): all mass on the token."""
        ids = torch.full((*tokens.shape, width), -1, dtype=torch.long, device=tokens.device)
        ids[..., 0] = tokens
        probs = torch.zeros(ids.shape, dtype=torch.float32, device=tokens.device)
        probs[..., 0] = 1.0
        return CompactLaw(ids, probs)


class SamplingLaws:
    """The processed laws of a sampling call: `laws(scores)` turns raw scores (..., vocab) into the law a token is
    sampled from, as `_sample` would (the processors in their order), compact after a top-k warper.

    Args:
        processors: the call's logits processors, warpers included; only processors that read no prefix may be
            given (the caller checks: `BatchState` keeps prefix-dependent ones on the token-by-token path).
    """

    def __init__(self, processors):
        processors = list(processors)
        top_k = next((i for i, p in enumerate(processors) if isinstance(p, TopKLogitsWarper)), None)
        # before top-k: monotone warpers (temperature) may run on the candidates; anything else runs on every token
        if top_k is not None and not all(isinstance(p, TemperatureLogitsWarper)
                                         for p in processors[:top_k] if isinstance(p, WARPERS)):
            top_k = None
        self.top_k = None if top_k is None else processors[top_k].top_k
        if top_k is None:
            self.full, self.on_candidates, self.after = processors, [], []
        else:
            first_warper = next(i for i, p in enumerate(processors) if isinstance(p, WARPERS))
            self.full = processors[:first_warper]
            self.on_candidates = processors[first_warper:top_k]
            self.after = processors[top_k:]

    @property
    def temperature(self) -> float:
        """The temperature warper's, 1.0 without one (for drafters whose own law takes only a temperature)."""
        warpers = [p for p in self.full + self.on_candidates + self.after if isinstance(p, TemperatureLogitsWarper)]
        return float(warpers[0].temperature) if warpers else 1.0

    @property
    def compact(self) -> bool:
        return self.top_k is not None

    def compacted(self, probs: torch.Tensor) -> CompactLaw:
        """Dense laws (..., vocab) made from this call's compact ones (a compact law spread over the vocabulary, or
        one with tokens removed and renormalised), back in compact form: they give mass to at most as many tokens."""
        values, ids = probs.topk(min(self.top_k + TIE_SLACK, probs.shape[-1]), dim=-1)
        return CompactLaw(ids, values)

    def laws(self, scores: torch.Tensor) -> tuple[CompactLaw, torch.Tensor | None]:
        """The laws of raw `scores` (..., vocab), and per law whether compaction kept it exact (None when dense)."""
        shape = scores.shape
        flat = scores.float().reshape(-1, shape[-1])
        placeholder = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)  # they read no ids
        for processor in self.full:
            flat = processor(placeholder, flat)
        if not self.compact:
            probs = flat.softmax(-1)
            return CompactLaw(None, probs.view(shape)), None
        width = min(self.top_k + TIE_SLACK, shape[-1])
        values, ids = flat.topk(width, dim=-1)
        for processor in self.on_candidates:
            values = processor(placeholder, values)
        top_k = min(self.top_k, shape[-1])
        # top-k keeps every token scoring at least the k-th score: exact when none outside the candidates does
        exact = (values[:, -1] < values[:, top_k - 1]) | (width == shape[-1])
        for processor in self.after:
            values = processor(placeholder, values)
        probs = values.softmax(-1)
        return CompactLaw(ids.view(*shape[:-1], width), probs.view(*shape[:-1], width)), exact.view(shape[:-1])
