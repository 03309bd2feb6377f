"""The equal-tau benchmark (`hf_diffspec.bench.equal_tau`) on a tiny random target in fp32: z-lab's loop and ours
run the real drafter and face the same accepts, so they take the same steps; every arm writes plain `generate`'s
output. Speeds are reported by the benchmark, never asserted."""

import importlib.util
import json

import pytest
import torch

from hf_diffspec.bench.equal_tau import (
    ARMS, PositionOracle, check_equal_tau, equal_tau_rows, main,
)
from hf_diffspec.bench.peers import zlab_method
from helpers import random_ids, tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("dflash") is None,
                                reason="z-lab's package is a peer: pip install --no-deps dflash==0.1.0")


@pytest.fixture(autouse=True)
def no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))  # the live arm runs on the drafter's own length
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")


@pytest.mark.parametrize("ahead", ["0", "1"], ids=["at-each-step", "drafting-ahead"])
def test_zlabs_loop_and_ours_take_the_same_steps_and_write_plain_generates_output(ahead, monkeypatch):
    """Drafting at each step (a CPU's default) and ahead (a GPU's): the oracle reads each pass's positions."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", ahead)
    target = tiny_target("qwen3", seed=0, layers=4)
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, block_size=8, mask_token_id=3)
    zlab = zlab_method(drafter, target)
    inputs = {"input_ids": random_ids(5, 24)}
    with torch.inference_mode():
        rows = equal_tau_rows(target, drafter, zlab, inputs, 40, [2, 4], list(ARMS), repeats=1,
                              progress=lambda _: None)
    assert check_equal_tau(rows) == []
    for tau in (2, 4):
        by_arm = {r["arm"]: r for r in rows if r["oracle_tau"] == tau}
        assert set(by_arm) == set(ARMS)
        assert all(r["identical_to_plain"] and r["settled"] for r in by_arm.values()), by_arm
        # the same accepts: the same steps, not merely close taus
        assert by_arm["zlab"]["steps"] == by_arm["ours-block"]["steps"] == by_arm["ours-block-static"]["steps"]
        assert 0.6 * tau <= by_arm["zlab"]["tau"] <= 1.5 * tau
        assert by_arm["plain"]["vs_plain"] == 1.0 and by_arm["zlab"]["vs_zlab"] == 1.0


def test_the_oracle_decides_each_position_once_whoever_asks():
    reference = list(range(10, 60))
    one, two = (PositionOracle([reference], 0.5, 128, extra=8, seed=3) for _ in range(2))
    assert torch.equal(one.table(0, "cpu"), two.table(0, "cpu"))
    table = one.table(0, "cpu")
    right = table[: len(reference)] == torch.tensor(reference)
    assert 0 < int(right.sum()) < len(reference)  # some right, some wrong, at q = 0.5
    assert PositionOracle([reference], 1.0, 128, extra=8).table(0, "cpu")[:50].tolist() == reference
    assert not torch.equal(PositionOracle([reference], 0.5, 128, extra=8, seed=4).table(0, "cpu"), table)


def test_an_arm_off_z_labs_tau_or_unsettled_is_named():
    rows = [{"oracle_tau": 3.0, "arm": "zlab", "tau": 3.0, "settled": True},
            {"oracle_tau": 3.0, "arm": "ours-block", "tau": 2.5, "settled": True},
            {"oracle_tau": 3.0, "arm": "ours-block-static", "tau": 3.0, "settled": False},
            {"oracle_tau": 3.0, "arm": "ours-live", "tau": 1.2, "settled": False}]  # not an equal-tau arm
    problems = check_equal_tau(rows)
    assert problems == ["tau 3, ours-block: tau 2.5 against z-lab's 3.0",
                        "tau 3, ours-block-static: its reference did not settle"]


def test_the_command_runs_at_tiny_scale_and_writes_its_record(tmp_path, capsys):
    path = tmp_path / "equal_tau.json"
    main(["--target", "tiny", "--taus", "3", "--max-new-tokens", "24", "--repeats", "1", "--json", str(path)])
    record = json.loads(path.read_text())
    assert record["problems"] == []
    assert [r["arm"] for r in record["rows"]] == list(ARMS)
    assert {"cpu", "isa_flags", "torch", "transformers"} <= set(record["machine"])  # the machine each figure needs
    assert "| 3 | ours-block |" in capsys.readouterr().out
