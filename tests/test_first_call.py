"""The first call a user makes, on every family, in the configuration users run: a fresh process, an empty cache
directory, nothing switched off (the first-use verify-cost profile is measured, the live gates choose each step, the
drafter runs the runtime's default trees and prompt lookup). Greedy fp32 output must equal plain `generate`'s on the
first call and on a second one that reads the cached profile (`tests/first_call.py`); the first call speculates and
caches its profile in the user's cache directory, or says that the machine was too busy to (no assertion depends on
a quiet machine). And each published target of
the README, rehearsed end to end from folders laid out like the real checkpoints (`tests/published_rehearsal.py`)
through the README's own command, `examples/published_drafter.py`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_diffspec.cli import main
from first_call import CASES

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def users_environment(cache: Path) -> dict:
    """This environment as a user's shell has it: no hf_diffspec switch set, an empty cache of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_DIFFSPEC_")}
    return {**env, "HF_DIFFSPEC_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("case", list(CASES))
def test_first_call_speculates_caches_its_profile_and_both_calls_equal_plain_generate(case, tmp_path):
    run = subprocess.run([sys.executable, str(TESTS / "first_call.py"), case], env=users_environment(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first, second = result["first"], result["second"]
    assert first["identical"] and second["identical"], result
    # the controller tries the drafter in the first call: its price, measured against a verify step, fits the call's
    # budget. Measured while other processes took the cores, the verify profile (or the price) is not cached, and
    # its costs can make no first try fit (beside two busy loops: 0 drafter steps, 39 plain ones, in one of four
    # first calls on Gemma 3, and on the Qwen3.5 hybrid in a fresh clone's run): then the first call need not try
    if result["profile_cached"] and result["drafting_price_cached"]:
        assert first["draft_steps"] >= 1, result
        # and it verifies drafts (its own or prompt lookup's), unless the measured costs said no draft pays
        assert first["draft_forwards"] >= 1 or first["node_counts"] and max(first["node_counts"]) == 1, result
    assert first["profile_measurements"] >= 1, "the first call measures the verify-cost profile"
    assert Path(result["profile_path"]).parent == tmp_path / "profiles"  # in the user's cache directory
    busy = [w for w in first["warnings"] if "measured on a busy machine" in w and "not cached for others" in w]
    if result["profile_cached"]:  # a good profile, read by the second call without measuring again
        assert Path(result["profile_path"]).is_file() and result["cached_profile_problem"] is None, result
        assert second["profile_measurements"] == 0 and not result["profile_rewritten_by_second_call"], result
    else:  # only on a busy machine (other processes took the cores): the first call said so, and the profile it
        # measured serves this process (the second call reads it as it is)
        assert busy, result
        assert Path(result["profile_path"]).is_file() and result["cached_profile_problem"] is None, result


@pytest.mark.parametrize("name", ["Qwen3.6-35B-A3B", "Qwen3-8B", "gemma-4-31B-it", "gpt-oss-20b"])
def test_published_target_rehearsed_end_to_end(name, tmp_path, monkeypatch, capsys):
    pytest.importorskip("dflash.model", reason="z-lab's package: pip install --no-deps dflash==0.1.0")
    from published_rehearsal import write

    target_dir, drafter_dir, template_kwargs = write(name, tmp_path)
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "published_drafter.py"), "--target", str(target_dir), "--drafter",
         str(drafter_dir), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "40",
         "--chat-template-kwargs", json.dumps(template_kwargs)],
        env=users_environment(tmp_path / "cache"), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "identical to plain generate: True" in run.stdout, run.stdout[-2000:]
    # `hf-diffspec profile` measures the full grid on a context longer than gpt-oss's window (128)
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path / "cache"))
    try:
        main(["profile", "--target", str(target_dir), "--dtype", "float32", "--repeats", "1", "--batch-sizes", "1,2"])
    except SystemExit as refused:  # a busy machine: measured, not saved
        assert "not saved" in str(refused)
    else:
        assert "saved" in capsys.readouterr().out
