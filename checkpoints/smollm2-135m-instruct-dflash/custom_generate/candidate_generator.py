"""The drafting side of speculative decoding: a `CandidateGenerator` that wraps a `DiffusionDrafter`.

Like every runtime file that `custom_generate/` ships (see `hub.py`), it imports only torch, transformers and
sibling modules, so it also runs from a Hub folder without hf_diffspec installed.

It owns the per-call drafter state: the drafter's KV cache (context K/V of committed tokens) and the target features of
tokens committed since the last draft. Our decoding loop calls `add_context` + `propose` (which returns a
`CandidateTree`); transformers' stock `_assisted_decoding` calls `get_candidates` (a chain), so the same drafter also
runs inside plain transformers assisted generation.
"""

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .tree import CandidateTree

DRAFTER_MODEL_TYPE = "diffusion_drafter"


def is_diffusion_drafter(model) -> bool:
    """True for hf_diffspec drafters, including ones loaded as remote code (another class object, same model_type)."""
    return getattr(getattr(model, "config", None), "model_type", None) == DRAFTER_MODEL_TYPE


def feature_layers(drafter) -> list[int]:
    """`output_hidden_states` indices of the target features (index 0 is the embeddings)."""
    return [i + 1 for i in drafter.config.target_layer_ids]


def gather_features(hidden_states, drafter) -> torch.Tensor:
    """Concatenate the selected target hidden states on the last dim: (batch, seq, n_layers * hidden)."""
    return torch.cat([hidden_states[i] for i in feature_layers(drafter)], dim=-1)


class DiffusionCandidateGenerator(CandidateGenerator):
    """Drafts with a block-diffusion drafter conditioned on the target's hidden states.

    Args:
        drafter: the `DiffusionDrafter`; re-bound to `target` (after a compatibility check) if needed.
        target: the model being decoded; its embeddings and LM head are used for drafting.
        max_length: total length (prompt + new tokens) never to be exceeded.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target: PreTrainedModel, max_length: int):
        if not is_diffusion_drafter(drafter):
            raise TypeError(f"expected a DiffusionDrafter, got {type(drafter).__name__}")
        # binding checks that the drafter was built for this target; the target generating is the one to borrow from
        if not drafter.is_bound or drafter.target_lm_head is not target.get_output_embeddings():
            drafter.bind_target(target)
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.max_length = max_length
        self.max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.cache = DynamicCache()
        self.context_valid: torch.Tensor | None = None  # (ctx,) bool: drafter cache slots that are real tokens
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # features, positions, valid
        # transformers' assisted loop merges this into the target forward: we only need these hidden states
        self.model_kwargs_overrides = {"output_hidden_states": feature_layers(drafter)}

    # ----- our loop -----------------------------------------------------------------------------------------------
    def add_context(self, hidden_states, index, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Queue the target features of newly committed tokens (`index` into the sequence dim of `hidden_states`).

        `valid` marks padding (False) among them, e.g. a left-padded prompt; padding stays masked in every draft.
        """
        features = gather_features(hidden_states, self.drafter)[:, index]
        if valid is None:
            valid = torch.ones(positions.shape[0], dtype=torch.bool, device=positions.device)
        self._pending.append((features, positions, valid.bool()))

    @torch.no_grad()
    def propose(self, root_token: int, root_position: int, max_depth: int) -> CandidateTree:
        """Draft up to `max_depth` tokens after `root_token` (the anchor) and return them as a chain."""
        max_depth = min(max_depth, self.drafter.config.num_draft_tokens or self.block_size - 1)
        if self.max_positions is not None:
            max_depth = min(max_depth, self.max_positions - 1 - root_position)
        device = self.drafter.device
        if max_depth <= 0:
            return CandidateTree.chain(root_token, torch.empty(0, dtype=torch.long, device=device))
        hidden = self.draft_block(root_token, root_position)[:, 1 : 1 + max_depth]
        probs = self.drafter.compute_logits(hidden).float().softmax(-1)[0]
        confidences, drafts = probs.max(-1)
        return CandidateTree.chain(root_token, drafts, confidences=confidences)

    def draft_block(self, root_token: int, root_position: int) -> torch.Tensor:
        """One drafter forward over `[anchor, MASK...]`; consumes the pending context; returns (1, block, hidden)."""
        device = self.drafter.device
        context, context_positions = None, torch.empty(0, dtype=torch.long, device=device)
        new_valid = torch.empty(0, dtype=torch.bool, device=device)
        if self._pending:
            context = torch.cat([f for f, _, _ in self._pending], dim=1).to(device)
            context_positions = torch.cat([p for _, p, _ in self._pending]).to(device)
            new_valid = torch.cat([v for _, _, v in self._pending]).to(device)
            self._pending = []
        self.context_valid = new_valid if self.context_valid is None else torch.cat([self.context_valid, new_valid])

        block_positions = root_position + torch.arange(self.block_size, device=device)
        noise = self.drafter.block_embeds(torch.tensor([root_token], device=device), self.block_size)
        mask = None
        if not bool(self.context_valid.all()):
            mask = torch.cat([self.context_valid, torch.ones(self.block_size, dtype=torch.bool, device=device)])[None]
        out = self.drafter(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=torch.cat([context_positions, block_positions])[None],
            attention_mask=mask,
            cache=self.cache,
        )
        # the block's K/V must not outlive this draft: only committed context stays cached
        self.cache.crop(-self.block_size)
        return out.last_hidden_state

    # ----- transformers' CandidateGenerator API (stock assisted decoding, chains, batch 1) -----------------------
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if is_first_iteration or model_outputs is None:
            return input_ids, None  # the target prefills and emits the first token itself
        committed = input_ids.shape[1]
        n_new = committed - 1 - self._context_length()
        self.add_context(
            model_outputs.hidden_states, slice(0, n_new),
            torch.arange(committed - 1 - n_new, committed - 1, device=input_ids.device),
        )
        depth = self.max_length - committed - 1
        tree = self.propose(int(input_ids[0, -1]), committed - 1, depth)
        if len(tree) == 1:
            return input_ids, None
        return torch.cat([input_ids, tree.tokens[None, 1:].to(input_ids.device)], dim=1), None

    def _context_length(self) -> int:
        cached = 0 if self.context_valid is None else self.context_valid.shape[0]
        return cached + sum(p.shape[0] for _, p, _ in self._pending)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass  # the block size is fixed; adaptive lengths live in our own loop
