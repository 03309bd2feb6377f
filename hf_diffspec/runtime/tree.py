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


def tree_forward_inputs(trees: list[CandidateTree], past_valid: torch.Tensor, root_positions: list[int],
                        dtype: torch.dtype):
    """Target inputs to verify one tree per row in one forward: `(tokens, attention_mask, position_ids)`.

    tokens (rows, n) and position_ids (rows, n), with n the largest tree: a node at depth d sits at its row's root
    position + d; shorter rows are padded with slots that see only themselves (their outputs are ignored).
    attention_mask (rows, 1, n, past + n) is additive float in `dtype` (0 = attend, dtype min = blocked), never bool:
    eager attention adds the mask, so a bool mask would be silently wrong there. `past_valid` (rows, past) marks
    which cached slots each row may see (False: padding, or slots of drafts another row accepted).
    When every row sees its whole cache and verifies a chain of the same length, the mask is the plain causal one:
    `None` is returned for it, so the model builds it (and SDPA can take its causal path), as in plain decoding.
    """
    rows, past = past_valid.shape
    n = max(len(t) for t in trees)
    device = past_valid.device
    if all(len(t) == n and t.is_chain for t in trees) and bool(past_valid.all()):
        tokens = torch.stack([t.tokens.to(device) for t in trees])
        positions = past + torch.arange(n, device=device).expand(rows, -1)
        return tokens, None, positions
    tokens = torch.empty(rows, n, dtype=torch.long, device=device)
    positions = torch.empty(rows, n, dtype=torch.long, device=device)
    allowed = torch.zeros(rows, n, past + n, dtype=torch.bool, device=device)
    allowed[:, :, past:] = torch.eye(n, dtype=torch.bool, device=device)
    for row, (tree, root) in enumerate(zip(trees, root_positions)):
        size = len(tree)
        tokens[row, :size] = tree.tokens.to(device)
        tokens[row, size:] = tokens[row, 0]
        positions[row, :size] = root + torch.tensor(tree.depths, device=device)
        positions[row, size:] = root
        allowed[row, :size, :past] = past_valid[row]
        allowed[row, :size, past : past + size] = tree.ancestor_matrix(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return tokens, mask[:, None], positions
