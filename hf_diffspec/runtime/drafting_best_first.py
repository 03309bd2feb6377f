"""Best-first draft trees from ONE drafter pass (DDTree-style): the drafter's per-slot marginals q_1..q_D of a block
give every token path a score, the product of its tokens' probabilities at their slots, an estimate of the chance
that verification reaches it. Nodes are expanded best-first under a node budget, so the tree spends its budget where
acceptance is likeliest: wide where the drafter hesitates, deep where it is sure. A chain is the tree that always
takes the first-ranked token.

The tree's SHAPE (how many children each node gets) is decided from the sorted probabilities alone; the tokens are
then the top-ranked ones (greedy) or, when sampling, drawn per node without replacement from q (child j from q with
its earlier siblings removed), and each node carries the distribution it was drawn from. So which nodes are verified
never depends on the drawn values, and recursive rejection sampling over siblings stays exact.
"""

import heapq

import numpy as np
import torch

from .sampling import CompactLaw
from .tree import CandidateTree


def best_first_shape(table: list[list[float]], budget: int,
                     max_children: int | None = None) -> list[tuple[tuple[int, ...], float]]:
    """Rank paths (the rank of the token taken at each depth) of the `budget` most probable nodes, in best-first
    order with their scores. `table`: each slot's k largest probabilities, descending, as nested lists on the
    host (depth, k); at most `max_children` of them per slot are used.

    A node is pushed only when its parent (first child) or its previous sibling (next sibling) is taken, so the
    result is closed under ancestors and earlier siblings, and scores come out in decreasing order. A node of score
    0 (a token its law cannot draw) is never taken."""
    depth = len(table)
    if depth == 0:
        return []
    k = len(table[0]) if max_children is None else min(len(table[0]), max_children)
    if k == 0:
        return []
    heap = [(-table[0][0], (0,), 1.0)]  # (-score, rank path, parent's score)
    taken = []
    while heap and len(taken) < budget:
        negative, path, parent_score = heapq.heappop(heap)
        score = -negative
        if not score > 0:
            break
        taken.append((path, score))
        d, rank = len(path), path[-1]
        if d < depth:
            heapq.heappush(heap, (-score * table[d][0], path + (0,), score))
        if rank + 1 < k:
            heapq.heappush(heap, (-parent_score * table[d - 1][rank + 1], path[:-1] + (rank + 1,), parent_score))
    return taken


def build_best_first_tree(root_token: int, probs: torch.Tensor | None, budget: int, node_count=None, *,
                          sample: bool, max_children: int, ranked=None, shape=None,
                          device=None, uniform: list[float] | None = None) -> CandidateTree:
    """The best-first tree after `root_token` from the drafter's marginals `probs` (depth, vocab).

    `budget`: most drafted nodes; `node_count(reach) -> n`, optional: how many nodes (root included) to verify given
    the candidates' reach scores in decreasing order (the cost model); `max_children`: widest branching per node.
    `ranked`: (sorted probabilities, their tokens) per slot as host lists, when the caller read them already
    (greedy: the tree is then built without reading the device); `shape`: `best_first_shape` of those probabilities
    and `budget`, when the caller computed it. `probs` None (sampling with compact laws): `ranked` holds each slot's
    whole law, and the tokens are drawn on the host from it with the uniform numbers `uniform` (one per node of
    the shape, read with the laws); the tree's laws stay on the host until `laws_to_device` moves a batch's in one
    copy."""
    if ranked is None:
        k = min(max_children, probs.shape[-1])
        sorted_probs, ranked_tokens = probs.topk(k, dim=-1)
        ranked = (sorted_probs.tolist(), ranked_tokens.tolist())
    sorted_probs, ranked_tokens = ranked
    if shape is None:
        shape = best_first_shape(sorted_probs, budget, max_children)
    if sample and probs is None:
        return _sampled_tree(root_token, sorted_probs, ranked_tokens, shape, node_count, device, uniform)
    if node_count is not None:
        shape = shape[: node_count([score for _, score in shape]) - 1]
    index = {(): 0}
    tokens, parents, scores = [root_token], [-1], []
    node_probs = [None] if sample else None  # the root's: none
    drawn: dict[tuple, list[int]] = {}  # parent rank path -> tokens of its children drawn so far
    for path, score in shape:
        parent, depth = path[:-1], len(path) - 1
        if parent not in index:
            continue  # below a child that could not be drawn
        if sample:  # the next child of this parent: drawn from q without its earlier siblings
            q = probs[depth].clone()
            q[drawn.setdefault(parent, [])] = 0
            mass = q.sum()
            if not mass > 0:
                # every token q gives mass to is an earlier sibling (a low temperature leaves few): no more children
                # here. That happens after as many siblings as q has such tokens, whichever were drawn, so the
                # tree's shape still does not depend on the drawn tokens.
                continue
            q /= mass
            token = int(torch.multinomial(q, 1))
            drawn[parent].append(token)
            node_probs.append(q)
        else:
            token = ranked_tokens[depth][path[-1]]
        index[path] = len(tokens)
        tokens.append(token)
        parents.append(index[parent])
        scores.append(score)
    return CandidateTree(tokens, parents, draft_laws=None if node_probs is None else CompactLaw(
        None, torch.stack([torch.zeros_like(probs[0]), *node_probs[1:]])),
        confidences=scores, device=probs.device)


def _sampled_tree(root_token: int, laws: list[list[float]], law_ids: list[list[int]], shape, node_count,
                  device, uniform: list[float]) -> CandidateTree:
    """`build_best_first_tree` when sampling from compact laws on the host: slot d's whole law is `laws[d]` over
    `law_ids[d]`; each node's token is drawn from it without its earlier siblings' tokens, and the tree carries the
    law each was drawn from (on the host: see `laws_to_device`)."""
    if node_count is not None:
        shape = shape[: node_count([score for _, score in shape]) - 1]
    width = len(laws[0])  # a row with no slot to draft gets no tree built (`_trees`)
    index = {(): 0}
    tokens, parents, scores = [root_token], [-1], []
    node_ids, node_probs = [[-1] * width], [[0.0] * width]
    drawn: dict[tuple, list[int]] = {}  # parent rank path -> positions (in its slot's law) of its children so far
    for (path, score), u in zip(shape, uniform):  # one uniform number per node, in the order they are taken
        parent, depth = path[:-1], len(path) - 1
        if parent not in index:
            continue
        taken = drawn.setdefault(parent, [])
        q = [0.0 if j in taken else p for j, p in enumerate(laws[depth])]
        mass = sum(q)
        if not mass > 0:  # every token the law can draw is an earlier sibling: the count, not the draw, decides
            continue
        q = [p / mass for p in q]
        pick, cumulative = 0, q[0]
        while cumulative <= u and pick + 1 < width:  # the inverse of q's distribution function at u
            pick += 1
            cumulative += q[pick]
        while q[pick] == 0:  # rounding past the last token with mass: step back to it
            pick -= 1
        taken.append(pick)
        index[path] = len(tokens)
        tokens.append(law_ids[depth][pick])
        parents.append(index[parent])
        scores.append(score)
        node_ids.append(law_ids[depth])
        node_probs.append(q)
    tree = CandidateTree(tokens, parents, confidences=scores, device=device)
    tree.host_laws = np.concatenate([np.asarray(node_ids, dtype=np.float64), np.asarray(node_probs)], axis=1)
    return tree


def laws_to_device(trees: list[CandidateTree], device) -> None:
    """Give the sampled trees of a batch their laws, drawn from on the host (`host_laws`: ids, then probabilities,
    per node), on `device` in one copy (float64 holds any vocabulary id exactly)."""
    host = [t for t in trees if getattr(t, "host_laws", None) is not None]
    if not host:
        return
    width = max(t.host_laws.shape[1] for t in host) // 2
    packed = np.full((sum(len(t) for t in host), 2 * width), -1.0)
    start = 0
    for tree in host:
        half = tree.host_laws.shape[1] // 2
        packed[start : start + len(tree), :half] = tree.host_laws[:, :half]
        packed[start : start + len(tree), width : width + half] = tree.host_laws[:, half:]
        packed[start : start + len(tree), width + half :] = 0.0
        start += len(tree)
    packed = torch.from_numpy(packed)
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    start = 0
    for tree in host:
        rows = packed[start : start + len(tree)]
        start += len(tree)
        tree.draft_laws, tree.host_laws = CompactLaw(rows[:, :width].long(), rows[:, width:].float()), None


def selector_tables(roots: torch.Tensor, draft_hidden: torch.Tensor, logits: torch.Tensor, selector, top_k: int,
                    max_children: int) -> torch.Tensor:
    """Every row's selector tables on the device, for the host to read in one copy (`unpack_selector_table`): per
    slot d and parent candidate c, the children a node gets (`build_selector_tree`). A node at depth d holds the root
    (d = 0) or one of slot d-1's top-`top_k` candidates, so the selector's distribution over slot d's candidates given
    each of those tokens covers every node a tree can hold; slot d's tables depend on slots d-1 and d alone, so a row
    limited to fewer slots than computed gets the same tree. `roots` (rows,), `draft_hidden` (rows, depth, hidden),
    `logits` (rows, depth, vocab). Returns (rows, n) float64 (token ids and candidate indices are exact there): the
    probabilities (depth, k, m), candidate indices (depth, k, m) and slot d's candidates' tokens (depth, k), m =
    `max_children` best first."""
    top = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1)  # (rows, depth, k)
    rows, depth, k = top.indices.shape
    previous = torch.cat([roots[:, None, None].expand(rows, 1, k), top.indices[:, :-1]], dim=1)  # slot d's parents
    scores = selector(draft_hidden[:, :depth, None, :].expand(-1, -1, k, -1), previous,
                      top.indices[:, :, None, :].expand(-1, -1, k, -1), top.values[:, :, None, :].expand(-1, -1, k, -1))
    probs, order = scores.softmax(-1).sort(-1, descending=True)
    m = min(max_children, k)
    return torch.cat([probs[..., :m].double().reshape(rows, -1), order[..., :m].double().reshape(rows, -1),
                      top.indices.double().reshape(rows, -1)], dim=1)


def unpack_selector_table(row: list[float], depth: int, top_k: int, max_children: int) -> tuple[list, list, list]:
    """One row of `selector_tables`, read, over `depth` slots: (probabilities per slot and candidate, candidate
    indices likewise, slot d's candidates' tokens). A vocabulary smaller than `top_k` has fewer candidates: the
    row's length says how many (it grows with k)."""
    k = next(k for k in range(top_k, 0, -1) if depth * k * (2 * min(max_children, k) + 1) <= len(row))
    m = min(max_children, k)
    n = depth * k * m
    probs_of = [[row[(d * k + c) * m : (d * k + c + 1) * m] for c in range(k)] for d in range(depth)]
    order_of = [[[int(i) for i in row[n + (d * k + c) * m : n + (d * k + c + 1) * m]] for c in range(k)]
                for d in range(depth)]
    tokens_of = [[int(t) for t in row[2 * n + d * k : 2 * n + (d + 1) * k]] for d in range(depth)]
    return probs_of, order_of, tokens_of


def build_selector_tree(root_token: int, tables: tuple[list, list, list], depth: int, budget: int, device,
                        node_count=None) -> CandidateTree:
    """Greedy drafting with DFlash 2's candidate selector: the best-first tree whose children are coherent with
    their parent, built on the host from a row's `selector_tables`. A node at depth d gets as children slot d's
    top-k candidates ranked by the selector's distribution given the node's own token, softmax(S_d(token, .)); a
    path's score is the product of those conditional probabilities. `depth`: the slots the row may draft.

    Greedy only: when sampling, a node's children would depend on its drawn token, and with a shared budget the number
    of its siblings too, which rejection sampling over siblings cannot allow (the marginal tree is used instead)."""
    probs_of, order_of, tokens_of = tables

    def children(d: int, candidate: int) -> tuple[list[float], list[int], list[int]]:
        """A node at depth d holding slot d-1's candidate `candidate` (the root: 0): its children's probabilities,
        candidate indices and tokens, best first."""
        order = order_of[d][candidate]
        return probs_of[d][candidate], order, [tokens_of[d][i] for i in order]

    tokens, parents, depths, scores, candidates = [root_token], [-1], [0], [1.0], [0]
    tables_of = {0: children(0, 0)}  # node -> its children's (probabilities, candidates, tokens), best first
    heap = [(-tables_of[0][0][0], 0, 0)]  # (-score, parent node, rank among the parent's children)
    while heap and len(tokens) - 1 < budget:
        negative, parent, rank = heapq.heappop(heap)
        node = len(tokens)
        probs, order, kids = tables_of[parent]
        tokens.append(kids[rank])
        candidates.append(order[rank])
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(-negative)
        if depths[node] < depth:
            tables_of[node] = children(depths[node], candidates[node])
            heapq.heappush(heap, (negative * tables_of[node][0][0], node, 0))
        if rank + 1 < len(probs):
            heapq.heappush(heap, (-scores[parent] * probs[rank + 1], parent, rank + 1))
    keep = len(tokens) if node_count is None else node_count(scores[1:])  # taken best first: ancestors come first
    return CandidateTree(tokens[:keep], parents[:keep], confidences=scores[1:keep], device=device)
