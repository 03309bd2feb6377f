"""The drafting side of speculative decoding: one `CandidateGenerator` subclass per drafting method.

- `DiffusionCandidateGenerator`: a DFlash drafter drafts one block per row in one forward; each row gets a chain.
- `SelectorCandidateGenerator`: the same chains from a DFlash 2 drafter, whose candidate selector picks the path.
- `BestFirstTreeCandidateGenerator`: a DFlash drafter with `draft_tree_budget` set: a best-first tree per row from the
  same single pass (DDTree-style).
- `PrefixTreeCandidateGenerator`: a D²SD dual drafter; the first drafter's block, then K branches re-drafted where
  rejection is likeliest (one batched pass of the second drafter), as one prefix tree per row.

Each owns the per-call drafter state (`DrafterContext`: the drafter's KV cache of committed tokens and the target
features not yet cached). Our decoding loop calls `add_context` and `propose` (a `CandidateTree` per row);
transformers' stock `_assisted_decoding` calls `get_candidates` (chains, batch 1), so the same drafter also runs inside
plain transformers assisted generation. How many drafts are verified is the `DraftLengthPolicy`'s decision.

Like every runtime file that `custom_generate/` ships (see `hub.py`), it imports only torch, transformers and
sibling modules, so it also runs from a Hub folder without hf_diffspec installed.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .drafting_best_first import (best_first_shape, build_best_first_tree, build_selector_tree, laws_to_device,
                                  selector_tables, unpack_selector_table)
from .control_policy import DraftLengthPolicy, speculation_policy
from .device_clock import StepClock
from .drafting_prefix_tree import DevicePlan, branch_slots, plan_rows, plan_table, prefix_tree, unpack_plans
from .drafting_static import StaticDrafterStep, keep_drafter_step, lease_drafter_step
from .sampling import CompactLaw, SamplingLaws
from .tree import CandidateTree, host_to_device, index_range
from .verify_cache import crop_attention
from .verify_cache import select_rows as select_cache_rows
from .verify_inputs import ValidSlots, additive_mask

DRAFTER_MODEL_TYPES = ("diffusion_drafter", "dual_diffusion_drafter")
# rows x slots up to which a step's drafter logits take one pass of the LM head (beyond: growing chunks, which also
# bound the step's memory at rows x slots x vocabulary)
ONE_PASS_SLOTS = 256


def is_diffusion_drafter(model) -> bool:
    """True for hf_diffspec drafters, including ones loaded as remote code (another class object, same model_type)."""
    return getattr(getattr(model, "config", None), "model_type", None) in DRAFTER_MODEL_TYPES


def first_drafter(model):
    """The DFlash drafter of a single or dual drafter."""
    return model.first if model.config.model_type == "dual_diffusion_drafter" else model


class DrafterContext:
    """One drafter's view of the committed tokens of every row: cached context K/V, which cached slots each row may
    see (padding and other rows' accepted drafts are not its own), and features committed since its last forward."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.device = drafter.device  # (a property that walks the parameters)
        self.cache = DynamicCache()
        self.valid_slots: ValidSlots | None = None  # which cached slots each row may see
        self.all_valid = True  # known on the host: every row may see every slot, cached or pending
        # features, positions and valid of each step since the last forward, with the rows of them still in the batch
        # (None: all): finished rows are left out when the features are taken, not copied out at every drop (steps
        # without a drafter forward pile up features, which at 64 rows made each drop copy tens of megabytes)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.static: StaticDrafterStep | None = None  # the capture-ready pass (`use_static`)

    def use_static(self, step: StaticDrafterStep) -> None:
        """Draft over `step`'s preallocated cache and persistent inputs from now on (before the first pass)."""
        self.static, self.cache = step, step.cache

    @property
    def valid(self) -> torch.Tensor | None:
        """(rows, cached slots) bool: which cached slots each row may see."""
        return None if self.valid_slots is None else self.valid_slots.view

    @property
    def length(self) -> int:
        cached = 0 if self.valid_slots is None else self.valid_slots.used
        return cached + sum(p.shape[1] for _, p, _, _ in self.pending)

    def select_rows(self, keep: torch.Tensor, moves=None) -> None:
        """Drop finished rows: keep only `keep` (indices into the current rows; `moves`: how the K/V keep them in
        place, from `BatchState.drop_finished`)."""
        if self.static is not None:
            self.static.select_rows(moves)  # a static step exists only inside `generate`, which passes them
        else:
            select_cache_rows(self.cache, keep, moves)
        self.all_valid = False  # the rows left may see every slot, but the host does not know it
        if self.valid_slots is not None:
            self.valid_slots.select_rows(keep)
        self.pending = [(f, p, v, keep if kept is None else kept[keep]) for f, p, v, kept in self.pending]

    def drop_last(self, slots: int, on_device: torch.Tensor | None = None) -> None:
        """Forget the last `slots` cached context slots (nothing may be pending); `on_device`: the same count on the
        device, which a static cache is cropped by (the same op whatever the count)."""
        if self.static is not None and on_device is not None:
            crop_attention(self.cache, on_device)
        elif slots > 0:
            self.cache.crop(-slots)
        self.valid_slots.used -= slots

    def _take_pending(self, rows: int):
        """The features, positions and validity (rows, n) of the slots committed since the last pass."""
        device = self.device
        if self.valid_slots is None:
            self.valid_slots = ValidSlots(torch.zeros(rows, 0, dtype=torch.bool, device=device),
                                    self.static.capacity if self.static is not None else None)
        if not self.pending:
            return None, torch.empty(rows, 0, dtype=torch.long, device=device), None
        steps = [(f, p, v) if kept is None else (f[kept], p[kept], v[kept]) for f, p, v, kept in self.pending]
        self.pending = []
        if len(steps) == 1:  # a step's features (the usual case): nothing to join
            return tuple(t.to(device) for t in steps[0])
        return tuple(torch.cat(parts, dim=1).to(device) for parts in zip(*steps))

    def _mask(self, block: int):
        if self.all_valid:
            return None
        return torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], block)], dim=1)

    def draft_block(self, root_tokens: torch.Tensor, root_positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """One forward over `[anchor, MASK...]` per row that also caches the pending context; (rows, block, hidden)."""
        context, context_positions, new_valid = self._take_pending(root_tokens.shape[0])
        noise = self.drafter.block_embeds(root_tokens, block_size)
        block_positions = root_positions[:, None] + index_range(block_size, root_positions.device)
        if self.static is not None:
            return self.static.draft(self.drafter, context, context_positions, self.valid_slots, new_valid, noise,
                                     block_positions)
        if new_valid is not None:
            self.valid_slots.append(new_valid)
        out = self.drafter(
            noise_embeds=noise, context_hidden_states=context,
            position_ids=torch.cat([context_positions, block_positions], dim=1),
            attention_mask=self._mask(block_size), cache=self.cache,
        )
        # the block's K/V must not outlive this draft: only committed context stays cached
        self.cache.crop(-block_size)
        return out.last_hidden_state

    def draft_branches(self, root_tokens: torch.Tensor, root_positions: torch.Tensor, drafts: torch.Tensor,
                       picks: torch.Tensor, block_size: int) -> torch.Tensor:
        """Blocks `[anchor, drafts[r, :i]..., MASK...]` for every prefix length i in `picks[r]` (rows, K), in one
        forward, on the device; returns (rows, K, block, hidden). A row's blocks sit side by side in its own sequence,
        each seeing the row's cached context and itself alone (the mask): the context's K/V are read once per row,
        never copied per branch."""
        device = self.device
        rows, count = picks.shape
        context, context_positions, new_valid = self._take_pending(rows)
        if context is not None:
            self.valid_slots.append(new_valid)
            self.drafter.prefill_context(context, context_positions, self.cache)
        slot = index_range(block_size, device)
        prefix = torch.cat([root_tokens[:, None], drafts], 1)[:, :block_size]  # slot s holds draft s - 1
        prefix = torch.cat([prefix, root_tokens[:, None].expand(-1, block_size - prefix.shape[1])], 1)
        is_mask = (slot[None, None] > picks[..., None]).reshape(rows, -1)  # (slot 0, the anchor, never)
        tokens = torch.where(is_mask, root_tokens[:, None], prefix.repeat(1, count))
        noise = self.drafter.target_embed_tokens(tokens)
        width = count * block_size
        positions = root_positions[:, None] + slot.repeat(count)
        block_of = index_range(width, device) // block_size
        sees = torch.cat([(self.valid if not self.all_valid else is_mask.new_ones(rows, self.length))[:, None]
                          .expand(-1, width, -1), (block_of[:, None] == block_of[None]).expand(rows, -1, -1)], dim=-1)
        mask = additive_mask(sees, noise.dtype)
        out = self.drafter(noise_embeds=noise, position_ids=positions, attention_mask=mask[:, None], cache=self.cache,
                           mask_positions=is_mask, extend_cache=False)
        return out.last_hidden_state.view(rows, count, block_size, -1)


@dataclass
class DraftPass:
    """The next step's drafting pass, run before this step's one read of the device (`draft_ahead`): what its trees
    are built from on the device (`tensors`, rows first) and the (rows, n) tensor the host reads for them (`read`:
    reach or ranked probabilities; None when the trees need nothing read), read with the step's outcome into
    `values`. `context`: the width of the step's slots in the drafter's context and its `all_valid` before
    them; `span`: the pass's start and end stamps."""

    tensors: tuple
    read: torch.Tensor | None
    context: tuple[int, bool, torch.Tensor | None]
    span: tuple
    values: list | None = None

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep the rows still decoding (`keep` on the host, `index` on the device)."""
        self.tensors = tuple(t if t is None else t[index] for t in self.tensors)
        if self.values is not None:
            self.values = [self.values[i] for i in keep]


class DiffusionCandidateGenerator(CandidateGenerator):
    """Drafts with a block-diffusion (DFlash) drafter conditioned on the target's hidden states: one chain per row,
    every row of a batch in one drafter forward.

    Args:
        drafter: a `DiffusionDrafter` (or a dual drafter, see `PrefixTreeCandidateGenerator`); re-bound to `target`
            (after a check) if needed.
        target: the model being decoded; its embeddings and LM head are used for drafting.
        policy: how many drafts to verify (`DraftLengthPolicy`); `None` builds the default one for `target`.
        sampling: when sampling, the call's processed laws (`SamplingLaws`): drafts are drawn from the drafter's logits
            through the same processors as the target's, and the trees carry those laws for rejection sampling;
            `None` drafts the argmax.
        max_length: total length never to be exceeded (used by transformers' stock loop, `get_candidates`).
    """

    requires_model_outputs = True
    static_drafting = True  # its passes can run over `drafting_static.StaticDrafterStep`

    def __init__(self, drafter, target: PreTrainedModel, policy: DraftLengthPolicy | None = None,
                 sampling: SamplingLaws | None = None, max_length: int | None = None):
        if not is_diffusion_drafter(drafter):
            raise TypeError(f"expected a DiffusionDrafter, got {type(drafter).__name__}")
        # binding checks that the drafter was built for this target; the target generating is the one to borrow from
        if not drafter.is_bound or first_drafter(drafter).target_lm_head is not target.get_output_embeddings():
            drafter.bind_target(target)
        self.drafter = drafter
        self.first = DrafterContext(first_drafter(drafter))
        self.contexts = [self.first]  # every drafter cache that must see the committed tokens
        self.block_size = self.first.drafter.config.block_size
        self.policy = policy or speculation_policy(drafter, target, method=type(self))
        self.sampling = sampling
        self.clock = StepClock(self.first.device)
        self._draft_spans = []  # (start, end) stamps of drafting passes whose time is not read yet
        self.max_length = max_length
        self.length_head = getattr(self.first.drafter, "length_head", None)
        # transformers' assisted loop merges this into the target forward: we only need these hidden states
        self.model_kwargs_overrides = {"output_hidden_states": drafter.target_feature_layers}

    # ----- our loop -----------------------------------------------------------------------------------------------
    def add_context(self, hidden_states, index, positions: torch.Tensor, valid: torch.Tensor | None = None,
                    all_valid: bool | None = None) -> None:
        """Queue the target features of newly committed tokens: `index` selects them on the sequence dim of
        `hidden_states` (a slice, or (rows, n) indices per row); `positions` (rows, n) are their positions.

        `valid` (rows, n) marks slots a row must never see (False), e.g. left padding or the unused tail of a row
        that accepted fewer tokens than another; they stay masked in every draft. `all_valid`: whether `valid` is all
        True, when the caller knows it on the host (else it is read from the device).
        """
        features = self.drafter.gather_target_features(hidden_states)
        if isinstance(index, slice):
            features = features[:, index]
        else:
            features = features[index_range(features.shape[0], index.device)[:, None], index]
        if valid is None:
            valid, all_valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device), True
        if all_valid is None:
            all_valid = bool(valid.all())
        for context in self.contexts:
            context.pending.append((features, positions, valid.bool(), None))
            context.all_valid = context.all_valid and all_valid

    def select_rows(self, keep: torch.Tensor, moves=None) -> None:
        """Forget finished rows (`keep`: indices of the rows still decoding; `moves`: see `DrafterContext`)."""
        for context in self.contexts:
            context.select_rows(keep, moves)

    def draft_statically(self, rows: int, max_length: int) -> None:
        """Draft over a preallocated cache and persistent inputs (`drafting_static.py`), as the static verify step
        verifies, where the drafter and the method allow it; call `keep_static` at the call's end."""
        if self.static_drafting:
            step = lease_drafter_step(self.first.drafter, rows, max_length)
            if step is not None:
                self.first.use_static(step)

    def keep_static(self) -> None:
        keep_drafter_step(self.first.drafter, self.first.static)

    # ----- drafting ahead: the next step's pass before this step's read --------------------------------------------
    def can_draft_ahead(self, rows: int) -> bool:
        """Whether the next step's drafting pass can run before this step's read: one pass of the LM head over every
        slot a row may verify (`ONE_PASS_SLOTS`; past it the slots are computed in chunks sized by reads)."""
        return rows * self._ahead_span() <= ONE_PASS_SLOTS

    def _ahead_span(self) -> int:
        return min(self.policy.most_drafts(), self.block_size - 1)

    @torch.no_grad()
    def draft_ahead(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, row_ends: list[int],
                    step_context=None) -> DraftPass:
        """The next step's drafting pass, from anchors and positions on the device, before the host reads this
        step's outcome (whose copy its own reads then ride: `DraftPass.read`). `row_ends`: each row's root position
        this step plus the drafts it may still commit (the same at the next step: both move by what is committed).
        `step_context`: (hidden states, index, positions, valid) of every slot of the step's accepted paths (those
        past a row's count not valid), queued as context first; `keep_ahead` crops them to what the rows kept once
        the host knows it."""
        context = (0, self.first.all_valid, None)
        if step_context is not None:
            hidden_states, index, positions, valid = step_context
            # (the longest path counted on the device too, which a static cache is cropped by)
            longest = valid.sum(-1).max() if self.first.static is not None else None
            context = (positions.shape[1], self.first.all_valid, longest)
            self.add_context(hidden_states, index, positions, valid, all_valid=False)
        start = self.clock.stamp()
        draft_hidden = self.first.draft_block(anchors, anchor_positions, self.block_size)
        tensors, read = self._ahead_pass(anchors, anchor_positions, draft_hidden[:, 1:], self._ahead_span(), row_ends)
        span = (start, self.clock.stamp())
        self._draft_spans.append(span)
        return DraftPass(tensors, read, context, span)

    def keep_ahead(self, ahead: DraftPass, values: list | None, kept: int | None = None,
                   rows_all_valid: bool = True) -> None:
        """After the read: the pass gets what was read along for it (`values`), and the drafter keeps `kept` slots of
        the step's context (the longest accepted path), as `add_context` would have given it; None: none of them
        (the step was accepted another way, which `add_context` gives next)."""
        ahead.values = values
        width, all_valid, longest = ahead.context
        if width:
            for context in self.contexts:  # (each drafts every pass, so each cached the step's slots)
                context.drop_last(width - (kept or 0), None if kept is None or longest is None else width - longest)
                context.all_valid = all_valid and (kept is None or rows_all_valid)
        self.record_draft_times()

    def _ahead_pass(self, roots: torch.Tensor, positions: torch.Tensor, draft_hidden: torch.Tensor, span: int,
                    row_ends: list[int]):
        """`propose`'s device work for chains over `span` slots after anchors `roots` at `positions` (on the device):
        (the tensors the chains are built from, the reach the cost model sizes them by (rows, span), or None). A row
        drafting fewer slots (`row_ends`) takes the first of them."""
        reach = None
        if self.policy.uses_cost_model and self.length_head is not None:
            reach = self._length_head_reach(draft_hidden[:, :span])
        logits = self.first.drafter.compute_logits(draft_hidden[:, :span])
        drafts, confidences, probs = self._pick(draft_hidden, logits, roots)
        if self.policy.uses_cost_model and reach is None:
            reach = torch.cumprod(confidences.float(), dim=-1)
        return (roots, drafts, confidences, probs), reach

    def _ahead_trees(self, ahead: DraftPass, root_tokens: list[int], limits: list[int]) -> list[CandidateTree]:
        roots, drafts, confidences, probs = ahead.tensors
        if ahead.values is not None:
            limits = self.policy.chain_lengths(ahead.values, limits)
        if max(limits) <= 0:
            return [self._root_only(root) for root in root_tokens]
        return self._chains(roots, drafts, confidences, probs, limits)

    @torch.no_grad()
    def propose(self, root_tokens: list[int], root_positions: list[int], remaining: list[int],
                ahead: DraftPass | None = None) -> list[CandidateTree]:
        """Draft after each row's anchor (at `root_positions`) a chain of at most `remaining` tokens per row: the
        limits (the policy's, then the length head's), the slots' logits, the drafts picked, the chains. `ahead`:
        the pass the previous step ran for this one (`draft_ahead`): the chains are built from it."""
        limits = self.policy.depth_limits(root_positions, remaining)
        if ahead is not None:
            return self._ahead_trees(ahead, root_tokens, limits)
        if max(limits) <= 0:  # nothing to draft: verify the anchors alone, no drafter forward
            return [self._root_only(root) for root in root_tokens]
        start = self.clock.stamp()
        roots, _, draft_hidden = self._draft_block(root_tokens, root_positions)
        limits = self._length_head_limits(draft_hidden, limits, start)
        if max(limits) == 0:
            return [self._root_only(root) for root in root_tokens]
        logits, limits = self._logits(draft_hidden, limits)
        drafts, confidences, probs = self._pick(draft_hidden, logits, roots)
        if self.policy.uses_cost_model and self.length_head is None:
            self._draft_finished(start)
            limits = self.policy.chain_lengths(torch.cumprod(confidences, dim=-1).tolist(), limits)
        return self._chains(roots, drafts, confidences, probs, limits)

    def _draft_finished(self, start) -> None:
        """A drafting pass that began at stamp `start` ends now: its time prices later drafts, read once the device
        has run it (on the CPU at once, on a GPU at a later step; `device_clock.StepClock`)."""
        self._draft_spans.append((start, self.clock.stamp()))
        self.record_draft_times()

    def record_draft_times(self) -> None:
        """Hand the policy the times of the drafting passes the device has run, in order."""
        while self._draft_spans:
            seconds = self.clock.seconds(*self._draft_spans[0])
            if seconds is None:
                return
            self._draft_spans.pop(0)
            self.policy.record_draft_time(seconds)

    def _length_head_limits(self, draft_hidden: torch.Tensor, limits: list[int], start) -> list[int]:
        """With a length head and the cost model, the chain lengths that pay given the head's acceptance estimates:
        the head sizes the drafts from hidden states, so only the slots to verify go through the LM head."""
        if not (self.policy.uses_cost_model and self.length_head is not None):
            return limits
        self._draft_finished(start)
        return self.policy.chain_lengths(self._length_head_reach(draft_hidden).tolist(), limits)

    def _length_head_reach(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """The length head's probability that each slot is reached (its acceptance estimates, multiplied)."""
        return torch.cumprod(self.length_head(draft_hidden).float().sigmoid(), dim=-1)

    def _logits(self, draft_hidden: torch.Tensor, limits: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Draft logits of the first `max(limits)` slots, and the limits cut to the slots computed."""
        span = max(limits)
        if not self.policy.uses_cost_model:
            return self.first.drafter.compute_logits(draft_hidden[:, :span]), limits

        # the cost model sizes the chains from these slots' confidences: more slots only while it wants them all
        # (approximately: the rate is rarely best again past a slot count it has already passed)
        def needs_more(logits):
            computed = logits.shape[1]
            confidences = torch.cumprod(self._confidences(logits), dim=-1).tolist()
            lengths = self.policy.chain_lengths(confidences, [min(k, computed) for k in limits])
            return any(n == computed < k for n, k in zip(lengths, limits))

        logits = self._slot_logits(draft_hidden, span, needs_more)
        return logits, [min(k, logits.shape[1]) for k in limits]

    def _pick(self, draft_hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor):
        """(drafts, their confidences, the draft laws) per row and slot: the argmax, or a draw when sampling (on the
        device). When sampling, confidences are the laws' maxima: what is verified must not depend on draws."""
        if self.sampling is None:
            confidences, drafts = self._distributions(logits).max(-1)
            return drafts, confidences, None
        laws = self._draft_laws(logits)
        return laws.sample(), laws.max(), laws

    def _chains(self, roots: torch.Tensor, drafts: torch.Tensor, confidences: torch.Tensor, probs,
                limits: list[int]) -> list[CandidateTree]:
        """One chain per row: its anchor and its first `limits[row]` drafts (with their distributions when
        sampling)."""
        span = max(limits)
        tokens = torch.cat([roots[:, None], drafts[:, :span].long()], dim=1)  # every row's chain at once
        if probs is not None:  # the verified drafts' laws alone (not the block's), after the root's empty one
            probs = probs[:, :span]
            rows, _, width = probs.probs.shape
            probs = CompactLaw(None if probs.ids is None else torch.cat([probs.ids.new_full((rows, 1, width), -1),
                                                                         probs.ids], dim=1),
                               torch.cat([probs.probs.new_zeros(rows, 1, width), probs.probs], dim=1))
        return [CandidateTree(tokens[row, : k + 1], list(range(-1, k)), confidences=confidences[row, :k],
                              draft_laws=None if probs is None else probs[row, : k + 1])
                for row, k in enumerate(limits)]

    def _draft_block(self, root_tokens: list[int], root_positions: list[int]):
        """One first-drafter pass over `[anchor, MASK...]` per row: (anchors, their positions, hidden states of the
        block's draft slots (rows, block - 1, hidden))."""
        roots, positions = host_to_device([root_tokens, root_positions], self.first.device)  # one copy
        return roots, positions, self.first.draft_block(roots, positions, self.block_size)[:, 1:]

    def _slot_logits(self, draft_hidden: torch.Tensor, span: int, needs_more) -> torch.Tensor:
        """Draft logits of the block's first slots, computed in growing chunks (4, 8, 16 ... slots, at most `span`)
        until `needs_more(logits)` says the slots computed so far decide what is verified. The LM head is the
        drafter's largest cost (49k rows per slot for SmolLM2), and steps usually verify only the first few slots.
        Up to `ONE_PASS_SLOTS` rows x slots, every slot in one pass: there the head's weights, read once per pass,
        cost more than its rows, and chunks would read them up to three times a step."""
        drafter, logits, end = self.first.drafter, None, 0
        if draft_hidden.shape[0] * span <= ONE_PASS_SLOTS:
            return drafter.compute_logits(draft_hidden[:, :span])
        while end < span:
            start, end = end, min(span, max(4, 2 * end))
            chunk = drafter.compute_logits(draft_hidden[:, start:end])
            logits = chunk if logits is None else torch.cat([logits, chunk], dim=1)
            if end < span and not needs_more(logits):
                break
        return logits

    def _root_only(self, root: int) -> CandidateTree:
        return CandidateTree([root], [-1], device=self.first.device)

    def _draft_laws(self, logits: torch.Tensor) -> CompactLaw:
        """When sampling, the laws drafts are drawn from: the drafter's logits through the call's processors."""
        return self.sampling.laws(logits)[0]

    def _distributions(self, logits: torch.Tensor) -> torch.Tensor:
        """Dense draft distributions: the softmax of the drafter logits, or when sampling its processed laws."""
        if self.sampling is None:
            return logits.float().softmax(-1)
        return self._draft_laws(logits).dense(logits.shape[-1])

    def _confidences(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's confidence in each slot: the largest probability of its law (never a draw)."""
        if self.sampling is None:
            return self._distributions(logits).max(-1).values
        return self._draft_laws(logits).max()

    # ----- transformers' CandidateGenerator API (stock assisted decoding, chains, batch 1) -----------------------
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if is_first_iteration or model_outputs is None:
            return input_ids, None  # the target prefills and emits the first token itself
        committed = input_ids.shape[1]
        n_new = committed - 1 - self.first.length
        self.add_context(
            model_outputs.hidden_states, slice(0, n_new),
            torch.arange(committed - 1 - n_new, committed - 1, device=input_ids.device)[None],
        )
        tree = self.propose([int(input_ids[0, -1])], [committed - 1], [self.max_length - committed - 1])[0]
        if len(tree) == 1:
            return input_ids, None
        return torch.cat([input_ids, tree.tokens[None, 1:].to(input_ids.device)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass  # the verified length is the policy's decision, made in `propose`

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts one step proposes (transformers >= 5.25 sizes a croppable cache's history by it)."""
        return self.block_size - 1


class SelectorCandidateGenerator(DiffusionCandidateGenerator):
    """Chains of a DFlash 2 drafter, whose candidate selector picks the path left to right (`select_drafts`): the
    whole span's logits at once (the selector reads them all), the draft distribution the selector's over its
    candidates."""

    def _logits(self, draft_hidden: torch.Tensor, limits: list[int]) -> tuple[torch.Tensor, list[int]]:
        return self.first.drafter.compute_logits(draft_hidden[:, : max(limits)]), limits

    def _pick(self, draft_hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor):
        temperature = None if self.sampling is None else self.sampling.temperature
        drafts, candidates, chosen = self.first.drafter.select_drafts(draft_hidden, logits, roots, temperature)
        if self.sampling is None:
            return drafts, chosen.max(-1).values, None
        # confidences stay the drafter's own maxima (independent of draws); the draft law is over the candidates
        return drafts, self._confidences(logits), CompactLaw(candidates, chosen.float())


class PrefixTreeCandidateGenerator(DiffusionCandidateGenerator):
    """D²SD: the first drafter's block per row, then K branches re-drafted from the prefix lengths where rejection is
    likeliest, by the dual drafter's VP drafter (its own cache) or, with `vp=None`, by the first drafter again, all
    in one batched pass; or taken from the first pass itself (`branches_from_first_pass`). One tree per row."""

    static_drafting = False  # a branch pass reads a row's whole cached context, of the cache's own length

    def __init__(self, drafter, target: PreTrainedModel, policy: DraftLengthPolicy | None = None,
                 sampling: SamplingLaws | None = None, max_length: int | None = None):
        super().__init__(drafter, target, policy, sampling, max_length)
        # the VP drafter has weights of its own, hence its own cache; else branches share the first drafter's (and
        # branches taken from the first pass run no second drafter: a VP drafter's cache would only pile up context)
        second = drafter.vp is not None and not drafter.config.branches_from_first_pass
        self.branch_context = DrafterContext(drafter.vp) if second else self.first
        if self.branch_context is not self.first:
            self.contexts.append(self.branch_context)

    @torch.no_grad()
    def propose(self, root_tokens: list[int], root_positions: list[int], remaining: list[int],
                ahead: DraftPass | None = None) -> list[CandidateTree]:
        limits = self.policy.depth_limits(root_positions, remaining)
        if ahead is not None:
            return self._ahead_trees(ahead, root_tokens, limits)
        if max(limits) <= 0:
            return [self._root_only(root) for root in root_tokens]
        start = self.clock.stamp()
        roots, positions, draft_hidden = self._draft_block(root_tokens, root_positions)
        tensors, table = self._planned_pass(roots, positions, draft_hidden, host_to_device(limits, roots.device),
                                            max(limits))
        table = table.tolist()  # every row's plan and every branch's alternative, drafts and laws' maxima: one read
        self._draft_finished(start)  # both passes, every row
        return self._planned_trees(root_tokens, tensors, table, limits)

    def _planned_pass(self, roots: torch.Tensor, positions: torch.Tensor, draft_hidden: torch.Tensor,
                      limits: torch.Tensor, depth: int) -> tuple[tuple, torch.Tensor]:
        """Both passes' device work over `depth` slots, rows within `limits` (on the device): the first drafter's
        distributions, every row's plan (drafts and branch points: a row with no room left plans none), the branches'
        distributions, and the table the host reads for them (`plan_table`)."""
        config, sample = self.drafter.config, self.sampling is not None
        probs = self._distributions(self.first.drafter.compute_logits(draft_hidden[:, :depth]))
        plan = plan_rows(probs, limits, config.num_branches, sample)
        length = config.branch_length
        if config.branches_from_first_pass:
            slots = branch_slots(plan.picks, length).clamp(max=depth - 1)  # past the last slot: read nowhere
            branch_probs = probs[index_range(probs.shape[0], probs.device)[:, None, None], slots]
        else:  # one batched pass of the branch drafter over every branch of every row
            hidden = self.branch_context.draft_branches(roots, positions, plan.drafts, plan.picks, self.block_size)
            slots = (branch_slots(plan.picks, length) + 1).clamp(max=self.block_size - 1)  # after each prefix
            spans = hidden.gather(2, slots[..., None].expand(-1, -1, -1, hidden.shape[-1]))
            logits = self.branch_context.drafter.compute_logits(spans.flatten(0, 2))
            branch_probs = self._distributions(logits).view(*spans.shape[:3], -1)
        table, alternative = plan_table(plan, branch_probs, sample)
        return (probs, branch_probs, alternative, plan.drafts, plan.main_scores, plan.boundary, plan.picks), table

    def _planned_trees(self, root_tokens: list[int], tensors: tuple, table: list, limits: list[int]):
        """Every row's tree from `_planned_pass`'s tensors and its table, read; a row's nodes within its limit."""
        config, sample, rows = self.drafter.config, self.sampling is not None, len(root_tokens)
        probs, branch_probs, alternative, *plan = tensors
        plans, branches = unpack_plans(table, DevicePlan(*plan), probs, branch_probs, alternative, limits)

        def node_count(reach):
            return self.policy.tree_node_count(reach, rows)

        trees = [prefix_tree(root_tokens[r], plans[r], branches[r], config.tree_budget, node_count, sample=sample)
                 if limits[r] > 0
                 else self._root_only(root_tokens[r]) for r in range(rows)]
        if sample and self.sampling.compact:  # the nodes' laws as compact as the slots' they came from
            for tree in trees:
                if tree.draft_laws is not None:
                    tree.draft_laws = self.sampling.compacted(tree.draft_laws.probs)
        return trees

    def _ahead_pass(self, roots: torch.Tensor, positions: torch.Tensor, draft_hidden: torch.Tensor, span: int,
                    row_ends: list[int]):
        """Both passes, planned within the next step's limits (`limits_on_device`)."""
        return self._planned_pass(roots, positions, draft_hidden, self.limits_on_device(positions, row_ends, span),
                                  span)

    def limits_on_device(self, positions: torch.Tensor, row_ends: list[int], span: int) -> torch.Tensor:
        """`policy.depth_limits` of roots at `positions`, on the device, where a pass drafted ahead knows them
        (`row_ends`: each row's root position plus the drafts it may still commit, which every step moves alike;
        `span`: the policy's most drafts within the block)."""
        limits = (host_to_device(row_ends, positions.device) - positions).clamp(max=span)
        if self.policy.max_positions is not None:
            limits = torch.minimum(limits, self.policy.max_positions - 1 - positions)
        return limits.clamp(min=0)

    def _ahead_trees(self, ahead: DraftPass, root_tokens: list[int], limits: list[int]) -> list[CandidateTree]:
        if max(limits) <= 0:
            return [self._root_only(root) for root in root_tokens]
        return self._planned_trees(root_tokens, ahead.tensors, ahead.values, limits)

    def get_candidates(self, *args, **kwargs):
        raise ValueError("transformers' assisted decoding verifies chains only; use generate() for D²SD trees")


class BestFirstTreeCandidateGenerator(DiffusionCandidateGenerator):
    """A best-first draft tree per row from the same single drafter pass (DDTree-style, `drafting_best_first.py`): token
    paths ranked by the product of their slot probabilities, at most `config.draft_tree_budget` nodes, the measured
    cost model choosing how many of them the target verifies."""

    def _tree_limits(self, root_positions: list[int], remaining: list[int]) -> list[int]:
        # a tree of B drafted nodes is at most B deep: distributions for deeper slots would never be used
        budget = self.first.drafter.config.draft_tree_budget
        return [min(k, budget) for k in self.policy.depth_limits(root_positions, remaining)]

    def _uses_selector(self) -> bool:
        return getattr(self.first.drafter, "selector", None) is not None and self.sampling is None

    def _ahead_span(self) -> int:
        return min(super()._ahead_span(), self.first.drafter.config.draft_tree_budget)

    def _ahead_pass(self, roots: torch.Tensor, positions: torch.Tensor, draft_hidden: torch.Tensor, span: int,
                    row_ends: list[int]):
        config = self.first.drafter.config
        logits = self.first.drafter.compute_logits(draft_hidden[:, :span])
        if self._uses_selector():  # the tables of every slot a row may draft: a shorter row's tree is the same
            return (), self._selector_table(roots, draft_hidden, logits)
        probs, table = self._ranked_table(logits, config.draft_tree_width, config.draft_tree_budget)
        return (probs,), table

    def _ahead_trees(self, ahead: DraftPass, root_tokens: list[int], limits: list[int]) -> list[CandidateTree]:
        if max(limits) <= 0:
            return [self._root_only(root) for root in root_tokens]
        slots = self._ahead_span()
        if self._uses_selector():
            return self._selector_trees(root_tokens, ahead.values, slots, limits)
        (probs,) = ahead.tensors
        return self._trees(root_tokens, probs, [self._unpack(row, slots) for row in ahead.values], limits, {})

    @torch.no_grad()
    def propose(self, root_tokens: list[int], root_positions: list[int], remaining: list[int],
                ahead: DraftPass | None = None) -> list[CandidateTree]:
        limits = self._tree_limits(root_positions, remaining)
        if ahead is not None:
            return self._ahead_trees(ahead, root_tokens, limits)
        if max(limits) <= 0:
            return [self._root_only(root) for root in root_tokens]
        config = self.first.drafter.config
        rows = len(root_tokens)
        start = self.clock.stamp()
        _, _, draft_hidden = self._draft_block(root_tokens, root_positions)
        if self._uses_selector():
            logits = self.first.drafter.compute_logits(draft_hidden[:, : max(limits)])
            table = self._selector_table(host_to_device(root_tokens, logits.device), draft_hidden, logits).tolist()
            self._draft_finished(start)
            return self._selector_trees(root_tokens, table, logits.shape[1], limits)
        budget, width = config.draft_tree_budget, config.draft_tree_width
        reads = {}  # slots computed -> (distributions or None, each row's ranked slots, read at once)
        shapes = {}  # (slots computed, row) -> the row's best-first shape over them

        def ranked(logits):
            """The ranked read of the slots computed so far, kept: the tree is built from the read that sized it."""
            slots = logits.shape[1]
            if slots not in reads:
                probs, table = self._ranked_table(logits, width, budget)
                reads[slots] = probs, [self._unpack(row, slots) for row in table.tolist()]
            return reads[slots]

        # best-first closure: a node deeper than every node of the budget's tree scores below one of them, so deeper
        # slots matter only when that tree already reaches the deepest slot computed
        def needs_more(logits):
            computed = logits.shape[1]
            unpacked = ranked(logits)[1]
            for r in range(rows):
                if limits[r] > computed:  # kept: the row's tree has this shape when no more slots are computed
                    shapes[computed, r] = best_first_shape(unpacked[r][0], budget, width)
                    if max(len(path) for path, _ in shapes[computed, r]) == computed:
                        return True
            return False

        logits = self._slot_logits(draft_hidden, max(limits), needs_more)
        probs, unpacked = ranked(logits)
        self._draft_finished(start)
        computed = logits.shape[1]
        limits = [min(k, computed) for k in limits]
        return self._trees(root_tokens, probs, unpacked, limits,
                           {r: shape for (slots, r), shape in shapes.items() if slots == computed})

    def _trees(self, root_tokens: list[int], probs, unpacked: list, limits: list[int], shapes: dict):
        """Every row's best-first tree from its ranked slots (`_unpack`ed), within its limit."""
        config, rows = self.first.drafter.config, len(root_tokens)
        device = self.first.device

        def node_count(reach):
            return self.policy.tree_node_count(reach, rows)

        trees = [build_best_first_tree(root_tokens[r], None if probs is None else probs[r, : limits[r]],
                                       config.draft_tree_budget, node_count, sample=self.sampling is not None,
                                       max_children=config.draft_tree_width, shape=shapes.get(r), device=device,
                                       uniform=unpacked[r][2],
                                       ranked=(unpacked[r][0][: limits[r]], [[int(t) for t in slot] for slot in
                                                                             unpacked[r][1][: limits[r]]]))
                 if limits[r] > 0 else self._root_only(root_tokens[r]) for r in range(rows)]
        laws_to_device(trees, device)  # the laws the host drew from, every row's in one copy
        return trees

    def _ranked_table(self, logits: torch.Tensor, width: int, budget: int):
        """The slots' distributions (or None), and per row one (rows, n) float64 tensor for the host to read: each
        slot's ranked probabilities and tokens, and (sampling with compact laws) uniform numbers for drawing the
        tree's tokens (`_unpack` reads a row of it). Greedy, or dense laws: the top-`width` per slot. Compact laws:
        each slot's whole law, ranked, and one uniform number per node a tree may take (drawn on the device), for the
        host to draw the tokens from."""
        if self.sampling is None or not self.sampling.compact:
            probs = self._distributions(logits)
            values, indices = probs.topk(min(width, probs.shape[-1]), dim=-1)
            return probs, torch.cat([values.double().flatten(1), indices.double().flatten(1)], dim=1)
        laws = self._draft_laws(logits)
        values, order = laws.probs.sort(-1, descending=True)
        indices = laws.ids.gather(-1, order)
        uniform = torch.rand(values.shape[0], budget, dtype=torch.float64, device=values.device)
        return None, torch.cat([values.double().flatten(1), indices.double().flatten(1), uniform], dim=1)

    def _unpack(self, row: list[float], slots: int):
        """One row of `_ranked_table` on the host: (probabilities per slot, tokens per slot, uniform numbers or
        None)."""
        uniform = None
        if self.sampling is not None and self.sampling.compact:
            uniform = row[len(row) - self.first.drafter.config.draft_tree_budget :]
            row = row[: len(row) - len(uniform)]
        size = len(row) // (2 * slots)

        def per_slot(flat):
            return [flat[i : i + size] for i in range(0, slots * size, size)]

        return per_slot(row[: slots * size]), per_slot(row[slots * size :]), uniform

    def _selector_table(self, roots: torch.Tensor, draft_hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """DFlash 2: every row's selector tables over the slots of `logits`, on the device (`selector_tables`)."""
        drafter = self.first.drafter
        return selector_tables(roots, draft_hidden, logits, drafter.selector,
                               drafter.config.selector_top_k, drafter.config.draft_tree_width)

    def _selector_trees(self, root_tokens: list[int], table: list, slots: int, limits: list[int]):
        """DFlash 2: each row's branches from the selector's candidates, from its tables (`table`, read) over
        `slots` slots."""
        config, rows, device = self.first.drafter.config, len(root_tokens), self.first.device

        def node_count(reach):
            return self.policy.tree_node_count(reach, rows)

        return [build_selector_tree(root_tokens[r], unpack_selector_table(table[r], slots, config.selector_top_k,
                                                                          config.draft_tree_width),
                                    limits[r], config.draft_tree_budget, device, node_count)
                if limits[r] > 0 else self._root_only(root_tokens[r]) for r in range(rows)]

    def get_candidates(self, *args, **kwargs):
        raise ValueError("transformers' assisted decoding verifies chains only; use generate() for draft trees "
                         "(or set drafter.config.draft_tree_budget = None)")


def generator_class(drafter) -> type:
    """The candidate generator of `drafter`'s method (chains for a DFlash drafter, prefix trees for a dual one)."""
    if not is_diffusion_drafter(drafter):
        raise TypeError(f"expected a DiffusionDrafter, got {type(drafter).__name__}")
    if drafter.config.model_type == "dual_diffusion_drafter":
        return PrefixTreeCandidateGenerator
    if getattr(drafter.config, "draft_tree_budget", None):
        return BestFirstTreeCandidateGenerator
    if getattr(first_drafter(drafter), "selector", None) is not None:
        return SelectorCandidateGenerator
    return DiffusionCandidateGenerator


def candidate_generator_for(drafter, target: PreTrainedModel, num_draft_tokens: int | None = None,
                            max_length: int | None = None) -> DiffusionCandidateGenerator:
    """The candidate generator of `drafter`'s method with its policy for one call (`speculation_policy`) of
    transformers' assisted decoding: its drafts are the argmaxes, which that loop verifies by matching its own tokens,
    sampled or not."""
    cls = generator_class(drafter)
    policy = speculation_policy(drafter, target, num_draft_tokens, method=cls)
    return cls(drafter, target, policy, None, max_length)
