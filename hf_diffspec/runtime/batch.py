"""The rows of a batch being decoded speculatively and their acceptance: what each row committed, and how.

`BatchState` owns the per-row committers (tokens, scores, stopping), the rows still decoding, their anchors and root
positions, and the three ways a step's trees are accepted (on the device for every row and node at once, a plain
step's rows by length, or token by token). The caches that follow the rows are the verifier's (`verifier.py`) and
the drafting's: the loop hands them what `accept` and `drop_finished` decided.

Stopping follows plain `generate` exactly (`_sample` in transformers 5.24): when the stopping criteria include an EOS
criterion, a row that stops is padded with `pad_token_id` until the batch ends; without one, a stopped row goes on
generating (plain `generate` does not pad it) until every row has stopped, and all rows end at that length.
"""

import copy
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    EosTokenCriteria,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from .sampling import WARPERS, CompactLaw, SamplingLaws
from .tree import TreeLayout, host_to_device, index_range
from .verification import choose_token, choose_token_among_drafts, rejection_choices

# processors whose scores do not depend on the prefix: applied to every verified position at once
PREFIX_FREE_PROCESSORS = (SuppressTokensLogitsProcessor, InfNanRemoveLogitsProcessor, LogitNormalization)
# when sampling, generate's warpers read the scores alone too
PREFIX_FREE_WHEN_SAMPLING = PREFIX_FREE_PROCESSORS + WARPERS
# processors that depend on the prefix's length alone, and only at some lengths (`_inactive`)
LENGTH_GATED_PROCESSORS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                           SuppressTokensAtBeginLogitsProcessor, ForcedBOSTokenLogitsProcessor,
                           ForcedEOSTokenLogitsProcessor)


def _inactive(processor, lengths: range) -> bool:
    """True when a processor that depends on the prefix's length alone leaves the scores unchanged at every prefix
    length in `lengths` (transformers 5.24's conditions)."""
    if isinstance(processor, MinLengthLogitsProcessor):
        return lengths.start >= processor.min_length
    if isinstance(processor, MinNewTokensLengthLogitsProcessor):
        return lengths.start - processor.prompt_length_to_skip >= processor.min_new_tokens
    if isinstance(processor, SuppressTokensAtBeginLogitsProcessor):
        return processor.begin_index not in lengths
    if isinstance(processor, ForcedBOSTokenLogitsProcessor):
        return 1 not in lengths
    if isinstance(processor, ForcedEOSTokenLogitsProcessor):
        return processor.max_length - 1 not in lengths
    return False


class TokenStore:
    """Every row's committed tokens, on the host (rows, capacity) with their lengths: the loop learns the committed
    tokens once per step anyway, and prompt lookup and stopping read them there without touching the device."""

    def __init__(self, input_ids: torch.Tensor, capacity: int):
        rows, length = input_ids.shape
        self.device = input_ids.device
        self.tokens = np.zeros((rows, max(capacity, length) + 1), dtype=np.int64)
        self.tokens[:, :length] = input_ids.cpu().numpy()
        self.lengths = [length] * rows

    def history(self, row: int) -> np.ndarray:
        return self.tokens[row, : self.lengths[row]]

    def append(self, row: int, tokens: list[int]) -> None:
        end = self.lengths[row] + len(tokens)
        if end > self.tokens.shape[1]:
            self.tokens = np.pad(self.tokens, ((0, 0), (0, end - self.tokens.shape[1] + 64)))
        self.tokens[row, self.lengths[row] : end] = tokens
        self.lengths[row] = end

    def ids(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), length) committed tokens of rows of one length, on the device."""
        length = self.lengths[rows[0]]
        return torch.from_numpy(self.tokens[rows, :length]).to(self.device)


class RowCommitter:
    """One row's committed tokens (held in the batch's `TokenStore`), appended one at a time exactly as `_sample`
    would: logits processors with the row's exact prefix, scores, streamer, stopping criteria. `limit` is the length
    the row may not pass."""

    def __init__(self, store: TokenStore, row: int, logits_processor, stopping_criteria, generation_config, streamer,
                 limit: int):
        self.store = store
        self.row = row
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.config = generation_config
        self.streamer = streamer
        self.limit = limit
        self.scores, self.raw_logits = [], []
        self.stopped_at: int | None = None  # length at which a stopping criterion fired

    @property
    def length(self) -> int:
        return self.store.lengths[self.row]

    @property
    def input_ids(self) -> torch.Tensor:
        """(1, length) on the device."""
        return self.store.ids([self.row])

    def cut(self, limit: int) -> int:
        """Drop tokens past `limit`; returns how many were dropped."""
        extra = max(0, self.length - limit)
        self.store.lengths[self.row] -= extra
        return extra

    def choose_and_commit(self, raw_logits: torch.Tensor, drafts=None) -> int:
        """Pick the target's token from its raw logits (1, vocab) given the committed prefix, commit it, return it.
        `drafts`: [(token, q)] of the children drawn from known distributions, for rejection sampling."""
        return commit_in_step([self], raw_logits, self.logits_processor, self.stopping_criteria, [drafts])[0]


def row_processors(logits_processor, selected: list[int], rows: int):
    """The processors as the rows `selected` (batch indices, in this order) alone see them, identical to what those
    rows get inside the whole batch of `rows`. Built-in processors keep batch-shaped state in two places in
    transformers 5.24: the repetition penalty's per-row `prompt_ignore_length` (sliced to the rows) and
    `prefix_allowed_tokens_fn`'s batch id (mapped back to the row's own index)."""
    if rows == 1:
        return logits_processor
    views = LogitsProcessorList()
    for processor in logits_processor:
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignore, torch.Tensor) and ignore.dim() == 1 and ignore.shape[0] == rows:
            processor = copy.copy(processor)
            processor.prompt_ignore_length = ignore[selected]
        if isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = (
                lambda batch_id, tokens, allowed=allowed, selected=tuple(selected): allowed(selected[batch_id], tokens))
        views.append(processor)
    return views


def commit_in_step(committers: list[RowCommitter], raw_logits: torch.Tensor, logits_processor, stopping_criteria,
                   drafts: list | None = None) -> list[int]:
    """Rows of one length each commit one token from their raw logits (rows, vocab), exactly as `_sample` appends a
    token to its batch: one call of the logits processors (`logits_processor`: their views for exactly these rows)
    and one of the stopping criteria for all of them. transformers' processors and criteria act on each row alone,
    so this is also what each row would get by itself; sampled tokens are drawn row after row. `drafts`: per row,
    the [(token, q)] of the children drawn from known distributions (rejection sampling), or None. Returns the
    tokens."""
    first = committers[0]
    ids = first.store.ids([c.row for c in committers])
    raw = raw_logits.to(dtype=torch.float32, copy=True)
    scores = logits_processor(ids, raw.clone())
    if first.config.do_sample:
        drafts = drafts or [None] * len(committers)
        tokens = torch.cat([choose_token_among_drafts(scores[i : i + 1], drafts[i]) if drafts[i]
                            else choose_token(scores[i : i + 1], True) for i in range(len(committers))])
    else:
        tokens = choose_token(scores, False)
    ids = torch.cat([ids, tokens[:, None]], dim=-1)
    chosen = tokens.tolist()
    for i, c in enumerate(committers):
        if c.config.output_scores:
            c.scores.append(scores[i : i + 1])
        if c.config.output_logits:
            c.raw_logits.append(raw[i : i + 1])
        c.store.append(c.row, [chosen[i]])
        if c.streamer is not None:
            c.streamer.put(tokens[i : i + 1].cpu())
    # criteria get what `_sample` hands them: the scores collected so far when they are returned (one row then:
    # scores need batch size 1), else None
    collected = tuple(first.scores) if first.config.return_dict_in_generate and first.config.output_scores else None
    stopped = stopping_criteria(ids, collected).tolist()
    for c, stop in zip(committers, stopped):
        if c.stopped_at is None and stop:
            c.stopped_at = c.length
    return chosen


@dataclass
class DeviceOutcome:
    """A step accepted on the device, before the host reads it: per row, how many tokens it commits (`count`,
    (rows,)), the tokens along its accepted path (`committed`, (rows, max depth + 1)) and the path's slots
    (`path_nodes`, None for uniform chains: their first slots)."""

    count: torch.Tensor
    committed: torch.Tensor
    path_nodes: torch.Tensor | None

    @property
    def anchors(self) -> torch.Tensor:
        """Each row's last committed token: the next step's anchor (a row that committed nothing ends now)."""
        return self.committed.gather(1, (self.count - 1).clamp(min=0)[:, None])[:, 0]


class BatchState:
    """Rows of one speculative `generate` call (see the module docstring).

    Args:
        committers: one `RowCommitter` per row, in batch order (sharing one `TokenStore`).
        pads_stopped_rows: plain generate's `has_eos_stopping_criteria`: stopped rows are padded (and leave the
            batch) rather than generated on.
        logits_processor: the batch's processors (each committer holds its own row's view); steps without drafts
            apply them to all rows of one length at once.

    Steps whose processors and criteria do not need each position's exact prefix (`PREFIX_FREE_PROCESSORS`, when
    sampling generate's warpers too, length-dependent ones where the step's lengths leave them inactive; EOS and
    max-length criteria) accept and commit on the device for every row and node at once (`_accept_on_device`), with
    one copy of the outcome to the host: greedy, and sampling with compact laws (`sampling`: a top-k warper). The
    others commit token by token (`_accept_path`), exactly as `_sample` would.
    """

    def __init__(self, committers: list[RowCommitter], pads_stopped_rows: bool, logits_processor,
                 sampling: SamplingLaws | None = None):
        self.committers = committers
        self.store = committers[0].store
        self.logits_processor = logits_processor
        self.active = list(range(len(committers)))  # batch index of each row still decoding
        self.anchors: list[int] = []  # each active row's last committed token, not yet seen by the target
        self.pads_stopped_rows = pads_stopped_rows
        # on the device, each active row's anchor position (see `start`), advanced by what each step keeps
        self.root_position_tensor: torch.Tensor | None = None
        self.root_shift: list[int] = []  # per row: root position - committed length (see `start`)
        self.cut_tokens: dict[int, int] = {}  # per row: committed tokens cut back when the batch ended
        self._room: torch.Tensor | None = None  # on the device, tokens each active row may still commit
        # the last step's (accepted nodes, counts) on the device, when it was accepted there
        self.accepted: tuple[torch.Tensor, torch.Tensor] | None = None
        self.read_along: list[list[float]] | None = None  # what `accept`'s `before_read` had read with the outcome
        self._max_length_stops = False
        self.sampling = sampling  # the target's laws, when sampling
        self._prefix_free = PREFIX_FREE_WHEN_SAMPLING if committers[0].config.do_sample else PREFIX_FREE_PROCESSORS
        self.device_ok, self.eos_tokens, self._eos_host = self._device_acceptance(committers[0])

    def _device_acceptance(self, committer: RowCommitter):
        """Whether steps may accept on the device (see the class docstring), and the EOS tokens then."""
        config = committer.config
        if config.output_scores or config.output_logits or committer.streamer is not None:
            return False, None, set()
        if config.do_sample and (self.sampling is None or not self.sampling.compact):
            return False, None, set()
        eos = None
        for criteria in committer.stopping_criteria:
            if type(criteria) is EosTokenCriteria:
                eos = criteria.eos_token_id if eos is None else torch.cat([eos, criteria.eos_token_id])
            elif not (type(criteria) is MaxLengthCriteria and criteria.max_length == committer.limit):
                return False, None, set()
        if any(type(p) not in self._prefix_free + LENGTH_GATED_PROCESSORS for p in self.logits_processor):
            return False, None, set()
        self._max_length_stops = any(type(c) is MaxLengthCriteria for c in committer.stopping_criteria)
        return True, eos, set(eos.tolist()) if eos is not None else set()

    def start(self, prompt_valid: torch.Tensor, position_offset: torch.Tensor) -> None:
        """After the prefill of prompts whose real tokens are `prompt_valid` (rows, length): positions continue at
        `position_offset` + real cached tokens (the offset is 0, except after a prompt that ends in a masked slot,
        where generate continues from that slot's position instead of the count); the host keeps each row's root
        position as its committed length + a shift (one read, here), the device as `root_position_tensor`."""
        self.root_position_tensor = prompt_valid.sum(-1) + position_offset
        self.root_shift = (self.root_position_tensor - 1 - prompt_valid.shape[1]).tolist()

    def next_slots(self) -> list[int]:
        """Each active row's next slot as plain `generate` counts them: its committed length - 1 (the anchor's)."""
        return [self.committers[r].length - 1 for r in self.active]

    def advance(self, counts: torch.Tensor) -> None:
        """Each row's next anchor follows the `counts` (rows,) tokens the step kept."""
        self.root_position_tensor = self.root_position_tensor + counts

    @property
    def root_positions(self) -> list[int]:
        """Position of each active row's anchor: the number of real tokens it has cached (see `start`)."""
        return [self.committers[r].length + self.root_shift[r] for r in self.active]

    def max_drafts(self) -> list[int]:
        """Drafts each active row could still commit after its anchor's target token, within its length limit."""
        return [self.committers[r].limit - self.committers[r].length - 1 for r in self.active]

    def history_rows(self) -> tuple[np.ndarray, list[int]]:
        """The active rows' committed tokens as one array (rows, longest; on the host) and their lengths."""
        lengths = [self.store.lengths[row] for row in self.active]
        return self.store.tokens[:, : max(lengths)][self.active], lengths

    def histories(self) -> list[np.ndarray]:
        """Each active row's committed tokens (1-D, on the host), its anchor last."""
        return [self.store.history(row) for row in self.active]

    def accept(self, trees, logits: torch.Tensor, layout: TreeLayout | None = None,
               before_read=None) -> list[list[int]]:
        """Descend each active row's tree with the target's choices (`logits` (rows, nodes, vocab)), committing every
        chosen token; returns the accepted nodes per row (root first) and sets the next anchors. `layout`: the
        trees' `TreeLayout` when the caller has it. `before_read(outcome)`, when the step accepts on the device: run
        with the `DeviceOutcome` before it is read, it returns a (rows, n) tensor read in the same copy (into
        `read_along`, one list per row), or None."""
        self.accepted, self.read_along = None, None
        depth = max(tree.max_depth for tree in trees)
        if self.device_ok and self._processors_act_alike(depth):
            return self._accept_on_device(trees, logits, layout or TreeLayout.of(trees, logits.device), before_read)
        return self._accept_token_by_token(trees, logits)

    def _accept_token_by_token(self, trees, logits: torch.Tensor) -> list[list[int]]:
        """`accept` token by token (`_accept_path`), or row groups of one length for a plain step."""
        self._room = None
        if all(len(tree) == 1 for tree in trees):
            return self._plain_step(logits[:, 0])
        paths = []
        for i, (row, tree) in enumerate(zip(self.active, trees)):
            path, self.anchors[i] = _accept_path(tree, self.committers[row], logits[i], self._finished)
            paths.append(path)
        return paths

    def _processors_act_alike(self, depth: int) -> bool:
        """True when every processor leaves the scores of every position of this step as a prefix-free function of
        the logits (prefix lengths from the shortest row's to the longest's plus `depth`)."""
        lengths = [self.committers[r].length for r in self.active]
        span = range(min(lengths), max(lengths) + depth + 1)
        return all(type(p) in self._prefix_free or _inactive(p, span) for p in self.logits_processor)

    def _accept_on_device(self, trees, logits: torch.Tensor, layout: TreeLayout, before_read=None) -> list[list[int]]:
        """Acceptance of every row's tree at once: the target's choice at every node (`_choices`), the deepest node
        whose ancestors all carry their parent's choice, its path's choices committed up to the first stop or the
        row's limit. One copy to the host: per row, the tokens it commits, its accepted path and their count (and
        what `before_read` adds)."""
        device = logits.device
        choice, inexact = self._choices(trees, logits, layout)
        reached, path_nodes, committed = _accepted_paths(layout, choice)
        if self._room is None:
            self._room = host_to_device([self.committers[r].limit - self.committers[r].length for r in self.active],
                                        device)
        count = torch.minimum(reached, self._room)
        levels = layout.levels
        if self.pads_stopped_rows and self.eos_tokens is not None:  # a row ends at its first stop token
            stops = torch.isin(committed, self.eos_tokens.to(device)) & (levels[None] < count[:, None])
            first = torch.where(stops, levels[None], layout.max_depth + 1).min(-1).values + 1
            count = torch.minimum(count, first)
        # chains need no nodes read back: a row's accepted path is its first `count` slots
        outcome = torch.cat([count[:, None], committed] + ([] if path_nodes is None else [path_nodes])
                            + ([] if inexact is None else [inexact[:, None].long()]), dim=1)
        along = None if before_read is None else before_read(DeviceOutcome(count, committed, path_nodes))
        if along is None:
            outcome = outcome.tolist()
        else:  # one copy (token ids and counts are exact in float64)
            table = torch.cat([outcome.double(), along.double()], dim=1).tolist()
            columns = outcome.shape[1]
            outcome = [[int(v) for v in row[:columns]] for row in table]
            self.read_along = [row[columns:] for row in table]
        if inexact is not None and any(values[-1] for values in outcome):
            # a law compaction could not keep exact (top-k tied past its candidates): this step token by token
            self.read_along = None  # (what was read along assumed the outcome dropped here)
            return self._accept_token_by_token(trees, logits)
        self._room = self._room - count
        self.accepted = (path_nodes, count)
        width = layout.max_depth + 1
        paths = []
        for i, (row, values) in enumerate(zip(self.active, outcome)):
            k = values[0]
            tokens = values[1 : 1 + k]
            committer = self.committers[row]
            self._commit_known(committer, tokens)
            if k:  # (0 only when a prompt leaves no room at all)
                self.anchors[i] = tokens[-1]
            paths.append(list(range(max(k, 1))) if path_nodes is None else values[1 + width : 1 + width + max(k, 1)])
        for row in self.active:
            self._finished(self.committers[row])
        return paths

    def _choices(self, trees, logits: torch.Tensor, layout: TreeLayout):
        """The target's choice at every node (rows, nodes) and, when sampling, per row whether a law at one of its
        nodes could not be compacted exactly (else None): greedy, the argmax of the processed scores; sampling,
        recursive rejection sampling among each node's children (`rejection_choices`)."""
        rows, nodes = layout.tokens.shape
        if self.sampling is not None:
            target, exact = self.sampling.laws(logits)
            choice = rejection_choices(target, layout.tokens, _children(trees, layout), _node_laws(trees, layout))
            return choice, (~exact & layout.real).any(-1)
        # the argmax of the logits' own dtype is that of their float32 copy (exact): no (rows, nodes, vocab) copy
        scores = logits
        processors = [p for p in self.logits_processor if type(p) in PREFIX_FREE_PROCESSORS]
        if processors:  # they read no ids: any (rows x nodes, 1) stands in for the prefixes
            flat = scores.float().reshape(rows * nodes, -1)  # processed in float32, as plain generate does
            for processor in processors:
                flat = processor(layout.tokens.reshape(-1, 1), flat)
            scores = flat.view(rows, nodes, -1)
        # `max(-1).indices` is the argmax (the first maximum, as argmax's), 3-4x faster than argmax on a CPU
        return scores.max(-1).indices, None

    def _commit_known(self, committer: RowCommitter, tokens: list[int]) -> None:
        """Append tokens chosen on the device and note where the row's criteria (EOS, max length) first fired."""
        start = committer.length
        self.store.append(committer.row, tokens)
        if committer.stopped_at is None:
            for j, token in enumerate(tokens):
                if token in self._eos_host or (self._max_length_stops and start + j + 1 >= committer.limit):
                    committer.stopped_at = start + j + 1
                    break

    def _plain_step(self, logits: torch.Tensor) -> list[list[int]]:
        """`accept` for a step without drafts: each row commits one token, rows of the same length together (at a
        large batch most steps are plain, and row-by-row processors and criteria cost several ms a step)."""
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(self.active):
            by_length.setdefault(self.committers[row].length, []).append(i)
        for group in by_length.values():
            rows = [self.active[i] for i in group]
            committers = [self.committers[row] for row in rows]
            processors = row_processors(self.logits_processor, rows, len(self.committers))
            tokens = commit_in_step(committers, logits[group], processors, committers[0].stopping_criteria)
            for i, token in zip(group, tokens):
                self.anchors[i] = token
        for row in self.active:
            self._finished(self.committers[row])  # as `_accept_path` does after each token: may end the batch's rows
        return [[0] for _ in self.active]

    def _finished(self, committer: RowCommitter) -> bool:
        if (not self.pads_stopped_rows and committer.stopped_at is not None
                and all(c.stopped_at is not None for c in self.committers)):
            # plain generate ends every row at the length where the last one stopped
            end = max(c.stopped_at for c in self.committers)
            for c in self.committers:
                if end < c.limit:
                    c.limit = end
                    self._room = None
        return committer.length >= committer.limit or (self.pads_stopped_rows and committer.stopped_at is not None)

    def drop_finished(self) -> tuple[list[int], torch.Tensor, tuple] | None:
        """Let finished rows leave the batch; the rows kept (indices into the active rows before, on the host and
        on the device, and the moves that keep them in place: `verify_cache.kept_rows`) when some left and some
        remain, for every cache to keep them too; else None (`active` is
        empty when no row is left). A row that generated past the batch's end (possible only when stopped rows
        generate on) is cut back to it (`cut_tokens`)."""
        for c in self.committers:
            extra = c.cut(c.limit)
            if extra:
                self.cut_tokens[c.row] = self.cut_tokens.get(c.row, 0) + extra
        survivors = [i for i, row in enumerate(self.active) if not self._finished(self.committers[row])]
        if len(survivors) == len(self.active):
            return None
        if not survivors:
            self.active = []
            return None
        # the survivors among the first len(survivors) places stay; the others fill the finished rows' places there,
        # so that the caches copy only the rows that move (`verify_cache.kept_rows`). Rows are known by their
        # committers, never by their place, so the output does not depend on the order.
        tail = [i for i in survivors if i >= len(survivors)]
        alive = set(survivors)
        keep = [i if i in alive else tail.pop() for i in range(len(survivors))]
        moved = [(place, row) for place, row in enumerate(keep) if place != row]
        packed = host_to_device(keep + [place for place, _ in moved] + [row for _, row in moved],
                                self.root_position_tensor.device)  # one copy
        index = packed[: len(keep)]
        moves = (len(keep), packed[len(keep) : len(keep) + len(moved)], packed[len(keep) + len(moved) :])
        self.root_position_tensor = self.root_position_tensor[index]
        if self._room is not None:
            self._room = self._room[index]
        self.active = [self.active[i] for i in keep]
        self.anchors = [self.anchors[i] for i in keep]
        return keep, index, moves

    def sequences(self, pad_token_id: int | None) -> torch.Tensor:
        """(rows, longest) committed tokens; rows that finished early are padded on the right (only possible when
        stopped rows are padded, as in plain generate)."""
        lengths = self.store.lengths
        longest = max(lengths)
        if any(n != longest for n in lengths):
            if pad_token_id is None:
                raise ValueError("rows that finish early are padded: set generation_config.pad_token_id (or "
                                 "eos_token_id)")
            out = self.store.tokens[:, :longest].copy()
            for row, n in enumerate(lengths):
                out[row, n:] = pad_token_id
        else:
            out = self.store.tokens[:, :longest]
        return torch.from_numpy(np.ascontiguousarray(out)).to(self.store.device)


def _accept_path(tree, committer: RowCommitter, logits: torch.Tensor, finished) -> tuple[list[int], int]:
    """Descend `tree` with the target's choices (logits (nodes, vocab) of one row), committing each chosen token,
    until the choice is not a child or the row is finished; return the accepted nodes (root first) and the last token
    committed, which is the next anchor."""
    node, path = 0, [0]
    laws = tree.draft_laws
    while True:
        drafts = None
        if laws is not None:
            drafts = [(token, _law_of(laws, child, token, logits)) for token, child in tree.children[node].items()]
        token = committer.choose_and_commit(logits[node : node + 1], drafts)
        child = tree.children[node].get(token)
        if finished(committer) or child is None:
            return path, token
        node = child
        path.append(node)


def _law_of(laws: CompactLaw, node: int, token: int, logits: torch.Tensor) -> torch.Tensor:
    """The dense law node `node` (carrying `token`) was drawn from: a point mass past the drawn nodes'."""
    if node >= laws.probs.shape[0]:
        laws, node = CompactLaw.point_masses(torch.tensor([token], device=logits.device), 1), 0
    return laws[node].dense(logits.shape[-1])


def _children(trees, layout: TreeLayout) -> torch.Tensor:
    """(rows, nodes, most children) each node's children in the order they were drawn (node order), -1 for none,
    in the trees acceptance reads (`TreeLayout.accept_parents`); built on the device."""
    rows, nodes = layout.tokens.shape
    device = layout.tokens.device
    # at most: a tree's widest node, and one more child where a lookup chain branches off
    width = max(max(Counter(t.parents[1 : t.base_size]).values(), default=1) + bool(t.lookup) for t in trees)
    child = layout.real & (layout.depths > 0)
    if layout.repeats is not None:
        child &= ~layout.repeats
    parents, slots = layout.accept_parents, index_range(nodes, device)
    earlier = (parents[:, :, None] == parents[:, None, :]) & child[:, None, :] & (slots[None, :] < slots[:, None])
    place = torch.where(child, parents * width + earlier.sum(-1), nodes * width)  # the rest to a spare column
    table = torch.full((rows, nodes * width + 1), -1, dtype=torch.long, device=device)
    table.scatter_(1, place, slots.expand(rows, nodes))
    return table[:, :-1].view(rows, nodes, width)


def _node_laws(trees, layout: TreeLayout) -> CompactLaw:
    """(rows, nodes, K) the law each node's token was drawn from: the trees' own laws (compact: the device path
    samples with compact laws alone, and the drafters' laws are compacted like the target's), point masses for nodes
    drafted deterministically (and for padding slots)."""
    laws = [tree.draft_laws for tree in trees]
    if all(law is None for law in laws):
        return CompactLaw.point_masses(layout.tokens, 1)
    width = max(law.width for law in laws if law is not None)
    rows, nodes = layout.tokens.shape
    ids = torch.full((rows, nodes, width), -1, dtype=torch.long, device=layout.tokens.device)
    probs = torch.zeros((rows, nodes, width), dtype=torch.float32, device=layout.tokens.device)
    ids[..., 0], probs[..., 0] = layout.tokens, 1.0  # point masses, replaced where a tree has laws
    for row, (tree, law) in enumerate(zip(trees, laws)):
        if law is None:
            continue
        drawn = law.probs.shape[0]  # the nodes after them are copied tokens: point masses
        ids[row, :drawn, : law.width] = law.ids  # (a narrower law's other columns stay id -1, probability 0)
        probs[row, :drawn, : law.width] = law.probs
    return CompactLaw(ids, probs)


def _accepted_paths(layout: TreeLayout, choice: torch.Tensor):
    """Given the target's choice at every node (rows, nodes): per row, how deep its accepted path reaches (nodes),
    the path's slots ((rows, max depth + 1), the last one repeated; None for uniform chains, whose path is their
    first slots) and the choices along it (the tokens the row commits)."""
    rows, nodes = layout.tokens.shape
    device = choice.device
    if layout.uniform_chains:  # slot i is depth i: the path is the leading drafts that match their parent's choice
        matches = layout.tokens[:, 1:] == choice[:, :-1]
        return matches.cumprod(-1).sum(-1) + 1, None, choice
    depths, ancestors = layout.depths, layout.accept_ancestors
    # a drafted node is rejected when it does not carry its parent's choice (a padding slot, depth -1, is never the
    # deepest: the root, depth 0, always qualifies); so is a lookup node that repeats a tree node
    rejected = (layout.tokens != choice.gather(1, layout.accept_parents)) & (depths > 0)
    if layout.repeats is not None:
        rejected |= layout.repeats
    on_accepted_path = ~(ancestors & rejected[:, None, :]).any(-1)
    # siblings carry distinct tokens: the deepest node on the accepted path is unique
    deepest_depth, deepest = torch.where(on_accepted_path, depths, -1).max(-1)
    if layout.chains:
        path_nodes = layout.levels.expand(rows, -1)
    else:  # the deepest node's ancestors in node order (parents come first), then the last slot repeated
        on_path = ancestors[index_range(rows, device), deepest]  # (rows, nodes)
        slots = torch.where(on_path, index_range(nodes, device), nodes - 1)
        path_nodes = slots.sort(-1).values[:, : layout.max_depth + 1]
    return deepest_depth + 1, path_nodes, choice.gather(1, path_nodes)  # committed: (rows, max depth + 1)
