"""Candidate token trees. A chain of drafts is a tree with one branch; the decoding loop only knows trees.

Node 0 is the root: the last committed token (the anchor), which the target has not processed yet. Every other node
is a drafted token whose parent is the token before it on its branch.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class CandidateTree:
    """Tokens to verify in one target forward.

    Attributes:
        tokens: (n,) token ids; tokens[0] is the root.
        parents: parent index of every node (-1 for the root); parents[i] < i.
        draft_probs: optional (n, vocab): row i is the distribution q that node i's token was drawn from (row 0, the
            root, is unused); used by rejection sampling, `None` for argmax drafts. Siblings are ordered as drawn.
        confidences: optional (n,) drafter confidence of each node's token.
    """

    tokens: torch.Tensor
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    depths: list[int] = field(init=False)
    children: list[dict[int, int]] = field(init=False)

    def __post_init__(self):
        if self.tokens.dim() != 1 or len(self.parents) != self.tokens.shape[0]:
            raise ValueError("tokens must be 1-D with one parent per node")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must start with -1 and point backwards, got {self.parents}")
        self.depths = [0] * len(self.parents)
        self.children = [{} for _ in self.parents]
        token_list = self.tokens.tolist()
        for i, p in enumerate(self.parents[1:], start=1):
            self.depths[i] = self.depths[p] + 1
            if token_list[i] in self.children[p]:
                raise ValueError(f"node {p} has two children carrying token {token_list[i]}; merge them")
            self.children[p][token_list[i]] = i

    @classmethod
    def chain(cls, root: int, drafts: torch.Tensor, **extra) -> "CandidateTree":
        """A single branch: root -> drafts[0] -> drafts[1] -> ..."""
        tokens = torch.cat([torch.tensor([root], device=drafts.device, dtype=torch.long), drafts.long()])
        return cls(tokens, list(range(-1, len(tokens) - 1)), **extra)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self, device=None) -> torch.Tensor:
        """(n, n) bool: [i, j] is True when node j is node i or one of its ancestors."""
        n = len(self)
        allowed = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            allowed[i] |= allowed[p]
        return allowed.to(device)

    def attention_mask(self, past_valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive 4D mask (1, 1, n, past + n) in `dtype`: 0 where a node may attend, dtype-min elsewhere.

        `past_valid` is a (past,) bool mask of the cached positions a node may see (False for padding). Additive float,
        never bool: eager attention adds the mask, so a bool mask would be silently wrong there.
        """
        device = past_valid.device
        allowed = torch.cat(
            [past_valid[None].expand(len(self), -1), self.ancestor_matrix(device)], dim=1
        )
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]

    def position_ids(self, start: int, device=None) -> torch.Tensor:
        """(1, n) positions: the root sits at `start`, a node at depth d at `start + d`."""
        return (start + torch.tensor(self.depths, device=device))[None]
