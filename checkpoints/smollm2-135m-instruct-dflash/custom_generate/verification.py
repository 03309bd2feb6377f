"""How the target picks each committed token. Lossless by construction: the pick depends only on the target's
processed distribution at the exact committed prefix, never on the drafts.

- greedy: argmax of the processed scores (what `_sample` does without sampling);
- sampling: one draw from softmax(processed scores) (what `_sample` does with sampling). The walk then descends into
  the child carrying the drawn token, if any ("exact-match" verification). For deterministic (argmax) drafts this
  accepts a draft x with probability p(x), the same as rejection sampling against a one-hot q, and needs no draft
  probabilities.
"""

import torch


def choose_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """(1, vocab) processed scores -> (1,) token id."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)
