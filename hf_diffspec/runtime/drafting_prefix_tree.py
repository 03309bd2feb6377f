"""D²SD prefix trees: where the first drafter's block is likeliest to be rejected, re-draft alternatives.

With first-drafter confidences c_k = max_v q_k(v), the probability that exactly the first i drafts are accepted is
estimated by the rejection-boundary posterior r(i) = (c_1 ... c_i)(1 - c_{i+1}). The K prefix lengths with the largest
r(i) are re-drafted (by the VP drafter, all in one batched pass): branch i keeps drafts 1..i, then proposes the VP
drafter's best token OTHER than draft i+1 (the main chain already holds that one) and continues with its drafts.

Branches that share tokens share nodes (a deduplicated tree verifies fewer tokens than the paper's per-branch
cascade). Every node gets the estimated probability that verification reaches it; the `budget` most probable nodes
are kept, which is ancestor-closed because a node is never more probable than its parent.
"""

from dataclasses import dataclass

import torch

from .sampling import CompactLaw
from .tree import CandidateTree, host_to_device


def draw_rows(probs: torch.Tensor, sample: bool) -> torch.Tensor:
    """A token per row of `probs` (n, vocab): drawn from it when `sample`, else its argmax."""
    return torch.multinomial(probs.float(), 1)[:, 0] if sample else probs.argmax(-1)


@dataclass
class RowPlan:
    """A row's first-drafter block on the host: its drafts (`drafts` on the device, `tokens` read), each draft's
    reach score (c_1 ... c_k), the rejection-boundary posterior r(i) per prefix length, the prefix lengths to re-draft
    (`picks`, ascending) and the slots' distributions (`laws`, on the device)."""

    drafts: torch.Tensor
    tokens: list[int]
    main_scores: list[float]
    boundary: list[float]
    picks: list[int]
    laws: torch.Tensor


@dataclass
class Branch:
    """A branch re-drafted after the main chain's first `prefix_length` drafts, on the host: its alternative to the
    main draft there (None: its law holds only the main draft) with that law's maximum and the law itself (on the
    device), then its further drafts with their laws' maxima and the laws."""

    prefix_length: int
    alternative: int | None
    alternative_score: float
    alternative_law: torch.Tensor
    tokens: list[int]
    maxima: list[float]
    laws: list[torch.Tensor]


def plan_rows(first_probs: torch.Tensor, limits: list[int], num_branches: int, sample: bool = False) -> list[RowPlan]:
    """Every row's plan from its first-drafter distributions `first_probs` (rows, depth, vocab), the first
    `limits[r]` slots of row r, in one read of the device: its drafts (drawn when `sample`) and the `num_branches`
    prefix lengths with the largest r(i)."""
    rows, depth, vocab = first_probs.shape
    confidences = first_probs.max(-1).values
    drafts = draw_rows(first_probs.reshape(-1, vocab), sample).view(rows, depth)
    reach = torch.cat([confidences.new_ones(rows, 1), torch.cumprod(confidences, 1)[:, :-1]], 1)  # P(first i)
    boundary = reach * (1 - confidences)                                                           # r(i)
    table = torch.cat([drafts.double(), (reach * confidences).double(), boundary.double()], 1).tolist()
    plans = []
    for r, (values, limit) in enumerate(zip(table, limits)):
        row_boundary = values[2 * depth : 2 * depth + limit]
        row_picks = sorted(sorted(range(limit), key=lambda i: -row_boundary[i])[:num_branches])
        plans.append(RowPlan(drafts[r, :limit], [int(t) for t in values[:limit]], values[depth : depth + limit],
                             row_boundary, row_picks, first_probs[r, :limit]))
    return plans


def branch_values(branch_probs: list[torch.Tensor], prefix_lengths: list[int], excluded: list[int],
                  sample: bool = False) -> list[Branch]:
    """Every branch on the host, in one read: `branch_probs[b]` (slots, vocab), the second drafter's distributions
    for slots i+1, i+2, ... after prefix length `prefix_lengths[b]` = i; its alternative is drawn from the first of
    them with the main draft `excluded[b]` taken out (the main chain holds that one)."""
    if not branch_probs:
        return []
    flat = torch.cat(branch_probs)
    lengths = [b.shape[0] for b in branch_probs]
    firsts = [sum(lengths[:b]) for b in range(len(lengths))]
    index = host_to_device([firsts, excluded], flat.device)
    maxima, draws = flat.max(-1).values, draw_rows(flat, sample)
    alternative = flat[index[0]].clone()
    alternative.scatter_(1, index[1][:, None], 0.0)
    mass = alternative.sum(-1)
    usable = mass > 0  # else the second drafter put all its mass on the main draft: no alternative to draft
    alternative = alternative / torch.where(usable, mass, 1.0)[:, None]
    alternative_draws = draw_rows(torch.where(usable[:, None], alternative, flat[index[0]]), sample)
    table = torch.cat([maxima.double(), draws.double(), alternative.max(-1).values.double(),
                       alternative_draws.double(), usable.double()]).tolist()
    slots, count = flat.shape[0], len(lengths)
    slot_max, slot_draws = table[:slots], table[slots : 2 * slots]
    alternative_max = table[2 * slots : 2 * slots + count]
    alternative_tokens, ok = table[2 * slots + count : 2 * slots + 2 * count], table[2 * slots + 2 * count :]
    return [Branch(i, int(alternative_tokens[b]) if ok[b] else None, alternative_max[b], alternative[b],
                   [int(t) for t in slot_draws[first + 1 : first + n]], slot_max[first + 1 : first + n],
                   [flat[s] for s in range(first + 1, first + n)])
            for b, (i, first, n) in enumerate(zip(prefix_lengths, firsts, lengths))]


def prefix_tree(root_token: int, plan: RowPlan, branches: list[Branch], budget: int, choose_count=None,
                sample: bool = False) -> CandidateTree:
    """The deduplicated, pruned tree of a row's main chain and its branches, built on the host from what
    `plan_rows` and `branch_values` read. `choose_count(reach_probs) -> n`, optional: how many nodes (root included)
    to verify given the reach probabilities of the candidates in decreasing order (the cost model); `budget` stays
    the upper bound. `sample`: the drafts were drawn, and the tree carries the laws they were drawn from as its
    `draft_laws` (for rejection sampling). Scores use only the laws' maxima, never the drawn tokens, so which nodes
    are kept does not depend on their own values (required for losslessness)."""
    main, scores, sources = _candidate_nodes(plan, branches)
    depth = len(plan.tokens)
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
        laws = CompactLaw(None, torch.stack([torch.zeros_like(plan.laws[0]), *node_probs[1:]]))
    return CandidateTree(tokens, parents, draft_laws=laws, confidences=node_conf[1:], device=plan.laws.device)


def _candidate_nodes(plan: RowPlan, branches: list[Branch]) -> tuple[tuple, dict, dict]:
    """Every candidate node of `prefix_tree`, keyed by its token path from the root: the main chain's token path,
    each node's reach score and the distribution it was drawn from."""
    scores: dict[tuple, float] = {}
    sources: dict[tuple, torch.Tensor] = {}

    def add(path: tuple, score: float, source: torch.Tensor) -> None:
        if score > scores.get(path, -1.0):
            scores[path], sources[path] = score, source

    main = tuple(plan.tokens)
    for k in range(len(main)):
        add(main[: k + 1], plan.main_scores[k], plan.laws[k])
    for branch in branches:
        if branch.alternative is None:
            continue
        i = branch.prefix_length
        score = plan.boundary[i] * branch.alternative_score
        path = main[:i] + (branch.alternative,)
        add(path, score, branch.alternative_law)
        for token, maximum, law in zip(branch.tokens, branch.maxima, branch.laws):
            score *= maximum
            path = path + (token,)
            add(path, score, law)
    return main, scores, sources
