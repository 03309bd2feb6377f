"""Prompt-lookup candidates: free drafts copied from the row's own text (as transformers' prompt-lookup decoding).

When the last few committed tokens of a row occurred earlier in it (the prompt, or what it generated), the tokens
that followed them then are a guess for what follows now. Such guesses cost no drafter forward, and they are right
often where a small drafter is weak: code that repeats names, answers that quote the question. The decoding loop
verifies them as one more branch of the step's tree, or alone (a step without a drafter forward), and the measured
cost model decides how many of them to verify from how often lookup drafts have been accepted at each depth so far.

Greedy decoding only: a copied token has no draft distribution for rejection sampling to use beside the drafter's
drawn siblings, so sampled decoding does not look up (its output distribution is unaffected either way).
"""

import torch

from .tree import CandidateTree


class PromptLookup:
    """Finds lookup drafts per row and measures how often they are accepted.

    Args:
        num_tokens: most tokens copied per step (transformers' `prompt_lookup_num_tokens`).
        max_ngram: longest suffix matched (transformers' `max_matching_ngram_size`); shorter suffixes are tried when
            it does not occur earlier.
        prior: acceptance probability assumed at every depth before any measurement, held as `prior_weight` pseudo
            steps, so the first steps neither trust nor dismiss lookup drafts outright.
    """

    def __init__(self, num_tokens: int, max_ngram: int = 2, prior: float = 0.5, prior_weight: float = 2.0):
        if num_tokens < 1 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 1 and max_ngram >= 1, got {num_tokens}, {max_ngram}")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        # per depth d: steps whose lookup draft reached depth d (d-1 accepted), and those that accepted depth d too
        self.trials = [prior_weight] * num_tokens
        self.hits = [prior * prior_weight] * num_tokens

    def find(self, ids: torch.Tensor, limit: int) -> torch.Tensor:
        """Up to `limit` tokens that followed the most recent earlier occurrence of the longest suffix of `ids` (1-D,
        the row's committed tokens, its anchor last) that occurred earlier; empty when none did."""
        limit = min(limit, self.num_tokens)
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            if limit <= 0:
                break
            # windows that end before the last token, so a continuation exists and the suffix itself is excluded
            windows = ids[:-1].unfold(0, n, 1)
            starts = (windows == ids[-n:]).all(-1).nonzero()
            if starts.numel():
                start = int(starts[-1]) + n
                return ids[start : start + limit]
        return ids.new_empty(0)

    def reach(self, length: int) -> list[float]:
        """Estimated probability that verification accepts each of a `length`-token lookup draft's first tokens."""
        probabilities, reach = [], 1.0
        for d in range(length):
            reach *= self.hits[d] / self.trials[d]
            probabilities.append(reach)
        return probabilities

    def record(self, drafts: torch.Tensor, committed: torch.Tensor) -> None:
        """A step verified lookup `drafts` (1-D) and the row committed `committed` (1-D, the bonus token included):
        the drafts matching the committed tokens were accepted, the first mismatch was rejected."""
        accepted = 0
        for draft, token in zip(drafts.tolist(), committed.tolist()):
            if draft != token:
                break
            accepted += 1
        for d in range(min(accepted + 1, len(drafts), len(committed))):
            self.trials[d] += 1
            self.hits[d] += d < accepted


def graft(tree: CandidateTree, drafts: torch.Tensor) -> CandidateTree:
    """`tree` with the chain root -> drafts[0] -> drafts[1] ... added: it follows the tree's own nodes while their
    tokens agree and branches off at the first token that differs. Greedy trees only (no draft distributions)."""
    if not len(drafts):
        return tree
    if tree.draft_probs is not None:
        raise ValueError("lookup drafts join greedy trees only: a sampled tree's nodes carry draft distributions")
    tokens, parents, node = tree.tokens.tolist(), list(tree.parents), 0
    for token in drafts.tolist():
        child = tree.children[node].get(token) if node < len(tree) else None
        if child is None:
            tokens.append(token)
            parents.append(node)
            node = len(tokens) - 1
        else:
            node = child
    if len(tokens) == len(tree):
        return tree
    return CandidateTree(torch.tensor(tokens, device=tree.tokens.device), parents)
