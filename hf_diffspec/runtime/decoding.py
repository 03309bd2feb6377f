"""The speculative decoding loop: draft a tree per row, verify all of them in one target forward, commit what the
target itself picks.

    prefill (prompts) ──► first token per row ──► loop:
        drafter.propose(anchors)                 ──► one CandidateTree per row (a chain is a tree with one branch)
        target(trees as a rectangle, 4D additive mask, depth positions, cached prefixes)
        walk each row's tree with the target's processed logits; commit token by token (stopping criteria, streamer)
        keep each row's accepted path in the KV cache; its target hidden states become the drafter's new context
        drop the rows that finished

It is the `custom_generate` callable that `generate()` runs once it has prepared logits processors, stopping
criteria, the cache and the generation config (see `generation.py`), so every standard generate option applies.
Lossless: every committed token is chosen by the target from its processed distribution given the exact committed
prefix of its row (argmax when greedy, a sample otherwise); drafts only decide how many of those choices one forward
can check. Rows of a batch accept different numbers of tokens (ragged): the cache keeps one slot column per accepted
position of the longest row, and a per-row validity mask hides what a row did not accept (and its left padding).
"""

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .drafting import DiffusionCandidateGenerator, feature_layers
from .kv_cache import keep_accepted_paths
from .tree import verify_inputs
from .verification import choose_token, choose_token_among_drafts


@dataclass
class SpeculationStats:
    """What one speculative `generate` call did. `tau` is tokens committed per row per target forward (bonus
    included); `committed_per_step` has one entry per row and step. `verified_tokens` counts real tree nodes,
    `verified_slots` the rectangle the target computed (rows x longest tree, padding included)."""

    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    verified_slots: int = 0
    new_tokens: int = 0
    committed_per_step: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        steps = self.committed_per_step
        return sum(steps) / len(steps) if steps else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "committed_per_step"}
        out["speculative_steps"] = len(self.committed_per_step)
        out["tau"] = self.tau
        return out


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the `SpeculationStats` of the call (as `speculation_stats`)."""

    speculation_stats: SpeculationStats | None = None


class _RowCommitter:
    """One row's committed tokens, appended one at a time exactly as `_sample` would: scores, streamer, stopping
    criteria. Logits processors and stopping criteria see the row alone (its own exact prefix)."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer):
        self.input_ids = input_ids  # (1, length)
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.config = generation_config
        self.streamer = streamer
        self.scores, self.raw_logits = [], []
        self.done = False

    def choose_and_commit(self, raw_logits: torch.Tensor, drafts=None) -> int:
        """Pick the target's token from its raw logits (1, vocab) given the committed prefix, commit it, return it.
        `drafts`: [(token, q)] of the children drawn from known distributions, for rejection sampling."""
        raw = raw_logits.to(dtype=torch.float32, copy=True)
        scores = self.logits_processor(self.input_ids, raw.clone())
        if self.config.do_sample and drafts:
            token = choose_token_among_drafts(scores, drafts)
        else:
            token = choose_token(scores, self.config.do_sample)
        if self.config.output_scores:
            self.scores.append(scores)
        if self.config.output_logits:
            self.raw_logits.append(raw)
        self.input_ids = torch.cat([self.input_ids, token[:, None]], dim=-1)
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        self.done = bool(self.stopping_criteria(self.input_ids, scores).all())
        return int(token)


def _row_processors(logits_processor, row: int, rows: int):
    """The processors as row `row` alone sees them. Processors keep batch-shaped state in one place in transformers
    5.24: the repetition penalty's per-row `prompt_ignore_length` (the row's left padding); it is sliced to the row."""
    if rows == 1:
        return logits_processor
    views = LogitsProcessorList()
    for processor in logits_processor:
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignore, torch.Tensor) and ignore.dim() == 1 and ignore.shape[0] == rows:
            processor = copy.copy(processor)
            processor.prompt_ignore_length = ignore[row : row + 1]
        views.append(processor)
    return views


def _draft_temperature(generation_config) -> float | None:
    """When sampling, drafts are drawn too (at the user's temperature) so that rejection sampling can use them."""
    if not generation_config.do_sample:
        return None
    return float(generation_config.temperature or 1.0)


def _check_batch(input_ids, attention_mask, generation_config, streamer, logits_processor) -> torch.Tensor:
    """Validate a batch for speculative decoding; return its (rows, length) bool mask of real prompt tokens."""
    rows = input_ids.shape[0]
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    valid = attention_mask.bool()
    empty = [r for r in range(rows) if not bool(valid[r].any())]
    if empty:
        raise ValueError(
            f"prompt row(s) {empty} are empty (no token has attention_mask 1); speculative decoding needs at least one "
            "prompt token per row to draft from. Drop those rows or give them a BOS token."
        )
    if rows > 1 and not bool(valid[:, -1].all()):
        raise ValueError(
            "the batch is right-padded (some rows end with attention_mask 0); decoder-only generation needs left "
            "padding: set tokenizer.padding_side = 'left' before tokenizing the batch."
        )
    if rows > 1:
        if generation_config.output_scores or generation_config.output_logits:
            raise ValueError(
                "output_scores/output_logits are only available at batch size 1 with a diffusion drafter: rows commit "
                "different numbers of tokens per step. Generate the rows one at a time to get them."
            )
        if streamer is not None:
            raise ValueError("streaming needs batch size 1 (as in transformers); generate the rows one at a time")
        if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor):
            raise ValueError("prefix_allowed_tokens_fn needs each row's batch index; use batch size 1 with it")
    return valid


def _pad_token(generation_config) -> int:
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None:
        raise ValueError("rows that finish early are padded: set generation_config.pad_token_id (or eos_token_id)")
    return int(pad)


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter=None,
    streamer=None,
    num_draft_tokens: int | None = None,
    **model_kwargs,
):
    """Speculative decoding with a diffusion drafter; called by `generate()` as a `custom_generate` callable.
    `num_draft_tokens`: verify that many drafts per step (fixed length); None lets the cost model decide."""
    start_time = time.perf_counter()
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and input_ids.shape[1] >= max_positions:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the target's context holds {max_positions}; "
            "shorten the prompt so that there is room for new tokens."
        )
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("speculative decoding needs a KV cache; do not pass use_cache=False")
    attention_mask = model_kwargs.get("attention_mask")
    valid = _check_batch(input_ids, attention_mask, generation_config, streamer, logits_processor)
    rows = input_ids.shape[0]
    device = input_ids.device

    stats = SpeculationStats()
    drafting = DiffusionCandidateGenerator(drafter, model, generation_config.max_length,
                                           sample_temperature=_draft_temperature(generation_config),
                                           num_draft_tokens=num_draft_tokens)
    layers = feature_layers(drafter)
    committers = [_RowCommitter(input_ids[r : r + 1], _row_processors(logits_processor, r, rows), stopping_criteria,
                                generation_config, streamer) for r in range(rows)]

    # Prefill: the prompts, then the first token of every row (drafting needs an anchor).
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids, attention_mask=attention_mask, position_ids=positions,
        cache=cache, use_cache=True, output_hidden_states=layers, logits_to_keep=1,
    )
    stats.target_forwards += 1
    drafting.add_context(out.hidden_states, slice(None), positions, valid)
    anchors = [c.choose_and_commit(out.logits[r : r + 1, -1]) for r, c in enumerate(committers)]
    cache_valid = valid  # (active rows, cached slots): which slots each row may attend to
    active = list(range(rows))  # original row index of each row still decoding
    stats.prefill_time_s = time.perf_counter() - start_time

    while True:
        finished = [i for i, r in enumerate(active) if committers[r].done]
        if finished:
            keep = [i for i in range(len(active)) if i not in finished]
            if not keep:
                break
            keep_index = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_index)
            drafting.select_rows(keep_index)
            cache_valid = cache_valid[keep_index]
            active = [active[i] for i in keep]
            anchors = [anchors[i] for i in keep]

        root_positions = cache_valid.sum(-1).tolist()
        remaining = [generation_config.max_length - committers[r].input_ids.shape[1] for r in active]
        t0 = time.perf_counter()
        trees = drafting.propose(anchors, root_positions, [m - 1 for m in remaining])
        t1 = time.perf_counter()
        if any(len(t) > 1 for t in trees):
            stats.draft_forwards += 1
            stats.drafted_tokens += sum(len(t) - 1 for t in trees)

        tokens, tree_mask, tree_positions = verify_inputs(trees, cache_valid, root_positions, model.dtype)
        out = model(tokens, attention_mask=tree_mask, position_ids=tree_positions,
                    cache=cache, use_cache=True, output_hidden_states=layers)
        stats.target_forwards += 1
        stats.verified_tokens += sum(len(t) for t in trees)
        stats.verified_slots += tokens.numel()

        paths = []
        for i, (row, tree) in enumerate(zip(active, trees)):
            path, anchors[i] = _walk(tree, committers[row], out.logits[i])
            paths.append(path)
            stats.committed_per_step.append(len(path))
        keep_accepted_paths(cache, cache_valid.shape[1], paths, tokens.shape[1])
        kept = max(len(p) for p in paths)
        offsets = torch.arange(kept, device=device)
        accepted = offsets[None] < torch.tensor([len(p) for p in paths], device=device)[:, None]
        cache_valid = torch.cat([cache_valid, accepted], dim=1)
        drafting.add_context(
            out.hidden_states, torch.tensor([p + [p[-1]] * (kept - len(p)) for p in paths], device=device),
            torch.tensor(root_positions, device=device)[:, None] + offsets, accepted,
        )
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += time.perf_counter() - t1

    if streamer is not None:
        streamer.end()
    sequences = _stack_rows([c.input_ids for c in committers], generation_config)
    stats.new_tokens = sum(c.input_ids.shape[1] - input_ids.shape[1] for c in committers)
    stats.total_time_s = time.perf_counter() - start_time
    drafter.last_generation_stats = stats

    if not generation_config.return_dict_in_generate:
        return sequences
    only = committers[0]
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(only.scores) if generation_config.output_scores else None,
        logits=tuple(only.raw_logits) if generation_config.output_logits else None,
        cache=cache if generation_config.use_cache else None,
        speculation_stats=stats,
    )


def _walk(tree, committer: _RowCommitter, logits: torch.Tensor) -> tuple[list[int], int]:
    """Descend `tree` with the target's choices (logits (nodes, vocab) of one row), committing each chosen token,
    until the choice is not a child or the row is done; return the accepted nodes (root first) and the last token
    committed, which is the next anchor."""
    node, path = 0, [0]
    while True:
        drafts = None
        if tree.draft_probs is not None:
            drafts = [(token, tree.draft_probs[child]) for token, child in tree.children[node].items()]
        token = committer.choose_and_commit(logits[node : node + 1], drafts)
        child = tree.children[node].get(token)
        if committer.done or child is None:
            return path, token
        node = child
        path.append(node)


def _stack_rows(rows: list[torch.Tensor], generation_config) -> torch.Tensor:
    """(1, length_r) rows -> (rows, max length), rows that finished early padded on the right (as generate does)."""
    longest = max(r.shape[1] for r in rows)
    if all(r.shape[1] == longest for r in rows):
        return torch.cat(rows)
    out = rows[0].new_full((len(rows), longest), _pad_token(generation_config))
    for i, r in enumerate(rows):
        out[i, : r.shape[1]] = r[0]
    return out
