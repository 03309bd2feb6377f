"""A reduced draft vocabulary: the target tokens a drafter may propose, chosen by frequency in its training data.

On a CPU the target's LM head dominates a draft's cost (SmolLM2: 49152 rows x 576 against ~4 M multiply-adds per
drafter layer), and training's cross-entropy pays it on every supervised slot. A drafter restricted to the V' most
frequent response tokens (`DiffusionDrafter.set_draft_vocabulary`) computes only those rows; a token outside them is
simply never drafted, so verification stays exact. Counts come from the response part of drafter training data
(`DrafterDataset`), optionally with ShareGPT answers tokenized by the target's tokenizer (evaluation prompts
excluded); the tokenizer's special tokens (EOS above all) are always kept.
"""

import os
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from hf_diffspec.prompts import eval_prompt_texts

from .data import DrafterDataset, sharegpt_exchanges


def count_response_tokens(dataset_or_dirs=None, tokenizer=None, sharegpt_responses: int = 0,
                          vocab_size: int | None = None, seed: int = 0) -> torch.Tensor:
    """How often each target token id occurs in responses: a (vocab_size,) int64 tensor.

    Args:
        dataset_or_dirs: a `DrafterDataset`, or data directories (holding `meta.json`) to read as one; the tokens
            after each sequence's prompt are counted. `None`: no data directories.
        tokenizer: the target's tokenizer; checks that the data were made with it, and tokenizes ShareGPT answers.
        sharegpt_responses: also count the answers of this many ShareGPT first exchanges (evaluation prompts
            excluded, in the seeded order data generation uses).
        vocab_size: length of the result (default: the tokenizer's, else the data's `vocab_size`, else max id + 1).
    """
    if dataset_or_dirs is None and not sharegpt_responses:
        raise ValueError("nothing to count: pass drafter data (a DrafterDataset or data directories) and/or "
                         "sharegpt_responses > 0")
    if sharegpt_responses and tokenizer is None:
        raise ValueError("counting ShareGPT answers needs the target's tokenizer: pass tokenizer=")
    responses: list[torch.Tensor] = []
    if dataset_or_dirs is not None:
        dataset = dataset_or_dirs
        if isinstance(dataset_or_dirs, (str, os.PathLike, list, tuple)):
            dataset = DrafterDataset(dataset_or_dirs, tokenizer=tokenizer)
        responses += [torch.from_numpy(seq[start:]) for seq, start in zip(dataset.sequences, dataset.prompt_lengths)]
        if vocab_size is None and tokenizer is None:
            vocab_size = max((m.get("vocab_size") or 0 for m in dataset.meta), default=0) or None
    if sharegpt_responses:
        exchanges = sharegpt_exchanges(seed, eval_prompt_texts())[:sharegpt_responses]
        for _, _, answer in tqdm(exchanges, desc="tokenize ShareGPT answers"):
            responses.append(torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"], dtype=torch.long))
    tokens = torch.cat(responses) if responses else torch.zeros(0, dtype=torch.long)
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else (int(tokens.max()) + 1 if tokens.numel() else 1)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside a vocabulary of {vocab_size}: the data were made "
                         "for another target")
    return torch.bincount(tokens, minlength=vocab_size)


def top_tokens(counts: torch.Tensor, size: int, always_include: Iterable[int] = ()) -> torch.Tensor:
    """The `size` ids to draft over, sorted: every id of `always_include`, then the most frequent others (ties: lower
    id first; ids never seen fill up the rest in id order)."""
    keep = sorted({int(i) for i in always_include})
    if not 1 <= size <= len(counts):
        raise ValueError(f"size must be between 1 and the vocabulary size {len(counts)}, got {size}")
    if len(keep) > size:
        raise ValueError(f"{len(keep)} tokens must always be kept, more than size={size}")
    if keep and not 0 <= keep[0] <= keep[-1] < len(counts):
        raise ValueError(f"always_include ids must lie in [0, {len(counts)}), got {keep[0]}..{keep[-1]}")
    ranked = torch.sort(counts, descending=True, stable=True).indices
    chosen = torch.zeros(len(counts), dtype=torch.bool)
    chosen[keep] = True
    others = ranked[~chosen[ranked]][: size - len(keep)]
    chosen[others] = True
    return chosen.nonzero().flatten()


def special_token_ids(tokenizer) -> list[int]:
    """The tokenizer's special tokens (EOS, chat-template markers, padding): always in a draft vocabulary."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    eos = tokenizer.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def most_frequent_tokens(dataset_or_dirs=None, size: int = 8192, *, tokenizer=None, always_include: Iterable[int] = (),
                         sharegpt_responses: int = 0, vocab_size: int | None = None) -> torch.Tensor:
    """The draft vocabulary of `size` target ids (sorted LongTensor): the tokenizer's special tokens (EOS) and
    `always_include`, then the most frequent response tokens of `dataset_or_dirs` (a `DrafterDataset` or data
    directories) and of `sharegpt_responses` ShareGPT answers. Pass it to `DiffusionDrafter.set_draft_vocabulary`.

    EOS must stay draftable (else every response's last token is a guaranteed miss), so either `tokenizer` or
    `always_include` (the target's EOS ids) is required.
    """
    keep = set(always_include) | set(special_token_ids(tokenizer) if tokenizer is not None else [])
    if not keep:
        raise ValueError("no EOS to keep: pass the target's tokenizer (its special tokens are kept), or "
                         "always_include=[eos_token_id, ...]")
    counts = count_response_tokens(dataset_or_dirs, tokenizer=tokenizer, sharegpt_responses=sharegpt_responses,
                                   vocab_size=vocab_size)
    return top_tokens(counts, size, keep)


__all__ = ["count_response_tokens", "most_frequent_tokens", "special_token_ids", "top_tokens"]
