"""Checkpoint formats in and out: z-lab DFlash, transformers' native DFlash drafter (MuseGlimmerAssistant), and the
layouts vLLM and SGLang load. The math of all of them is the DFlash drafter; only config fields and tensor names differ
(`DiffusionDrafter.from_pretrained` reads the published ones directly; `convert_to_drafter` saves them in ours):

| ours                      | z-lab / vLLM / SGLang        | transformers native (muse_glimmer_assistant) |
|---------------------------|------------------------------|----------------------------------------------|
| fc.weight                 | fc.weight                    | encoder.fc.weight                            |
| hidden_norm.weight        | hidden_norm.weight           | encoder.output_norm_enc.weight               |
| layers.N.*, norm.weight   | same                         | same                                         |
| mask_embedding (optional) | - (mask_token_id row)        | - (mask_token_id row)                        |
| draft_vocab_ids (optional)| - (full vocabulary)          | - (full vocabulary)                          |
| selector.* (optional)     | candidate_selector.* (DFlash 2) | - (argmax drafts)                         |
| layers.N.block_convs.{0,1}| layers.N.{attention,mlp}_conv (DFlash 2) | -                               |

`reduce_vocabulary` turns one of our drafters into one drafting over a reduced vocabulary (same weights).

What the engines read of an export (`export_for_engine`): vLLM 0.32 (`qwen3_dflash`) reads the config, the weights,
`mask_embedding.pt` (a MASK vector substituted for `mask_token_id` inside the drafter) and, where shipped, a draft
head (`lm_head.weight`, `d2t`, `draft_vocab_size`); SGLang (`sglang/srt/models/dflash.py`, read, not run here) loads
`layers.*`, `fc`, `hidden_norm` and `norm`, embeds through the target's table (MASK included) and scores with the
target's head, ignoring other tensors: it has no place for a learned MASK vector or a draft head.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .hub import save_drafter
from .modeling import DiffusionDrafter, DiffusionDrafterConfig, published_layout

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


def resolve_checkpoint(path_or_hub_id) -> Path:
    """A local checkpoint folder as it is, or a Hub repository id downloaded (config, weights, card) through
    `huggingface_hub.snapshot_download`."""
    folder = Path(path_or_hub_id)
    if folder.is_dir():
        return folder
    if folder.exists() or str(path_or_hub_id).count("/") != 1:
        raise FileNotFoundError(f"{path_or_hub_id} is neither a checkpoint folder nor a Hub repository id (owner/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_hub_id), allow_patterns=["*.json", "*.safetensors", "*.md"]))


def convert_to_drafter(src, out, source: str) -> Path:
    """Save the published DFlash drafter at `src` (a folder or a Hub id) in `source` layout (`zlab` or `hf-native`)
    as a Hub-ready DiffusionDrafter folder, in its own dtype. `DiffusionDrafter.from_pretrained` reads those layouts
    directly; this writes our layout with the remote code and `custom_generate/` a Hub folder needs."""
    if source not in FORMATS_IN:
        raise ValueError(f"unknown format {source!r}; choose from {list(FORMATS_IN)}")
    folder = resolve_checkpoint(src)
    layout = published_layout(_read_config(folder))
    if layout != source:
        raise ValueError(f"{src} is {'not a published DFlash layout' if layout is None else f'in the {layout} layout'}, "
                         f"not {source!r}" + (f": convert it with --from {layout}" if layout else ""))
    dtype = next(v.dtype for v in read_state_dict(folder).values() if v.is_floating_point())
    return save_drafter(DiffusionDrafter.from_pretrained(folder, dtype=dtype), out)


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


def published_logit_fields(config: DiffusionDrafterConfig) -> dict:
    """The `dflash_config` fields z-lab's drafter reads for how it embeds and scores a block, where ours differ from
    its defaults."""
    fields = {}
    if config.output_multiplier != 1.0:
        fields["output_multiplier"] = config.output_multiplier
    if config.final_logit_softcapping:
        fields["final_logit_softcapping"] = config.final_logit_softcapping
    if config.input_embedding_scale not in (None, 1.0):
        fields["input_embedding_scale"] = config.input_embedding_scale
    return fields


#: what vLLM's DFlash loader (vllm 0.32, `qwen3_dflash`) reads beside the weights for a MASK that is not a target
#: token's row: `{"mask_token_id": id, "embedding": vector}`, substituted for that token inside the drafter only
MASK_EMBEDDING_FILE = "mask_embedding.pt"


def export_for_engine(drafter_dir, out, engine: str, target=None, mask_token_id: int | str = "auto",
                      draft_vocabulary: bool = False) -> tuple[Path, list[str]]:
    """Write the z-lab layout that vLLM's and SGLang's DFlash loaders read. Returns (folder, notes on what was
    dropped or needs care); raises when the drafter cannot run on that engine at all.

    A drafter that learned its own MASK vector goes to vLLM as `mask_token_id` (an id, or "auto": a token the target
    never reads, found through `target`'s tokenizer) plus `MASK_EMBEDDING_FILE`. `draft_vocabulary` writes a reduced
    draft vocabulary as vLLM reads one (`draft_vocab_size`, the target's head rows as `lm_head.weight`, `d2t`: each
    draft id's offset to its target id); `target` (a built-in name or a folder, `load_target`) gives the rows.
    `out` appears complete or not at all."""
    if engine not in FORMATS_OUT:
        raise ValueError(f"unknown export format {engine!r}; choose from {list(FORMATS_OUT)}")
    drafter_dir, out = Path(drafter_dir), Path(out)
    config = DiffusionDrafterConfig.from_pretrained(drafter_dir)
    state = read_state_dict(drafter_dir)
    notes, extra_files = [], {}
    loaded_target = []

    def target_model():
        if target is None:
            raise ValueError("this export needs the drafter's target (its tokenizer or head rows): pass --target "
                             "NAME|FOLDER (a built-in name such as smollm2-135m-instruct, or the target's folder)")
        if not loaded_target:
            from .targets import load_target

            loaded_target.extend(load_target(str(target), dtype=torch.float32))
        return loaded_target
    if config.draft_role != "first":
        raise ValueError(f"{engine} runs first (DFlash) drafters only; this one is a {config.draft_role} drafter")
    if config.block_conv:
        raise ValueError(f"this drafter has DFlash 2's block convolutions, which {engine}'s DFlash loader (the z-lab "
                         "DFlash layout written here) has no place for; export a DFlash drafter (block_conv=False)")
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    if config.causal_layers not in ([], sliding):  # z-lab's loaders make exactly the sliding layers causal
        raise ValueError(f"causal layers {config.causal_layers} other than the sliding-window ones {sliding} cannot "
                         f"be written in the z-lab DFlash layout that {engine} reads")
    extra = sorted(k for k in state if k.startswith("length_head"))
    if extra:
        notes.append(f"dropped the adaptive length head ({len(extra)} tensors): {engine} verifies fixed lengths")
        state = {k: v for k, v in state.items() if k not in extra}
    selector = sorted(k for k in state if k.startswith("selector."))
    if selector:
        notes.append(f"dropped the candidate selector ({len(selector)} tensors): {engine}'s DFlash loader drafts "
                     "each slot's argmax")
        state = {k: v for k, v in state.items() if k not in selector}
    dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    zlab_vocab = {}
    if "draft_vocab_ids" in state:
        ids = state.pop("draft_vocab_ids")
        if draft_vocabulary and engine == "vllm":
            head = target_model()[0].get_output_embeddings()
            if getattr(head, "bias", None) is not None:
                raise ValueError("the target's output head has a bias, which vLLM's draft head has no place for; "
                                 "export without --draft-vocabulary")
            state["lm_head.weight"] = head.weight.detach()[ids].to(dtype)
            state["d2t"] = ids - torch.arange(len(ids))
            zlab_vocab = {"draft_vocab_size": len(ids)}
            notes.append(f"the reduced draft vocabulary ({len(ids)} tokens) as vLLM reads one: draft_vocab_size, "
                         "the target's head rows as lm_head.weight, d2t")
        else:
            notes.append(f"dropped the reduced draft vocabulary ({config.draft_vocab_size} tokens): {engine}'s DFlash "
                         "loader drafts over the full vocabulary" + (" (--draft-vocabulary keeps it)"
                                                                      if engine == "vllm" else ""))
    exported_mask_id = config.mask_token_id
    if config.mask_token_id is None:
        if engine != "vllm":
            raise ValueError(
                f"this drafter learned its own MASK embedding, and {engine}'s DFlash loader embeds MASK through the "
                "target's embedding table only (no separate vector). Export it with --format vllm, which carries "
                f"the vector in {MASK_EMBEDDING_FILE}, or fine-tune it with a mask_token_id (a reserved or unused "
                "token of the target) first.")
        exported_mask_id = _mask_token_for_export(mask_token_id, config.vocab_size, target_model)
        vector = state.pop("mask_embedding")
        extra_files[MASK_EMBEDDING_FILE] = lambda path: torch.save(
            {"mask_token_id": exported_mask_id, "embedding": vector.clone()}, path)
        notes.append(f"the learned MASK vector goes as token {exported_mask_id} with {MASK_EMBEDDING_FILE}, which "
                     "vLLM substitutes for that token inside the drafter only (the target never reads it)")
    zlab = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps, "attention_bias": config.attention_bias,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_parameters if config.rope_parameters["rope_type"] != "default" else None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "tie_word_embeddings": False, "use_sliding_window": config.uses_sliding_window,
        "sliding_window": config.sliding_window, "layer_types": config.layer_types,
        "block_size": config.block_size, "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": exported_mask_id, "target_layer_ids": config.target_layer_ids,
                          **published_logit_fields(config)},
        "torch_dtype": str(dtype).replace("torch.", ""), **zlab_vocab,
    }
    if sliding and not config.causal_layers:
        zlab["is_causal"] = False  # z-lab's loader would make its sliding-window layers causal
    notes.append(f"vLLM's num_speculative_tokens k also sets the drafter's block (k + 1 slots): this drafter was "
                 f"trained on {config.block_size}, and drafts worse in a shorter block (the shipped SmolLM2 drafter "
                 "in vLLM 0.32, fp32 greedy, 15 built-in prompts: acceptance 1.36 at k=4 against 1.55 at k=15)")
    if config.num_draft_tokens:
        notes.append(f"verify length {config.num_draft_tokens} is an engine flag: pass it as num_speculative_tokens "
                     "(vLLM) / --speculative-num-draft-tokens (SGLang, counts the anchor: +1)")
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors",
                  metadata={"format": "pt"})
        for name, write in extra_files.items():
            write(staging / name)
        readme = drafter_dir / "README.md"
        if readme.is_file():
            shutil.copyfile(readme, staging / "README.md")
        (staging / "config.json").write_text(json.dumps(zlab, indent=2))  # last: a folder with a config is whole
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, notes


def _mask_token_for_export(mask_token_id: int | str, vocab_size: int, target_model) -> int:
    """`--mask-token-id`: an id below `vocab_size`, or "auto" (`unused_target_token` of the target's tokenizer)."""
    if mask_token_id == "auto":
        from .targets import unused_target_token

        return unused_target_token(target_model()[1], vocab_size)
    try:
        token = int(mask_token_id)
    except (TypeError, ValueError):
        raise ValueError(f"--mask-token-id takes a token id or 'auto', got {mask_token_id!r}") from None
    if not 0 <= token < vocab_size:
        raise ValueError(f"--mask-token-id {token} is outside the target's vocabulary (0..{vocab_size - 1})")
    return token


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
