"""Rules the whole package shares: where the cache lives, how a file is written so that it is never seen half
written, and which token pads a batch.

They live in the runtime folder because the runtime needs them too (the cost model's profiles, padding finished
rows) and this folder may import only the standard library, torch, transformers and its siblings; the rest of
hf_diffspec and the trainers import them from here.
"""

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: Environment variable that moves the cache root.
CACHE_ENV = "HF_DIFFSPEC_CACHE"


def cache_dir() -> Path:
    """Root of the hf_diffspec cache: `$HF_DIFFSPEC_CACHE` if set, else `~/.cache/hf_diffspec`.

    Holds `wheels/` (PyPI wheels), `models/` (built-in targets) and `profiles/` (measured verify costs). Not created
    here: whoever writes into it creates what it needs.
    """
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hf_diffspec"


def atomic_write(path: str | os.PathLike[str], content: str | bytes | Callable[[Path], None]) -> Path:
    """Write a file so that `path` holds either its old content or the complete new one, never a part.

    `content` is the text or bytes to write, or a function that writes the file at the path it is given. It is
    written under a temporary name beside `path` (same file system; `.NAME.tmp-PID-THREAD`, so writers in several
    threads never share one) and renamed into place; on any error the
    temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            content(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def publish_dir(src: Path, dest: Path, is_complete: Callable[[Path], bool]) -> Path:
    """Move the finished directory `src` to `dest` in one rename, so that `dest` is only ever seen whole.

    An incomplete `dest` (left by an old version or a manual copy) is renamed aside and deleted first. If another
    process published a complete `dest` meanwhile (`is_complete(dest)`), theirs is kept and `src` deleted.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            os.replace(src, dest)  # fails if dest is a non-empty directory
            return dest
        except OSError:
            if is_complete(dest):
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


def pad_token_id(source) -> int | None:
    """The token that pads a batch and fills rows that finish early: `source.pad_token_id`, else its (first) EOS
    token, else None.

    `source` is a tokenizer, a `GenerationConfig` or a model config: the same rule everywhere, as plain `generate`
    falls back to EOS when no pad token is set.
    """
    pad = getattr(source, "pad_token_id", None)
    if pad is None:
        pad = getattr(source, "eos_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
    return None if pad is None else int(pad)
