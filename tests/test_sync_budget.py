"""A decoding step the device does not wait for: the host synchronisations (`.item()`, `.tolist()`, `bool(tensor)`,
`nonzero()`, copies to the host) and host-to-device copies between two target forwards stay within a small budget
that does not grow with the batch's rows, the tree's size or how many drafts are accepted (greedy decoding with
transformers' built-in processors and criteria: EOS, max length, suppressed tokens).

The first window (after the prefill) may also hold the prefill's own reads, once per call (the prompts' padding and
the first tokens). Where the remaining ones are, per step (`HostSyncCounter` counts them outside the target's and the drafter's
forwards; see `hf_diffspec/bench/host_syncs.py`):
- syncs (no wait for the whole device among them: steps are timed by stamps read later): one copy of the step's
  outcome to the host (accepted length, committed tokens and stop flags of every row, `BatchState.accept`), with
  prompt-lookup drafts too (they join the drafter's tokens unread: `CandidateTree.lookup`). A drafter step runs the
  next step's drafting pass before that copy (`drafting.draft_ahead`), so what the host reads to build the next
  trees rides on it: the drafter's confidences or its length head's reach when the cost model sizes chains, every
  row's top-k draft probabilities and tokens for best-first trees. A step that drafts after a step that did not
  (a lookup or plain step, whose successor is not drafted ahead) reads its pass once more; DFlash 2's selector
  trees read their tables (`drafting_best_first.selector_tables`) like best-first trees their probabilities, and
  D²SD its plans and branches (`drafting_prefix_tree.plan_table`);
- copies: the anchors and their positions to the drafter (one, only on such steps), the verified trees' tokens and
  parents when they were built on the host (one), and the rows still decoding when some finished (one, only on
  such steps).
"""

import pytest
import torch

from hf_diffspec.bench.host_syncs import HostSyncCounter
from helpers import oracle_drafter_outputs, tiny_drafter, tiny_target

# the outcome, and what the next step's trees are built from riding on it; one more on a step that switches to
# drafting (`_allowed`)
SYNC_BUDGET = 1
COPY_BUDGET = 3
PREFILL_READS = 3

VOCAB = 48


def _prompts(rows: int, seed: int = 0) -> torch.Tensor:
    """Prompts that repeat a phrase, so prompt lookup finds drafts in every row."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, VOCAB, (rows, 6), generator=gen)
    return torch.cat([phrase, torch.randint(2, VOCAB, (rows, 3), generator=gen), phrase, phrase[:, :3]], dim=1)


# a user's sampling settings (Qwen3 ships temperature 0.6, top-k 20, top-p 0.95)
SAMPLING = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


# the live cost model's profile (seconds by rows and slots), given rather than measured: a measurement's own forwards
# and reads are no step's
LIVE_COSTS = {1: {1: 1.0, 4: 1.1, 8: 1.3, 16: 1.8}, 4: {1: 1.2, 4: 1.4, 8: 1.8, 16: 2.6},
              16: {1: 1.6, 4: 2.2, 8: 3.0, 16: 4.6}}


class _Steps(list):
    """Per step, whether it drafted at its own step (a drafter step whose pass was not run ahead); `drafted`: per
    step, whether it was a drafter step."""

    def __init__(self):
        super().__init__()
        self.drafted = []


def _record_steps(monkeypatch) -> _Steps:
    """The steps of the calls that follow, in order (`_Steps`)."""
    from hf_diffspec.runtime import drafting
    from hf_diffspec.runtime.control_speculation import AlwaysSpeculate, SpeculationController, StepKind

    own_pass = _Steps()
    for cls in (SpeculationController, AlwaysSpeculate):
        def deciding(self, *args, decide=cls.decide):
            kind, depth = decide(self, *args)
            own_pass.append(kind is StepKind.DRAFT)  # until `propose` says it had a pass run ahead
            own_pass.drafted.append(kind is StepKind.DRAFT)
            return kind, depth

        monkeypatch.setattr(cls, "decide", deciding)
    for cls in (drafting.DiffusionCandidateGenerator, drafting.BestFirstTreeCandidateGenerator,
                drafting.PrefixTreeCandidateGenerator):
        def proposing(self, *args, propose=cls.propose):
            own_pass[-1] = len(args) < 4 or args[3] is None
            return propose(self, *args)

        monkeypatch.setattr(cls, "propose", proposing)
    return own_pass


def _allowed(own_pass: list) -> list[int]:
    """Reads allowed in each window between two target forwards: window i holds step i - 1's outcome and step i's
    drafting; a drafter step whose pass was not run ahead (after a lookup or plain step, or a probe the controller
    did not expect to pay) reads its own."""
    return [SYNC_BUDGET + (i > 0 and own) for i, own in enumerate(own_pass)]


def _count(rows: int, tree_budget: int | None, lookup: int, oracle: bool, monkeypatch,
           sample: bool = False, length: int | None = 4, method: str = "diffusion", eos: int | None = 1
           ) -> HostSyncCounter:
    """One call's reads per step; `method`: the drafter's ("diffusion": chains or best-first trees by
    `tree_budget`; "d2sd": a dual drafter with a VP drafter; "selector": DFlash 2's selector trees); `eos`: the
    end-of-sequence token (None: rows run to the length limit, as an oracle drafter needs at 16 rows)."""
    if length is None:  # the cost model chooses the lengths and tree sizes
        from hf_diffspec.runtime import control_policy
        from hf_diffspec.runtime.control_cost import VerifyCost

        monkeypatch.setattr(control_policy, "verify_cost_for", lambda target, graphs=False: VerifyCost(LIVE_COSTS))
        monkeypatch.setattr(control_policy, "drafting_price_for", lambda *args: 0.3)  # (its passes are no step's)
    target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0)
    if method == "d2sd":
        from helpers import tiny_dual_drafter

        drafter = tiny_dual_drafter(target, block_size=6, seed=3, vp_seed=4, num_branches=2, tree_budget=8)
    else:
        drafter = tiny_drafter(target, block_size=6, seed=3, draft_tree_budget=tree_budget, draft_tree_width=2,
                               **(dict(selector_rank=4, selector_top_k=4) if method == "selector" else {}))
    ids = _prompts(rows)
    kwargs = dict(max_new_tokens=16, eos_token_id=eos, pad_token_id=1, suppress_tokens=[5],
                  **(SAMPLING if sample else dict(do_sample=False)))
    if oracle:  # the drafter proposes the target's own continuation: long accepted paths
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        oracle_drafter_outputs(monkeypatch, drafter.first if method == "d2sd" else drafter, target, list(reference))
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")  # drafting ahead, as where a read waits for the device
    # a dual drafter's passes call its drafters' own forwards
    counter = HostSyncCounter(target, [drafter.first, drafter.vp] if method == "d2sd" else [drafter])
    counter.own_pass = _record_steps(monkeypatch)
    with counter:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              num_assistant_tokens=length, prompt_lookup_num_tokens=lookup,
                              return_dict_in_generate=True, **kwargs)
    assert out.speculation_stats.target_forwards == counter.forwards
    assert len(counter.steps) >= 3
    return counter


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("tree_budget,lookup,oracle,sample,length",
                         [(None, 0, False, False, 4), (None, 3, False, False, 4), (3, 0, False, False, 4),
                          (10, 3, False, False, 4), (10, 3, True, False, 4),
                          (None, 0, False, True, 4), (None, 3, False, True, 4), (10, 3, False, True, 4),
                          (None, 3, False, False, None), (None, 3, False, True, None), (10, 3, False, True, None)],
                         ids=["chains", "chains+lookup", "small-trees", "trees+lookup", "trees+lookup-high-tau",
                              "sampled-chains", "sampled-chains+lookup", "sampled-trees+lookup",
                              "live-chains+lookup", "live-sampled-chains+lookup", "live-sampled-trees+lookup"])
def test_host_syncs_per_step_stay_within_a_budget_independent_of_rows_trees_and_tau(rows, tree_budget, lookup,
                                                                                    oracle, sample, length,
                                                                                    monkeypatch):
    """Greedy and sampling alike (sampling: the target's and the drafter's laws compact after top-k, accepted on
    the device; the sampled trees' laws, drawn on the host, go to the device in one more copy), at a fixed draft
    length and with the cost model choosing it (`live`)."""
    counter = _count(rows, tree_budget, lookup, oracle, monkeypatch, sample, length)
    worst = counter.worst()
    syncs, copies = counter.per_step_syncs, counter.per_step_copies
    allowed = _allowed(counter.own_pass)
    # the first window also holds what the prefill reads once (the prompts' padding, the first tokens)
    assert syncs[0] <= SYNC_BUDGET + PREFILL_READS and copies[0] <= COPY_BUDGET + PREFILL_READS, (syncs, copies)
    assert all(n <= a for n, a in zip(syncs[1:], allowed[1:])), f"syncs per step {syncs}, allowed {allowed}; {worst}"
    if length is not None:  # every step drafts: one read each
        assert max(syncs[1:]) == SYNC_BUDGET, syncs
    assert max(copies[1:]) <= COPY_BUDGET + sample, f"copies per step {copies}; worst: {worst}"
    # no wait for the whole device inside a step: steps are timed by stamps read later (`device_clock.StepClock`;
    # the first window holds the prefill's one wait, which times the prefill)
    assert not any(step["sync:synchronize"] for step in counter.steps[1:]), counter.steps


def test_host_time_bench_reports_host_time_and_torch_calls_per_step():
    from hf_diffspec.bench.host_time import compare_host_time, host_time_markdown

    target = tiny_target("llama", seed=3, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=6, seed=3, draft_tree_width=2)
    results = compare_host_time(target, drafter, _prompts(2), max_new_tokens=8, batches=[1, 2], repeats=1)
    ours = [r for r in results if r["method"].startswith("ours")]
    assert [(r["method"], r["rows"]) for r in ours] == [
        (m, rows) for rows in (1, 2) for m in ("ours: chains", "ours: trees", "ours: trees + lookup")]
    for r in ours:
        assert r["host_ms_per_step"] > 0 and r["forward_ms_per_step"] > 0
        # each step accepts, lays out the next tree and drafts: dozens of torch calls outside the forwards
        assert r["torch_calls_per_step"] > 10
    assert drafter.config.draft_tree_budget is None  # the bench puts the drafter's config back
    assert "torch calls / step" in host_time_markdown(results)


@pytest.mark.every_step_speculates("counts torch calls per speculative step")
def test_torch_calls_per_step_grow_with_the_targets_depth_only_by_the_caches_crop():
    """Accepted tree paths stay in the slots the verify forward wrote them to (the nodes off them are hidden, and
    dropped every few dozen slots): per step the loop touches each K/V layer only to crop it (two views), where moving
    the accepted paths together took a gather and a write per tensor and layer on every step whose path was not its
    tree's first slots (here: prompt-lookup branches). Beside the crop, a layer's hidden slots are compacted every
    few dozen slots, which lookup nodes repeating the drafter's bring about sooner (measured: 3.07 calls a layer)."""
    calls = {}
    for layers in (2, 10):
        target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0, layers=layers)
        drafter = tiny_drafter(target, block_size=6, seed=3, draft_tree_budget=10, draft_tree_width=2)
        ids = _prompts(1)
        with HostSyncCounter(target, [drafter]) as counter:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  num_assistant_tokens=4, prompt_lookup_num_tokens=3, max_new_tokens=32,
                                  min_new_tokens=32, do_sample=False, return_dict_in_generate=True)
        assert out.speculation_stats.lookup_tokens > 0
        steps = counter.per_step_calls[1:]
        calls[layers] = sum(steps) / len(steps)
    assert (calls[10] - calls[2]) / 8 <= 3.5, calls


def test_repeat_interleave_counts_as_a_host_read_only_when_its_size_is_not_known_on_the_host():
    from torch.nn import Linear

    model = Linear(2, 2)
    with HostSyncCounter(model) as counter:
        model(torch.zeros(1, 2))  # the first window starts after a target forward
        torch.arange(4).repeat_interleave(2, dim=0)  # an int count: Gated DeltaNet repeats key heads so
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)
        torch.arange(2).repeat_interleave(torch.tensor([1, 2]))  # the output's size is read from the device
        model(torch.zeros(1, 2))
    assert counter.steps[0]["sync:repeat_interleave"] == 1


def _one_window(calls) -> dict:
    """What `HostSyncCounter` counts in `calls()`, run between two forwards of a stand-in target (on a CPU run, the
    tensors made before counting are the device's)."""
    from torch.nn import Linear

    model = Linear(2, 2)
    with HostSyncCounter(model) as counter:
        model(torch.zeros(1, 2))  # the first window starts after a target forward
        calls()
        model(torch.zeros(1, 2))
    return {k: v for k, v in counter.steps[0].items() if k != "calls"}


def test_every_copy_to_the_host_counts_as_a_host_read():
    """`.to` the host (named by the string "cpu" on a CPU run: a `torch.device` there is the loop's own) and `copy_`
    into host memory (made with no device, on "cpu", or a view of such) wait for the device as `.cpu()`, `.tolist()`,
    `.item()` and `.numpy()` do."""
    import numpy as np

    x = torch.arange(4.0)
    assert _one_window(lambda: (x.to("cpu"), x.to(device="cpu"), x.to("cpu", torch.float64))) == {"sync:to(cpu)": 3}
    assert _one_window(lambda: torch.empty(4).copy_(x)) == {"sync:copy_(to host)": 1}
    assert _one_window(lambda: torch.empty(8, device="cpu")[:4].copy_(x)) == {"sync:copy_(to host)": 1}
    assert _one_window(lambda: x.to("cpu").copy_(x)) == {"sync:to(cpu)": 1, "sync:copy_(to host)": 1}
    assert _one_window(lambda: (x.cpu(), x.tolist(), x[0].item(), x.numpy(), np.asarray(x))) == {
        "sync:cpu": 1, "sync:tolist": 1, "sync:item": 1, "sync:numpy": 1, "sync:__array__": 1}
    # the loop's own moves, device-to-device copies, host-to-host work: no host read
    assert _one_window(lambda: (x.to(x.device), x.to(torch.float64), torch.empty(4, device=x.device).copy_(x),
                                torch.zeros(4).copy_(torch.ones(4)), torch.from_numpy(np.ones(4)).to(x.device))) == {}


@pytest.mark.every_step_speculates("counts the host reads of steps that roll linear-attention states back")
def test_rolling_linear_attention_states_back_stays_within_the_budget(monkeypatch):
    """A hybrid target (Gated DeltaNet layers, 2 key heads for 4 value heads) whose rows reject drafts: every such
    step puts the linear layers' states back and advances them through the accepted tokens, on the device."""
    from helpers import NoisyOracle, install_oracle, random_ids, tiny_hybrid_target

    target = tiny_hybrid_target(sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6)
    ids = random_ids(0, 12, rows=2)
    reference = target.generate(ids, max_new_tokens=30, do_sample=False)
    install_oracle(monkeypatch, NoisyOracle(list(reference), vocab_size=128, noise=0.3, seed=3))
    with HostSyncCounter(target, [drafter]) as counter:
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert out.speculation_stats.linear_state_replays >= 3
    # measured: one step of eight reads twice (the budget is met by attention-only targets, above)
    assert max(counter.per_step_syncs[1:]) <= SYNC_BUDGET + 1, counter.worst()


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_d2sd_steps_read_the_device_once_whatever_the_rows(rows, sample, monkeypatch):
    """D²SD plans its branches on the device from the first drafter's pass, drafts them, and builds its trees on the
    host from one read of both passes for all rows and branches, run with the next step's pass before the step's read
    and read with its outcome (it read once per row, slot and node: 39 reads a step at 1 row, about 600 at 16; then
    once per pass beside the outcome: 3; then 2)."""
    from helpers import tiny_dual_drafter

    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")  # drafting ahead, as where a read waits for the device
    target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_dual_drafter(target, block_size=6, seed=3)
    ids = _prompts(rows)
    with HostSyncCounter(target, [drafter]) as counter:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              num_assistant_tokens=4, prompt_lookup_num_tokens=3, max_new_tokens=16, eos_token_id=1,
                              pad_token_id=1, return_dict_in_generate=True,
                              **(SAMPLING if sample else dict(do_sample=False)))
    assert out.speculation_stats.draft_steps >= 3
    syncs = counter.per_step_syncs
    assert syncs[0] <= SYNC_BUDGET + PREFILL_READS and max(syncs[1:]) == SYNC_BUDGET, syncs


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("method,sample", [("d2sd", False), ("d2sd", True), ("selector", False)],
                         ids=["live-d2sd+lookup", "live-sampled-d2sd+lookup", "live-selector-trees+lookup"])  # live: the cost model
def test_d2sd_and_selector_trees_with_the_cost_model_live_stay_within_the_budget(rows, method, sample, monkeypatch):
    """D²SD and selector trees with the cost model live (every tree pruned by it, not a fixed length) and prompt
    lookup, the first drafter an oracle: one read a step, as for chains and best-first trees."""
    # every step drafts, drafted ahead (whether drafting pays would follow the loop's measured host time)
    import itertools

    from hf_diffspec.runtime.control_speculation import SpeculationController
    from helpers import steer_steps

    steer_steps(monkeypatch, itertools.repeat(True))
    monkeypatch.setattr(SpeculationController, "expects_draft", lambda self, rows: True)
    counter = _count(rows, 8 if method == "selector" else None, 3, True, monkeypatch, sample, length=None,
                     method=method, eos=None)
    syncs, steps = counter.per_step_syncs, counter.own_pass
    assert syncs[0] <= SYNC_BUDGET + PREFILL_READS and max(syncs[1:]) == SYNC_BUDGET, syncs
    # every step drafted from a pass run ahead, but the last (no row had room left to draft: nothing was run ahead)
    assert all(steps.drafted) and not any(steps[:-1]), (steps, steps.drafted)


@pytest.mark.parametrize("rows", [1, 16])
def test_selector_trees_read_the_device_once_a_step_whatever_the_rows(rows, monkeypatch):
    """DFlash 2's selector trees (greedy) are built on the host from every row's selector tables (each slot's
    candidates ranked given each token a node there can hold: `selector_tables`), computed with the next step's
    pass before the step's read and read with its outcome. They read the device once per node expanded, per row (19
    reads a step at 1 row with these settings, 289 at 16), then twice (the outcome, the tables)."""
    monkeypatch.setenv("HF_DIFFSPEC_DRAFT_AHEAD", "1")  # drafting ahead, as where a read waits for the device
    target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=3.0)
    drafter = tiny_drafter(target, block_size=6, seed=3, selector_rank=4, selector_top_k=4, draft_tree_budget=8,
                           draft_tree_width=2)
    ids = _prompts(rows)
    with HostSyncCounter(target, [drafter]) as counter:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              num_assistant_tokens=4, max_new_tokens=16, eos_token_id=1, pad_token_id=1,
                              do_sample=False, return_dict_in_generate=True)
    assert out.speculation_stats.draft_steps >= 3 and out.speculation_stats.drafted_tokens > 0
    syncs = counter.per_step_syncs
    assert syncs[0] <= SYNC_BUDGET + PREFILL_READS and max(syncs[1:]) == SYNC_BUDGET, syncs
