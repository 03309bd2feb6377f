"""How the target picks each committed token, always from its processed distribution p at the exact committed prefix.

- greedy: argmax of the processed scores (what `_sample` does without sampling);
- sampling: recursive rejection sampling over the node's children, in the order they were drawn. Child x, drawn from
  a known law q_x (a drafter's warped law, the same law without earlier siblings, or a point mass for a
  deterministic draft: prompt lookup, an argmax), is accepted with probability min(1, p(x)/q_x(x)); on rejection p
  becomes norm(max(0, p - q_x)) and the next child is tried; if all are rejected the token is drawn from what is left
  of p. Each try is one speculative-sampling step targeting the current residual with a fresh proposal, so the
  committed token is distributed exactly as p. A point mass is accepted with probability p(x) and removes x from p:
  for deterministic children that is "draw from p, descend into the child carrying the token".

`rejection_choices` runs the rule for every row and node of a step at once, on the device, on compact laws
(`sampling.py`); `choose_token_among_drafts` is the same rule for one position with dense laws (the token-by-token
path). Both run the tries through `rejection_try`, the rule's one step.
"""

import torch

from .sampling import CompactLaw


def choose_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """(1, vocab) processed scores -> (1,) token id."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
    return scores.max(dim=-1).indices  # the argmax (its first maximum), 3-4x faster on a CPU


def rejection_try(residual: torch.Tensor, support: torch.Tensor | None, token: torch.Tensor, law: CompactLaw,
                  trying: torch.Tensor):
    """One try of the rule at many positions at once: where `trying`, `token` drawn from `law` is accepted with
    probability min(1, r(token) / q(token)) against the current `residual` r (..., K) over the ids `support`; where it
    is rejected, r becomes norm(max(0, r - q)). Returns (accepted, residual). `support` None: r and `law` are dense
    (the token-by-token path); else compact, as every law on the device path is (`sampling.SamplingLaws.compact`)."""
    token_id = token.clamp(min=0)
    r_token = residual.gather(-1, token_id[..., None]).squeeze(-1) if support is None else \
        ((support == token[..., None]) * residual).sum(-1)
    accepted = trying & (torch.rand(token.shape, device=residual.device) * law.at(token_id) < r_token)
    q = law.probs if support is None else law.on(support)
    after = (residual - q).clamp(min=0)
    mass = after.sum(-1, keepdim=True)
    # a mass of 0: p equals q up to rounding, a rejection had probability ~0, and p is what is left
    rejected = (trying & ~accepted)[..., None] & (mass > 0)
    return accepted, torch.where(rejected, after / mass.clamp(min=1e-30), residual)


def rejection_choices(target: CompactLaw, tokens: torch.Tensor, children: torch.Tensor,
                      node_laws: CompactLaw) -> torch.Tensor:
    """The token the target commits after each node of a batch of trees, were the node reached: `target` (rows,
    nodes, K) its processed law at every node; `tokens` (rows, nodes) the nodes' tokens; `children` (rows, nodes, M)
    each node's children in the order they were drawn (-1: none); `node_laws` (rows, nodes, K') the compact law each
    node's token was drawn from. The accepted child's token, or a draw from the residual when every child was rejected;
    a path then follows these choices exactly as a greedy one follows the argmax."""
    rows, nodes = tokens.shape
    residual, support = target.probs.float(), target.ids
    choice = torch.zeros_like(tokens)  # read only where decided
    decided = torch.zeros_like(tokens, dtype=torch.bool)
    flat_index = torch.arange(rows, device=tokens.device)[:, None] * nodes
    for rank in range(children.shape[-1]):  # the few sibling ranks; every row and node at once
        child = children[..., rank]
        index = (flat_index + child.clamp(min=0)).flatten()
        token = tokens.flatten()[index].view(rows, nodes)
        law = CompactLaw(node_laws.ids.flatten(0, 1)[index].view(rows, nodes, -1),
                         node_laws.probs.flatten(0, 1)[index].view(rows, nodes, -1))
        accepted, residual = rejection_try(residual, support, token, law, (child >= 0) & ~decided)
        choice = torch.where(accepted, token, choice)
        decided |= accepted
    return torch.where(decided, choice, CompactLaw(support, residual).sample())


def choose_token_among_drafts(scores: torch.Tensor, children: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Recursive rejection sampling over `children` [(token, dense q it was drawn from)] at one position: (1, vocab)
    processed scores -> (1,) token."""
    residual = scores.softmax(dim=-1)[0]
    device = residual.device
    for token, q in children:
        token = torch.tensor(token, device=device)
        accepted, residual = rejection_try(residual, None, token, CompactLaw(None, q.to(device, residual.dtype)),
                                           torch.tensor(True, device=device))
        if accepted:
            return token.reshape(1)
    return torch.multinomial(residual, num_samples=1)
