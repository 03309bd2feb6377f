"""How the target picks each committed token, always from its processed distribution p at the exact committed prefix.

- greedy: argmax of the processed scores (what `_sample` does without sampling);
- sampling, argmax drafts: one draw from p (what `_sample` does); acceptance descends into the child carrying it
  ("exact-match"). For deterministic drafts this is the best any lossless rule can do: it accepts the children with
  total probability sum p(child).
- sampling, drafts drawn from known distributions q (the tree's `draft_probs`): recursive rejection sampling. Children
  are tried in the order they were drawn; child x (drawn from q_x) is accepted with probability min(1, p(x)/q_x(x));
  on rejection p becomes norm(max(0, p - q_x)) and the next child is tried; if all are rejected the token is drawn
  from what is left of p. Each try is one speculative-sampling step targeting the current residual with a fresh
  proposal, so the committed token is distributed exactly as p.
"""

import torch


def choose_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """(1, vocab) processed scores -> (1,) token id."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


def choose_token_among_drafts(scores: torch.Tensor, children: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Recursive rejection sampling over `children` [(token, q it was drawn from)]: (1, vocab) scores -> (1,)."""
    p = scores.softmax(dim=-1)[0]
    for token, q in children:
        q = q.to(p.device, p.dtype)
        if float(torch.rand(())) * float(q[token]) < float(p[token]):  # accept with probability min(1, p/q)
            return torch.tensor([token], device=scores.device)
        residual = (p - q).clamp(min=0)
        mass = residual.sum()
        if not mass > 0:  # p equals q up to rounding: a rejection had probability ~0, and p is what is left
            continue
        p = residual / mass
    return torch.multinomial(p, num_samples=1)
