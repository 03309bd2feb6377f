"""The offline acceptance length: drafter quality without decoding (SpecForge's "simulated acceptance length").

On held-out sequences that the target wrote itself (greedy), every response position is an anchor. At each one the
drafter drafts one block `[anchor, MASK x (block_size-1)]` conditioned on the target's features of the context strictly
before the anchor, which is exactly what a `dflash-block` decode step sees there, and its drafts are compared with
the target's own continuation. All blocks of a sequence run in one forward of the training step
(`BlockDiffusionTrainer.block_forward`), so this measures what training optimises.

Per anchor `a` of a sequence of n tokens, with L the number of leading drafts equal to the target's tokens:
`tau(a) = min(1 + L, n - 1 - a)`, the tokens a decode step from that anchor commits (the bonus token included, cut
where the sequence ends, as `max_new_tokens` or EOS cut a decode). A slot is judged only while the text from the
anchor to it is the target's own greedy choice; after the first place where it is not (bf16 regeneration drifting
from the measuring forward), the target's continuation is unknown and the block stops there (counted in
`unjudged_blocks`). Reported:
- `tau`: mean over all anchors, with its standard error clustered by sequence (anchors of a sequence are correlated);
- `decode_tau`: committed tokens per step over the anchors a `dflash-block` decode visits (the first response token,
  then each anchor plus its tau), which is what `hf-diffspec bench --methods dflash-block` reports on the prompts of
  these sequences; equal to it in fp32 (tested);
- `reach[k]`: the fraction of blocks whose first k drafts are all accepted, and `acceptance[k]`: that of slot k given
  slots 1..k-1 (`reach[k] / reach[k-1]`); per domain as well.
"""

import math
import tempfile

import torch

from hf_diffspec.prompts import DOMAINS, load_prompts

from .block_diffusion import BlockDiffusionTrainer
from .configs import DrafterTrainingArguments
from .data import DrafterDataset, ShardWriter

OFFLINE_ACCEPTANCE_LOG = "offline_acceptance.jsonl"
ANCHORS_PER_FORWARD = 256
DRAFT_ROWS = 64  # blocks whose (rows, slots, vocabulary) logits exist at a time


@torch.no_grad()
def block_drafts(trainer: BlockDiffusionTrainer, model, inputs: dict, blocks=None) -> tuple[torch.Tensor, ...]:
    """One training forward over all blocks of `inputs` (the collator's columns) with `model`, the drafter to measure
    (e.g. a copy in the target's dtype; `trainer` supplies the target and the forward), or `blocks`, that forward's
    output where the caller has it. Returns, per draft slot (batch, anchors, block_size - 1): the greedy draft, the
    target's token there, whether the slot is judged (inside the sequence, and the text from the anchor to it the
    target's own greedy choice, whatever the training configuration's target_consistent_labels says) and whether it
    is inside the sequence."""
    if type(trainer).prefix_lengths is not BlockDiffusionTrainer.prefix_lengths:
        raise ValueError(f"{type(trainer).__name__} drafts after a prefix of real tokens; the offline acceptance "
                         "length measures first (DFlash) drafters, whose blocks are [anchor, MASK...]")
    if blocks is None:
        blocks = trainer.block_forward(model, inputs)
    slot_positions, labels = blocks.slot_positions, blocks.labels
    written = inputs["input_ids"].gather(1, slot_positions.flatten(1)).view_as(slot_positions)
    consistent = torch.ones_like(labels, dtype=torch.bool)
    consistent[..., 2:] = torch.cumprod((written == labels)[..., 1:-1].long(), -1).bool()
    anchor_tokens = inputs["input_ids"].gather(1, inputs["anchors"]).flatten()
    drafts = draft_tokens(model, blocks.hidden[:, :, 1:].flatten(0, 1), anchor_tokens)
    offsets = torch.arange(1, labels.shape[-1], device=labels.device)
    in_sequence = (inputs["anchors"][:, :, None] + offsets) < inputs["attention_mask"].sum(1)[:, None, None]
    in_sequence &= inputs["anchor_mask"][:, :, None]
    return drafts.view_as(labels[..., 1:]), labels[..., 1:], in_sequence & consistent[..., 1:], in_sequence


@torch.no_grad()
def accepted_drafts(trainer: BlockDiffusionTrainer, model, inputs: dict,
                    blocks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, anchors) leading drafts of each block equal to the target's own continuation (`block_drafts`), and
    whether the block was cut short because the text after them is not the target's own choice."""
    drafts, labels, judged, in_sequence = block_drafts(trainer, model, inputs, blocks)
    accepted = torch.cumprod(((drafts == labels) & judged).long(), -1).sum(-1)
    after = accepted.clamp(max=drafts.shape[-1] - 1)[..., None]  # the draft slot that ended the chain
    cut = (in_sequence & ~judged).gather(-1, after)[..., 0] & (accepted < drafts.shape[-1])
    return accepted, cut


def draft_tokens(drafter, draft_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """(blocks, slots) target ids that greedy drafting picks from the draft slots' hidden states (blocks, slots, H):
    the argmax over the drafter's vocabulary, or with a DFlash 2 selector its left-to-right walk from the anchor (as
    inference drafts), in chunks of blocks (never a whole (blocks, slots, vocabulary) tensor)."""
    out = []
    for hidden, anchor in zip(draft_hidden.split(DRAFT_ROWS), anchors.split(DRAFT_ROWS)):
        if getattr(drafter, "selector", None) is not None:
            out.append(drafter.select_drafts(hidden, drafter.compute_logits(hidden), anchor)[0])
            continue
        logits, vocab_ids = drafter.compute_draft_vocab_logits(hidden)
        picks = logits.argmax(-1)
        out.append(picks if vocab_ids is None else vocab_ids[picks])
    return torch.cat(out)


def sequence_inputs(sequence: torch.Tensor, prompt_length: int, anchors: list[int], device) -> dict:
    """The collator's columns for one sequence with the given anchors."""
    n = len(sequence)
    loss_mask = torch.zeros(1, n, dtype=torch.bool)
    loss_mask[0, prompt_length:] = True
    return {"input_ids": sequence[None].to(device), "attention_mask": torch.ones(1, n, dtype=torch.long, device=device),
            "loss_mask": loss_mask.to(device), "anchors": torch.tensor([anchors], device=device),
            "anchor_mask": torch.ones(1, len(anchors), dtype=torch.bool, device=device)}


@torch.no_grad()
def sequence_taus(trainer: BlockDiffusionTrainer, model, sequence: torch.Tensor, prompt_length: int,
                  anchors_per_forward: int = ANCHORS_PER_FORWARD) -> tuple[torch.Tensor, int]:
    """tau(a) for every anchor a = prompt_length .. n-2 of one sequence (1-D, in anchor order), and how many of
    those blocks were cut short where the text stops being the target's own choice."""
    n = len(sequence)
    anchors = list(range(prompt_length, n - 1))
    accepted, cut = [torch.empty(0, dtype=torch.long)], 0
    for start in range(0, len(anchors), anchors_per_forward):
        chunk = anchors[start : start + anchors_per_forward]
        drafts, cut_short = accepted_drafts(trainer, model, sequence_inputs(sequence, prompt_length, chunk,
                                                                             trainer.args.device))
        accepted.append(drafts[0].cpu())
        cut += int(cut_short.sum())
    remaining = n - 1 - torch.tensor(anchors, dtype=torch.long)
    return torch.minimum(1 + torch.cat(accepted), remaining), cut


def decode_walk(taus: torch.Tensor) -> list[int]:
    """The tokens committed per step by a `dflash-block` decode that starts at the first anchor and moves on by each
    step's tau (`taus[i]`: tau at the i-th anchor)."""
    steps, i = [], 0
    while i < len(taus):
        steps.append(int(taus[i]))
        i += int(taus[i])
    return steps


def summarize(per_sequence: list[dict], block_size: int) -> dict:
    """Mean tau with its sequence-clustered standard error, decode tau, reach and per-slot acceptance, for the
    `per_sequence` records ({"taus", "steps", "unjudged"})."""
    taus = torch.cat([r["taus"] for r in per_sequence]).double()
    blocks = len(taus)
    if blocks == 0:
        return {"blocks": 0}
    mean = float(taus.mean())
    # cluster-robust variance of the mean: sum over sequences of (sum of deviations)^2 / N^2
    clustered = sum(float((r["taus"].double() - mean).sum()) ** 2 for r in per_sequence)
    steps = [s for r in per_sequence for s in r["steps"]]
    accepted = taus - 1
    reach = [float((accepted >= k).double().mean()) for k in range(block_size)]
    return {
        "tau": round(mean, 4), "tau_se": round(math.sqrt(clustered) / blocks, 4),
        "decode_tau": round(sum(steps) / len(steps), 4) if steps else None,
        "blocks": blocks, "sequences": len(per_sequence), "decode_steps": len(steps),
        "reach": [round(r, 4) for r in reach[1:]],
        "acceptance": [round(reach[k] / reach[k - 1], 4) if reach[k - 1] else None for k in range(1, block_size)],
        "unjudged_blocks": sum(r["unjudged"] for r in per_sequence),
    }


@torch.no_grad()
def offline_acceptance(trainer: BlockDiffusionTrainer, model, dataset: DrafterDataset,
                       max_sequences: int | None = None, anchors_per_forward: int = ANCHORS_PER_FORWARD) -> dict:
    """The offline acceptance length of `model` (the drafter module, e.g. a copy in the target's dtype) on the
    first `max_sequences` sequences of `dataset` (all by default): the summary over all and per domain, and each
    sequence's decode steps (`committed_per_step`)."""
    block_size = trainer.block_size
    per_sequence = []
    count = len(dataset) if max_sequences is None else min(max_sequences, len(dataset))
    for i in range(count):
        item = dataset[i]
        taus, cut = sequence_taus(trainer, model, item["input_ids"], item["prompt_length"], anchors_per_forward)
        per_sequence.append({"taus": taus, "steps": decode_walk(taus), "domain": item["domain"], "unjudged": cut})
    report = summarize(per_sequence, block_size)
    domains = sorted({r["domain"] for r in per_sequence})
    report["per_domain"] = {d: summarize([r for r in per_sequence if r["domain"] == d], block_size) for d in domains}
    # per sequence, what a paired comparison of two drafters on the same sequences needs (`paired_tau_difference`)
    report["sequence_blocks"] = [len(r["taus"]) for r in per_sequence]
    report["sequence_tau_sums"] = [int(r["taus"].sum()) for r in per_sequence]
    report["committed_per_step"] = [r["steps"] for r in per_sequence]
    return report


def paired_tau_difference(report: dict, base: dict) -> tuple[float, float]:
    """tau of `report` minus tau of `base`, two `offline_acceptance` reports on the same sequences (hence the same
    blocks), with the sequence-clustered standard error of the difference: both drafters are judged on every block,
    so most of what makes each tau uncertain (which sequences, which blocks) cancels."""
    for name in ("sequence_blocks", "sequence_tau_sums"):
        if name not in report or name not in base:
            raise ValueError(f"a report without {name!r} (written before paired comparisons existed): measure both "
                             "drafters again with `hf-diffspec eval acceptance --json`")
    if report["sequence_blocks"] != base["sequence_blocks"]:
        raise ValueError("the two reports were measured on different sequences or blocks (other --data, "
                         "--max-sequences or target): measure both on the same ones")
    blocks = report["sequence_blocks"]
    deltas = [a - b for a, b in zip(report["sequence_tau_sums"], base["sequence_tau_sums"])]
    total = sum(blocks)
    mean = sum(deltas) / total
    clustered = sum((d - n * mean) ** 2 for d, n in zip(deltas, blocks))  # as `summarize`'s, on the differences
    return mean, math.sqrt(clustered) / total


def measuring_trainer(drafter, target) -> BlockDiffusionTrainer:
    """A trainer that only measures (`offline_acceptance` needs its training forward), for a drafter outside
    training; nothing is written."""
    with tempfile.TemporaryDirectory() as scratch:
        args = DrafterTrainingArguments(output_dir=scratch, use_cpu=target.device.type == "cpu", bf16=False)
        return BlockDiffusionTrainer(model=drafter, args=args, target=target)


@torch.no_grad()
def write_heldout_data(target, tokenizer, target_name: str, out_dir, prompts: list[dict],
                       max_new_tokens: int = 256) -> int:
    """The target's greedy answers to held-out `prompts` (records with `id`, `domain` and the templated `text`, as
    `hf_diffspec.prompts.load_prompts(..., tokenizer=...)` gives), one prompt at a time exactly as the benchmark
    decodes them, as data shards in `out_dir` (resumable by id). These are measuring sequences, never training data:
    evaluation prompts are what they are for."""
    writer = ShardWriter(out_dir, target_name, tokenizer, source="heldout", shard_size=32)
    for prompt in prompts:
        if prompt["id"] in writer.done_ids:
            continue
        inputs = tokenizer([prompt["text"]], return_tensors="pt", add_special_tokens=False).to(target.device)
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        writer.add(prompt["id"], out[0].tolist(), inputs["input_ids"].shape[1], prompt["domain"])
    writer.flush()
    return len(prompts)


def heldout_prompts(tokenizer, per_domain: int) -> list[dict]:
    """The benchmark's held-out prompts, `per_domain` of each of code, math and chat, interleaved (code 0, math 0,
    chat 0, code 1, ...) so that the first 3 n are the benchmark's `--prompts n` set."""
    by_domain = [load_prompts(domain, n_per_domain=per_domain, tokenizer=tokenizer) for domain in DOMAINS]
    return [p for row in zip(*by_domain) for p in row]
