"""The measured cost model: profiles, interpolation, choosing how much to verify, and losslessness with it on."""

import json
import logging
import random
import subprocess
import sys
import time

import pytest
import torch

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator, PrefixTreeCandidateGenerator
from hf_diffspec.runtime.control_speculation import SpeculationController
from hf_diffspec.runtime.control_cost import VerifyCost, best_node_count
from hf_diffspec.runtime.control_profiles import measure_verify_cost, profile_key, save_profile, verify_cost_for
from helpers import steer_steps, tiny_drafter, tiny_target


def test_interpolation_and_extrapolation():
    cost = VerifyCost({1: {1: 1.0, 4: 1.3, 8: 2.1}, 4: {1: 2.0, 4: 3.0, 8: 5.0}})
    assert cost(1) == 1.0 and cost(0) == 1.0
    assert cost(2) == pytest.approx(1.1) and cost(6) == pytest.approx(1.7)
    assert cost(12) == pytest.approx(2.9)
    assert cost(4, rows=4) == 3.0 and cost(4, rows=2) == pytest.approx(1.3 + (3.0 - 1.3) / 3)
    assert cost(1, rows=8) == pytest.approx(2.0 + (2.0 - 1.0) / 3 * 4)  # beyond the profile: linear in rows


def test_the_profile_is_refined_by_what_steps_cost():
    """A profile measured on a short context, and steps that cost twice that at 1 slot and three times at 8 (a long
    context): the cost follows what is observed, between observed sizes too, per batch-size bucket."""
    cost = VerifyCost({1: {1: 1.0, 8: 2.0, 16: 4.0}, 4: {1: 2.0, 16: 8.0}})
    for _ in range(150):
        cost.observe(1, 1, 2.0)
        cost.observe(8, 1, 6.0)
    assert cost(1) == pytest.approx(2.0, rel=0.01) and cost(8) == pytest.approx(6.0, rel=0.01)
    assert cost(4) == pytest.approx(cost.profiled(4) * 2.43, rel=0.01)  # ratio interpolated between 2 and 3
    assert cost(16) == pytest.approx(12.0, rel=0.01)  # flat beyond the largest observed size
    assert cost(1, 4) == 2.0 and cost.profiled(8) == 2.0  # other buckets and the profile itself untouched
    cost.observe(2, 3, 2.2)  # 3 rows share the bucket of 4
    assert cost(2, 3) == pytest.approx(2.2)
    assert cost(2, 4) / cost.profiled(2, 4) == pytest.approx(2.2 / cost.profiled(2, 3))


def test_verify_more_only_when_it_pays():
    flat = VerifyCost({1: {1: 1.0, 16: 1.0}})           # verifying is free: take every node with any chance
    steep = VerifyCost({1: {1: 1.0, 2: 2.0, 16: 16.0}})  # each token costs a full forward: never worth it
    probs = [0.9, 0.8, 0.5, 0.1, 0.01]
    assert best_node_count([probs], flat, 0.1) == 6
    assert best_node_count([probs], steep, 0.1) == 1
    moderate = VerifyCost({1: {1: 1.0, 3: 1.05, 6: 1.5}})
    assert best_node_count([probs], moderate, 0.2) == 4  # confident nodes in, long shots out
    assert best_node_count([[0.0, 0.0]], moderate, 0.2) == 1


def test_a_compute_bound_batch_verifies_shorter_drafts():
    """The same drafts: at batch 1 (flat costs) the whole chain is worth verifying; 16 rows make each extra slot cost
    16 tokens, so only the confident heads are verified."""
    cost = VerifyCost({1: {1: 1.0, 8: 1.05}, 16: {1: 2.0, 2: 3.0, 8: 9.0}})
    probs = [0.9, 0.7, 0.5, 0.35, 0.25]
    assert best_node_count([probs], lambda n: cost(n, 1), 0.1) == 6
    # rates per slot count n = 1..4: 7.6, 9.8, 10.1, 9.7 rows-tokens/s: two drafts per row
    assert best_node_count([probs] * 16, lambda n: cost(n, 16), 0.1) == 3


def test_profile_is_keyed_by_device_dtype_and_threads(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # nothing measured on the fly: the keys decide what is found
    target = tiny_target("llama")
    assert verify_cost_for(target) is None
    costs = measure_verify_cost(target, sizes=(1, 2, 4), batches=(1, 3), context_length=16, repeats=2)
    assert set(costs) == {1, 3} and set(costs[3]) == {1, 2, 4} and all(t > 0 for t in costs[1].values())
    path = save_profile(target, costs)
    assert verify_cost_for(target).costs == costs
    key = profile_key(target)
    assert profile_key(target.to(torch.bfloat16)) != key  # another dtype is another profile: measured anew
    assert verify_cost_for(target) is None
    target.to(torch.float32)
    path.write_text(json.dumps({"key": key, "verify_seconds": {"1": 0.1, "4": 0.2}}))  # the batch-1 format
    with caplog.at_level(logging.WARNING):
        assert verify_cost_for(target) is None
    assert "older measurement" in caplog.text


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.every_step_speculates("asserts the lengths a saved synthetic profile chooses")
def test_cost_model_lengths_stay_lossless(tmp_path, monkeypatch, dual):
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("qwen3", seed=6, sharpen=4)
    save_profile(target, {1: {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.2, 16: 1.6}})
    drafter = tiny_drafter(target, block_size=8)
    with torch.no_grad():  # confident on some slots, unsure on others: the cost model's choice then varies
        drafter.norm.weight.mul_(30)
    if dual:
        drafter = hf_diffspec.DualDiffusionDrafter.from_drafters(drafter, None, num_branches=3)
    sizes = []
    generator_class = PrefixTreeCandidateGenerator if dual else DiffusionCandidateGenerator
    original = generator_class.propose

    def recording(self, *args, **kwargs):
        trees = original(self, *args, **kwargs)
        sizes.extend(len(t) for t in trees)
        return trees

    monkeypatch.setattr(generator_class, "propose", recording)
    ids = torch.randint(2, 128, (1, 9))
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=25),
                       target.generate(ids, max_new_tokens=25))
    assert len(set(sizes[:-3])) > 1, "the verified size should follow the drafter's confidence"
    if not dual:  # a user-set num_assistant_tokens is a fixed length, whatever the profile says
        sizes.clear()
        assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=25, num_assistant_tokens=2),
                           target.generate(ids, max_new_tokens=25))
        assert set(sizes[:-3]) == {3}


def test_a_missing_profile_is_measured_once(tmp_path, monkeypatch):
    from hf_diffspec.runtime import control_profiles as cost_model

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    # whatever else this machine runs now: the guards against a busy machine have tests of their own
    monkeypatch.setattr(cost_model, "implausible_costs", lambda costs: None)
    monkeypatch.setattr(cost_model, "MAX_OTHERS_LOAD", float("inf"))
    target = tiny_target("llama")
    cost = verify_cost_for(target)
    assert cost is not None and set(cost.costs) == {1, 4, 16} and set(cost.costs[1]) == {1, 2, 4, 8, 16}
    assert (tmp_path / "profiles" / f"{profile_key(target)}.json").is_file()
    monkeypatch.setattr(cost_model, "measure_verify_cost", None)  # cached: measured once per process and machine
    again = verify_cost_for(target)
    assert again is not cost and again.costs == cost.costs  # each call its own copy


def test_a_disturbed_profile_is_measured_again(tmp_path, monkeypatch, caplog):
    """A curve where 2 tokens cost 13x one token (seen here while another process held the cores) is re-measured."""
    from hf_diffspec.runtime import control_profiles as cost_model

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "1")
    disturbed = {1: {1: 0.306, 2: 4.052, 4: 4.063, 8: 4.091, 16: 4.126}}
    quiet = {1: {1: 0.05, 2: 0.06, 4: 0.094, 8: 0.169, 16: 0.305}}
    assert cost_model.implausible_costs(disturbed) and cost_model.implausible_costs(quiet) is None
    measured = iter([disturbed, quiet])
    monkeypatch.setattr(cost_model, "measure_verify_cost", lambda target, **kw: next(measured))
    with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
        cost = verify_cost_for(tiny_target("llama"))
    assert cost.costs == quiet and "disturbed" in caplog.text


def test_the_controller_outlives_a_generate_call_for_the_same_setup_only():
    """What one call learned (its drafter steps accepted nothing) is where the next call starts, weighed less; another
    target, thread count or method starts afresh."""
    from hf_diffspec.runtime.control_speculation import AlwaysSpeculate, StepKind, StepRecord
    from hf_diffspec.runtime.drafting import candidate_generator_for

    target, other = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=4)
    policy = candidate_generator_for(drafter, target).policy
    policy.control.record(StepRecord(StepKind.DRAFT, 1, 0, 1, 1.0, 4, 0.5, 0.5), [0], [0])  # what a call measured
    policy.keep_measurements()  # as the call does at its end
    kept = candidate_generator_for(drafter, target).policy.control
    assert kept is not policy.control and kept.drafter.trials == {k: 0.5 * v for k, v in
                                                                  policy.control.drafter.trials.items()}
    assert not candidate_generator_for(drafter, other).policy.control.drafter.trials
    assert isinstance(candidate_generator_for(drafter, target, num_draft_tokens=2).policy.control,
                      AlwaysSpeculate)  # fixed: no measured controller
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not candidate_generator_for(drafter, target).policy.control.drafter.trials
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.every_step_speculates("counts the plain and drafter steps of a fixed pattern")
def test_plain_steps_mixed_with_speculative_ones_stay_identical(monkeypatch, seed):
    """Whatever the controller chooses, each step (plain or speculative) commits the target's own tokens; the
    drafter's context catches up on the tokens committed by plain steps."""
    import random

    rng = random.Random(seed)
    steer_steps(monkeypatch, iter(lambda: rng.random() < 0.5, None))
    target = tiny_target("qwen3", seed=seed)
    drafter = tiny_drafter(target, block_size=4, seed=seed)
    ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.2)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    stats = out.speculation_stats
    assert stats.plain_steps + stats.lookup_steps > 0 and stats.draft_forwards > 0


QUIET = {1: {1: 0.05, 2: 0.06, 4: 0.08, 8: 0.12, 16: 0.2}, 4: {1: 0.06, 2: 0.075, 4: 0.1, 8: 0.16, 16: 0.28}}
REACH = [[0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1], [0.5, 0.2, 0.1], [0.1, 0.05, 0.02], [0.99] * 15]


def decisions(cost):
    """What the policy would verify under `cost`: best slot counts for a few reach lists, at 1 and 4 rows."""
    return [best_node_count([reach] * rows, lambda n: cost(n, rows), 0.01) for reach in REACH for rows in (1, 4)]


@pytest.mark.parametrize("poison", ["slow_one_token", "non_monotone"])
def test_a_poisoned_profile_file_is_measured_again_on_load(tmp_path, monkeypatch, caplog, poison):
    """A profile cached while another process held the cores (T(1) 5x its quiet value; a 4-token forward at 0.48x a
    1-token one, as seen on a 2-core machine) is not trusted: the next call measures again and decides as the quiet
    profile does."""
    from hf_diffspec.runtime import control_profiles as cost_model

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    poisoned = {b: dict(row) for b, row in QUIET.items()}
    if poison == "slow_one_token":
        poisoned[1][1] = 5 * QUIET[1][1]
    else:
        poisoned[1][4] = 0.48 * poisoned[1][1]
    save_profile(target, poisoned)
    assert decisions(VerifyCost(poisoned)) != decisions(VerifyCost(QUIET))  # the poison changes what is verified
    monkeypatch.setattr(cost_model, "measure_verify_cost", lambda target, **kw: QUIET)
    with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
        cost = verify_cost_for(target)
    assert "measuring it again" in caplog.text
    assert decisions(cost) == decisions(VerifyCost(QUIET))
    assert cost_model.read_profile(cost_model.profile_path(target)) == (QUIET, None)  # the quiet one is cached


def test_live_steps_faster_than_the_profile_measure_it_again_once(tmp_path, monkeypatch, caplog):
    """A profile measured while the machine was busy all along (every forward 5x slower: a plausible curve) is caught
    by the loop: its steps run far faster than profiled, so it is measured again, once, with one log line."""
    from hf_diffspec.runtime import control_profiles as cost_model

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("qwen3", seed=6, sharpen=4)
    slow = {b: {n: 40 * t for n, t in row.items()} for b, row in QUIET.items()}  # seconds: far slower than live
    save_profile(target, slow)
    measured = []

    def measure(target, **kw):  # a measurement takes a while; no step is charged for it
        measured.append(1)
        time.sleep(1.0)
        return QUIET

    monkeypatch.setattr(cost_model, "measure_verify_cost", measure)
    monkeypatch.setattr(cost_model, "MAX_OTHERS_LOAD", float("inf"))  # one attempt whatever else runs now
    step_seconds = []
    record = SpeculationController.record
    monkeypatch.setattr(SpeculationController, "record", lambda self, step, *rest: step_seconds.append(step.seconds)
                        or record(self, step, *rest))
    drafter = tiny_drafter(target, block_size=8)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
            assert torch.equal(out, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert len(measured) == 1 and caplog.text.count("live steps disagree") == 1
    assert max(step_seconds) < 0.9, "the re-measurement's time was charged to a step (and the controller)"
    assert verify_cost_for(target).costs == QUIET
    assert cost_model.read_profile(cost_model.profile_path(target)) == (QUIET, None)


def test_a_profile_measured_under_load_serves_this_process_only(tmp_path, monkeypatch, caplog):
    """Two processes spinning on the cores while the first call measures: the profile is used by every target of
    the architecture in this process (a second instance measures nothing), and another process, which may run on a
    quieter machine, measures again."""
    from hf_diffspec.runtime import control_profiles as cost_model

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
            cost = verify_cost_for(target)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert cost is not None and "busy machine" in caplog.text
    path = cost_model.profile_path(target)
    monkeypatch.setattr(cost_model, "measure_verify_cost", None)  # this process measures once
    assert verify_cost_for(target).costs == cost.costs
    assert verify_cost_for(tiny_target("llama")).costs == cost.costs  # another instance of the architecture
    costs, problem = cost_model.read_profile(path)
    assert costs == cost.costs and problem is None
    another = subprocess.run([sys.executable, "-c", "from hf_diffspec.runtime.control_profiles import read_profile; "
                              f"print(read_profile(__import__('pathlib').Path({str(path)!r}))[1])"],
                             capture_output=True, text=True, check=True)
    assert "measured on a busy machine by another process" in another.stdout


def test_other_processes_load_counts_other_processes_only(monkeypatch):
    """Machine-wide busy time minus this process's own CPU time, per second of wall time."""
    from hf_diffspec.runtime import control_profiles as cost_model

    readings = {"busy": iter([100.0, 103.0]), "own": iter([10.0, 11.8]), "clock": iter([50.0, 52.0])}
    monkeypatch.setattr(cost_model, "_machine_busy_seconds", lambda: next(readings["busy"]))
    monkeypatch.setattr(cost_model, "_own_cpu_seconds", lambda: next(readings["own"]))
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: next(readings["clock"]))
    with cost_model.OtherProcessesLoad() as load:
        pass
    assert load.cores == pytest.approx((3.0 - 1.8) / 2.0)
    assert cost_model._machine_busy_seconds is not None  # and the real readers work on this machine:
    monkeypatch.undo()
    assert cost_model._machine_busy_seconds() > 0 and cost_model._own_cpu_seconds() > 0


def test_profile_show_and_clear(tmp_path, monkeypatch, capsys):
    from hf_diffspec.cli import main

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    path = save_profile(target, QUIET, others_load=0.02)
    price = path.parent / "drafting-0123456789abcdef.json"  # as `drafting_price_for` writes it
    price.write_text(json.dumps({"method": "BestFirstTreeCandidateGenerator", "price": {"1": 0.234, "16": 1.5}}))
    main(["profile", "--show"])
    shown = capsys.readouterr().out
    assert path.name in shown and "llama" in shown and "T(1 row, 1 token) = 50.0 ms" in shown and "0.02 cores" in shown
    assert "BestFirstTreeCandidateGenerator drafting pass costs 0.23 at 1 rows, 1.50 at 16 rows" in shown
    main(["profile", "--clear"])
    assert not path.exists() and not price.exists() and "removed" in capsys.readouterr().out
    main(["profile", "--show"])
    assert "no verify-cost profiles" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["cut_short", "not_json", "foreign_layout", "empty_costs"])
def test_a_damaged_profile_file_is_reported_once_and_measured_again(tmp_path, monkeypatch, caplog, damage):
    """A profile cut short (a full disk), overwritten, from another program or emptied: the call logs one line
    naming the file, measures the profile again and decodes exactly as plain generate; the next call too."""
    from hf_diffspec.runtime import control_profiles as cost_model
    from hf_diffspec.runtime.control_state import reset_speculation_state

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    reset_speculation_state()  # as a new process: the profile is read from the file
    target = tiny_target("llama", seed=5, sharpen=4)
    save_profile(target, QUIET)
    path = cost_model.profile_path(target)
    text = path.read_text()
    path.write_text({"cut_short": text[: len(text) // 2], "not_json": "\x00\x01 binary",
                     "foreign_layout": json.dumps([1, 2, 3]),
                     "empty_costs": json.dumps({"format": cost_model.PROFILE_FORMAT, "verify_seconds": {}})}[damage])
    measured = []
    monkeypatch.setattr(cost_model, "measure_verify_cost", lambda target, **kw: measured.append(1) or QUIET)
    drafter = tiny_drafter(target, block_size=8)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
            assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False))
    damaged = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(damaged) == 1 and str(path) in damaged[0].getMessage()  # once: the next call uses what was measured
    assert measured


def test_a_cache_folder_that_cannot_be_written_gives_identical_output(tmp_path, monkeypatch, caplog):
    """HF_DIFFSPEC_CACHE under a regular file (as a read-only home in a container): the profile is measured, cannot
    be saved (one log line), and every call decodes exactly as plain generate."""
    from hf_diffspec.runtime import control_profiles as cost_model
    from hf_diffspec.runtime.control_state import reset_speculation_state

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(blocker / "cache"))
    reset_speculation_state()
    # the save is attempted whatever this machine runs now (on a busy one nothing would be saved): its guards
    # against a busy machine have tests of their own
    monkeypatch.setattr(cost_model, "implausible_costs", lambda costs: None)
    monkeypatch.setattr(cost_model, "MAX_OTHERS_LOAD", float("inf"))
    target = tiny_target("llama", seed=7, sharpen=4)
    drafter = tiny_drafter(target, block_size=8)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="hf_diffspec.runtime.control_profiles"):
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
            assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False))
    assert "cannot be cached (NotADirectoryError" in caplog.text


def test_widths_observed_at_different_loads_keep_the_profiles_shape():
    """Wide steps seen while the machine was busy, one-token steps while it was quiet (calls in threads come and go):
    the load moves every width's price, so a wide forward is not priced out against a one-token one."""
    cost = VerifyCost({1: {1: 1.0, 8: 2.0, 16: 4.0}})
    for _ in range(3):
        cost.observe(8, 1, 6 * cost.profiled(8))
    cost.observe(1, 1, 2 * cost.profiled(1))
    assert cost(8) / cost(1) == pytest.approx(cost.profiled(8) / cost.profiled(1), rel=0.15)
    assert 2 < cost(1) < 6  # the load, between what was seen
    assert cost.loaded(1) == pytest.approx(cost.profiled(1) * cost.loads[1])


def test_a_machine_busier_than_its_profile_keeps_drafting_what_pays(tmp_path, monkeypatch):
    """The profile measured quiet (the first call's), then every step timed 6x slower (other processes on the cores):
    a drafter whose drafts are all accepted (an oracle's) keeps drafting. Its first step's cost and what that step
    committed are priced at the same load (the cost model observes a step before the controller charges it), and
    drafting timed at a load is priced against verifying at that load."""
    from hf_diffspec.runtime.device_clock import StepClock
    from helpers import PerThreadReference, oracle_drafter_outputs, random_ids

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama", seed=3, sharpen=4)
    drafter = tiny_drafter(target, block_size=8, draft_tree_budget=10, draft_tree_width=3)
    ids = random_ids(0, 6).repeat(1, 3)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    reference = PerThreadReference()
    reference.use(plain[0])
    oracle_drafter_outputs(monkeypatch, drafter, target, reference)
    # the profile of a quiet machine: the one-token forward measured, wider ones as a quiet tiny model's cost (nearly
    # flat); measured whole on a busy machine, its wide forwards can look dear enough to price out the first try
    one = measure_verify_cost(target, sizes=(1,), batches=(1,), context_length=16, repeats=5)[1][1]
    save_profile(target, {1: {n: one * (1 + 0.02 * (n - 1)) for n in (1, 2, 4, 8, 16)}})
    seconds = StepClock.seconds
    monkeypatch.setattr(StepClock, "seconds", lambda self, start, end: 6 * seconds(self, start, end))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    steps = out.speculation_stats.committed_per_step
    assert sum(steps) >= 3 * len(steps), f"tokens a step: {steps}"


def test_the_drafting_price_is_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    """A drafting pass's price in verify steps (`drafting_price_for`): measured the first time for a row count, kept
    by the target, cached on disk (a new process, or after a reset, reads it without measuring), measured again for
    another row count; with automatic profiling off and nothing cached, none (the controller then guesses)."""
    from hf_diffspec.runtime import control_profiles
    from hf_diffspec.runtime.control_policy import FixedLength
    from hf_diffspec.runtime.control_state import reset_speculation_state

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(control_profiles, "MAX_OTHERS_LOAD", float("inf"))  # cached however busy (a CI machine is)
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, block_size=8)
    measured = []
    measure = control_profiles.measure_drafting_price
    monkeypatch.setattr(control_profiles, "measure_drafting_price",
                        lambda *args, **kw: measured.append(args[2]) or measure(*args, **kw))

    def price(rows):
        return control_profiles.drafting_price_for(target, drafter, DiffusionCandidateGenerator, rows, lambda: (
            DiffusionCandidateGenerator(drafter, target, FixedLength(7, 8))))

    first = price(1)
    assert 0 < first < 100 and measured == [1]
    assert price(1) == first and measured == [1]
    reset_speculation_state()
    assert price(1) == first and measured == [1]  # read from the cached file
    price(4)
    assert measured == [1, 4] and len(list((tmp_path / "profiles").glob("drafting-*.json"))) == 1
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")
    assert price(16) is None and measured == [1, 4]
