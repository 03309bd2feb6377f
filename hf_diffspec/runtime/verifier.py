"""The verify step's one home: `TargetVerifier`, created once per call, owns everything the target's forward over the
drafts needs and everything that forward leaves behind.

    verifier = TargetVerifier(model, cache, static_length, feature_layers)
    with verifier:                                   # the call holds the verify attention and the recording hooks
        out = verifier.prefill(ids, mask, positions, valid)
        loop:
            out, layout = verifier.forward(trees, root_positions)   # inputs, masks, attention, recording, graphs
            kept = verifier.keep(paths, accepted, next_slots)       # crop, validity, compaction, windows, rollback
            verifier.select_rows(index, keep)                       # rows that finished leave every cache
        cache = verifier.finish(next_slots)                         # what generate's output returns

It owns:
- the target's cache in every form (`verify_cache.py`: generate's own, windowed, static, linear states), and which
  cached slot each row may see (`valid`, kept in place in a `ValidSlots`: left padding, slots of drafts another row
  accepted and tree nodes off a row's accepted path are invisible to it; on the capture-ready step written at the
  cache's count on the device, the cache cropped by a count on the device, so no step's op takes a count from the
  host);
- the verify inputs and every mask (`verify_inputs.py`), the verify attention (`verify_attention.py`);
- the recurrent states' recording and rollback (`verify_recurrent.py`);
- the static buffers and CUDA graphs of the capture-ready step (`verify_graphs.py`).

The verify-cost profile times this same forward (`control_profiles.measure_verify_cost`): one recipe for both.

Accepted nodes stay in the slots the tree forward wrote them to: the slots after the last accepted node of every row
are cropped, and the nodes before it that a row did not accept stay, hidden by its validity mask (a node's key
carries its own position, whatever its slot) until a compaction drops them (every `COMPACT_AFTER_HIDDEN_SLOTS`
hidden slots, and at the end of the call).

Imports: torch, transformers and sibling runtime modules only (this file travels in `custom_generate/`).
"""

import contextlib
import functools

import torch
from transformers.cache_utils import StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .tree import TreeLayout, call_indices, host_to_device, index_range
from .verify_attention import VerifyAttention
from .verify_cache import (cached_count, crop_attention, drop_old_keys, dropped_slots, gather_slots, select_rows,
                           target_cache)
from .verify_graphs import keep_static_step, lease_static_step
from .verify_inputs import AttentionLayout, ValidSlots, tree_forward_inputs, verify_masks, verify_width
from .verify_recurrent import RecurrentStates

# hidden slots in the cache's tail (tree nodes off the accepted paths) that trigger a compaction: moving the accepted
# nodes together every step costs a gather and a write per K/V tensor per step, a fixed cost per layer that an
# 8B target's 36 layers pay on every step; a few dozen hidden slots cost the attention next to nothing
COMPACT_AFTER_HIDDEN_SLOTS = 64


class KeptSlots:
    """What `TargetVerifier.keep` kept of a step, for the drafter's context: `index` selects each row's accepted
    nodes on the forward's slot dimension (a slice when they are every row's first slots, else (rows, longest)
    slot indices); `offsets` (longest,) their depths; `accepted` (rows, longest) which of them the row accepted;
    `counts` (rows,) how many, on the device; `rows_all_valid`: known on the host, every row sees every slot it
    committed or was prompted with; `longest`: the longest path. `offsets`, `index` and `accepted` are made when
    first read (a step drafted ahead reads none: its pass took every slot of the paths)."""

    def __init__(self, longest: int, nodes: torch.Tensor | None, counts: torch.Tensor, rows_all_valid: bool):
        self.longest, self._nodes, self.counts, self.rows_all_valid = longest, nodes, counts, rows_all_valid

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        return index_range(self.longest, self.counts.device)

    @functools.cached_property
    def index(self) -> slice | torch.Tensor:
        return slice(0, self.longest) if self._nodes is None else self._nodes[:, : self.longest]

    @functools.cached_property
    def accepted(self) -> torch.Tensor:
        return self.offsets[None] < self.counts[:, None]


class TargetVerifier:
    """One call's verify step on `model` (see the module docstring).

    Args:
        model: the target.
        cache: the cache `generate` prepared (None: the verifier makes one); kept when it can be cropped back.
        static_length: with `cache_implementation="static"`, the call's max length: a preallocated cache, persistent
            inputs, and CUDA graphs where opted in, kept for the next call of `rows` rows (`verify_graphs.StaticStep`).
        feature_layers: the target hidden states the drafter reads (`output_hidden_states`).
        explicit_masks: every step with an explicit 4D mask, even for chains every row verifies in full (the
            verify-cost profile: it prices the forwards of trees and ragged rows, which take one).
        rows: the call's rows (the static step's shape).
    """

    def __init__(self, model, cache=None, static_length: int | None = None, feature_layers=None,
                 explicit_masks: bool = False, rows: int = 1):
        self.model = model
        # the capture-ready step: its cache, inputs and graphs kept on the target across calls of its shape
        self.static = lease_static_step(model, rows, static_length) if static_length else None
        self.cache = self.static.cache if self.static else target_cache(model.config, cache)
        self.attention_layout = AttentionLayout.of(model.config)
        self.feature_layers = feature_layers
        self.explicit_masks = explicit_masks
        self.dtype = model.dtype  # a property that walks the parameters: read once
        self.attention = VerifyAttention(model)
        self.recurrent = RecurrentStates(model, self.cache)
        self.capture = self.static.inputs if self.static else None
        self.graphs = self.static.graphs if self.static else None
        self.valid_slots: ValidSlots | None = None  # which cached slots each row may attend to
        self.all_valid = False  # known on the host: every row may see every cached slot
        # known on the host: every row sees every slot it committed or was prompted with (no padding, rows in step);
        # unlike `all_valid`, blind to the tail's hidden tree nodes (the drafter's context has none)
        self.rows_all_valid = False
        self.prompt_length = 0
        self.device: torch.device | None = None  # the inputs' device (the prefill's)
        self.slots = 0  # the last forward's slots per row
        self._first: torch.Tensor | None = None  # the capture-ready step: the cache's count before its last forward
        # the cache's tail: from `_tail_start` on, slots may be hidden tree nodes; per row, how many of them it sees
        self._tail_start = 0
        self._tail_counts: list[int] = []
        self._held = contextlib.ExitStack()

    def __enter__(self) -> "TargetVerifier":
        self._held.enter_context(call_indices())
        self._held.enter_context(self.attention.held())
        self._held.enter_context(self.recurrent.held())
        return self

    def __exit__(self, error_type, *exc) -> None:
        self._held.close()
        if self.static is not None and error_type is None:  # a call that failed midway keeps nothing
            keep_static_step(self.model, self.static)

    @property
    def valid(self) -> torch.Tensor:
        """(rows, cached slots) bool: which slots each row may attend to."""
        return self.valid_slots.view

    def prefill(self, input_ids: torch.Tensor, attention_mask, positions: torch.Tensor, valid: torch.Tensor):
        """The prompts' forward, padded rows together (the model's own attention and masks, the last position's
        logits); `valid` (rows, length) marks the real prompt tokens. Not through the verify attention: at 4,096 and
        8,000 tokens of one row its causal mask made the forward 1.7x and 2.0x transformers' SDPA path (which needs
        no mask there) on the CPU. Not row by row without the padding either: on the Xeon with AMX that took 1.3-1.7x
        the padded batch's time (16 built-in prompts, 1,646 tokens padded to 2,896: 1.38 s against 0.94 s), a
        forward's own cost outweighing the padding's tokens."""
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=positions, cache=self.cache,
                         use_cache=True, output_hidden_states=self.feature_layers, logits_to_keep=1)
        self.valid_slots = ValidSlots(valid, self.capture.capacity if self.capture else None)
        self.prompt_length, self.device = input_ids.shape[1], input_ids.device
        self.all_valid = self.rows_all_valid = bool(valid.all())
        self._tail_start, self._tail_counts = valid.shape[1], [0] * valid.shape[0]
        self._drop_old_keys(lambda: [self.prompt_length - 1] * valid.shape[0])
        return out

    def forward(self, trees, root_positions: torch.Tensor):
        """Verify one tree per row (`root_positions` (rows,): each root's position, on the device) in one target
        forward over the cache; returns the model's output and the trees' `TreeLayout`."""
        if self.capture:  # into the step's persistent buffers, padded to the static cache's rows (`rows_bucket`)
            layout = TreeLayout.of(trees, self.device, verify_width(max(map(len, trees))))
            self._first = cached_count(self.cache).clone()
            tokens, mask, positions = self.capture.fill(layout, self.valid_slots, self._first, root_positions,
                                                        self.dtype, self.cache.layers[0].keys.shape[0])
            rows = layout.tokens.shape[0]
        else:
            layout = TreeLayout.of(trees, self.device)
            no_mask = self.all_valid and not self.explicit_masks
            tokens, mask, positions = tree_forward_inputs(trees, self.valid, root_positions, self.dtype, layout,
                                                          no_mask)
            mask = verify_masks(self.attention_layout, mask, layout.depths, self.valid, self.prompt_length,
                                dropped_slots(self.cache))
            rows = tokens.shape[0]

        model, cache, layers = self.model, self.cache, self.feature_layers

        def verify():  # what a CUDA graph captures: every tensor it reads is one of its closure's
            return model(tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         output_hidden_states=layers)

        switched = self.attention.needed(tokens.shape[1], mask, self.attention_layout.sliding_window)
        with self.recurrent.recording(layout), self.attention.switched() if switched else contextlib.nullcontext():
            out = self.graphs.run(verify, cache, (*tokens.shape, mask.shape[-1])) if self.graphs else verify()
        self.slots = tokens.shape[1]
        if tokens.shape[0] > rows:  # the padding rows' outputs are no row's
            out = CausalLMOutputWithPast(logits=out.logits[:rows], hidden_states=None if out.hidden_states is None
                                         else tuple(None if h is None else h[:rows] for h in out.hidden_states))
        return out, layout

    def rewind(self) -> None:
        """Undo the last forward's K/V (the profile's forwards leave the cache as it was; linear-attention states
        are put back by the caller's `verify_cache.LinearStates`)."""
        crop_attention(self.cache, self.slots)

    def keep(self, paths: list[list[int]], accepted, next_slots) -> KeptSlots:
        """Keep each row's accepted path (`paths`: its nodes, root first) in the cache, visible to that row only,
        and leave linear-attention states as if each row had seen only those. `accepted`: (nodes, counts) on the
        device when the batch accepted there, else None; `next_slots()`: each row's committed length - 1 (read
        only where a sliding window needs it)."""
        device = self.device
        lengths = [len(p) for p in paths]
        kept = max(lengths)
        span = max(p[-1] for p in paths) + 1  # slots up to the last accepted node (nodes follow their parents)
        prefixes = all(p[-1] == len(p) - 1 for p in paths)  # every path is its tree's first slots
        if accepted is not None:  # accepted on the device: nodes past a row's count are hidden below
            nodes, counts = accepted
            nodes = None if prefixes else nodes
        else:
            nodes = None if prefixes else host_to_device([p + [p[-1]] * (kept - len(p)) for p in paths], device)
            counts = host_to_device(lengths, device)
        visible = self._visible(nodes, counts)
        if self.capture:  # counted on the device: the same ops whatever the rows accepted
            last = (visible.any(0) * (index_range(self.slots, device) + 1)).max()  # `span`, on the device
            crop_attention(self.cache, self.slots - last)
            self.valid_slots.write_at(self._first, visible, span)
        else:
            if self.slots > span:
                crop_attention(self.cache, self.slots - span)
            self.valid_slots.append(visible[:, :span])
        self.rows_all_valid = self.rows_all_valid and min(lengths) == kept
        self.all_valid = self.all_valid and self.rows_all_valid and prefixes
        self._tail_counts = [c + n for c, n in zip(self._tail_counts, lengths)]
        self.recurrent.keep_accepted(paths, self.slots)
        self._compact_or_drop(next_slots)
        return KeptSlots(kept, nodes, counts, self.rows_all_valid)

    def _visible(self, nodes: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        """(rows, the last forward's slots) bool: the slots of each row's accepted path, its `nodes` ((rows, k), the
        entries past its count padding), or its first `counts` slots (`nodes` None: every path is a prefix)."""
        slots = index_range(self.slots, counts.device)
        if nodes is None:  # nothing hidden but a shorter row's tail
            return slots[None] < counts[:, None]
        on_path = (index_range(nodes.shape[1], counts.device)[None] < counts[:, None]).long()
        return torch.zeros(counts.shape[0], self.slots, dtype=torch.long, device=counts.device).scatter_add_(
            1, nodes, on_path) > 0

    def _compact_or_drop(self, next_slots) -> None:
        tail = self.valid_slots.used - self._tail_start
        # sliding layers drop only slots every row counts: rows' holes in the tail are closed up every so often
        window = self.attention_layout.sliding_window
        if (tail if window else tail - max(self._tail_counts)) >= COMPACT_AFTER_HIDDEN_SLOTS:
            self.compact(next_slots)
        else:
            self._drop_old_keys(next_slots)

    def _drop_old_keys(self, next_slots) -> None:
        """Sliding layers keep what plain generate keeps: the keys within some row's window (`verify_cache.py`).
        Every cached slot counts for every row before the tail, or everywhere when every row sees every slot."""
        if self.attention_layout.sliding_window is not None:
            if self.all_valid:  # the whole tail is every row's: compaction (if rows diverge) starts after it
                self._tail_start, self._tail_counts = self.valid_slots.used, [0] * len(self._tail_counts)
            drop_old_keys(self.cache, self.attention_layout.sliding_window, next_slots(), self._tail_start)

    def compact(self, next_slots) -> None:
        """Drop the slots of the cache's tail that no row sees: each row's visible tail slots move to the tail's
        front in order, and the cache is cropped to the row that has the most (one gather and one write per K/V
        tensor)."""
        start, counts = self._tail_start, self._tail_counts
        tail = self.valid[:, start:]
        if counts and tail.shape[1] == min(counts):  # every row sees every slot of the tail: nothing to move
            self._tail_start, self._tail_counts = start + min(counts), [0] * len(counts)
        elif counts and (tail.shape[1] > max(counts) or self.attention_layout.sliding_window):
            # per row, its visible slots first, in order (a stable sort puts hidden after visible)
            order = torch.sort((~tail).to(torch.uint8), dim=1, stable=True).indices[:, : max(counts)]
            gather_slots(self.cache, start, order, self.valid.shape[1])
            self.valid_slots.replace_from(start, tail.gather(1, order))
            self._tail_start, self._tail_counts = start + min(counts), [c - min(counts) for c in counts]
            self.all_valid = self.rows_all_valid
        self._drop_old_keys(next_slots)

    def select_rows(self, index: torch.Tensor, keep: list[int], moves=None) -> None:
        """Keep only the rows `keep` (`index`: the same on the device; `moves`: how, in place, from
        `BatchState.drop_finished`) in the cache and its bookkeeping."""
        select_rows(self.cache, index, moves)
        self.valid_slots.select_rows(index)
        self._tail_counts = [self._tail_counts[i] for i in keep]

    def finish(self, next_slots):
        """The cache as `generate`'s output returns it: no hidden tree nodes left in it, no padding rows."""
        self.compact(next_slots)
        rows = self.valid.shape[0]
        for layer in self.cache.layers:
            if isinstance(layer, StaticLayer) and layer.is_initialized and layer.keys.shape[0] > rows:
                layer.keys, layer.values = layer.keys[:rows], layer.values[:rows]
        return self.cache
