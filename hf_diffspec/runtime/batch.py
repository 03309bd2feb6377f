"""The state of a batch being decoded speculatively: its rows, what each committed, and the caches that follow them.

`BatchState` owns everything that must change together when rows accept different numbers of tokens or finish:
the per-row committers (tokens, scores, stopping), the rows still decoding, their anchors, the validity of every
cached slot per row (left padding and slots of drafts another row accepted are invisible to a row), the target's KV
cache and the drafter's context caches. The loop only calls `accept`, `keep_accepted` and `drop_finished`.

Stopping follows plain `generate` exactly (`_sample` in transformers 5.24): when the stopping criteria include an EOS
criterion, a row that stops is padded with `pad_token_id` until the batch ends; without one, a stopped row goes on
generating (plain `generate` does not pad it) until every row has stopped, and all rows end at that length.
"""

import copy

import torch
from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor

from .kv_cache import keep_accepted_paths
from .verification import choose_token, choose_token_among_drafts


class RowCommitter:
    """One row's committed tokens, appended one at a time exactly as `_sample` would: logits processors with the
    row's exact prefix, scores, streamer, stopping criteria. `limit` is the length the row may not pass."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, limit: int):
        self.input_ids = input_ids  # (1, length)
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.config = generation_config
        self.streamer = streamer
        self.limit = limit
        self.scores, self.raw_logits = [], []
        self.stopped_at: int | None = None  # length at which a stopping criterion fired

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

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
    ids = first.input_ids if len(committers) == 1 else torch.cat([c.input_ids for c in committers])
    raw = raw_logits.to(dtype=torch.float32, copy=True)
    scores = logits_processor(ids, raw.clone())
    if first.config.do_sample:
        drafts = drafts or [None] * len(committers)
        tokens = torch.cat([choose_token_among_drafts(scores[i : i + 1], drafts[i]) if drafts[i]
                            else choose_token(scores[i : i + 1], True) for i in range(len(committers))])
    else:
        tokens = choose_token(scores, False)
    ids = torch.cat([ids, tokens[:, None]], dim=-1)
    for i, c in enumerate(committers):
        if c.config.output_scores:
            c.scores.append(scores[i : i + 1])
        if c.config.output_logits:
            c.raw_logits.append(raw[i : i + 1])
        c.input_ids = ids[i : i + 1]
        if c.streamer is not None:
            c.streamer.put(tokens[i : i + 1].cpu())
    # criteria get what `_sample` hands them: the scores collected so far when they are returned (one row then:
    # scores need batch size 1), else None
    collected = tuple(first.scores) if first.config.return_dict_in_generate and first.config.output_scores else None
    stopped = stopping_criteria(ids, collected).tolist()
    for c, stop in zip(committers, stopped):
        if c.stopped_at is None and stop:
            c.stopped_at = c.length
    return tokens.tolist()


class BatchState:
    """Rows of one speculative `generate` call and the caches that follow them (see the module docstring).

    Args:
        committers: one `RowCommitter` per row, in batch order.
        prompt_valid: (rows, prompt length) bool, the real (not padding) prompt tokens.
        cache: the target's KV cache (prefilled with the prompts).
        drafting: the candidate generator, whose drafter caches follow the rows.
        pads_stopped_rows: plain generate's `has_eos_stopping_criteria`: stopped rows are padded (and leave the
            batch) rather than generated on.
        logits_processor: the batch's processors (each committer holds its own row's view); steps without drafts
            apply them to all rows of one length at once.
    """

    def __init__(self, committers: list[RowCommitter], prompt_valid: torch.Tensor, cache, drafting,
                 pads_stopped_rows: bool, logits_processor):
        self.committers = committers
        self.logits_processor = logits_processor
        self.active = list(range(len(committers)))  # batch index of each row still decoding
        self.anchors: list[int] = []  # each active row's last committed token, not yet seen by the target
        self.cache_valid = prompt_valid  # (active rows, cached slots): which slots each row may attend to
        self.cache = cache
        self.drafting = drafting
        self.pads_stopped_rows = pads_stopped_rows
        # per active row, added to its count of real cached tokens to give positions: 0, except after a prompt that
        # ends in a masked slot, where generate continues from that slot's position (0) instead of the count
        self.position_offset = torch.zeros(prompt_valid.shape[0], dtype=torch.long, device=prompt_valid.device)

    @property
    def root_positions(self) -> list[int]:
        """Position of each active row's anchor: the number of real tokens it has cached (see `position_offset`)."""
        return self._root_positions().tolist()

    def _root_positions(self) -> torch.Tensor:
        return self.cache_valid.sum(-1) + self.position_offset

    def max_drafts(self) -> list[int]:
        """Drafts each active row could still commit after its anchor's target token, within its length limit."""
        return [self.committers[r].limit - self.committers[r].length - 1 for r in self.active]

    def histories(self) -> list[torch.Tensor]:
        """Each active row's committed tokens (1-D), its anchor last."""
        return [self.committers[row].input_ids[0] for row in self.active]

    def accept(self, trees, logits: torch.Tensor) -> list[list[int]]:
        """Descend each active row's tree with the target's choices (`logits` (rows, nodes, vocab)), committing every
        chosen token; returns the accepted nodes per row (root first) and sets the next anchors."""
        if all(len(tree) == 1 for tree in trees):
            return self._plain_step(logits[:, 0])
        paths = []
        for i, (row, tree) in enumerate(zip(self.active, trees)):
            path, self.anchors[i] = _accept_path(tree, self.committers[row], logits[i], self._finished)
            paths.append(path)
        return paths

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

    def keep_accepted(self, paths: list[list[int]], hidden_states, num_slots: int) -> None:
        """Keep each row's accepted path in the target's cache, mark its slots valid for that row only, and hand
        their target features to the drafter."""
        device = self.cache_valid.device
        past = self.cache_valid.shape[1]
        roots = self._root_positions()
        kept = max(len(p) for p in paths)
        padded = torch.tensor([p + [p[-1]] * (kept - len(p)) for p in paths], device=device)  # (rows, kept)
        keep_accepted_paths(self.cache, past, paths, padded, num_slots)
        offsets = torch.arange(kept, device=device)
        accepted = offsets[None] < torch.tensor([len(p) for p in paths], device=device)[:, None]
        self.cache_valid = torch.cat([self.cache_valid, accepted], dim=1)
        self.drafting.add_context(hidden_states, padded, roots[:, None] + offsets, accepted)

    def _finished(self, committer: RowCommitter) -> bool:
        if not self.pads_stopped_rows and all(c.stopped_at is not None for c in self.committers):
            # plain generate ends every row at the length where the last one stopped
            end = max(c.stopped_at for c in self.committers)
            for c in self.committers:
                c.limit = min(c.limit, end)
        return committer.length >= committer.limit or (self.pads_stopped_rows and committer.stopped_at is not None)

    def drop_finished(self) -> bool:
        """Let finished rows leave the batch (and every cache); False when no row is left. A row that generated
        past the batch's end (possible only when stopped rows generate on) is cut back to it."""
        for c in self.committers:
            c.input_ids = c.input_ids[:, : c.limit]
        keep = [i for i, row in enumerate(self.active) if not self._finished(self.committers[row])]
        if len(keep) == len(self.active):
            return True
        if not keep:
            self.active = []
            return False
        index = torch.tensor(keep, device=self.cache_valid.device)
        self.cache.batch_select_indices(index)
        self.drafting.select_rows(index)
        self.cache_valid = self.cache_valid[index]
        self.position_offset = self.position_offset[index]
        self.active = [self.active[i] for i in keep]
        self.anchors = [self.anchors[i] for i in keep]
        return True

    def sequences(self, pad_token_id: int | None) -> torch.Tensor:
        """(rows, longest) committed tokens; rows that finished early are padded on the right (only possible when
        stopped rows are padded, as in plain generate)."""
        rows = [c.input_ids for c in self.committers]
        longest = max(r.shape[1] for r in rows)
        if all(r.shape[1] == longest for r in rows):
            return torch.cat(rows)
        if pad_token_id is None:
            raise ValueError("rows that finish early are padded: set generation_config.pad_token_id (or eos_token_id)")
        out = rows[0].new_full((len(rows), longest), pad_token_id)
        for i, r in enumerate(rows):
            out[i, : r.shape[1]] = r[0]
        return out


def _accept_path(tree, committer: RowCommitter, logits: torch.Tensor, finished) -> tuple[list[int], int]:
    """Descend `tree` with the target's choices (logits (nodes, vocab) of one row), committing each chosen token,
    until the choice is not a child or the row is finished; return the accepted nodes (root first) and the last token
    committed, which is the next anchor."""
    node, path = 0, [0]
    while True:
        drafts = None
        if tree.draft_probs is not None:
            drafts = [(token, tree.draft_probs[child]) for token, child in tree.children[node].items()]
        token = committer.choose_and_commit(logits[node : node + 1], drafts)
        child = tree.children[node].get(token)
        if finished(committer) or child is None:
            return path, token
        node = child
        path.append(node)
