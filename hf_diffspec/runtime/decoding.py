"""The speculative decoding loop: draft a tree per row, verify all of them in one target forward, commit what the
target itself picks. It reads in one screen (`speculative_generate`, `_step`); its parts:

    policy    = speculation_policy(...)        control: how many drafts, whether to speculate (`control_policy.py`,
                                               `control_speculation.py`, measured costs `control_profiles.py`)
    drafting  = generator_class(drafter)(...)  one CandidateTree per row (`drafting*.py`)
    verifier  = TargetVerifier(model, ...)     the target's forward over the trees and every cache it leaves
                                               (`verifier.py`, `verify_*.py`)
    batch     = BatchState(...)                rows, what each committed, acceptance (`batch.py`)

    prefill (prompts) ──► first token per row (its anchor) ──► loop (`_step`):
        lookup.propose(batch)          ──► prompt-lookup drafts per row (free: copied from the row's own text)
        control.decide(rows, lookups)  ──► the step's kind: DRAFT (the drafter's trees, lookup drafts grafted on
                                           as one more branch), LOOKUP (lookup drafts alone, no drafter forward)
                                           or PLAIN (the anchors alone: a plain decode step), and how many lookup
                                           drafts pay
        drafting.propose(anchors)      ──► one CandidateTree per row (a chain is a tree with one branch), from
                                           the pass the last step ran ahead when there is one
        verifier.forward(trees)        ──► one target forward: trees as a rectangle, 4D mask, depth positions
        batch.accept(trees, logits)    ──► descend each tree with the target's choices: greedy, for every row and
                                           node at once on the device, one read of the outcome per step (when the
                                           processors and criteria need no exact prefix per position); else token
                                           by token (logits processors, stopping criteria, streamer). Before that
                                           read, where a read waits for the device, a drafter step runs the next
                                           step's drafting pass from the outcome still on the device
                                           (`drafting.draft_ahead`): what the next trees are sized and shaped by
                                           rides on the same read
        verifier.keep(paths)           ──► accepted paths kept in the cache, visible to their row; recurrent states
                                           rolled back and advanced along them; their target features become the
                                           drafter's new context (`drafting.add_context`)
        control.observe_lookups        ──► every row's lookup drafts against what the target committed
        control.record / policy.record_step (a StepRecord, once its times are read)
                                       ──► what the step committed and cost, and the verify cost observed
        batch.drop_finished()          ──► finished rows leave the batch, the verifier's caches and the drafter's

Between two target forwards the host reads the device a fixed number of times whatever the batch or tree size
(`tests/test_sync_budget.py`): the committed tokens are copied to the host once per step (`TokenStore`), and prompt
lookup, stopping and root positions work from that copy; with drafting ahead, that copy also carries the next
step's drafter confidences or ranked top-k, so a step that drafts after a drafter step reads once (one more when its
pass ran at its own step: on a CPU, where the host runs every op as called and a read costs nothing, and after a
lookup or plain step or a probe the controller did not expect to pay). Nothing else in a step waits for the device: steps are
timed by stamps on the device's own timeline (`device_clock.StepClock`; on the CPU the host clock), each ending after
`keep` and the replay, so their time is the step's and not the next one's; on a GPU a step's times are read at a
later step's read and reach the controller and the cost model then (`_record_timed_steps`).

The controller and the verify-cost profile in use outlive the call, on the target (`control_state.py`;
`reset_speculation_state` forgets them): the call works on copies of its own and hands them back at its end, so calls
in several threads at once share no state while they run (the verify attention and the recurrent-state recording
are per thread too). It is the `custom_generate` callable that `generate()` runs once it has prepared logits
processors, stopping criteria, the cache and the generation config (see `generation.py`), so every standard generate
option applies. Lossless: every committed token is chosen by the target from its processed distribution given the
exact committed prefix of its row (argmax when greedy, a sample otherwise); drafts only decide how many of those
choices one forward can check. Rows of a batch accept different numbers of tokens (ragged): the cache keeps one slot
column per accepted position of the longest row, and a per-row validity mask hides what a row did not accept (and
its left padding).
"""

import os
from dataclasses import dataclass, field, replace

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch import PREFIX_FREE_WHEN_SAMPLING, BatchState, RowCommitter, TokenStore, row_processors
from .control_speculation import StepKind, StepRecord
from .control_policy import DraftLengthPolicy, speculation_policy
from .device_clock import StepClock, device_time
from .drafting import DiffusionCandidateGenerator, DraftPass, generator_class
from .drafting_lookup import NO_LOOKUP_DRAFTS, PromptLookup
from .files import pad_token_id
from .sampling import SamplingLaws
from .tree import CandidateTree, index_range
from .verifier import TargetVerifier


@dataclass
class SpeculationStats:
    """What one speculative `generate` call did. `tau` is tokens committed per row per target forward (bonus
    included); `committed_per_step` has one entry per row and step. `drafted_tokens` counts every candidate after the
    anchors, `lookup_tokens` those copied by prompt lookup (some may coincide with the drafter's). `verified_tokens`
    counts real tree nodes, `verified_slots` the rectangle the target computed (rows x longest tree, padding
    included). Steps by kind (`control_speculation.StepKind`): `draft_steps` ran the drafter (lookup drafts grafted
    on), `lookup_steps` verified prompt-lookup drafts alone, `plain_steps` the anchors alone (a plain decode step).
    `linear_state_replays`: steps after which a linear-attention target's recurrent states
    were put back and advanced through the accepted tokens only (`verify_recurrent.py`). `unused_drafting_passes`:
    drafting passes run ahead for a step that then did not draft (`drafting.draft_ahead`)."""

    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    lookup_tokens: int = 0
    verified_tokens: int = 0
    verified_slots: int = 0
    new_tokens: int = 0
    draft_steps: int = 0
    lookup_steps: int = 0
    plain_steps: int = 0
    linear_state_replays: int = 0
    unused_drafting_passes: int = 0
    committed_per_step: list[int] = field(default_factory=list)
    _entry_rows: list[int] = field(default_factory=list, repr=False)  # the batch row of each committed_per_step entry
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        steps = self.committed_per_step
        return sum(steps) / len(steps) if steps else 0.0

    def add_step(self, step: StepRecord, trees: list[CandidateTree], paths: list[list[int]], lookup_tokens: int,
                 rows: list[int]):
        """Count one loop step that verified `trees` (lookup drafts included) and accepted `paths`, of the batch rows
        `rows`."""
        self.target_forwards += 1
        self.draft_forwards += step.kind is StepKind.DRAFT and any(len(t) > 1 for t in trees)
        self.draft_steps += step.kind is StepKind.DRAFT
        self.lookup_steps += step.kind is StepKind.LOOKUP
        self.plain_steps += step.kind is StepKind.PLAIN
        self.drafted_tokens += sum(len(t) - 1 for t in trees)
        self.lookup_tokens += lookup_tokens
        self.verified_tokens += sum(len(t) for t in trees)
        self.verified_slots += step.rows * step.slots
        self.committed_per_step.extend(len(p) for p in paths)
        self._entry_rows.extend(rows)

    def add_time(self, step: StepRecord) -> None:
        """A step's times, once read (`decoding._record_timed_steps`)."""
        self.draft_time_s += step.seconds - step.verify_seconds
        self.verify_time_s += step.verify_seconds

    def cut_back(self, row: int, tokens: int) -> None:
        """Row `row` was cut back by `tokens` committed tokens (the batch ended before them: stopped rows generate
        on until every row has stopped); they leave its latest steps' counts."""
        for i in range(len(self.committed_per_step) - 1, -1, -1):
            if tokens == 0:
                return
            if self._entry_rows[i] == row:
                taken = min(tokens, self.committed_per_step[i])
                self.committed_per_step[i] -= taken
                tokens -= taken

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "committed_per_step" and not k.startswith("_")}
        out["speculative_steps"] = len(self.committed_per_step)
        out["tau"] = self.tau
        return out


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the `SpeculationStats` of the call (as `speculation_stats`)."""

    speculation_stats: SpeculationStats | None = None


def _sampling_laws(generation_config, logits_processor) -> SamplingLaws | None:
    """When sampling, the laws tokens are drawn from: the processors that read no prefix, generate's warpers among
    them. The target's law on the device path (where every processor is one of these or inactive) and the drafter's
    (drafts are drawn where the target puts its mass; a processor left out only lowers acceptance)."""
    if not generation_config.do_sample:
        return None
    return SamplingLaws([p for p in logits_processor if type(p) in PREFIX_FREE_WHEN_SAMPLING])


def _is_builtin(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "transformers"


def _check_batch(input_ids, attention_mask, generation_config, streamer, logits_processor,
                 stopping_criteria) -> torch.Tensor:
    """Validate a batch for speculative decoding; return its (rows, length) bool mask of real prompt tokens.
    Batch-size checks look at the number of rows only: transformers drops an all-ones attention mask."""
    rows = input_ids.shape[0]
    if rows > 1:
        if generation_config.output_scores or generation_config.output_logits:
            raise ValueError(
                "output_scores/output_logits are only available at batch size 1 with a diffusion drafter: rows commit "
                "different numbers of tokens per step. Generate the rows one at a time to get them."
            )
        if streamer is not None:
            raise ValueError("streaming needs batch size 1 (as in transformers); generate the rows one at a time")
        custom = [type(x).__name__ for x in [*logits_processor, *stopping_criteria] if not _is_builtin(x)]
        if custom:
            raise ValueError(
                f"custom logits processors / stopping criteria ({', '.join(custom)}) at batch size > 1: speculative "
                "decoding applies them to each row alone, shaped (1, length), where plain generate passes the whole "
                "batch (batch, length), so a batch-aware one could act differently. Generate the rows one at a time, "
                "or use transformers' built-in processors and criteria (those are applied identically)."
            )
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    valid = attention_mask.bool()
    empty = (~valid.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"prompt row(s) {empty} are empty (no token has attention_mask 1); speculative decoding needs at least one "
            "prompt token per row to draft from. Drop those rows or give them a BOS token."
        )
    return valid  # masked slots anywhere (right padding too) stay invisible to their row, as in plain generate


def _check_context(model, input_ids) -> None:
    """Refuse a prompt that leaves the target no room for new tokens, before anything runs."""
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and input_ids.shape[1] >= max_positions:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the target's context holds {max_positions}; "
            "shorten the prompt so that there is room for new tokens."
        )


@dataclass
class DecodingCall:
    """One speculative `generate` call's parts, made before the loop and read by `_prefill`, `_step` and
    `_finish`."""

    verifier: TargetVerifier
    batch: BatchState
    committers: list[RowCommitter]
    drafting: DiffusionCandidateGenerator
    policy: DraftLengthPolicy
    lookup: PromptLookup
    stats: SpeculationStats
    generation_config: object
    streamer: object
    prompt_length: int
    start_time: float
    device: torch.device
    clock: StepClock
    timing: list = field(default_factory=list)  # (step, its start, verify start and end stamps) not read yet
    ahead: DraftPass | None = None  # the drafting pass the last step ran for the next one (`drafting.draft_ahead`)

    def drop_finished(self) -> bool:
        """Finished rows leave the batch and every cache; False when no row is left."""
        kept = self.batch.drop_finished()
        if kept is not None:
            keep, index, moves = kept
            self.verifier.select_rows(index, keep, moves)
            self.drafting.select_rows(index, moves)
            if self.ahead is not None:
                self.ahead.select_rows(keep, index)
        return bool(self.batch.active)


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter=None,
    streamer=None,
    num_draft_tokens: int | None = None,
    prompt_lookup_tokens: int | None = None,
    **model_kwargs,
):
    """Speculative decoding with a diffusion drafter; called by `generate()` as a `custom_generate` callable.
    `num_draft_tokens`: verify that many drafts per step (fixed length); None lets the policy decide.
    `prompt_lookup_tokens`: up to that many prompt-lookup drafts per row and step beside the drafter's (point
    masses when sampling); None or 0: none."""
    start_time = device_time(input_ids.device)
    _check_context(model, input_ids)
    valid = _check_batch(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer, logits_processor,
                         stopping_criteria)
    static = generation_config.cache_implementation == "static"  # the capture-ready step (`verify_graphs.py`)
    verifier = TargetVerifier(model, model_kwargs.get("cache") if generation_config.use_cache else None,
                              generation_config.max_length if static else None, drafter.target_feature_layers,
                              rows=input_ids.shape[0])
    method = generator_class(drafter)
    policy = speculation_policy(drafter, model, num_draft_tokens, method,  # control first, handed on
                                graphs=bool(verifier.graphs and verifier.graphs.backend), rows=input_ids.shape[0],
                                horizon=generation_config.max_length - input_ids.shape[1])
    sampling = _sampling_laws(generation_config, logits_processor)
    drafting = method(drafter, model, policy, sampling)
    if static:
        drafting.draft_statically(input_ids.shape[0], generation_config.max_length)
    lookup = PromptLookup(prompt_lookup_tokens or 0, generation_config.max_matching_ngram_size or 3)  # 0: no lookup
    batch, committers = _rows(input_ids, logits_processor, stopping_criteria, generation_config, streamer, sampling)
    call = DecodingCall(verifier, batch, committers, drafting, policy, lookup, SpeculationStats(target_forwards=1),
                        generation_config, streamer, input_ids.shape[1], start_time, input_ids.device,
                        StepClock(input_ids.device))
    with verifier:
        _prefill(call, input_ids, valid, model_kwargs.get("attention_mask"))
        step_end = call.clock.stamp()
        while call.drop_finished():
            step_end = _step(call, step_end)
        _record_timed_steps(call, wait=True)
        policy.keep_measurements()  # where the next call on this drafter and target starts
        if static:
            drafting.keep_static()
        return _finish(call)


def _rows(input_ids, logits_processor, stopping_criteria, generation_config, streamer, sampling):
    """The batch's rows and their committers (one `TokenStore` for all)."""
    rows = input_ids.shape[0]
    store = TokenStore(input_ids, generation_config.max_length)
    committers = [RowCommitter(store, r, row_processors(logits_processor, [r], rows), stopping_criteria,
                               generation_config, streamer, generation_config.max_length) for r in range(rows)]
    # plain generate pads stopped rows only when an EOS criterion exists; otherwise it generates them on
    pads_stopped_rows = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    return BatchState(committers, pads_stopped_rows, logits_processor, sampling), committers


def _prefill(call: DecodingCall, input_ids, valid: torch.Tensor, attention_mask) -> None:
    """The prompts' forward, then the first token of every row (drafting needs an anchor). Positions as generate
    derives them from the mask (masked slots at 0), and new tokens continue from the last prompt position, as
    generate's do: both matter for a prompt that ends in a masked token (right padding)."""
    batch, verifier = call.batch, call.verifier
    positions = (valid.long().cumsum(-1) - 1).masked_fill_(~valid, 0)
    out = verifier.prefill(input_ids, attention_mask, positions, valid)
    batch.start(valid, positions[:, -1] + 1 - valid.sum(-1))
    call.drafting.add_context(out.hidden_states, slice(None), positions, valid, all_valid=verifier.all_valid)
    batch.anchors = [0] * input_ids.shape[0]

    row_ends = [p + d for p, d in zip(batch.root_positions, batch.max_drafts())]

    def draft_first(outcome):  # the first step's drafting pass, its reads riding on the first tokens' read
        call.ahead = call.drafting.draft_ahead(outcome.anchors, batch.root_position_tensor, row_ends)
        return call.ahead.read

    first = draft_first if _drafts_ahead(call, batch.root_positions) else None
    batch.accept([CandidateTree([0], [-1])] * input_ids.shape[0], out.logits[:, -1:], before_read=first)
    if call.ahead is not None:
        if batch.accepted is None:  # the first tokens were chosen token by token: the pass saw no outcome
            call.ahead = None
        else:
            call.drafting.keep_ahead(call.ahead, batch.read_along)
    call.stats.prefill_time_s = device_time(call.device) - call.start_time


def reads_wait(device: torch.device) -> bool:
    """Whether the host waits for `device` when it reads a tensor: everywhere but on the CPU, where the host runs
    every op as it is called (`HF_DIFFSPEC_DRAFT_AHEAD=1` / `0` says so instead, for tests and comparisons)."""
    forced = os.environ.get("HF_DIFFSPEC_DRAFT_AHEAD")
    return forced == "1" if forced in ("0", "1") else device.type != "cpu"


def _drafts_ahead(call: DecodingCall, root_positions: list[int]) -> bool:
    """Whether this step runs the next step's drafting pass before its read (`drafting.draft_ahead`): where a read
    waits for the device (on a CPU the second read is free, and a pass the next step does not use is not), when the
    controller expects the next step to draft, the method drafts in one pass, and some row will have room for drafts
    next (each commits a token at least, within its length and the context)."""
    batch = call.batch
    if not (reads_wait(call.device) and call.policy.control.expects_draft(len(batch.active))
            and call.drafting.can_draft_ahead(len(batch.active))):
        return False
    return max(call.policy.depth_limits([p + 1 for p in root_positions], [d - 1 for d in batch.max_drafts()])) > 0


def _step(call: DecodingCall, step_start):
    """One loop step (see the module docstring), from stamp `step_start` (the previous step's end); returns its
    end's. It never waits for the device but in `batch.accept`'s one read of the outcome."""
    batch, policy, verifier, device = call.batch, call.policy, call.verifier, call.device
    rows, root_positions = len(batch.active), batch.root_positions  # host values: no device read
    found = call.lookup.propose(batch, root_positions, policy)  # as deep as each row may verify
    ngrams, lengths = found.ngrams or [0] * rows, found.lengths or [0] * rows
    kind, lookup_depth = policy.control.decide(rows, ngrams, lengths)
    ahead, call.ahead = call.ahead, None
    call.stats.unused_drafting_passes += ahead is not None and kind is not StepKind.DRAFT
    draft_start = call.clock.stamp() if kind is StepKind.DRAFT else None
    if kind is StepKind.DRAFT:
        trees = call.drafting.propose(batch.anchors, root_positions, batch.max_drafts(), ahead)
    else:  # no drafter forward: the anchors alone (a plain decode step), or with their lookup drafts
        trees = [CandidateTree([anchor], [-1], device=device) for anchor in batch.anchors]
    lookups = found.truncated(lookup_depth) if kind is not StepKind.PLAIN else NO_LOOKUP_DRAFTS
    trees = lookups.graft(trees)

    verify_start = call.clock.stamp()  # the drafter's forward is the draft's time
    out, layout = verifier.forward(trees, batch.root_position_tensor)
    # a drafter step drafts the next step before reading its own outcome, its reads riding on this one
    drafts_ahead = kind is StepKind.DRAFT and _drafts_ahead(call, root_positions)

    def draft_next(outcome):  # the drafter's context: every slot of the accepted paths, those past a row's count hidden
        levels = index_range(outcome.committed.shape[1], device)
        index = slice(0, len(levels)) if outcome.path_nodes is None else outcome.path_nodes
        row_ends = [p + d for p, d in zip(root_positions, batch.max_drafts())]
        call.ahead = call.drafting.draft_ahead(
            outcome.anchors, batch.root_position_tensor + outcome.count, row_ends,
            (out.hidden_states, index, batch.root_position_tensor[:, None] + levels, levels < outcome.count[:, None]))
        return call.ahead.read

    paths = batch.accept(trees, out.logits, layout, draft_next if drafts_ahead else None)  # the step's one read
    if call.ahead is not None and batch.accepted is None:  # accepted token by token: the pass saw no outcome
        call.drafting.keep_ahead(call.ahead, None)
        call.ahead = None
    if found.ngram:  # every row's lookup drafts against what it committed (on the host), whatever was verified
        policy.control.observe_lookups(ngrams, found.drafts, [ids[len(ids) - len(p):].tolist()
                                                              for ids, p in zip(batch.histories(), paths)])
    kept = verifier.keep(paths, batch.accepted, batch.next_slots)
    if call.ahead is not None:  # the pass cached every slot of the accepted paths: the longest path's are kept
        call.drafting.keep_ahead(call.ahead, batch.read_along, kept.longest, kept.rows_all_valid)
    else:
        call.drafting.add_context(out.hidden_states, kept.index, batch.root_position_tensor[:, None] + kept.offsets,
                                  kept.accepted, all_valid=kept.rows_all_valid)
    batch.advance(kept.counts)

    step_end = call.clock.stamp()  # after keep and the replay: their device time is this step's
    step = StepRecord(kind, rows, found.ngram, committed=sum(len(p) for p in paths), seconds=0.0,
                      slots=verifier.slots, verify_seconds=0.0)  # the times once read
    call.stats.add_step(step, trees, paths, lookups.num_tokens, batch.active)
    # a tree built from a pass run ahead was drafted in the last step's span: that pass's span is its drafting time
    draft_span = ahead.span if ahead is not None and draft_start is not None else (draft_start, verify_start)
    call.timing.append((step, ngrams, [len(p) - 1 for p in paths], (step_start, draft_span, verify_start, step_end)))
    if _record_timed_steps(call):  # the profile was measured again: those seconds are no step's
        step_end = call.clock.stamp()
    return step_end


def _record_timed_steps(call: DecodingCall, wait: bool = False) -> bool:
    """Hand the controller and the cost model, in order, every step whose end the device has run, with its times: on
    the CPU the step just ended, on a GPU at the latest one step late (`device_clock.StepClock`); with `wait`, all
    of them after waiting for the device (a call's end). True when the profile was measured again meanwhile."""
    if wait and call.timing:
        device_time(call.device)  # waits for the device
    call.drafting.record_draft_times()
    measured = False
    while call.timing:
        step, ngrams, accepted, (start, draft_span, verify_start, end) = call.timing[0]
        seconds = call.clock.seconds(start, end)
        if seconds is None:
            break
        call.timing.pop(0)
        drafting = call.clock.seconds(*draft_span) if draft_span[0] is not None else 0.0
        step = replace(step, seconds=seconds, verify_seconds=call.clock.seconds(verify_start, end),
                       draft_seconds=drafting)
        # the cost model first: the controller charges the step and credits what it committed at the same prices
        measured |= call.policy.record_step(step)
        call.policy.control.record(step, ngrams, accepted)
        call.stats.add_time(step)
    return measured


def _finish(call: DecodingCall):
    """After the loop: the sequences (padded as plain generate pads them), the statistics, and what
    `return_dict_in_generate` asks for."""
    config, stats, batch = call.generation_config, call.stats, call.batch
    if call.streamer is not None:
        call.streamer.end()
    cache = call.verifier.finish(batch.next_slots)  # the returned cache holds no hidden tree nodes
    sequences = batch.sequences(pad_token_id(config))
    for row, tokens in batch.cut_tokens.items():
        stats.cut_back(row, tokens)
    stats.new_tokens = sum(c.length - call.prompt_length for c in call.committers)
    stats.linear_state_replays = call.verifier.recurrent.replays
    stats.total_time_s = device_time(sequences.device) - call.start_time
    if not config.return_dict_in_generate:
        return sequences
    only = call.committers[0]
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(only.scores) if config.output_scores else None,
        logits=tuple(only.raw_logits) if config.output_logits else None,
        cache=cache if config.use_cache else None,
        speculation_stats=stats,
    )
