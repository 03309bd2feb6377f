"""D²SD prefix trees: where the first drafter's block is likeliest to be rejected, re-draft alternatives.

With first-drafter confidences c_k = max_v q_k(v), the probability that exactly the first i drafts are accepted is
estimated by the rejection-boundary posterior r(i) = (c_1 ... c_i)(1 - c_{i+1}). The K prefix lengths with the largest
r(i) are re-drafted (by the VP drafter, all in one batched pass): branch i keeps drafts 1..i, then proposes the VP
drafter's best token OTHER than draft i+1 (the main chain already holds that one) and continues with its drafts.

Branches that share tokens share nodes (a deduplicated tree verifies fewer tokens than the paper's per-branch
cascade). Every node gets the estimated probability that verification reaches it; the `budget` most probable nodes
are kept, which is ancestor-closed because a node is never more probable than its parent.
"""

import torch

from .sampling import CompactLaw
from .tree import CandidateTree


def draw(probs: torch.Tensor, sample: bool) -> int:
    return int(torch.multinomial(probs, 1)) if sample else int(probs.argmax())


def plan_branches(first_probs: torch.Tensor, num_branches: int, sample: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The first drafter's drafts (drawn when `sample`) and the prefix lengths i to re-draft: the `num_branches`
    largest r(i), ascending. `first_probs` (depth, vocab): its distributions for slots 1..depth."""
    depth = first_probs.shape[0]
    confidences = first_probs.max(-1).values
    drafts = torch.tensor([draw(row, sample) for row in first_probs], device=first_probs.device)
    reach = torch.cat([confidences.new_ones(1), torch.cumprod(confidences, 0)[:-1]])  # P(first i accepted)
    boundary = reach * (1 - confidences)                                                # r(i), i = 0..depth-1
    return drafts, sorted(torch.topk(boundary, min(num_branches, depth)).indices.tolist())


def build_prefix_tree(root_token: int, first_probs: torch.Tensor, drafts: torch.Tensor, picks: list[int],
                      branch_probs: list[torch.Tensor], budget: int, choose_count=None,
                      sample: bool = False) -> CandidateTree:
    """The deduplicated, pruned tree of the main chain `drafts` and the branches re-drafted at prefix lengths `picks`
    (from `plan_branches`). `branch_probs[j]` (slots, vocab): the second drafter's distributions for slots
    picks[j]+1, picks[j]+2, ... (as many as it proposes).
    `choose_count(reach_probs) -> n`, optional: how many nodes (root included) to verify given the reach
    probabilities of the candidates in decreasing order (the cost model); `budget` stays the upper bound.
    `sample`: draw every draft from its distribution instead of taking the argmax, and return those distributions
    as the tree's `draft_laws` (for rejection sampling). Scores then use only distribution maxima, never the drawn
    tokens, so which nodes are kept does not depend on their own values (required for losslessness)."""
    main, scores, sources = _candidate_nodes(first_probs, drafts, picks, branch_probs, sample)
    depth = first_probs.shape[0]
    # keep the most probable nodes; a child is never more probable than its parent, so this keeps ancestors
    effective = {p: min(scores[p[:j]] for j in range(1, len(p) + 1)) for p in scores}
    keep = sorted(scores, key=lambda p: (-effective[p], len(p)))[: budget - 1]
    if choose_count is not None:
        keep = keep[: choose_count([effective[p] for p in keep]) - 1]
    # children in the order they were drawn (a branch's alternative after the main draft it excludes)
    main_paths = {main[: k + 1] for k in range(depth)}
    keep.sort(key=lambda p: (len(p), p not in main_paths))
    index = {(): 0}
    tokens, parents, node_conf, node_probs = [root_token], [-1], [1.0], [None]  # the root's law: none
    for path in keep:
        if path[:-1] not in index:
            continue  # its parent was pruned (only possible with equal scores)
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        node_conf.append(scores[path])
        node_probs.append(sources[path])
    laws = None
    if sample:  # the tree's nodes' laws alone, in one copy (not every slot and branch); the root's row unused
        laws = CompactLaw(None, torch.stack([torch.zeros_like(first_probs[0]), *node_probs[1:]]))
    return CandidateTree(tokens, parents, draft_laws=laws,
                         confidences=node_conf[1:], device=first_probs.device)


def _candidate_nodes(first_probs: torch.Tensor, drafts: torch.Tensor, picks: list[int], branch_probs: list,
                     sample: bool) -> tuple[tuple, dict, dict]:
    """Every candidate node of `build_prefix_tree`, keyed by its token path from the root: the main chain's token
    path, each node's reach score and the distribution it was drawn from."""
    depth = first_probs.shape[0]
    confidences = first_probs.max(-1).values
    reach = torch.cat([confidences.new_ones(1), torch.cumprod(confidences, 0)[:-1]])
    boundary = reach * (1 - confidences)

    # candidate nodes keyed by their token path from the root: reach score and the distribution they were drawn from
    scores: dict[tuple, float] = {}
    sources: dict[tuple, torch.Tensor] = {}

    def add(path: tuple, score: float, source: torch.Tensor) -> None:
        if score > scores.get(path, -1.0):
            scores[path], sources[path] = score, source

    main = tuple(drafts.tolist())
    for k in range(depth):
        add(main[: k + 1], float(reach[k] * confidences[k]), first_probs[k])

    for row, i in enumerate(picks):
        probs = branch_probs[row]                          # second drafter: slots i+1, i+2, ...
        alternative_probs = probs[0].clone()
        alternative_probs[main[i]] = 0                     # the alternative to draft i+1: any token but that one
        mass = alternative_probs.sum()
        if not mass > 0:  # the second drafter puts all its mass on the main draft: no alternative to draft
            continue
        alternative_probs /= mass
        score = float(boundary[i]) * float(alternative_probs.max())
        path = main[:i] + (draw(alternative_probs, sample),)
        add(path, score, alternative_probs)
        for slot in range(1, probs.shape[0]):
            score *= float(probs[slot].max())
            path = path + (draw(probs[slot], sample),)
            add(path, score, probs[slot])
    return main, scores, sources
