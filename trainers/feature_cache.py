"""The target's features and argmax at every position of a data directory's sequences, computed once and reused by
every epoch of training (`--cached-features`), so that a training step runs no target forward.

The block-diffusion step needs two things from the frozen target: its hidden states at the drafter's feature layers
(the drafter's context) and its argmax at each position (the labels). Both depend only on the sequence, so one
teacher-forced forward per sequence gives them for every epoch; on a CPU that forward is about half of a step at 64
anchors per sequence.

A cache lives in `DATA_DIR/target-features/`: `meta.json` (the feature layers, the dtype, the target's weight
fingerprint) and one safetensors file per data shard, of the same name, holding `features.{i}` (length,
layers x hidden) and `argmax.{i}` (length,) for the shard's i-th sequence. Each file is written atomically and a
rerun skips the shards already cached (resume); under `torchrun` / `accelerate launch` the processes share the shards
out. A cache made by other weights or for other feature layers is refused when training reads it.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hf_diffspec.runtime.files import atomic_write

FEATURES_DIR = "target-features"
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def target_fingerprint(target) -> str:
    """Identifies the target's weights whatever dtype they are loaded in: its class, its shape and a sample of its
    input embeddings, final norm and first layer, rounded to bf16."""
    digest = hashlib.sha256(type(target).__name__.encode())
    digest.update(json.dumps([target.config.vocab_size, target.config.hidden_size,
                              target.config.num_hidden_layers]).encode())
    params = dict(target.named_parameters())
    names = sorted(params)
    for name in (names[0], names[len(names) // 2], names[-1]):
        sample = params[name].detach().flatten()[:4096].to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(name.encode() + sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_meta(target, feature_layers: list[int], dtype: torch.dtype) -> dict:
    return {"format_version": 1, "target_feature_layers": list(feature_layers), "dtype": str(dtype).split(".")[-1],
            "target_fingerprint": target_fingerprint(target)}


def data_shards(data_dir: Path) -> list[Path]:
    """The complete shards of a data directory (their sidecars mark them complete), by name."""
    return sorted(p.with_suffix(".npz") for p in data_dir.glob("shard-*.json"))


@torch.no_grad()
def write_target_features(target, drafter, data_dir, dtype: torch.dtype = torch.bfloat16, batch_size: int = 8) -> int:
    """Cache the target's features (at `drafter.target_feature_layers`) and argmax for every sequence of `data_dir`;
    returns the number of shards written now (those already cached are skipped)."""
    data_dir = Path(data_dir)
    out = data_dir / FEATURES_DIR
    state = PartialState()
    meta = cache_meta(target, drafter.target_feature_layers, dtype)
    meta_path = out / "meta.json"
    if state.is_main_process:
        out.mkdir(exist_ok=True)
        if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
            raise ValueError(f"{out} caches another target's features, other feature layers or another dtype "
                             f"({meta_path.read_text().strip()}); delete {out} to cache these")
        atomic_write(meta_path, json.dumps(meta, indent=2))
    state.wait_for_everyone()
    todo = [shard for shard in data_shards(data_dir) if not (out / f"{shard.stem}.safetensors").exists()]
    with state.split_between_processes(todo) as share:
        mine = list(share)
    for shard in tqdm(mine, desc="target features"):
        arrays = np.load(shard)
        offsets = arrays["offsets"]
        sequences = [torch.from_numpy(arrays["tokens"][offsets[i]:offsets[i + 1]].astype(np.int64))
                     for i in range(len(offsets) - 1)]
        tensors = {}
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths: less padding
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(sequences[i]) for i in rows)
            input_ids = torch.zeros((len(rows), width), dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(rows):
                input_ids[row, : len(sequences[i])] = sequences[i]
                attention_mask[row, : len(sequences[i])] = 1
            # the training step's own target forward (right padding, the same feature layers)
            output = target(input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                            output_hidden_states=drafter.target_feature_layers)
            features = drafter.gather_target_features(output.hidden_states).to("cpu", dtype)
            argmax = output.logits.argmax(-1).to("cpu", torch.int32)
            for row, i in enumerate(rows):
                n = len(sequences[i])
                tensors[f"features.{i}"] = features[row, :n].contiguous()
                tensors[f"argmax.{i}"] = argmax[row, :n].contiguous()
        atomic_write(out / f"{shard.stem}.safetensors", lambda path: save_file(tensors, str(path)))
    state.wait_for_everyone()
    return len(mine)


class CachedFeatures:
    """Reads one data directory's cached features, after checking they are this target's at these layers."""

    def __init__(self, data_dir, target, feature_layers: list[int]):
        self.dir = Path(data_dir) / FEATURES_DIR
        meta_path = self.dir / "meta.json"
        command = f"hf-diffspec data features {data_dir} (with --drafter for an --init drafter)"
        if not meta_path.exists():
            raise FileNotFoundError(f"--cached-features: {data_dir} has no cached target features; write them with "
                                    f"`{command}`, or train without --cached-features")
        meta = json.loads(meta_path.read_text())
        if meta["target_feature_layers"] != list(feature_layers):
            raise ValueError(f"{self.dir} caches the target's layers {meta['target_feature_layers']}, and this drafter "
                             f"reads {list(feature_layers)}: delete it and run `{command}` for this drafter")
        if meta["target_fingerprint"] != target_fingerprint(target):
            raise ValueError(f"{self.dir} was cached with other target weights than the target being trained against; "
                             f"delete it and run `{command}` with this target")

    def path(self, shard: Path) -> Path:
        path = self.dir / f"{Path(shard).stem}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"--cached-features: {path} is missing (the cache is older than the shard "
                                    f"{shard}); run `hf-diffspec data features {self.dir.parent}` again: it writes "
                                    "only what is missing")
        return path


def read_cached(path: Path, index: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The features (length, F) and argmax (length,) of a shard's `index`-th sequence, cut to `length` tokens."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice(f"features.{index}")[:length], f.get_slice(f"argmax.{index}")[:length].long()
