"""Checkpoint formats in and out: z-lab DFlash, transformers' native DFlash drafter (MuseGlimmerAssistant), and the
layouts vLLM and SGLang load. The math of all of them is the DFlash drafter; only config fields and tensor names differ:

| ours                      | z-lab / vLLM / SGLang        | transformers native (muse_glimmer_assistant) |
|---------------------------|------------------------------|----------------------------------------------|
| fc.weight                 | fc.weight                    | encoder.fc.weight                            |
| hidden_norm.weight        | hidden_norm.weight           | encoder.output_norm_enc.weight               |
| layers.N.*, norm.weight   | same                         | same                                         |
| mask_embedding (optional) | - (mask_token_id row)        | - (mask_token_id row)                        |
| draft_vocab_ids (optional)| - (full vocabulary)          | - (full vocabulary)                          |
| selector.* (optional)     | - (argmax drafts)            | - (argmax drafts)                            |

`reduce_vocabulary` turns one of our drafters into one drafting over a reduced vocabulary (same weights).
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .hub import save_drafter
from .modeling import DiffusionDrafter, DiffusionDrafterConfig

NATIVE_RENAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
FORMATS_IN = ("zlab", "hf-native")
FORMATS_OUT = ("vllm", "sglang")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Tensors of a single-file or sharded safetensors checkpoint."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(folder / shard))
        return state
    raise FileNotFoundError(f"no model.safetensors (or sharded index) in {folder}")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return json.loads(path.read_text())


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not supported by DiffusionDrafter (plain RoPE only)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _check_full_attention(cfg: dict) -> None:
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding and (cfg.get("sliding_window") or 0) < cfg.get("max_position_embeddings", 0):
        raise ValueError(
            f"layer types {sorted(set(sliding))} with a sliding window of {cfg.get('sliding_window')} are not "
            "supported by DiffusionDrafter (full attention only)"
        )


def config_from_external(cfg: dict, source: str) -> DiffusionDrafterConfig:
    """Our config from a z-lab (`dflash_config` nested) or transformers-native (top-level fields) config dict."""
    nested = cfg.get("dflash_config") or {}
    layer_ids = nested.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask_token_id = nested.get("mask_token_id", cfg.get("mask_token_id"))
    block_size = cfg.get("block_size", nested.get("block_size"))
    missing = [name for name, value in [("target_layer_ids", layer_ids), ("mask_token_id", mask_token_id),
                                        ("block_size", block_size)] if value is None]
    if missing:
        raise ValueError(f"the {source} config lacks {missing}; is this a DFlash drafter checkpoint?")
    _check_full_attention(cfg)
    num_target_layers = cfg.get("num_target_layers") or nested.get("num_target_layers") or max(layer_ids) + 4
    return DiffusionDrafterConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"), hidden_act=cfg.get("hidden_act", "silu"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), attention_bias=cfg.get("attention_bias", False),
        rope_theta=_rope_theta(cfg), max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        vocab_size=cfg.get("vocab_size"), block_size=block_size, target_layer_ids=list(layer_ids),
        num_target_layers=num_target_layers, mask_token_id=mask_token_id,
    )


def convert_to_drafter(src, out, source: str) -> Path:
    """Convert a `zlab` or `hf-native` DFlash checkpoint folder into a DiffusionDrafter folder."""
    if source not in FORMATS_IN:
        raise ValueError(f"unknown format {source!r}; choose from {list(FORMATS_IN)}")
    src, out = Path(src), Path(out)
    config = config_from_external(_read_config(src), source)
    state = read_state_dict(src)
    if source == "hf-native":
        state = {NATIVE_RENAMES.get(k, k): v for k, v in state.items()}
    drafter = DiffusionDrafter(config)
    expected = drafter.state_dict()
    problems = [f"missing {k} {tuple(v.shape)}" for k, v in expected.items() if k not in state]
    problems += [f"{k}: checkpoint {tuple(state[k].shape)} vs expected {tuple(v.shape)}"
                 for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    if problems:
        raise ValueError(f"cannot convert {src} ({source}): " + "; ".join(problems))
    drafter.load_state_dict(state)
    dtype = next(iter(state.values())).dtype
    return save_drafter(drafter.to(dtype), out)


def reduce_vocabulary(drafter_dir, out, token_ids) -> Path:
    """Save the DiffusionDrafter at `drafter_dir` to `out` drafting over only `token_ids` (target ids, e.g. from
    `trainers.draft_vocabulary.most_frequent_tokens`); its weights are unchanged and in their dtype."""
    drafter_dir = Path(drafter_dir)
    model_type = _read_config(drafter_dir).get("model_type")
    if model_type != DiffusionDrafterConfig.model_type:
        raise ValueError(f"{drafter_dir} holds a {model_type!r} checkpoint; a reduced vocabulary applies to a "
                         f"DiffusionDrafter ({DiffusionDrafterConfig.model_type!r})")
    dtype = next(v.dtype for v in read_state_dict(drafter_dir).values() if v.is_floating_point())
    drafter = DiffusionDrafter.from_pretrained(drafter_dir, dtype=dtype)
    return save_drafter(drafter.set_draft_vocabulary(token_ids), out)


#: our tensors that DFlash engines (vLLM, SGLang, z-lab, transformers' DFlash path) have no place for: they verify
#: whole blocks of argmax drafts over the full vocabulary
NOT_IN_DFLASH_ENGINES = ("length_head.", "draft_vocab_ids", "selector.")


def export_for_engine(drafter_dir, out, engine: str) -> tuple[Path, list[str]]:
    """Write the z-lab layout that vLLM's and SGLang's DFlash loaders read. Returns (folder, notes on what was
    dropped or needs care); raises when the drafter cannot run on that engine at all."""
    if engine not in FORMATS_OUT:
        raise ValueError(f"unknown export format {engine!r}; choose from {list(FORMATS_OUT)}")
    drafter_dir, out = Path(drafter_dir), Path(out)
    config = DiffusionDrafterConfig.from_pretrained(drafter_dir)
    state = read_state_dict(drafter_dir)
    notes = []
    if config.draft_role != "first":
        raise ValueError(f"{engine} runs first (DFlash) drafters only; this one is a {config.draft_role} drafter")
    extra = sorted(k for k in state if k.startswith("length_head"))
    if extra:
        notes.append(f"dropped the adaptive length head ({len(extra)} tensors): {engine} verifies fixed lengths")
        state = {k: v for k, v in state.items() if k not in extra}
    selector = sorted(k for k in state if k.startswith("selector."))
    if selector:
        notes.append(f"dropped the candidate selector ({len(selector)} tensors): {engine}'s DFlash loader drafts "
                     "each slot's argmax")
        state = {k: v for k, v in state.items() if k not in selector}
    if "draft_vocab_ids" in state:
        notes.append(f"dropped the reduced draft vocabulary ({config.draft_vocab_size} tokens): {engine}'s DFlash "
                     "loader drafts over the full vocabulary")
        state = {k: v for k, v in state.items() if k != "draft_vocab_ids"}
    if config.mask_token_id is None:
        raise ValueError(
            f"this drafter learned its own MASK embedding, and {engine}'s DFlash loader takes the MASK embedding from "
            "a target token (dflash_config.mask_token_id). Fine-tune it with a mask_token_id (e.g. a reserved or "
            "unused token of the target) before exporting."
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    zlab = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps, "attention_bias": config.attention_bias,
        "rope_theta": config.rope_theta, "rope_scaling": None, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "layer_types": ["full_attention"] * config.num_hidden_layers,
        "block_size": config.block_size, "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": config.target_layer_ids},
        "torch_dtype": str(next(iter(state.values())).dtype).replace("torch.", ""),
    }
    (out / "config.json").write_text(json.dumps(zlab, indent=2))
    if config.num_draft_tokens:
        notes.append(f"verify length {config.num_draft_tokens} is an engine flag: pass it as num_speculative_tokens "
                     "(vLLM) / --speculative-num-draft-tokens (SGLang, counts the anchor: +1)")
    readme = drafter_dir / "README.md"
    if readme.is_file():
        shutil.copyfile(readme, out / "README.md")
    return out, notes


def target_token_mask_reason(drafter, where: str) -> str | None:
    """Why `drafter`'s weights cannot run in `where`, a loop that embeds MASK as a target token (transformers' DFlash
    path, z-lab's loop); None: they can."""
    if drafter.config.draft_role != "first":
        return f"{where} runs first (DFlash) drafters only; this one is a {drafter.config.draft_role} drafter"
    if drafter.config.mask_token_id is None:
        return (f"this drafter learned its own MASK embedding (mask_token_id is None), and {where} embeds MASK as a "
                "target token (mask_token_id), so these weights cannot run there as they are; a drafter trained "
                "with a mask_token_id can, and so can this one where the target's tokenizer leaves a token the "
                "target never reads (the benchmark then carries the vector in that token's embedding row)")
    return None


def native_dflash_drafter(drafter):
    """`drafter`'s weights as transformers' own DFlash drafter (`MuseGlimmerAssistantModel`): the config fields
    mapped, `fc` / `hidden_norm` renamed as `NATIVE_RENAMES` reads them, `NOT_IN_DFLASH_ENGINES` tensors left out.
    Raises ValueError when the weights cannot be expressed there."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    reason = target_token_mask_reason(drafter, "transformers' DFlash path")
    if reason is not None:
        raise ValueError(reason)
    config = drafter.config
    if config.attention_bias:
        raise ValueError("transformers' DFlash drafter has no attention biases; this drafter has them")
    native = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim or config.hidden_size // config.num_attention_heads, hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
        layer_types=["full_attention"] * config.num_hidden_layers, block_size=config.block_size,
        mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ))
    ours_to_native = {ours: native_name for native_name, ours in NATIVE_RENAMES.items()}
    state = {ours_to_native.get(k, k): v for k, v in drafter.state_dict().items()
             if not k.startswith(NOT_IN_DFLASH_ENGINES)}
    try:
        native.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(f"the weights do not fit transformers' DFlash drafter: {error}") from None
    return native.to(device=drafter.device, dtype=drafter.dtype).eval()
