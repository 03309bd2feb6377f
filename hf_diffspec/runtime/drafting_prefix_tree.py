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
from .tree import CandidateTree, index_range


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


@dataclass
class DevicePlan:
    """Every row's first-drafter block, on the device, before any read: its drafts (rows, depth) (drawn when
    sampling), each draft's reach score c_1 ... c_k (rows, depth), the rejection-boundary posterior r(i) (rows,
    depth) and the `num_branches` prefix lengths to re-draft (`picks` (rows, K), ascending; a row of limit L < K has
    real picks in its first L columns only, the rest past its limit)."""

    drafts: torch.Tensor
    main_scores: torch.Tensor
    boundary: torch.Tensor
    picks: torch.Tensor


def plan_rows(first_probs: torch.Tensor, limits: torch.Tensor, num_branches: int, sample: bool) -> DevicePlan:
    """Every row's plan from its first-drafter distributions `first_probs` (rows, depth, vocab), the first
    `limits[r]` slots of row r (`limits` on the device: a pass drafted ahead knows them there only), on the device:
    its drafts and the `num_branches` prefix lengths with the largest r(i) among its slots (the earliest first among
    equal ones)."""
    rows, depth, vocab = first_probs.shape
    confidences = first_probs.max(-1).values
    drafts = draw_rows(first_probs.reshape(-1, vocab), sample).view(rows, depth)
    reach = torch.cat([confidences.new_ones(rows, 1), torch.cumprod(confidences, 1)[:, :-1]], 1)  # P(first i)
    boundary = reach * (1 - confidences)                                                           # r(i)
    within = index_range(depth, first_probs.device)[None] < limits[:, None]
    ranked = torch.where(within, boundary, -1.0).sort(dim=-1, descending=True, stable=True).indices
    picks = ranked[:, : min(num_branches, depth)].sort(-1).values  # a row's real picks come before its others
    return DevicePlan(drafts, reach * confidences, boundary, picks)


def branch_slots(picks: torch.Tensor, length: int) -> torch.Tensor:
    """(rows, K, length) slot indices of each branch's distributions: slots i, i + 1, ... after prefix length i."""
    return picks[..., None] + index_range(length, picks.device)


def plan_table(plan: DevicePlan, branch_probs: torch.Tensor, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What the host reads of every row's plan and branches, on the device: (the (rows, n) float64 table
    `unpack_plans` reads, each branch's alternative law (rows, K, vocab)). `branch_probs` (rows, K, length, vocab):
    the second drafter's distributions for slots i+1, i+2, ... after each pick's prefix length i. A branch's
    alternative is drawn from the first of them with the main draft there taken out (the main chain holds that one)."""
    rows = plan.drafts.shape[0]
    count, vocab = branch_probs.shape[1], branch_probs.shape[-1]
    maxima = branch_probs.max(-1).values
    draws = draw_rows(branch_probs.reshape(-1, vocab), sample).view(rows, -1)
    alternative = branch_probs[:, :, 0].clone()
    alternative.scatter_(-1, plan.drafts.gather(1, plan.picks)[..., None], 0.0)  # the main draft taken out
    mass = alternative.sum(-1)
    usable = mass > 0  # else the second drafter put all its mass on the main draft: no alternative to draft
    alternative = alternative / torch.where(usable, mass, 1.0)[..., None]
    alternative_draws = draw_rows(torch.where(usable[..., None], alternative, branch_probs[:, :, 0])
                                  .reshape(-1, vocab), sample).view(rows, count)
    columns = [plan.drafts, plan.main_scores, plan.boundary, plan.picks, maxima.flatten(1), draws,
               alternative.max(-1).values, alternative_draws, usable]
    return torch.cat([c.double() for c in columns], 1), alternative  # token ids are exact in float64


def unpack_plans(table: list[list[float]], plan: DevicePlan, first_probs: torch.Tensor, branch_probs: torch.Tensor,
                 alternative: torch.Tensor, limits: list[int]) -> tuple[list[RowPlan], list[list[Branch]]]:
    """Every row's plan and branches on the host, from `plan_table`'s table, read. Row r holds its first
    `limits[r]` slots, its branches the second drafter's slots up to the same slot."""
    depth = plan.drafts.shape[1]
    _, count, length, _ = branch_probs.shape
    slots = count * length
    plans, branches = [], []
    for r, (values, limit) in enumerate(zip(table, limits)):
        picks = [int(i) for i in values[3 * depth : 3 * depth + count]][: min(count, limit)]
        plans.append(RowPlan(plan.drafts[r, :limit], [int(t) for t in values[:limit]],
                             values[depth : depth + limit], values[2 * depth : 2 * depth + limit], picks,
                             first_probs[r, :limit]))
        at = 3 * depth + count
        slot_max, slot_draws = values[at : at + slots], values[at + slots : at + 2 * slots]
        at += 2 * slots
        alt_max, alt_tokens, ok = values[at : at + count], values[at + count : at + 2 * count], values[at + 2 * count :]
        row_branches = []
        for b, i in enumerate(picks):
            n = min(length, limit - i)  # the branch's slots up to the row's limit
            row_branches.append(Branch(
                i, int(alt_tokens[b]) if ok[b] else None, alt_max[b], alternative[r, b],
                [int(t) for t in slot_draws[b * length + 1 : b * length + n]],
                slot_max[b * length + 1 : b * length + n], [branch_probs[r, b, j] for j in range(1, n)]))
        branches.append(row_branches)
    return plans, branches


def prefix_tree(root_token: int, plan: RowPlan, branches: list[Branch], budget: int, choose_count=None, *,
                sample: bool) -> CandidateTree:
    """The deduplicated, pruned tree of a row's main chain and its branches, built on the host from what
    `unpack_plans` read. `choose_count(reach_probs) -> n`, optional: how many nodes (root included)
    to verify given the reach probabilities of the candidates in decreasing order (the cost model); `budget` stays
    the upper bound. `sample`: the drafts were drawn, and the tree carries the laws they were drawn from as its
    `draft_laws` (for rejection sampling). Scores use only the laws' maxima, never the drawn tokens, so which nodes
    are kept does not depend on their own values (required for losslessness)."""
    main, scores, sources = _candidate_nodes(plan, branches)
    depth = len(plan.tokens)
    # keep the most probable nodes; a node's effective score is at most its parent's and ties go to the shorter
    # path, so every kept node's ancestors are kept, and come before it
    effective = {p: min(scores[p[:j]] for j in range(1, len(p) + 1)) for p in scores}
    keep = sorted(scores, key=lambda p: (-effective[p], len(p)))[: budget - 1]
    if choose_count is not None:
        keep = keep[: choose_count([effective[p] for p in keep]) - 1]
    # children in the order they were drawn (a branch's alternative after the main draft it excludes)
    main_paths = {main[: k + 1] for k in range(depth)}
    keep.sort(key=lambda p: (len(p), p not in main_paths))
    index = {(): 0}
    tokens, parents = [root_token], [-1]
    for path in keep:
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
    laws = None
    if sample:  # the tree's nodes' laws alone, in one copy (not every slot and branch); the root's row unused
        laws = CompactLaw(None, torch.stack([torch.zeros_like(plan.laws[0]), *(sources[p] for p in keep)]))
    return CandidateTree(tokens, parents, draft_laws=laws, confidences=[scores[p] for p in keep],
                         device=plan.laws.device)


def _candidate_nodes(plan: RowPlan, branches: list[Branch]) -> tuple[tuple, dict, dict]:
    """Every candidate node of `prefix_tree`, keyed by its token path from the root: the main chain's token path,
    each node's reach score and the distribution it was drawn from. No two candidates share a path: a branch leaves
    the main chain at its alternative, which is never the main draft there, and branches leave it at different
    prefix lengths; the branches share the main chain's nodes before that."""
    scores: dict[tuple, float] = {}
    sources: dict[tuple, torch.Tensor] = {}
    main = tuple(plan.tokens)
    for k in range(len(main)):
        scores[main[: k + 1]], sources[main[: k + 1]] = plan.main_scores[k], plan.laws[k]
    for branch in branches:
        if branch.alternative is None:
            continue
        i = branch.prefix_length
        score = plan.boundary[i] * branch.alternative_score
        path = main[:i] + (branch.alternative,)
        scores[path], sources[path] = score, branch.alternative_law
        for token, maximum, law in zip(branch.tokens, branch.maxima, branch.laws):
            score *= maximum
            path = path + (token,)
            scores[path], sources[path] = score, law
    return main, scores, sources
