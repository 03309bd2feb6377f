"""Training data for drafters: token sequences (prompt + response) written as compact, atomic, resumable shards.

Two sources, one format:
- relabelled real text: ShareGPT assistant turns as they are; the target's own argmax at every position becomes the
  label at training time (one prefill per sequence, far cheaper than generation);
- target-regenerated responses: the target answers ShareGPT prompts itself (greedy, chat template, batched).

A data directory holds `meta.json` (target, tokenizer fingerprint) and shards `shard-NNNNN.npz` (tokens, offsets,
prompt lengths) each with a `shard-NNNNN.json` sidecar (ids, domains, sources). Every file is written under a temporary
name and renamed into place, so an interrupted or failed run (disk full included) never leaves a partial shard that
looks complete. The sidecar is written last and marks a shard complete: the loader reads only shards that have one,
and a rerun skips the ids already written, after removing what an interrupted run left (temporary files of processes
that are gone, arrays without their sidecar).

Generation under `torchrun` / `accelerate launch` is shared out: each process answers its share of the prompts and
writes its own shard set, `shard-rankR-NNNNN`, the main process first (it writes `meta.json`). A rerun, with any
number of processes, skips the ids that any shard set already holds.

Evaluation prompts (HumanEval, MATH-500, MT-Bench) are never used for training: records whose prompt matches one of
them are dropped.
"""

import hashlib
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from hf_diffspec.prompts import chat_prompt, eval_prompt_texts, iter_sharegpt
from hf_diffspec.runtime.files import atomic_write, pad_token_id

from .feature_cache import CachedFeatures, read_cached

FORMAT_VERSION = 1
SHARD_SIZE = 512

_CODE = re.compile(
    r"```|\bdef |\bclass |\bfunction\b|\bpython\b|\bjavascript\b|\bjava\b|\bc\+\+|\bsql\b|\bcode\b|\bscript\b|"
    r"\bbug\b|\bcompile|\bregex\b|\bhtml\b|\bcss\b|\bapi\b|\bimport\b",
    re.IGNORECASE,
)
_MATH = re.compile(
    r"\bsolve\b|\bequation|\bcalculate|\bprobability|\bintegral|\bderivative|\bmatrix\b|\bprove\b|\btheorem|"
    r"\d+\s*[-+*/^=]\s*\d+|\bmath",
    re.IGNORECASE,
)


def classify_domain(prompt: str) -> str:
    """A keyword heuristic: `code`, `math` or `chat` (used to report acceptance per domain)."""
    if _CODE.search(prompt):
        return "code"
    if _MATH.search(prompt):
        return "math"
    return "chat"


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies a tokenizer by its vocabulary and chat template: data made with another one is refused."""
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps([vocab, getattr(tokenizer, "chat_template", None)], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class ShardWriter:
    """Buffers records and writes them as shards of `shard_size` records named `{prefix}-NNNNN`; knows which ids
    are already on disk, in any shard set (resume). One writer per shard set at a time."""

    def __init__(self, out_dir, target_name: str, tokenizer, source: str, shard_size: int = SHARD_SIZE,
                 prefix: str = "shard", details: dict | None = None):
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        self.shard_size = shard_size
        self.prefix = prefix
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        fingerprint = tokenizer_fingerprint(tokenizer)
        meta_path = self.dir / "meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("tokenizer_fingerprint") != fingerprint:
                raise ValueError(
                    f"{self.dir} holds data for target {meta.get('target')!r} with another tokenizer; "
                    "write to a new directory"
                )
        else:
            meta = {"format_version": FORMAT_VERSION, "target": target_name, "tokenizer_fingerprint": fingerprint,
                    "vocab_size": len(tokenizer)}
            atomic_write(meta_path, json.dumps(meta, indent=2))
        self.source = source
        self.details = details or {}  # how this run made its records (e.g. the target's dtype): in every sidecar
        self._remove_interrupted_writes()
        self.done_ids = {rid for shard in sorted(self.dir.glob("shard-*.json")) for rid in json.loads(shard.read_text())["ids"]}
        # after the highest number on disk, not the count: a shard deleted by hand is never overwritten
        own = [self._number(p.name) for p in self.dir.glob(f"{prefix}-*.json")]
        self.next_shard = 1 + max((n for n in own if n is not None), default=-1)
        self.buffer: list[dict] = []

    def _number(self, name: str) -> int | None:
        """The shard number of a file of this writer's set (`PREFIX-NNNNN.npz|json`), else None."""
        match = re.fullmatch(rf"{re.escape(self.prefix)}-(\d+)\.(npz|json)", name)
        return int(match.group(1)) if match else None

    def _remove_interrupted_writes(self) -> None:
        """Delete what a killed run left in this writer's shard set: `atomic_write`'s temporary files
        (`.NAME.tmp-PID-THREAD`) of processes that are gone, and arrays whose sidecar was never written (the next flush
        writes that shard again). None of them is ever read, but they would pile up over kills. Other shard sets are
        left to their own writers, which may be writing them now."""
        for tmp in self.dir.glob(f".{self.prefix}-*.tmp-*"):
            name, _, owner = tmp.name[1:].rpartition(".tmp-")
            pid = owner.split("-")[0]
            if self._number(name) is not None and os.name == "posix" and pid.isdigit() and not _process_alive(int(pid)):
                tmp.unlink(missing_ok=True)
        for arrays in self.dir.glob(f"{self.prefix}-*.npz"):
            if self._number(arrays.name) is not None and not arrays.with_suffix(".json").exists():
                arrays.unlink(missing_ok=True)

    def add(self, record_id: str, tokens: list[int], prompt_length: int, domain: str) -> None:
        self.buffer.append({"id": record_id, "tokens": tokens, "prompt_length": prompt_length, "domain": domain})
        self.done_ids.add(record_id)
        if len(self.buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"{self.prefix}-{self.next_shard:05d}"
        tokens = np.concatenate([np.asarray(r["tokens"], dtype=np.int32) for r in self.buffer])
        offsets = np.cumsum([0] + [len(r["tokens"]) for r in self.buffer]).astype(np.int64)
        prompt_lengths = np.asarray([r["prompt_length"] for r in self.buffer], dtype=np.int32)
        dtype = np.uint16 if tokens.max(initial=0) < 2**16 else np.int32

        def write_arrays(path):
            with open(path, "wb") as f:
                np.savez_compressed(f, tokens=tokens.astype(dtype), offsets=offsets, prompt_lengths=prompt_lengths)

        sidecar = {"ids": [r["id"] for r in self.buffer], "domains": [r["domain"] for r in self.buffer],
                   "source": self.source, **self.details}
        atomic_write(self.dir / f"{name}.npz", write_arrays)
        # the sidecar is the "shard complete" marker, so it is written last
        atomic_write(self.dir / f"{name}.json", json.dumps(sidecar))
        self.next_shard += 1
        self.buffer = []


def process_shard_writer(out_dir, target_name: str, tokenizer, source: str, shard_size: int = SHARD_SIZE,
                         details: dict | None = None):
    """This process's `ShardWriter`: alone, shards `shard-NNNNN`; one of several processes (`torchrun`, `accelerate
    launch`), its own shard set `shard-rankR-NNNNN`, created after the main process's (which writes meta.json)."""
    state = PartialState()
    prefix = "shard" if state.num_processes == 1 else f"shard-rank{state.process_index}"
    with state.main_process_first():
        return ShardWriter(out_dir, target_name, tokenizer, source=source, shard_size=shard_size, prefix=prefix,
                           details=details)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists (POSIX)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _first_exchange(record: dict) -> tuple[str, str] | None:
    turns = record.get("conversations") or []
    for i in range(len(turns) - 1):
        if turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt":
            prompt, answer = (turns[i].get("value") or "").strip(), (turns[i + 1].get("value") or "").strip()
            if prompt and answer:
                return prompt, answer
    return None


def sharegpt_exchanges(seed: int, exclude: set[str]):
    """(id, prompt, answer) of ShareGPT first exchanges in a seeded order, evaluation prompts removed."""
    items = []
    for record in iter_sharegpt():
        pair = _first_exchange(record)
        if pair and pair[0] not in exclude:
            items.append((f"sharegpt/{record.get('id')}", *pair))
    random.Random(seed).shuffle(items)
    return items


def write_relabel_data(tokenizer, target_name: str, out_dir, num_samples: int, max_length: int = 1024,
                       seed: int = 0, skip: int = 0, shard_size: int = SHARD_SIZE) -> int:
    """Real ShareGPT exchanges, chat-templated and tokenized; labels come from the target at training time."""
    writer = ShardWriter(out_dir, target_name, tokenizer, source="relabel", shard_size=shard_size)
    exchanges = sharegpt_exchanges(seed, eval_prompt_texts())[skip:]
    written = 0
    for record_id, prompt, answer in tqdm(exchanges, desc="relabel data", total=min(num_samples, len(exchanges))):
        if written >= num_samples:
            break
        if record_id in writer.done_ids:
            written += 1
            continue
        prompt_ids = chat_prompt(tokenizer, prompt, tokenize=True)
        full_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], return_dict=False)
        if full_ids[: len(prompt_ids)] != prompt_ids or len(prompt_ids) >= max_length - 8:
            continue  # template not prefix-stable, or no room for a response
        writer.add(record_id, full_ids[:max_length], len(prompt_ids), classify_domain(prompt))
        written += 1
    writer.flush()
    return written


def record_prompt(record: dict) -> str | list[dict]:
    """What a prompt record asks: its conversation ("messages") when it has one, else its "prompt"."""
    return record["messages"] if "messages" in record else record["prompt"]


def user_turns(prompt: str | list[dict]) -> list[str]:
    """The user's texts of a prompt: the prompt itself, or a conversation's user messages."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m.get("role") == "user"]


@torch.no_grad()
def write_generated_data(target, tokenizer, target_name: str, out_dir, num_samples: int, max_new_tokens: int = 256,
                         batch_size: int = 16, max_prompt_length: int = 512, seed: int = 0, skip: int = 0,
                         prompts: list[dict] | None = None, shard_size: int = SHARD_SIZE) -> int:
    """The target's own greedy answers (batched, left-padded, chat template) to ShareGPT prompts, or to `prompts`:
    {"id", "prompt"} records (e.g. from a JSONL file), or {"id", "messages"} for a conversation that ends with a user
    turn (`chat_prompt`), its domain that of its user turns. Under several processes each answers its share of the
    `num_samples` prompts into its own shard set (`process_shard_writer`); all return once every share is written.
    Each shard records the dtype the target answered in (greedy answers in bf16 and in fp32 part at near ties)."""
    state = PartialState()
    writer = process_shard_writer(out_dir, target_name, tokenizer, source="generated", shard_size=shard_size,
                                  details={"dtype": str(target.dtype).removeprefix("torch.")})
    exclude = eval_prompt_texts()
    if prompts is None:
        source = [(rid, prompt) for rid, prompt, _ in sharegpt_exchanges(seed, exclude)]
    else:
        source = [(p["id"], record_prompt(p)) for p in prompts]
        source = [(rid, prompt) for rid, prompt in source if not exclude.intersection(user_turns(prompt))]
    todo = []
    for record_id, prompt in source[skip:]:
        if len(todo) >= num_samples:
            break
        ids = chat_prompt(tokenizer, prompt, tokenize=True)
        if len(ids) <= max_prompt_length:
            todo.append((record_id, prompt, ids))
    todo = todo[:num_samples]
    with state.split_between_processes(todo) as share:
        pending = [t for t in share if t[0] not in writer.done_ids]
    pending.sort(key=lambda t: len(t[2]))  # similar lengths per batch: less padding
    pad = pad_token_id(tokenizer)
    eos = tokenizer.eos_token_id
    bar = tqdm(total=len(pending), desc="generate data")
    for start in range(0, len(pending), batch_size):
        batch = pending[start : start + batch_size]
        width = max(len(ids) for _, _, ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, _, ids) in enumerate(batch):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        out = target.generate(input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
                              max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for row, (record_id, prompt, ids) in enumerate(batch):
            response = out[row, width:].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            writer.add(record_id, ids + response, len(ids), classify_domain("\n".join(user_turns(prompt))))
        bar.update(len(batch))
    bar.close()
    writer.flush()
    state.wait_for_everyone()
    return len(todo)


class DrafterDataset(Dataset):
    """All shards of one or more data directories: items are {"input_ids", "prompt_length", "domain"}, plus
    "target_features" and "target_argmax" with `cached_features=(target, feature_layers)`: what
    `hf-diffspec data features` cached for that target at those layers (`feature_cache.py`), checked here."""

    def __init__(self, dirs, tokenizer=None, max_length: int | None = None, cached_features: tuple | None = None):
        dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
        self.sequences: list[np.ndarray] = []
        self.prompt_lengths: list[int] = []
        self.domains: list[str] = []
        self.feature_files: list[tuple[Path, int]] = []  # (cache file, index in it) per sequence, when cached
        self.meta = []
        for d in map(Path, dirs):
            cache = CachedFeatures(d, *cached_features) if cached_features else None
            meta_path = d / "meta.json"
            if not meta_path.exists():
                raise FileNotFoundError(
                    f"{d} is not a drafter data directory (no meta.json); create one with `hf-diffspec data ...`"
                )
            meta = json.loads(meta_path.read_text())
            if tokenizer is not None and meta["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
                raise ValueError(
                    f"{d} was made for target {meta['target']!r} with a different tokenizer than this target's; "
                    "regenerate the data with this target"
                )
            self.meta.append(meta)
            sidecars = sorted(d.glob("shard-*.json"))
            for sidecar in sidecars:
                try:
                    info = json.loads(sidecar.read_text())
                    arrays = np.load(sidecar.with_suffix(".npz"))
                    tokens, offsets, prompts = arrays["tokens"], arrays["offsets"], arrays["prompt_lengths"]
                except (OSError, ValueError, KeyError) as error:
                    raise ValueError(f"corrupt data shard {sidecar.with_suffix('.npz')}: {error}") from error
                if len(offsets) != len(info["ids"]) + 1:
                    raise ValueError(f"corrupt data shard {sidecar}: {len(info['ids'])} ids, {len(offsets) - 1} rows")
                for i in range(len(info["ids"])):
                    seq = tokens[offsets[i] : offsets[i + 1]].astype(np.int64)
                    if max_length:
                        seq = seq[:max_length]
                    if int(prompts[i]) + 2 > len(seq):
                        continue  # no response token to train on
                    self.sequences.append(seq)
                    self.prompt_lengths.append(int(prompts[i]))
                    self.domains.append(info["domains"][i])
                    if cache:
                        self.feature_files.append((cache.path(sidecar), i))
        if not self.sequences:
            raise ValueError(f"no training sequences found in {', '.join(map(str, dirs))}")

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": torch.from_numpy(self.sequences[i]), "prompt_length": self.prompt_lengths[i],
                "domain": self.domains[i]}
        if self.feature_files:
            item["target_features"], item["target_argmax"] = read_cached(*self.feature_files[i], len(self.sequences[i]))
        return item

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.sequences))
