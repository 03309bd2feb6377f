"""The drafting side of speculative decoding: a `CandidateGenerator` that wraps a diffusion drafter.

It owns the per-call drafter state (`DrafterContext`: the drafter's KV cache of committed tokens and the target
features not yet cached). Our decoding loop calls `add_context` + `propose` (which returns a `CandidateTree`: a chain
for a DFlash drafter, a D²SD prefix tree for a dual drafter); transformers' stock `_assisted_decoding` calls
`get_candidates` (a chain), so the same drafter also runs inside plain transformers assisted generation.

Like every runtime file that `custom_generate/` ships (see `hub.py`), it imports only torch, transformers and
sibling modules, so it also runs from a Hub folder without hf_diffspec installed.
"""

import time

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .cost_model import VerifyCost, best_node_count
from .prefix_tree import build_prefix_tree
from .tree import CandidateTree

DRAFTER_MODEL_TYPES = ("diffusion_drafter", "dual_diffusion_drafter")


def is_diffusion_drafter(model) -> bool:
    """True for hf_diffspec drafters, including ones loaded as remote code (another class object, same model_type)."""
    return getattr(getattr(model, "config", None), "model_type", None) in DRAFTER_MODEL_TYPES


def first_drafter(model):
    """The DFlash drafter of a single or dual drafter."""
    return model.first if model.config.model_type == "dual_diffusion_drafter" else model


def feature_layers(drafter) -> list[int]:
    """`output_hidden_states` indices of the target features (index 0 is the embeddings)."""
    return [i + 1 for i in first_drafter(drafter).config.target_layer_ids]


def gather_features(hidden_states, drafter) -> torch.Tensor:
    """Concatenate the selected target hidden states on the last dim: (batch, seq, n_layers * hidden)."""
    return torch.cat([hidden_states[i] for i in feature_layers(drafter)], dim=-1)


class DrafterContext:
    """One drafter's view of the committed tokens: cached context K/V, which slots are padding, and the features of
    tokens committed since its last forward."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = DynamicCache()
        self.valid: torch.Tensor | None = None  # (ctx,) bool over cached slots
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # features, positions, valid

    @property
    def length(self) -> int:
        cached = 0 if self.valid is None else self.valid.shape[0]
        return cached + sum(p.shape[0] for _, p, _ in self.pending)

    def _take_pending(self):
        device = self.drafter.device
        if not self.pending:
            return None, torch.empty(0, dtype=torch.long, device=device)
        context = torch.cat([f for f, _, _ in self.pending], dim=1).to(device)
        positions = torch.cat([p for _, p, _ in self.pending]).to(device)
        new_valid = torch.cat([v for _, _, v in self.pending]).to(device)
        self.pending = []
        self.valid = new_valid if self.valid is None else torch.cat([self.valid, new_valid])
        return context, positions

    def _mask(self, block: int, rows: int = 1):
        if bool(self.valid.all()):
            return None
        ones = torch.ones(block, dtype=torch.bool, device=self.valid.device)
        return torch.cat([self.valid, ones])[None].expand(rows, -1)

    def draft_block(self, root_token: int, root_position: int, block_size: int) -> torch.Tensor:
        """One forward over `[anchor, MASK...]` that also caches the pending context; returns (1, block, hidden)."""
        device = self.drafter.device
        context, context_positions = self._take_pending()
        noise = self.drafter.block_embeds(torch.tensor([root_token], device=device), block_size)
        out = self.drafter(
            noise_embeds=noise, context_hidden_states=context,
            position_ids=torch.cat([context_positions, root_position + torch.arange(block_size, device=device)])[None],
            attention_mask=self._mask(block_size), cache=self.cache,
        )
        # the block's K/V must not outlive this draft: only committed context stays cached
        self.cache.crop(-block_size)
        return out.last_hidden_state

    def draft_branches(self, root_token: int, prefixes: list[torch.Tensor], root_position: int,
                       block_size: int) -> torch.Tensor:
        """Blocks `[anchor, prefix..., MASK...]`, one row per prefix, in one forward over the shared cached context;
        returns (rows, block, hidden)."""
        device = self.drafter.device
        context, context_positions = self._take_pending()
        if context is not None:
            self.drafter.prefill_context(context, context_positions[None], self.cache)
        rows = len(prefixes)
        tokens = torch.full((rows, block_size), root_token, dtype=torch.long, device=device)
        is_mask = torch.ones((rows, block_size), dtype=torch.bool, device=device)
        is_mask[:, 0] = False
        for row, prefix in enumerate(prefixes):
            tokens[row, 1 : 1 + len(prefix)] = prefix
            is_mask[row, 1 : 1 + len(prefix)] = False
        noise = self.drafter.target_embed_tokens(torch.where(is_mask, root_token, tokens))
        positions = (root_position + torch.arange(block_size, device=device))[None].expand(rows, -1)
        out = self.drafter(noise_embeds=noise, position_ids=positions, attention_mask=self._mask(block_size, rows),
                           cache=self.cache, mask_positions=is_mask, extend_cache=False)
        return out.last_hidden_state


class DiffusionCandidateGenerator(CandidateGenerator):
    """Drafts with a block-diffusion drafter (or a D²SD dual drafter) conditioned on the target's hidden states.

    Args:
        drafter: a `DiffusionDrafter` or `DualDiffusionDrafter`; re-bound to `target` (after a check) if needed.
        target: the model being decoded; its embeddings and LM head are used for drafting.
        max_length: total length (prompt + new tokens) never to be exceeded.
        sample_temperature: when set, drafts are drawn from softmax(drafter logits / temperature) and the tree carries
            those distributions for rejection sampling; `None` drafts the argmax.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target: PreTrainedModel, max_length: int, sample_temperature: float | None = None):
        if not is_diffusion_drafter(drafter):
            raise TypeError(f"expected a DiffusionDrafter, got {type(drafter).__name__}")
        # binding checks that the drafter was built for this target; the target generating is the one to borrow from
        if not drafter.is_bound or first_drafter(drafter).target_lm_head is not target.get_output_embeddings():
            drafter.bind_target(target)
        self.drafter = drafter
        self.first = DrafterContext(first_drafter(drafter))
        self.is_dual = drafter.config.model_type == "dual_diffusion_drafter"
        self.second = None
        if self.is_dual:  # the VP drafter has weights of its own, hence its own cache; else branches share the first
            self.second = DrafterContext(drafter.vp) if drafter.vp is not None else self.first
        self.block_size = self.first.drafter.config.block_size
        self.max_length = max_length
        self.sample_temperature = sample_temperature
        self.max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        # with a measured cost profile the verified length follows the drafter's confidence step by step
        self.verify_cost = VerifyCost.for_target(target)
        self.draft_seconds: float | None = None
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
        for context in {id(c): c for c in (self.first, self.second) if c is not None}.values():
            context.pending.append((features, positions, valid.bool()))

    def _depth_limit(self, root_position: int, max_depth: int) -> int:
        config = self.drafter.config
        if self.is_dual:
            limit = config.max_depth
        elif self.verify_cost is not None:
            limit = self.block_size - 1  # the cost model decides how much of the block to verify
        else:
            limit = config.num_draft_tokens or self.block_size - 1
        max_depth = min(max_depth, limit, self.block_size - 1)
        if self.max_positions is not None:
            max_depth = min(max_depth, self.max_positions - 1 - root_position)
        return max_depth

    @torch.no_grad()
    def propose(self, root_token: int, root_position: int, max_depth: int) -> CandidateTree:
        """Draft after `root_token` (the anchor): a chain, or for a dual drafter a D²SD prefix tree."""
        max_depth = self._depth_limit(root_position, max_depth)
        device = self.first.drafter.device
        if max_depth <= 0:
            return CandidateTree.chain(root_token, torch.empty(0, dtype=torch.long, device=device))
        start = time.perf_counter()
        hidden = self.first.draft_block(root_token, root_position, self.block_size)[:, 1 : 1 + max_depth]
        sample = self.sample_temperature is not None
        probs = self._distributions(self.first.drafter.compute_logits(hidden))[0]
        if not self.is_dual:
            confidences, drafts = probs.max(-1)
            if sample:  # confidences stay the maxima: what is verified must not depend on the drawn values
                drafts = torch.multinomial(probs, 1)[:, 0]
            if self.verify_cost is not None:
                self._track_draft_time(start)
                n = best_node_count(torch.cumprod(confidences, 0).tolist(), self.verify_cost, self.draft_seconds)
                drafts, confidences, probs = drafts[: n - 1], confidences[: n - 1], probs[: n - 1]
            draft_probs = torch.cat([torch.zeros_like(probs[:1]), probs]) if sample else None
            return CandidateTree.chain(root_token, drafts, confidences=confidences, draft_probs=draft_probs)

        length = self.drafter.config.branch_length

        def branch_probs(prefixes):
            """Per branch: distributions for `length` slots from its branch point on (slot i+1 for prefix i)."""
            if self.drafter.config.branches_from_first_pass:
                return [probs[len(p) : len(p) + length] for p in prefixes]
            hidden = self.second.draft_branches(root_token, prefixes, root_position, self.block_size)
            rows = [hidden[r, 1 + len(p) : 1 + min(len(p) + length, max_depth)] for r, p in enumerate(prefixes)]
            branch = self._distributions(self.second.drafter.compute_logits(torch.cat(rows)))
            return list(branch.split([len(r) for r in rows]))

        def choose_count(reach_probs):
            if self.verify_cost is None:
                return len(reach_probs) + 1
            self._track_draft_time(start)
            return best_node_count(reach_probs, self.verify_cost, self.draft_seconds)

        config = self.drafter.config
        return build_prefix_tree(root_token, probs, branch_probs, config.num_branches, config.tree_budget, choose_count,
                                 sample=sample)

    def _distributions(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft distributions: softmax of the drafter logits, at the sampling temperature when sampling."""
        logits = logits.float()
        if self.sample_temperature is not None:
            logits = logits / max(self.sample_temperature, 1e-5)
        return logits.softmax(-1)

    def _track_draft_time(self, start: float) -> None:
        elapsed = time.perf_counter() - start
        self.draft_seconds = elapsed if self.draft_seconds is None else 0.8 * self.draft_seconds + 0.2 * elapsed

    # ----- transformers' CandidateGenerator API (stock assisted decoding, chains, batch 1) -----------------------
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if is_first_iteration or model_outputs is None:
            return input_ids, None  # the target prefills and emits the first token itself
        if self.is_dual:
            raise ValueError("transformers' assisted decoding verifies chains only; use generate() for D²SD trees")
        committed = input_ids.shape[1]
        n_new = committed - 1 - self.first.length
        self.add_context(
            model_outputs.hidden_states, slice(0, n_new),
            torch.arange(committed - 1 - n_new, committed - 1, device=input_ids.device),
        )
        tree = self.propose(int(input_ids[0, -1]), committed - 1, self.max_length - committed - 1)
        if len(tree) == 1:
            return input_ids, None
        return torch.cat([input_ids, tree.tokens[None, 1:].to(input_ids.device)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass  # the block size is fixed; adaptive lengths live in our own loop
