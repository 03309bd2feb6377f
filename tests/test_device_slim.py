"""`examples/device_slim.sh`: what a device call sends stays under its 64 MiB, and the checkout comes back as it was."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_slim_keeps_what_travels_under_64_mib_and_restores_the_index(tmp_path):
    """`examples/device_slim.sh slim` leaves the large checkpoints out of what a device call sends (the files stay
    on disk), refuses to slim twice, and `restore` gives back the index and the exclude file as they were."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(clone)], check=True)
    script = clone / "examples" / "device_slim.sh"
    script.write_bytes((ROOT / "examples" / "device_slim.sh").read_bytes())  # this checkout's version
    subprocess.run(["git", "add", "examples/device_slim.sh"], cwd=clone, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "t"],
                   cwd=clone, check=True)

    def slim(action: str, check: bool = True, paths: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "SLIM_PATHS": paths} if paths else None
        return subprocess.run(["bash", str(script), action], cwd=clone, capture_output=True, text=True, check=check,
                              env=env)

    exclude = clone / ".git" / "info" / "exclude"
    exclude_before = exclude.read_text() if exclude.exists() else ""
    before = float(slim("size").stdout)
    assert "would travel" in slim("slim").stdout
    assert float(slim("size").stdout) < 64
    assert (clone / "checkpoints" / "campaign-smollm2" / "model.safetensors").is_file()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status and all(line.startswith("D  checkpoints/") for line in status.splitlines())
    assert "already slim" in slim("slim", check=False).stderr
    slim("restore")
    assert float(slim("size").stdout) == before
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout == ""
    assert (exclude.read_text() if exclude.exists() else "") == exclude_before

    # every checkpoint out (the drafter campaign's lease), and `restore` without SLIM_PATHS puts back all of them
    slim("slim", paths="all")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=clone, capture_output=True, text=True).stdout.split("\0")
    outside = sum((clone / f).stat().st_size for f in tracked if f and not f.startswith("checkpoints/")) / 2**20
    assert abs(float(slim("size").stdout) - outside) <= 0.1  # what travels: every tracked file but the checkpoints
    assert outside < 64 - 8 - 1  # room beside it for a lease's part of at least 8 MiB (`drafter_campaign.sh lease`)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert "checkpoints/smollm2-135m-instruct-dflash/" in status
    slim("restore")
    assert float(slim("size").stdout) == before
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout == ""
    assert (exclude.read_text() if exclude.exists() else "") == exclude_before
