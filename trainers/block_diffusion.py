"""Block-diffusion distillation of a drafter from a frozen target (the DFlash recipe), as a `transformers.Trainer`.

Per sequence, random anchors on response tokens each start a block `[anchor, MASK x (block_size-1)]` at positions
anchor..anchor+block_size-1. All blocks of a batch run in ONE drafter forward: every block attends to the target
features of the context strictly before its anchor (what inference has: the anchor's own features are not known yet),
to itself bidirectionally, and to no other block. A sequence's blocks run in rows of `blocks_per_row` blocks that
share its context (projected once per sequence): a query scans the context and its row's blocks, not all of the
sequence's, so the attention grows linearly with the anchors per sequence instead of quadratically. Slot k predicts
what the target itself would emit k positions after the anchor (its argmax on the sequence), with cross-entropy
weighted by exp(-(k-1)/decay). A drafter with a reduced draft vocabulary (`config.draft_vocab_size`) is trained over
its V' logits only, and slots whose label lies outside it are left out of the loss: it can never draft them, and
skipping the other rows of the LM head is the saving. The LM head runs on supervised slots only (not on those
beyond `loss_depth`).

The target lives on the trainer (frozen, never optimised, never saved); features and labels come from one target
forward per batch, computed on the fly. Subclasses change the loss (`block_loss`: reverse KL for AdaFlash's OPD),
the block contents (`prefix_lengths`: D²SD's VP drafter) or what is trained (the length head), and share everything
else. Each Trainer reads its own fields from its configuration class (`configs.py`).

Under DDP or FSDP (`torchrun`, `accelerate launch`) everything a loss trains runs inside the wrapped model's forward
(`run_as_forward`: the length head and the selector too), losses are normalised over the whole batch of every process
(`batch_sum`), the time budget follows the main process's clock, and the collator seeds its anchors per process and
per dataloader worker. Every process holds its own full copy of the frozen target (not sharded, also under FSDP).
"""

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import get_worker_info
from transformers import Trainer, TrainerCallback, TrainingArguments

from .configs import DrafterTrainingArguments, LengthHeadConfig, ReverseKLConfig, VariablePrefixConfig
from .continuation import WarmupCosine

LOGITS_CHUNK = 8192


def default_loss_decay(block_size: int) -> float:
    """DFlash: 7 for blocks of 16, 5 for 10, 4 for 8; in between, about 0.45 x block size."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, round(0.45 * block_size, 1)))


@dataclass
class BlockForward:
    """What one drafter forward over all blocks of a batch gives the losses: hidden states (B, n, size, H); the
    target's token at each slot (B, n, size); the slots to learn; prefix lengths; slot positions; target logits."""

    hidden: torch.Tensor
    labels: torch.Tensor
    selected: torch.Tensor
    prefix: torch.Tensor
    slot_positions: torch.Tensor
    target_logits: torch.Tensor


class BlockDiffusionCollator:
    """Right-pads sequences and samples `num_anchors` anchors per sequence (fresh each time: re-sampled per epoch).

    An anchor `a` is valid when tokens a and a+1 are both response tokens. Rows with fewer valid anchors get padding
    anchors with `anchor_mask` False.

    The anchors' generator is seeded by `seed`, the process (`process_index` under DDP/FSDP) and, in a dataloader
    worker, the worker's seed, which torch draws anew for every worker and every epoch: each process and worker draws
    its own anchors (a generator copied into the workers would repeat the same ones in all of them).
    """

    def __init__(self, pad_token_id: int, num_anchors: int = 64, seed: int | None = None, process_index: int = 0):
        self.pad_token_id = pad_token_id
        self.num_anchors = num_anchors
        self.seed, self.process_index = seed, process_index
        self._rng, self._rng_worker_seed = None, None

    @property
    def rng(self) -> random.Random:
        worker = get_worker_info()
        worker_seed = None if worker is None else worker.seed
        if self._rng is None or worker_seed != self._rng_worker_seed:
            self._rng_worker_seed = worker_seed
            self._rng = random.Random(None if self.seed is None else f"{self.seed}/{self.process_index}/{worker_seed}")
        return self._rng

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        batch = len(features)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        loss_mask = torch.zeros((batch, width), dtype=torch.bool)
        anchors = torch.zeros((batch, self.num_anchors), dtype=torch.long)
        anchor_mask = torch.zeros((batch, self.num_anchors), dtype=torch.bool)
        for row, f in enumerate(features):
            ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
            n, start = len(ids), int(f["prompt_length"])
            input_ids[row, :n] = ids
            attention_mask[row, :n] = 1
            loss_mask[row, start:n] = True
            candidates = list(range(start, n - 1))
            picked = sorted(self.rng.sample(candidates, min(self.num_anchors, len(candidates))))
            anchors[row, : len(picked)] = torch.tensor(picked, dtype=torch.long)
            anchor_mask[row, : len(picked)] = True
        batch_dict = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                      "anchors": anchors, "anchor_mask": anchor_mask}
        if "target_features" in features[0]:  # cached by `hf-diffspec data features`: the step runs no target
            cached = [f["target_features"] for f in features]
            batch_dict["target_features"] = cached[0].new_zeros((batch, width, cached[0].shape[-1]))
            batch_dict["target_argmax"] = torch.zeros((batch, width), dtype=torch.long)
            for row, f in enumerate(features):
                batch_dict["target_features"][row, : len(f["target_features"])] = f["target_features"]
                batch_dict["target_argmax"][row, : len(f["target_argmax"])] = f["target_argmax"]
        return batch_dict


def block_attention_mask(anchors, attention_mask, block_size: int, dtype) -> torch.Tensor:
    """(rows, 1, n*block, seq + n*block) additive mask of rows of n blocks (`anchors` (rows, n)) over [context ;
    the row's blocks]: the context before each block's anchor and the block itself, nothing else."""
    batch, n = anchors.shape
    seq = attention_mask.shape[1]
    device = anchors.device
    context = torch.arange(seq, device=device)[None, None, :] < anchors[:, :, None]       # (B, n, seq)
    context &= attention_mask.bool()[:, None, :]
    context = context[:, :, None, :].expand(batch, n, block_size, seq).reshape(batch, n * block_size, seq)
    block_ids = torch.arange(n * block_size, device=device) // block_size
    own_block = (block_ids[:, None] == block_ids[None, :])[None].expand(batch, -1, -1)
    allowed = torch.cat([context, own_block], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def run_as_forward(model, accelerator, fn, *args):
    """`fn(forward, *args)` run as the forward of `model`'s own module, inside every wrapper around it (DDP, FSDP,
    DeepSpeed), with `forward` the module's own forward (and the autocast accelerate may have given it). Parameters
    that `fn` uses outside that forward (the length head, the selector) are then gathered for it like the forward's,
    and their gradients are synchronised with the others'."""
    module = accelerator.unwrap_model(model)
    patched = module.__dict__.get("forward")  # accelerate's mixed-precision wrapper, when it set one
    forward = module.forward
    module.forward = lambda *inputs: fn(forward, *inputs)
    try:
        return model(*args)
    finally:
        if patched is None:
            del module.forward
        else:
            module.forward = patched


def as_config(args: TrainingArguments | None, config_class: type[DrafterTrainingArguments]):
    """`args` as `config_class` (plain `TrainingArguments` keep their values and get the class's own defaults)."""
    if isinstance(args, config_class):
        return args
    if args is None:
        return config_class()
    values = {f.name: getattr(args, f.name) for f in fields(TrainingArguments) if f.init}
    return config_class(**values)


class BlockDiffusionTrainer(Trainer):
    """Distils a `DiffusionDrafter` from a frozen target with block-diffusion training.

    Args (beyond `Trainer`'s):
        args: a `DrafterTrainingArguments` (block loss decay, time budget; a plain `TrainingArguments` gets their
            defaults). `remove_unused_columns` is forced to False (the collator's columns are not forward arguments).
        target: the frozen target model (teacher and feature source); moved to the training device. Under DDP or
            FSDP every process holds its own whole copy (never sharded).

    With a reduced draft vocabulary (`drafter.config.draft_vocab_size`), the cross-entropy runs over the V' logits
    of the drafter's vocabulary, and slots whose label (the target's token) lies outside it are ignored in the loss
    (the drafter can never propose them); they still count as misses in the logged `train_tau`/`draft_accuracy`.
    """

    config_class = DrafterTrainingArguments
    loss_is_scaled_for_ga = False

    def __init__(self, model=None, args: TrainingArguments | None = None, *trainer_args, target=None, **kwargs):
        if target is None:
            raise ValueError(f"{type(self).__name__} needs the frozen target: pass target=...")
        args = as_config(args, self.config_class)
        args.remove_unused_columns = False
        super().__init__(model, args, *trainer_args, **kwargs)
        self.target = target.to(self.args.device).eval().requires_grad_(False)
        drafter = self.drafter
        drafter.bind_target(self.target)
        self.block_size = drafter.config.block_size
        self.loss_decay = self.args.loss_decay or default_loss_decay(self.block_size)
        self._metrics = defaultdict(list)
        self.time_budget = None
        if self.args.time_budget_minutes:
            self.time_budget = TimeBudget(self.args.time_budget_minutes * 60)
            self.add_callback(self.time_budget)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # training tokens seen (every process's), for held-out tau against training tokens: transformers counts
        # `main_input_name`, which a drafter's forward does not take; kept in the trainer state, so a resumed run
        # counts on
        tokens = inputs["attention_mask"].sum()
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum())
        return super().training_step(model, inputs, num_items_in_batch)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """With a time budget, warmup + cosine follow the fraction of the budget spent instead of the step count;
        with `schedule_steps`, one warmup + cosine over that many steps, kept by every resumed run (the budget then
        only stops each run)."""
        if self.time_budget:
            self.time_budget.start()
        if self.args.schedule_steps:
            schedule = WarmupCosine(self.args.schedule_steps, self.args.get_warmup_steps(self.args.schedule_steps),
                                    start=self.args.schedule_start)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, schedule)
            return self.lr_scheduler
        if not self.time_budget:
            return super().create_scheduler(num_training_steps, optimizer)
        warmup = self.args.warmup_steps if 0 < self.args.warmup_steps < 1 else 0.04

        def factor(_step):
            frac = min(1.0, self.time_budget.spent)
            if frac < warmup:
                return max(frac / warmup, 1e-3)
            return 0.5 * (1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))

        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
        return self.lr_scheduler

    @property
    def drafter(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    # ----- what subclasses change ----------------------------------------------------------------------------------
    def prefix_lengths(self, anchors: torch.Tensor) -> torch.Tensor:
        """Real tokens after the anchor inside each block (0 for DFlash; the VP trainer samples them)."""
        return torch.zeros_like(anchors)

    def block_loss(self, logits, labels, weights, target_logits_fn):
        """Weighted mean cross-entropy over the selected slots (of the whole batch: `batch_sum`). `target_logits_fn()`
        gives the target's logits there (unused here; the reverse-KL trainer needs them). With a reduced draft
        vocabulary, `logits`, `labels` and the target's logits are all over its V' columns, and only slots whose label
        lies inside it are passed."""
        ce = F.cross_entropy(logits.float(), labels, reduction="none")
        return (weights * ce).sum() / self.batch_sum(weights).clamp(min=1e-6)

    def batch_sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values.sum()` over the whole batch, every process's share of it (no gradient): what losses divide by. Each
        process divides its own sum by it and `compute_loss` multiplies by the number of processes whose gradients
        are averaged, so N processes train as one would on their batches together."""
        total = values.detach().sum()
        return self.accelerator.reduce(total, "sum") if self.accelerator.num_processes > 1 else total

    # ----- the shared machinery ------------------------------------------------------------------------------------
    def block_forward(self, forward, inputs) -> "BlockForward":
        """One drafter `forward` over every block of the batch (the DFlash mask), with the target's labels."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        anchors, anchor_mask, loss_mask = inputs["anchors"], inputs["anchor_mask"], inputs["loss_mask"]
        batch, seq = input_ids.shape
        n, size = anchors.shape[1], self.block_size
        drafter = self.drafter

        features, argmax, target_logits = self.target_outputs(inputs)
        labels_at = torch.zeros_like(input_ids)
        labels_at[:, 1:] = argmax[:, :-1]  # what the target emits at each position

        offsets = torch.arange(size, device=input_ids.device)
        # a block's positions and contents past its own row's end (rows are right-padded) are the same however wide
        # the batch is padded: a process's share of a batch trains as that batch does
        block_positions = anchors[:, :, None] + offsets                                     # (B, n, size)
        in_range = block_positions < attention_mask.sum(1)[:, None, None]
        slot_positions = block_positions.clamp(max=seq - 1)                                 # for gathers only
        prefix = self.prefix_lengths(anchors)                                                # (B, n)
        is_real = offsets[None, None, :] <= prefix[:, :, None]                              # anchor + prefix tokens
        block_tokens = torch.where(is_real & in_range, input_ids.gather(1, slot_positions.flatten(1)).view_as(slot_positions), 0)
        # rows of `per_row` blocks, each row with the context of its sequence (the last row padded with blocks at 0)
        per_row = min(self.args.blocks_per_row or n, n)
        rows = -(-n // per_row)

        def in_rows(blocks):  # (B, n, ...) -> (B * rows, per_row, ...)
            padding = blocks.new_zeros((batch, rows * per_row - n, *blocks.shape[2:]))
            return torch.cat([blocks, padding], 1).view(batch * rows, per_row, *blocks.shape[2:])

        embed = self.target.get_input_embeddings()
        noise = embed(in_rows(block_tokens).flatten(1))                                      # (B*rows, per_row*size, H)
        context_positions = torch.arange(seq, device=input_ids.device).expand(batch * rows, -1)
        positions = torch.cat([context_positions, in_rows(block_positions).flatten(1)], 1)
        mask = block_attention_mask(in_rows(anchors), attention_mask.repeat_interleave(rows, 0), size, noise.dtype)
        hidden = forward(
            noise_embeds=noise, context_hidden_states=features, position_ids=positions, attention_mask=mask,
            mask_positions=~in_rows(is_real).flatten(1),
        ).last_hidden_state.view(batch, rows * per_row, size, -1)[:, :n]

        # slots to learn: after the prefix, inside the sequence, on response tokens, of real anchors
        slot_loss_mask = loss_mask.gather(1, slot_positions.flatten(1)).view_as(slot_positions)
        selected = (~is_real) & in_range & slot_loss_mask & anchor_mask[:, :, None]
        if self.args.target_consistent_labels:
            selected &= self.consistent_with_target(input_ids, labels_at, slot_positions, is_real | ~in_range)
        labels = labels_at.gather(1, slot_positions.flatten(1)).view_as(slot_positions)
        return BlockForward(hidden, labels, selected, prefix, slot_positions, target_logits)

    @torch.no_grad()
    def target_outputs(self, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target's features at the drafter's layers, its argmax and its logits at every position: from the
        batch when the data carry them cached (`--cached-features`: no logits then), else from one target forward."""
        if "target_features" in inputs:
            return inputs["target_features"].to(self.target.dtype), inputs["target_argmax"], None
        out = self.target(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                          output_hidden_states=self.drafter.target_feature_layers)
        # the logits are kept for subclasses that need the target's distributions, not just its argmax
        return self.drafter.gather_target_features(out.hidden_states), out.logits.argmax(-1), out.logits

    @staticmethod
    def consistent_with_target(input_ids, labels_at, slot_positions, given) -> torch.Tensor:
        """(B, n, size) True where every token between the anchor (and its `given` real prefix) and the slot is the
        target's own greedy choice, so that the slot's label is what greedy verification from the anchor accepts."""
        agrees = (input_ids == labels_at).gather(1, slot_positions.flatten(1)).view_as(slot_positions) | given
        consistent = torch.ones_like(agrees)
        consistent[..., 1:] = torch.cumprod(agrees[..., :-1].long(), -1).bool()
        return consistent

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = run_as_forward(model, self.accelerator, self.drafter_loss, inputs)
        # each process's loss is its share of the whole batch's (`batch_sum`), and the gradients are averaged
        loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def drafter_loss(self, forward, inputs) -> tuple[torch.Tensor, dict]:
        """The loss of a batch and the outputs `compute_loss` returns; runs as the wrapped drafter's forward
        (`run_as_forward`), `forward` being the drafter's own."""
        blocks = self.block_forward(forward, inputs)
        hidden, selected, prefix, slot_positions = blocks.hidden, blocks.selected, blocks.prefix, blocks.slot_positions
        offsets = torch.arange(self.block_size, device=hidden.device)
        k_after_prefix = (offsets[None, None, :] - prefix[:, :, None]).clamp(min=1).float()
        if self.args.loss_depth:  # deeper slots, which acceptance rarely reaches, cost the LM head and teach little
            selected = selected & (k_after_prefix <= self.args.loss_depth)
        weights_all = torch.exp(-(k_after_prefix - 1) / self.loss_decay)

        # logits over the drafter's vocabulary: V' columns (target ids `vocab_ids`) with a reduced one, else all V
        logits, vocab_ids = self.draft_vocab_logits(hidden[selected])
        labels = blocks.labels[selected]
        drafts = logits.detach().argmax(-1)
        learnable = torch.ones_like(labels, dtype=torch.bool)
        if vocab_ids is not None:
            drafts = vocab_ids[drafts]
            columns = torch.searchsorted(vocab_ids, labels).clamp(max=len(vocab_ids) - 1)
            learnable = vocab_ids[columns] == labels  # a label outside the draft vocabulary is left out of the loss
            labels = columns

        def target_logits_fn():
            rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None, None].expand_as(slot_positions)[selected]
            # the target's distribution for the token at position p is its output at p - 1
            target_logits = blocks.target_logits[rows, slot_positions[selected] - 1][learnable]
            # over V' columns a reverse KL keeps its gradient: it changes by log p_T(V'), a constant per slot
            return target_logits if vocab_ids is None else target_logits[:, vocab_ids]

        weights = weights_all[selected][learnable]
        loss = self.block_loss(logits[learnable], labels[learnable], weights, target_logits_fn)
        if getattr(self.drafter, "selector", None) is not None:
            # the token before each slot (an anchor at position 0 has none; it is never a selected slot)
            before = (slot_positions - 1).clamp(min=0)
            previous = inputs["input_ids"].gather(1, before.flatten(1)).view_as(slot_positions)
            loss = loss + self.selector_loss(hidden[selected][learnable], previous[selected][learnable],
                                             logits[learnable], labels[learnable], vocab_ids, weights)
        self._record_metrics(drafts, blocks.labels, selected, prefix)
        return loss, {"hidden": hidden}

    def selector_loss(self, hidden, previous, logits, labels, vocab_ids, weights) -> torch.Tensor:
        """DFlash 2's selector loss: a k-way cross-entropy of S(previous token, .) over the slot's top-k candidates,
        with the previous token the text's own (teacher forcing) and the label put in place of the k-th candidate
        when it is not among them. `logits`/`labels` are over the draft vocabulary (columns `vocab_ids`, or all)."""
        k = min(self.drafter.config.selector_top_k, logits.shape[-1])
        candidates = logits.detach().topk(k, dim=-1).indices
        hit = candidates == labels[:, None]
        candidates[:, -1] = torch.where(hit.any(-1), candidates[:, -1], labels)
        gold = (candidates == labels[:, None]).float().argmax(-1)
        ids = candidates if vocab_ids is None else vocab_ids[candidates]
        scores = self.drafter.selector(hidden, previous, ids, logits.gather(-1, candidates))
        weighted = weights * F.cross_entropy(scores, gold, reduction="none")
        if len(weighted):
            self._metrics["selector_loss"].append(float(weighted.detach().sum() / weights.sum().clamp(min=1e-6)))
            # teacher-forced: how often the selector's pick is the label (draft_accuracy is the drafter's argmax)
            self._metrics["selector_accuracy"].append(float((scores.detach().argmax(-1) == gold).float().mean()))
        return weighted.sum() / self.batch_sum(weights).clamp(min=1e-6)

    def draft_vocab_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, width) logits of `hidden` (rows, H) over the drafter's draft vocabulary in chunks, and the target
        ids of the columns (`None`: the full vocabulary)."""
        chunks = [self.drafter.compute_draft_vocab_logits(c) for c in hidden.split(LOGITS_CHUNK)]  # >= 1 chunk
        return torch.cat([logits for logits, _ in chunks]), chunks[0][1]

    @torch.no_grad()
    def _record_metrics(self, drafts, labels, selected, prefix):
        """`drafts`: the drafter's argmax target id at each selected slot."""
        if drafts.shape[0] == 0:
            return
        correct = torch.zeros(selected.shape, dtype=torch.bool, device=selected.device)
        correct[selected] = drafts == labels[selected]
        # tokens per target forward if each block's drafts were verified left to right (anchor/prefix slots pass)
        passes = torch.where(torch.arange(correct.shape[-1], device=correct.device) <= prefix[..., None], True, correct)
        blocks = selected.any(-1)
        self._metrics["train_tau"].append(float(torch.cumprod(passes.long(), -1)[blocks].sum(-1).float().mean()))
        self._metrics["draft_accuracy"].append(float(correct[selected].float().mean()))

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The logged metrics are means over every process's steps: Trainer calls `log` on all processes alike."""
        shares = [{key: (sum(values), len(values)) for key, values in self._metrics.items() if values}]
        self._metrics.clear()
        totals = defaultdict(lambda: [0.0, 0])
        for share in gather_object(shares):
            for key, (total, count) in share.items():
                totals[key][0] += total
                totals[key][1] += count
        logs.update({key: round(total / count, 4) for key, (total, count) in totals.items()})
        super().log(logs, *args, **kwargs)


class LengthHeadTrainer(BlockDiffusionTrainer):
    """Trains the drafter's length (acceptance) head with everything else frozen.

    Labels come from the drafter's own argmax drafts against the target: in each block, draft k is accepted when it
    equals the target's token at that position (its argmax given the true prefix, i.e. the trajectory when the data
    are the target's own generations). The head is trained, with binary cross-entropy, on every slot whose earlier
    drafts were all accepted: it learns P(accept k | accepted 1..k-1), whose running products are the reach
    probabilities the cost model uses. Logged next to it: the same loss for the drafter's raw confidence as the
    prediction (the baseline the head must beat).
    """

    config_class = LengthHeadConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        drafter = self.drafter
        if drafter.length_head is None:
            raise ValueError("the drafter has no length head: call drafter.add_length_head() before training it")
        drafter.requires_grad_(False)
        drafter.length_head.requires_grad_(True)

    def drafter_loss(self, forward, inputs) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            blocks = self.block_forward(forward, inputs)
            draft_hidden = blocks.hidden[:, :, 1:].flatten(0, 1)                      # (blocks, size-1, H)
            ok = blocks.selected[:, :, 1:].flatten(0, 1)
            labels = blocks.labels[:, :, 1:].flatten(0, 1)
            drafts, confidences = [], []
            for chunk in draft_hidden.split(max(1, LOGITS_CHUNK // draft_hidden.shape[1])):
                # the drafts inference would make: over the drafter's own (possibly reduced) vocabulary
                logits, vocab_ids = self.drafter.compute_draft_vocab_logits(chunk)
                top = logits.float().softmax(-1).max(-1)
                confidences.append(top.values)
                drafts.append(top.indices if vocab_ids is None else vocab_ids[top.indices])
            drafts, confidences = torch.cat(drafts), torch.cat(confidences)
            accepted = (drafts == labels) & ok
            # slot k is a training example when the block reached it: every earlier draft accepted, k itself valid
            reached = torch.cumprod(torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], 1).long(), 1).bool()
            use = reached & ok
        logits = self.drafter.length_head(draft_hidden)
        target = accepted[use].float()
        bce = F.binary_cross_entropy_with_logits(logits[use].float(), target, reduction="sum")
        if use.any():
            with torch.no_grad():  # the baseline: the drafter's own confidence as the acceptance probability
                baseline = F.binary_cross_entropy(confidences[use].clamp(1e-6, 1 - 1e-6), target)
                self._metrics["confidence_bce"].append(float(baseline))
                self._metrics["acceptance_rate"].append(float(target.mean()))
                self._metrics["predicted_rate"].append(float(logits[use].float().sigmoid().mean()))
        return bce / self.batch_sum(use.float()).clamp(min=1), {"logits": logits}


class VariablePrefixTrainer(BlockDiffusionTrainer):
    """Trains D²SD's variable-prefix (VP) drafter: each block starts with the anchor plus `l` real tokens,
    Pr(l) ∝ beta^l with at least one MASK slot left, and only slots after the prefix are learned (weights
    exp(-(k-l-1)/decay) via the shared loss). At inference the prefix is the first drafter's accepted-looking drafts."""

    config_class = VariablePrefixConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        beta = self.args.prefix_beta
        lengths = torch.arange(self.block_size - 1, dtype=torch.float)
        self.prefix_probs = beta**lengths / (beta**lengths).sum()

    def prefix_lengths(self, anchors: torch.Tensor) -> torch.Tensor:
        draws = torch.multinomial(self.prefix_probs, anchors.numel(), replacement=True)
        return draws.view_as(anchors).to(anchors.device)


class ReverseKLTrainer(BlockDiffusionTrainer):
    """AdaFlash's loss per block slot (anchor excluded, weights w_k = exp(-(k-1)/decay), N = sum of weights):

        alpha * sum_i w_i CE_i / N  +  (1 - alpha) * sum_i w_i min(KL_i(p_S || p_T) / N, clip)

    with the reverse KL computed exactly over the vocabulary at temperature T (times T^2), p_T the target's own
    next-token distribution at that position of the trajectory. `alpha`, `kl_clip` and `temperature` come from
    `ReverseKLConfig`.
    """

    config_class = ReverseKLConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.alpha, self.kl_clip, self.temperature = self.args.alpha, self.args.kl_clip, self.args.temperature

    def block_loss(self, logits, labels, weights, target_logits_fn):
        ce = super().block_loss(logits, labels, weights, target_logits_fn)
        kl = reverse_kl(logits, target_logits_fn(), self.temperature)
        if len(kl):
            self._metrics["reverse_kl"].append(float((weights * kl).sum().detach() / weights.sum().clamp(min=1e-6)))
        total = self.batch_sum(weights).clamp(min=1e-6)
        # the clip applies per position, to that position's share of the mean (AdaFlash's reference code)
        return self.alpha * ce + (1 - self.alpha) * (weights * torch.clamp(kl / total, max=self.kl_clip)).sum()


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_S || p_T) per row, exact over the vocabulary, scaled by T^2."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1) * temperature**2


class TimeBudget(TrainerCallback):
    """`--time-budget`: the fraction of the budget `spent`, read on the main process's clock after every optimizer
    step and broadcast to every process, which all follow it: the same learning rate (the trainer's warmup + cosine
    over it) and a stop at the same step. A process stopping on its own clock would leave the others waiting in a
    collective."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started, self.spent = None, 0.0

    def start(self) -> None:
        self.started, self.spent = time.perf_counter(), 0.0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.spent = broadcast_object_list([(time.perf_counter() - self.started) / self.seconds])[0]

    def on_step_end(self, args, state, control, **kwargs):
        if self.spent >= 1:
            control.should_training_stop = True
            control.should_save = True


def loss_curve_summary(history: list[dict]) -> dict:
    """Loss curve summary for model cards: first, last, min logged loss and the last train_tau."""
    losses = [h["loss"] for h in history if "loss" in h]
    taus = [h["train_tau"] for h in history if "train_tau" in h]
    if not losses:
        return {}
    return {"first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4), "min_loss": round(min(losses), 4),
            "logged_points": len(losses), "last_train_tau": taus[-1] if taus else math.nan}
