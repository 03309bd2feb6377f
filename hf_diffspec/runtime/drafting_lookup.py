"""Prompt-lookup candidates: free drafts copied from the row's own text (as transformers' prompt-lookup decoding).

When the last few committed tokens of a row occurred earlier in it (the prompt, or what it generated), the tokens
that followed them then are a guess for what follows now. Such guesses cost no drafter forward, and they are right
often where a small drafter is weak: code that repeats names, answers that quote the question. The decoding loop
verifies them as one more branch of the step's tree, or alone (a step without a drafter forward); the speculation
controller decides how many of them to verify from how often lookup drafts have been accepted at each depth, which it
measures after every step (`control_speculation.py`).

When sampling, a copied token is a deterministic draft: its law is a point mass, and rejection sampling accepts it
with the target's probability of it (`verification.py`), beside the drafter's drawn siblings. Whether a lookup branch
joins a drafted node depends on that node's drawn token, never on the target's draws, which rejection sampling
allows: a node's children may depend on everything drawn before them.

A step's lookup drafts join its drafted trees without the host reading the drafter's tokens: each row's drafts go
after its tree's nodes as a chain from the root (`CandidateTree.lookup`), and where they repeat the tree's own
nodes, acceptance merges them on the device (`tree.TreeLayout`).
"""

from dataclasses import dataclass, field

import numpy as np

from .tree import CandidateTree


@dataclass
class LookupDrafts:
    """One step's prompt-lookup drafts: per active row, its drafts (a list of token ids, possibly empty) and the
    length of the suffix match they were found after (0: none). `ngram`: the longest match among rows with drafts (0:
    no row has any)."""

    drafts: list[list[int]]
    ngrams: list[int]
    ngram: int = field(init=False)

    def __post_init__(self):
        self.ngram = max((n for d, n in zip(self.drafts, self.ngrams) if len(d)), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

    @property
    def lengths(self) -> list[int]:
        return [len(d) for d in self.drafts]

    def truncated(self, depth: int) -> "LookupDrafts":
        """The first `depth` drafts of every row (the ones a step verifies)."""
        if depth <= 0 or not self.ngram:
            return NO_LOOKUP_DRAFTS
        return LookupDrafts([d[:depth] for d in self.drafts], self.ngrams)

    def graft(self, trees: list[CandidateTree]) -> list[CandidateTree]:
        """Each row's tree with its lookup drafts as one more branch (see `graft`)."""
        if not self.ngram:
            return trees
        return [graft(tree, drafts) for tree, drafts in zip(trees, self.drafts)]


NO_LOOKUP_DRAFTS = LookupDrafts([], [])


class PromptLookup:
    """Finds lookup drafts per row; how many of them a step verifies is the speculation controller's decision
    (`control_speculation.py`), which measures their acceptance.

    Args:
        num_tokens: most tokens copied per step (transformers' `prompt_lookup_num_tokens`); 0: lookup off.
        max_ngram: longest suffix matched (transformers' `max_matching_ngram_size`); shorter suffixes are tried when
            it does not occur earlier. The loop uses 3 unless the generation config sets one: after 1-, 2- and
            3-token matches, 0.69, 1.72 and 3.57 lookup drafts were accepted per step on the built-in prompts, so
            the match length tells steps worth a drafter forward from steps that are not.
    """

    def __init__(self, num_tokens: int, max_ngram: int):
        if num_tokens < 0 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 0 and max_ngram >= 1, got {num_tokens}, {max_ngram}")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram

    def propose(self, batch, root_positions: list[int], policy) -> LookupDrafts:
        """The lookup drafts of every active row of `batch` (a `BatchState`) whose anchors sit at `root_positions`,
        as many as the row may verify (`policy.depth_limits`)."""
        if not self.num_tokens:
            return NO_LOOKUP_DRAFTS
        limits = policy.depth_limits(root_positions, batch.max_drafts())
        found = self.find_rows(*batch.history_rows(), limits)
        return LookupDrafts([list(d) for d, _ in found], [n for _, n in found])  # a match always has drafts

    def find(self, ids, limit: int):
        """Up to `limit` tokens that followed the most recent earlier occurrence of the longest suffix of `ids` (1-D,
        the row's committed tokens, its anchor last) that occurred earlier, and that suffix's length; (empty, 0) when
        none did. The most recent occurrence: on the built-in prompts its drafts were accepted more often than the
        first occurrence's (transformers' choice), 1.93 against 1.83 tokens per step. `ids`: a numpy array (the
        loop's host copy of the committed tokens); the drafts come back as one."""
        return self.find_rows(ids[None], [ids.shape[0]], [limit])[0]

    def find_rows(self, ids: np.ndarray, lengths: list[int], limits: list[int]) -> list[tuple[np.ndarray, int]]:
        """`find` for several rows at once, with the same few array operations whatever their number: row r's
        committed tokens are `ids[r, : lengths[r]]` (`ids` (rows, at least the longest), on the host). A row's
        match length is 0 exactly when it has no drafts: a match ends before the row's last token, so at least one
        token follows it."""
        length = np.asarray(lengths)
        rows = np.arange(len(lengths))
        # earlier occurrences of each row's last token (before it, so that a continuation exists): their rows and
        # ends, then how many of the tokens before each also match the suffix, for all of them at once (an
        # occurrence ends before the suffix does, so an n-token match never reaches into the suffix itself)
        width = max(lengths)
        if width < 2:
            return [(ids[r, :0], 0) for r in rows]
        last = ids[rows, np.maximum(length - 1, 0)]
        row, end = np.nonzero((ids[:, :width] == last[:, None]) & (np.arange(width) < length[:, None] - 1))
        if not len(end):
            return [(ids[r, :0], 0) for r in rows]
        matched = np.ones(len(end), dtype=np.int64)
        still = np.ones(len(end), dtype=bool)
        suffix_end = length[row] - 1
        for n in range(1, min(self.max_ngram, width - 1)):
            still &= (end >= n) & (ids[row, np.maximum(end - n, 0)] == ids[row, suffix_end - n])
            matched += still
        # per row, the longest match and, among those, the most recent: the largest (matched, end)
        best = np.full(len(lengths), -1)
        np.maximum.at(best, row, matched * width + end)
        found = []
        for r, (n, limit) in enumerate(zip(lengths, limits)):
            limit = min(limit, self.num_tokens)
            if limit <= 0 or best[r] < 0:
                found.append((ids[r, :0], 0))
            else:
                start = int(best[r] % width) + 1
                found.append((ids[r, start : min(start + limit, n)], int(best[r] // width)))
        return found


def graft(tree: CandidateTree, drafts) -> CandidateTree:
    """`tree` with the chain root -> drafts[0] -> drafts[1] ... after its nodes (`drafts`: token ids, a list, a
    tensor or an array). Its first nodes repeat the tree's where the tokens agree; acceptance reads the merged tree
    (`CandidateTree.children`, `TreeLayout.accept_parents`). The added nodes are deterministic drafts, point masses
    when sampling (the tree's laws cover its drawn nodes only)."""
    if not len(drafts):
        return tree
    tokens = tree.token_list if tree.knows_tokens() else tree.tokens
    return CandidateTree(tokens, tree.parents, draft_laws=tree.draft_laws, confidences=tree.confidences,
                         device=tree.device, lookup=drafts)
