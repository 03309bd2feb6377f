"""Candidate token trees. A chain of drafts is a tree with one branch; the decoding loop only knows trees.

Node 0 is the root: the last committed token (the anchor), which the target has not processed yet. Every other node
is a drafted token whose parent is the token before it on its branch.

A tree's shape (parents, depths) always lives on the host; its tokens live where they were made: on the device when
the drafter drew them (chains), on the host when the host chose them (best-first trees, grafted lookup drafts). Nothing
reads device tokens on the host unless it must (`token_list`), so building, verifying and accepting the trees of a
whole batch costs a fixed number of host synchronisations (`TreeLayout`).

Prompt-lookup drafts join a drafted tree as a chain from the root after its nodes (`lookup`), whatever the drafter's
tokens: where the two agree, the chain's first nodes repeat the tree's. The target computes the same thing at a
repeated node as at its original (same tokens, same positions), so acceptance reads the tree merged: the repeats are
left out, and the first lookup node past them is a child of the tree node they repeat (`TreeLayout.accept_parents`,
found on the device). The tree's shape thus never waits for the drafter's tokens.

The index tensors the loop reads every step (ranges, bit values, a fixed chain's shape) are built once per call and
kept in the call's context (`call_indices`, entered by the call's `TargetVerifier`): read only, and nothing of them
outlives the call or is seen by another thread. Outside a call they are built afresh.
"""

import contextlib
import contextvars
from dataclasses import dataclass

import torch


class CandidateTree:
    """Tokens to verify in one target forward.

    Args:
        tokens: (n,) token ids, a tensor or a list of ints (then the tensor is made on `device` when asked for);
            tokens[0] is the root.
        parents: parent index of every node (-1 for the root); parents[i] < i.
        draft_laws: optional, the law each drawn node's token was drawn from, a `CompactLaw` (m, K) for the first m
            nodes (the root's row unused); the nodes after them, and every node when `None`, are deterministic
            drafts (argmax, prompt lookup), whose laws are point masses. Used by rejection sampling; siblings are
            ordered as drawn.
        confidences: optional, one per drafted node (the root's left out): a chain's drafter confidence in each
            token, a tree's estimated chance that verification reaches each node (what the bench's replay records).
        lookup: optional, prompt-lookup drafts (host ints) joined as a chain from the root after the nodes of
            `tokens`: the tree's last len(lookup) nodes (see the module docstring).
    """

    def __init__(self, tokens, parents: list[int], draft_laws=None,
                 confidences: torch.Tensor | None = None, device=None, lookup: list[int] = ()):
        self.lookup = [int(t) for t in lookup]
        if self.lookup:
            size = len(parents)
            parents = list(parents) + [0] + list(range(size, size + len(self.lookup) - 1))
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError("tokens must be 1-D with one parent per node")
            self._tokens, self._token_list, size = tokens, None, tokens.shape[0] + len(self.lookup)
            self.base_size = tokens.shape[0]
        else:
            tokens = [int(t) for t in tokens]
            self._tokens, self._token_list, size = None, tokens + self.lookup, len(tokens) + len(self.lookup)
            self.base_size = len(tokens)
        self.device = device
        if len(parents) != size:
            raise ValueError("tokens must be 1-D with one parent per node")
        self.parents = list(parents)
        self.is_chain = self.parents == list(range(-1, size - 1))
        if self.is_chain:
            self.depths = list(range(size))
        else:
            self.depths = [0]
            for i, p in enumerate(self.parents[1:], start=1):
                if not 0 <= p < i:
                    raise ValueError(f"parents must start with -1 and point backwards, got {parents}")
                self.depths.append(self.depths[p] + 1)
            if self.parents[0] != -1:
                raise ValueError(f"parents must start with -1 and point backwards, got {parents}")
        self.draft_laws = draft_laws
        self.confidences = confidences
        self._children = None
        # two siblings carrying one token are refused where they are made (`children` says which)
        if not self.is_chain and (self._token_list is not None or tokens.device.type == "cpu") and not self.lookup:
            if len(set(zip(self.parents[1:], self.token_list[1:]))) < size - 1:
                self.children  # noqa: B018

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor(self._token_list, dtype=torch.long, device=self.device)
        elif self._tokens.shape[0] < len(self):  # the drafter's on the device, the lookup drafts after them
            self._tokens = torch.cat([self._tokens, torch.tensor(self.lookup, device=self._tokens.device)])
        return self._tokens

    @property
    def base_tokens(self) -> torch.Tensor:
        """The tokens of the nodes before the lookup chain (where they were made)."""
        return self.tokens[: self.base_size] if self._tokens is None else self._tokens[: self.base_size]

    @property
    def token_list(self) -> list[int]:
        """The tokens on the host (read from the device once, when they were made there)."""
        if self._token_list is None:
            self._token_list = self._tokens[: self.base_size].tolist() + self.lookup
        return self._token_list

    def knows_tokens(self) -> bool:
        """True when the host holds the tokens (no synchronisation to read them)."""
        return self._token_list is not None

    @property
    def children(self) -> list[dict[int, int]]:
        """Per node, {token: child node}, the lookup chain merged into the tree (its repeats of the tree's nodes
        left out)."""
        if self._children is None:
            children = [{} for _ in self.parents]
            token_list = self.token_list
            for i, p in enumerate(self.parents[1 : self.base_size], start=1):
                if token_list[i] in children[p]:
                    raise ValueError(f"node {p} has two children carrying token {token_list[i]}; merge them")
                children[p][token_list[i]] = i
            node = 0
            for i in range(self.base_size, len(self)):  # the lookup chain follows the tree while the tokens agree
                node = children[node].setdefault(token_list[i], i)
            self._children = children
        return self._children

    @classmethod
    def chain(cls, root, drafts: torch.Tensor, **extra) -> "CandidateTree":
        """A single branch: root -> drafts[0] -> drafts[1] -> ... `root`: an int or a 0-d/1-element tensor."""
        if isinstance(root, torch.Tensor):
            root = root.reshape(1).to(drafts.device, torch.long)
        else:
            root = torch.tensor([root], device=drafts.device, dtype=torch.long)
        tokens = torch.cat([root, drafts.long()])
        return cls(tokens, list(range(-1, len(tokens) - 1)), **extra)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


# the running call's index tensors, {key: tensor}: see the module docstring
_CALL_INDICES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_diffspec_call_indices", default=None)


@contextlib.contextmanager
def call_indices():
    """The block is one call: the index tensors it asks for are built once and kept until it ends."""
    token = _CALL_INDICES.set({})
    try:
        yield
    finally:
        _CALL_INDICES.reset(token)


def _call_cached(key: tuple, make):
    cache = _CALL_INDICES.get()
    if cache is None:
        return make()
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


def index_range(n: int, device: torch.device) -> torch.Tensor:
    """`torch.arange(n)` on `device`, built once per size and call: the loop indexes slots, levels and rows with the
    same few sizes every step (read only)."""
    return _call_cached(("range", n, device), lambda: torch.arange(n, device=device))


def _bit_values(n: int, device: torch.device) -> torch.Tensor:
    """1 << j for j < n on `device` (read only)."""
    return _call_cached(("bits", n, device), lambda: 1 << index_range(n, device))


def host_to_device(data, device) -> torch.Tensor:
    """A long tensor of host `data` on `device`; to a CUDA device through pinned memory, so that the copy is queued
    behind the device's work instead of waiting for it."""
    tensor = torch.tensor(data, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class TreeLayout:
    """The trees of a batch as a rectangle on the device, n = the largest tree: `tokens` (rows, n), shorter trees
    padded with their root; `parents` (rows, n), the root and padding slots their own parent; `depths` (rows, n), -1
    for padding; `real` (rows, n), depths >= 0; `ancestors` (rows, n, n) bool, [r, i, j] True when node j is node i
    or one of its ancestors (a padding slot: itself only); `levels`, 0 .. max_depth. `chains`: every tree is a chain
    (an accepted path is then a prefix); `uniform_chains`: chains of one length (slot i is the node at depth i).

    What acceptance reads, the trees with their lookup chains merged in (see the module docstring): `repeats`
    (rows, n), the lookup nodes that repeat a tree node, or None when no tree has lookup drafts after drafted nodes;
    `accept_parents` and `accept_ancestors`, the merged trees' (the target's forward sees `parents` and
    `ancestors`)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    real: torch.Tensor
    ancestors: torch.Tensor
    levels: torch.Tensor
    sizes: list[int]
    max_depth: int
    chains: bool
    uniform_chains: bool
    repeats: torch.Tensor | None = None
    accept_parents: torch.Tensor | None = None
    accept_ancestors: torch.Tensor | None = None

    def __post_init__(self):
        if self.accept_parents is None:
            self.accept_parents, self.accept_ancestors = self.parents, self.ancestors

    @classmethod
    def of(cls, trees: list[CandidateTree], device, width: int = 0) -> "TreeLayout":
        """Lay `trees` out on `device`, `width` slots at least: one host-to-device copy of their shapes and ancestors
        (and of their tokens when the host holds them all), none when they are chains of one length (their shape is
        built once)."""
        rows, sizes = len(trees), [len(t) for t in trees]
        n, max_depth = max(*sizes, width), max(t.max_depth for t in trees)
        chains = all(t.is_chain for t in trees)
        same_size = all(s == n for s in sizes)
        host_tokens = [t.token_list for t in trees] if all(t.knows_tokens() for t in trees) else None
        grafted = any(t.lookup and t.base_size > 1 for t in trees)  # lookup chains beside drafted nodes
        # lookup drafts (host) after device tokens, a drafted chain cut to its root included: copied with the shape
        lookups = grafted or (host_tokens is None and any(t.lookup for t in trees))
        if chains and same_size and not lookups:
            parents, depths, real, ancestors, levels = _uniform_chains_shape(rows, n, device)
            if host_tokens is not None:
                tokens = host_to_device(host_tokens, device)
        else:
            shape = [[[max(p, 0) for p in t.parents] + list(range(len(t), n)) for t in trees],
                     [t.depths + [-1] * (n - len(t)) for t in trees]]
            # each node's ancestors as the bits of one integer, built on the host in one pass over the nodes and
            # copied with the shape (a padding slot: its own bit)
            ancestor_bits = n < 63
            if ancestor_bits:
                shape.append([_ancestor_bits(t.parents) + [1 << i for i in range(len(t), n)] for t in trees])
            if host_tokens is not None:
                shape.append([tokens + [tokens[0]] * (n - len(tokens)) for tokens in host_tokens])
            if lookups:  # each lookup node's token at its slot, and the lookup token at each depth (-1: none)
                shape.append([[-1] * t.base_size + t.lookup + [-1] * (n - len(t)) for t in trees])
                shape.append([[-1] + t.lookup + [-1] * (n - 1 - len(t.lookup)) for t in trees])
            shape = host_to_device(shape, device)
            parents, depths = shape[0], shape[1]
            real = depths >= 0
            levels = index_range(max_depth + 1, device)
            if ancestor_bits:
                ancestors = (shape[2][:, :, None] & _bit_values(n, device)) != 0
            else:  # each round adds the ancestors of every node's ancestors: max_depth rounds reach the root
                ancestors = torch.eye(n, dtype=torch.bool, device=device).expand(rows, n, n)
                gather_index = parents[:, :, None].expand(rows, n, n)
                for _ in range(max_depth):
                    ancestors = ancestors | ancestors.gather(1, gather_index)
            if host_tokens is not None:
                tokens = shape[3 if ancestor_bits else 2]
        if host_tokens is None:  # the drafter's tokens, the lookup drafts (copied with the shape) after them
            tokens = [t.base_tokens.to(device) for t in trees]
            if same_size and not lookups:
                tokens = torch.stack(tokens)
            else:  # padded to n (any token: padding slots take their root's below)
                tokens = torch.nn.functional.pad(torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True),
                                                 (0, n - max(t.base_size for t in trees)))
            if lookups:
                tokens = torch.where(shape[-2] >= 0, shape[-2], tokens)
        if not same_size:
            tokens = torch.where(real, tokens, tokens[:, :1])
        if grafted:
            return cls(tokens, parents, depths, real, ancestors, levels, sizes, max_depth, chains, False,
                       *_merged_lookup(tokens, parents, depths, real, ancestors, shape[-2] >= 0, shape[-1]))
        return cls(tokens, parents, depths, real, ancestors, levels, sizes, max_depth, chains, chains and same_size)


def _merged_lookup(tokens, parents, depths, real, ancestors, is_lookup, lookup_at_depth) -> tuple[torch.Tensor, ...]:
    """`TreeLayout`'s repeats, accept_parents and accept_ancestors: each row's lookup chain (`is_lookup` slots; its
    token at each depth `lookup_at_depth`) merged into its tree on the device. A tree node repeats the chain's start
    when it and every ancestor below the root carry the lookup token of their depth; the chain's nodes down to the
    deepest such node's depth repeat it, and the next one hangs below it."""
    rows, n = tokens.shape
    drafted = real & ~is_lookup & (depths > 0)
    differs = drafted & (tokens != lookup_at_depth.gather(1, depths.clamp(min=0)))
    follows = real & ~is_lookup & ~(ancestors & differs[:, None, :]).any(-1)
    # siblings carry distinct tokens: at most one node per depth follows the chain, and the root (depth 0) always
    # does, so the deepest is unique (whichever index a device's max returns on ties)
    reach, attach = torch.where(follows, depths, -1).max(-1)
    repeats = is_lookup & (depths <= reach[:, None])
    live = is_lookup & ~repeats
    accept_parents = torch.where(live & (depths == reach[:, None] + 1), attach[:, None], parents)
    attach_ancestors = ancestors.gather(1, attach[:, None, None].expand(rows, 1, n))
    accept_ancestors = torch.where(live[:, :, None], (ancestors & ~repeats[:, None, :]) | attach_ancestors, ancestors)
    return repeats, accept_parents, accept_ancestors


def _ancestor_bits(parents: list[int]) -> list[int]:
    """Per node of a tree (`parents` point backwards), bit j set when node j is the node or one of its ancestors."""
    bits = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    return bits


def _uniform_chains_shape(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """`TreeLayout`'s parents, depths, real, ancestors and levels of `rows` chains of `n` nodes: the same tensors
    step after step at a fixed draft length, so they are built once per call (read only; a few hundred bytes each)."""
    return _call_cached(("chains", rows, n, device), lambda: _chains_shape(rows, n, device))


def _chains_shape(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    index = index_range(n, device)
    parents = (index - 1).clamp(min=0).expand(rows, n)
    depths = index.expand(rows, n)
    real = torch.ones(rows, n, dtype=torch.bool, device=device)
    ancestors = (index[:, None] >= index[None, :]).expand(rows, n, n)
    return parents, depths, real, ancestors, index
