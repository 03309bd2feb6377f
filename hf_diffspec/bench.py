"""`hf-diffspec bench`: speed of speculative decoding against plain `generate` and against what a user would use
instead, measured as ratios within one run.

Methods run interleaved batch by batch (the order rotates), after one warm-up call per method that is not counted,
so that drift of the machine affects all methods alike. At batch size B the prompts are taken B at a time (cycling
to fill the last batch), left-padded, and every method decodes the same batches. Per method (and domain at batch 1)
it reports tau (tokens committed per row per target forward, bonus included; 1.0 for plain `generate`), throughput
(new tokens over the whole batch per second, each row counted up to its EOS), the ratio to `ar` at the same batch size
from the same run, and whether each row equals `ar`'s row token for token.

The methods (`build_method_drafters`):
- ours (`SPECULATIVE_METHODS`): one drafter run several ways through our loop, plus D²SD;
- peers (`PEER_METHODS`), what a user would run instead: transformers' prompt-lookup decoding (`pld`), the same
  drafter weights through transformers' own DFlash path (`hf-dflash`) and through z-lab's loop (`zlab`, PyPI package
  `dflash`), and a smaller sibling of the target as transformers' assistant model (`ar-assistant`). Their loops report
  no statistics, so their tau is counted from the target's forwards. A peer that cannot run with the given drafter,
  target or batch size is reported as skipped, with the reason, never replaced by something else.

Loop efficiency (`oracle_methods`, `oracle_efficiency`): an oracle drafter proposes the target's own greedy
continuation, corrupted so that tau is about 2, 4 or 8, through our loop; the achieved speedup over `ar` divided by
the speedup the verify-cost profile predicts for the achieved tau shows the loop's own overhead, apart from drafting.

Every report starts with the machine record (`machine_description`): CPU model and ISA features or GPU, threads,
dtype and the measured verify-cost curve, which decide whether verifying several tokens at once pays.
"""

import copy
import json
import math
import os
import platform
import random
import tempfile
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch
import transformers
from tqdm.auto import tqdm

from .drafters import load_drafter, shipped_drafter
from .machine import cpu_record
from .runtime.drafting import DiffusionCandidateGenerator, default_policy
from .runtime.files import atomic_write, pad_token_id
from .runtime.tree import CandidateTree
from .targets import unused_target_token

SPECULATIVE_METHODS = ("dflash", "dflash-fixed", "dflash-block", "adaflash", "tree", "tree-lookup", "d2sd",
                       "d2sd-reuse", "d2sd-resample")
PEER_METHODS = ("pld", "hf-dflash", "zlab", "ar-assistant")
#: built-in target -> the smaller model of its family that `ar-assistant` drafts with (same tokenizer)
ASSISTANT_SIBLINGS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
#: candidate tokens per prompt-lookup step: the value transformers' documentation uses
PROMPT_LOOKUP_TOKENS = 10
#: n of the verify-cost curve T_verify(1, n) / T_verify(1, 1) in the machine record
CURVE_SIZES = (1, 2, 4, 8, 16)


@dataclass
class StepCounts:
    """What one call did, per row and step: tokens committed after the prefill's, loop steps (row-steps at batch > 1),
    tokens verified (real candidates, anchors included), slots the target computed (padding included), target
    forwards after the prefill, and the prefill's seconds (our loop only: 0 where unknown)."""

    committed: int = 0
    steps: int = 0
    verified: int = 0
    slots: int = 0
    forwards: int = 0
    prefill_seconds: float = 0.0

    @classmethod
    def of(cls, stats) -> "StepCounts":
        """From our loop's `SpeculationStats`."""
        return cls(committed=sum(stats.committed_per_step), steps=len(stats.committed_per_step),
                   verified=stats.verified_tokens, slots=stats.verified_slots, forwards=stats.target_forwards - 1,
                   prefill_seconds=stats.prefill_time_s)


class TargetForwardCounter:
    """Counts the target's forwards and the tokens each one reads, for loops that report no statistics of their own
    (transformers' assisted generation, z-lab's loop). Batch size 1: the first forward is the prefill."""

    def __init__(self, target):
        self.target = target
        self.lengths: list[int] = []

    def __enter__(self) -> "TargetForwardCounter":
        def count(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            self.lengths.append(ids.shape[1])

        self.handle = self.target.register_forward_pre_hook(count, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def counts(self, new_tokens: int) -> StepCounts:
        """`new_tokens`: what the call generated; the prefill forward picks the first of them."""
        steps = self.lengths[1:]
        return StepCounts(committed=max(new_tokens - 1, 0), steps=len(steps), verified=sum(steps), slots=sum(steps),
                          forwards=len(steps))


@dataclass
class Method:
    """What one benchmarked method runs.

    - `drafter`: our drafter, run through our loop (None and no `runner`: `target.generate` with `generate_kwargs`);
    - `generate_kwargs`: extra `generate` arguments (a peer's `assistant_model`, `prompt_lookup_num_tokens`, ...);
    - `runner`: a loop that is not `target.generate`: `runner(target, inputs, max_new_tokens)` returns
      (sequences, `StepCounts` or None); a `runner.prepare(target, batches, max_new_tokens)`, when present, is called
      once before the warm-up, untimed;
    - `skip_reason`: the method cannot run here, and why (reported instead of results);
    - `single_row`: why the method cannot decode several rows at once (None: it can); skipped at batch size > 1;
    - `peer`: someone else's loop: its tau is counted from target forwards, and an error in its warm-up is reported
      as a skip (with the error) instead of stopping the benchmark;
    - `target_patch`: a context manager factory, `target_patch(target)`, entered around each of the method's calls
      (`MaskVectorRow.applied`).
    """

    drafter: object | None = None
    generate_kwargs: dict = field(default_factory=dict)
    runner: Callable | None = None
    skip_reason: str | None = None
    single_row: str | None = None
    peer: bool = False
    target_patch: Callable | None = None


def build_method_drafters(methods: list[str], target, target_name: str, drafter: str | None = None,
                          vp_drafter: str | None = None, dflash_length: int | None = None, num_branches: int = 4,
                          tree_budget: int = 16, max_depth: int = 8, branch_length: int = 4,
                          assistant_model=None, prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS,
                          tokenizer=None) -> dict[str, Method]:
    """Method name -> `Method`, for `ar` and any of `SPECULATIVE_METHODS` and `PEER_METHODS` (`tokenizer`: the
    target's, for the peers that embed MASK as a target token; see `peer_methods`):
    - `dflash`: chains, what `target.generate(**inputs, assistant_model=drafter)` does for a drafter without a tree
      budget (its length head left out, a checkpoint's `draft_tree_budget` ignored): per step the measured cost
      model sizes the drafts from the drafter's confidences, and the policy decodes plainly where speculation does
      not pay;
    - `dflash-fixed`: the same drafter verifying a fixed number of drafts every step (`dflash_length`, default the
      drafter's `num_draft_tokens`, else its whole block), always speculating;
    - `dflash-block`: the same drafter verifying its whole block every step, DFlash's own fixed length (its tau is
      the drafter's acceptance length, independent of how fast a machine verifies);
    - `adaflash`: the default path with the drafter's length head sizing the drafts;
    - `tree`: the default path drafting best-first trees of at most `tree_budget` nodes from the same single pass,
      prompt lookup off;
    - `tree-lookup`: `tree` plus up to `prompt_lookup_tokens` prompt-lookup drafts per step, grafted on as one more
      branch or verified alone without a drafter forward (what the shipped SmolLM2 drafter does by default: its
      config sets `draft_tree_budget` and `prompt_lookup_num_tokens`);
    - `d2sd` first + VP drafter, `d2sd-reuse` the first drafter re-drafting its own branches (the paper's
      DFlash -> DFlash ablation), `d2sd-resample` branches taken from the first pass's own distributions;
    - peers, see `peer_methods` (`assistant_model`, `prompt_lookup_tokens`).

    `drafter` and `vp_drafter` are what `load_drafter` takes (None: the drafters shipped for `target_name`); the
    tree arguments shape D²SD trees.

    Raises:
        ValueError: an unknown method, or one of ours whose requirement is missing (the message says how to provide
            it). Peers that cannot run are returned with a `skip_reason` instead.
        FileNotFoundError: a drafter that cannot be found.
    """
    from . import DiffusionDrafter, DualDiffusionDrafter
    from .runtime.cost_model import VerifyCost

    unknown = [m for m in methods if m not in ("ar", *SPECULATIVE_METHODS, *PEER_METHODS)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from ar, {', '.join(SPECULATIVE_METHODS)} and the peers "
                         f"{', '.join(PEER_METHODS)}")
    needs_drafter = set(methods) & {*SPECULATIVE_METHODS, "hf-dflash", "zlab"}
    # chains for the chain methods, whatever the checkpoint's default (the shipped drafter drafts trees)
    # pure drafter methods: no prompt lookup, whatever the checkpoint's default
    first = (load_drafter(drafter, target, target_name, draft_tree_budget=None, prompt_lookup_num_tokens=None)
             if needs_drafter else None)
    if {"dflash", "adaflash", "tree", "tree-lookup"} & set(methods) and VerifyCost.for_target(target) is None:
        dtype = str(target.dtype).replace("torch.", "")
        raise ValueError("dflash, adaflash and tree size drafts with the measured cost model: run "
                         f"`hf-diffspec profile --target {target_name} --dtype {dtype}` first (or leave "
                         "HF_DIFFSPEC_AUTO_PROFILE unset so that it is measured on first use)")
    tree = dict(num_branches=num_branches, tree_budget=tree_budget, max_depth=max_depth, branch_length=branch_length)
    peers = peer_methods([m for m in methods if m in PEER_METHODS], target, target_name, first,
                         assistant_model=assistant_model, prompt_lookup_tokens=prompt_lookup_tokens,
                         tokenizer=tokenizer)
    drafters = {}
    for method in methods:
        if method in peers:
            drafters[method] = peers[method]
        elif method == "dflash-fixed":
            length = dflash_length or first.config.num_draft_tokens or first.config.block_size - 1
            drafters[method] = Method(first, {"num_assistant_tokens": length})
        elif method == "dflash-block":
            drafters[method] = Method(first, {"num_assistant_tokens": first.config.block_size - 1})
        elif method in ("dflash", "adaflash"):
            with_head = method == "adaflash"
            if with_head and first.length_head is None:
                raise ValueError("adaflash needs a drafter with a trained length head: train one with `hf-diffspec "
                                 "train length-head --init DRAFTER ...` and pass it as --drafter")
            chosen = first
            if not with_head and first.length_head is not None:  # the same weights, the head left out
                chosen = load_drafter(drafter, target, target_name, length_head=False, draft_tree_budget=None,
                                      prompt_lookup_num_tokens=None)
            drafters[method] = Method(chosen)
        elif method in ("tree", "tree-lookup"):
            lookup = prompt_lookup_tokens if method == "tree-lookup" else None
            trees = load_drafter(drafter, target, target_name, length_head=False, draft_tree_budget=tree_budget,
                                 prompt_lookup_num_tokens=lookup)
            drafters[method] = Method(trees)
        elif method == "d2sd-reuse":
            drafters[method] = Method(DualDiffusionDrafter.from_drafters(first, None, **tree))
        elif method == "d2sd-resample":
            drafters[method] = Method(DualDiffusionDrafter.from_drafters(first, None, branches_from_first_pass=True,
                                                                         **tree))
        elif method == "d2sd":
            vp_path = vp_drafter or shipped_drafter(target_name, variable_prefix=True)
            if vp_path is None or not (Path(vp_path) / "config.json").exists():
                raise ValueError("method d2sd needs a VP drafter: pass --vp-drafter PATH (or use d2sd-reuse)")
            vp = DiffusionDrafter.from_pretrained(vp_path, target=target)
            drafters[method] = Method(DualDiffusionDrafter.from_drafters(first, vp, **tree))
    return drafters


# ----- peers ------------------------------------------------------------------------------------------------------

ASSISTED_ONE_ROW = "transformers' assisted generation decodes batch size 1 only"


def peer_methods(methods: list[str], target, target_name: str, drafter=None, assistant_model=None,
                 prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS, tokenizer=None) -> dict[str, Method]:
    """Peer name -> `Method` (with a `skip_reason` where it cannot run):
    - `pld`: transformers' prompt-lookup decoding, `prompt_lookup_num_tokens=prompt_lookup_tokens`;
    - `hf-dflash`: `drafter`'s weights as transformers' own DFlash drafter, `speculation_type="dflash"`;
    - `zlab`: `drafter`'s weights in z-lab's `DFlashDraftModel`, decoded by z-lab's `dflash_generate`;
    - `ar-assistant`: `assistant_model` (a model, or a name/path for `load_target`; None: the smaller sibling of
      built-in `target_name`, see `ASSISTANT_SIBLINGS`) as transformers' assistant model.
    Both DFlash peers embed MASK as a target token. A drafter that learned its own MASK vector runs there with that
    vector in the row of a token the target never reads (`MaskVectorRow`; needs `tokenizer` to find one)."""
    mask_row = None
    if {"hf-dflash", "zlab"} & set(methods) and drafter is not None and tokenizer is not None \
            and drafter.config.mask_token_id is None and drafter.config.draft_role == "first":
        try:
            mask_row = MaskVectorRow(target, unused_target_token(tokenizer, drafter.config.vocab_size),
                                     drafter.mask_embedding)
            drafter = mask_row.drafter(drafter)
        except ValueError:
            pass  # no token is free to carry the vector: the peers say why they skip (`_target_token_mask_reason`)
    built = {}
    for method in methods:
        if method == "pld":
            built[method] = Method(generate_kwargs={"prompt_lookup_num_tokens": prompt_lookup_tokens},
                                   single_row=ASSISTED_ONE_ROW, peer=True)
        elif method == "hf-dflash":
            built[method] = _hf_dflash_method(drafter)
        elif method == "zlab":
            built[method] = _zlab_method(drafter, target)
        elif method == "ar-assistant":
            built[method] = _assistant_method(target, target_name, assistant_model)
        else:
            raise ValueError(f"unknown peer {method!r}; choose from {', '.join(PEER_METHODS)}")
    for method in ("hf-dflash", "zlab"):
        if method in built and mask_row is not None:
            built[method].target_patch = mask_row.applied
    return built


class MaskVectorRow:
    """A drafter that learned its own MASK vector, run where MASK is a target token (transformers' DFlash path,
    z-lab's loop): the vector is written into row `token_id` of an untied copy of the target's input embedding, a
    token the target never reads (`targets.unused_target_token`), and that copy is swapped in only while the peer
    decodes. The output head and every other row stay as they are, so the target computes exactly what it did for
    any text without that token (the benchmark's identity column checks the outputs), and the peer runs all of the
    drafter's weights."""

    def __init__(self, target, token_id: int, vector: torch.Tensor):
        self.token_id = token_id
        self.embedding = copy.deepcopy(target.get_input_embeddings())  # a module of its own: the head keeps the original
        with torch.no_grad():
            self.embedding.weight[token_id] = vector.to(self.embedding.weight)

    def drafter(self, drafter):
        """A twin of `drafter` (same weights, unbound) that embeds MASK as `token_id` instead of its own vector."""
        config = copy.deepcopy(drafter.config)
        config.mask_token_id = self.token_id
        twin = type(drafter)(config)
        twin.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "mask_embedding"})
        return twin.to(device=drafter.device, dtype=drafter.dtype).eval()

    @contextmanager
    def applied(self, target):
        original = target.get_input_embeddings()
        target.set_input_embeddings(self.embedding)
        try:
            yield
        finally:
            target.set_input_embeddings(original)


def _target_token_mask_reason(drafter, where: str) -> str | None:
    """Why `drafter`'s weights cannot run in `where` (None: they can)."""
    if drafter.config.draft_role != "first":
        return f"{where} runs first (DFlash) drafters only; this one is a {drafter.config.draft_role} drafter"
    if drafter.config.mask_token_id is None:
        return (f"this drafter learned its own MASK embedding (mask_token_id is None), and {where} embeds MASK as a "
                "target token (mask_token_id), so these weights cannot run there as they are; a drafter trained "
                "with a mask_token_id can, and so can this one where the target's tokenizer leaves a token the "
                "target never reads (the benchmark then carries the vector in that token's embedding row)")
    return None


def native_dflash_drafter(drafter):
    """`drafter`'s weights as transformers' own DFlash drafter (`MuseGlimmerAssistantModel`): the config fields
    mapped, `fc` / `hidden_norm` renamed as `formats.NATIVE_RENAMES` reads them, `formats.NOT_IN_DFLASH_ENGINES`
    tensors left out.
    Raises ValueError when the weights cannot be expressed there."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    from .formats import NATIVE_RENAMES, NOT_IN_DFLASH_ENGINES

    reason = _target_token_mask_reason(drafter, "transformers' DFlash path")
    if reason is not None:
        raise ValueError(reason)
    config = drafter.config
    if config.attention_bias:
        raise ValueError("transformers' DFlash drafter has no attention biases; this drafter has them")
    native = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim or config.hidden_size // config.num_attention_heads, hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
        layer_types=["full_attention"] * config.num_hidden_layers, block_size=config.block_size,
        mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ))
    ours_to_native = {ours: native_name for native_name, ours in NATIVE_RENAMES.items()}
    state = {ours_to_native.get(k, k): v for k, v in drafter.state_dict().items()
             if not k.startswith(NOT_IN_DFLASH_ENGINES)}
    try:
        native.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(f"the weights do not fit transformers' DFlash drafter: {error}") from None
    return native.to(device=drafter.device, dtype=drafter.dtype).eval()


def _hf_dflash_method(drafter) -> Method:
    try:
        native = native_dflash_drafter(drafter)
    except ValueError as error:
        return Method(skip_reason=str(error), peer=True)
    return Method(generate_kwargs={"assistant_model": native, "speculation_type": "dflash"},
                  single_row=ASSISTED_ONE_ROW, peer=True)


class ZLabRunner:
    """z-lab's own loop (`dflash.model.dflash_generate`, greedy, batch size 1) with `model` (a `DFlashDraftModel`),
    stopping at the target's EOS tokens as its benchmark does."""

    def __init__(self, model, generate, stop_token_ids: list[int]):
        self.model = model
        self.generate = generate
        self.stop_token_ids = stop_token_ids or None

    def __call__(self, target, inputs, max_new_tokens: int):
        ids = inputs["input_ids"]
        with TargetForwardCounter(target) as counter:
            out = self.generate(self.model, target, ids, max_new_tokens, self.stop_token_ids)
        return out, counter.counts(out.shape[1] - ids.shape[1])


def _zlab_method(drafter, target) -> Method:
    """`drafter` exported to the z-lab layout (`formats.export_for_engine`, the layout z-lab, vLLM and SGLang load)
    and loaded by z-lab's `DFlashDraftModel.from_pretrained`, as a user of z-lab's package would."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError:
        return Method(skip_reason="z-lab's package is not installed: pip install 'hf-diffspec[peers]' "
                                  "(or pip install --no-deps dflash==0.1.0)", peer=True)
    from .formats import export_for_engine

    reason = _target_token_mask_reason(drafter, "z-lab's loop")
    if reason is not None:
        return Method(skip_reason=reason, peer=True)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(Path(tmp) / "ours")
        exported, _ = export_for_engine(Path(tmp) / "ours", Path(tmp) / "zlab", "vllm")
        model = DFlashDraftModel.from_pretrained(exported, dtype=drafter.dtype)
    model = model.to(drafter.device).eval()
    return Method(runner=ZLabRunner(model, dflash_generate, sorted(_eos_ids(target))),
                  single_row="z-lab's transformers loop decodes batch size 1 only", peer=True)


def _assistant_method(target, target_name: str, assistant_model) -> Method:
    if assistant_model is None:
        assistant_model = ASSISTANT_SIBLINGS.get(str(target_name).lower())
        if assistant_model is None:
            pairs = ", ".join(f"{small} -> {big}" for big, small in ASSISTANT_SIBLINGS.items())
            return Method(skip_reason=f"no smaller sibling known for target {target_name!r} (built-in pairs: {pairs}); "
                                      "pass --assistant-model NAME_OR_PATH", peer=True)
    if isinstance(assistant_model, (str, os.PathLike)):
        from .targets import load_target

        assistant_model, _ = load_target(assistant_model, dtype=target.dtype, device=target.device)
    return Method(generate_kwargs={"assistant_model": assistant_model}, single_row=ASSISTED_ONE_ROW, peer=True)


# ----- loop efficiency: an oracle drafter ---------------------------------------------------------------------------

def oracle_acceptance(tau: float, drafts: int) -> float:
    """The probability q with which each of `drafts` draft positions is kept right (else replaced by a wrong token),
    independently, so that a step commits tau tokens on average: 1 + q + q^2 + ... + q^drafts = tau (the anchor's
    target token, then each draft reached and right). Bisection; 1.0 when tau >= drafts + 1."""
    if tau < 1:
        raise ValueError(f"an oracle tau must be >= 1 (one token per step at least), got {tau}")
    if tau >= drafts + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q**i for i in range(drafts + 1)) < tau else (lo, q)
    return (lo + hi) / 2


class OracleCandidateGenerator(DiffusionCandidateGenerator):
    """Benchmark only: drafts each row's reference continuation (the target's own greedy output), each position kept
    with probability `acceptance` and otherwise replaced by another token, as a chain of the policy's fixed length.
    Reads no target features and runs no drafter forward: what is timed is our loop alone (verify, walk, commit,
    cache upkeep), so its efficiency shows apart from drafter quality. Lossless like any drafting: the target picks.

    `references`: per row of the batch, its prompt without padding followed by its reference continuation, so that a
    row's anchor position indexes it directly."""

    def __init__(self, drafter, target, references: list[list[int]], acceptance: float, drafts: int, seed: int = 0):
        super().__init__(drafter, target, default_policy(drafter, target, fixed=drafts))
        self.references = references
        self.acceptance = acceptance
        self.rows = list(range(len(references)))  # batch row of each row still decoding
        self.rng = random.Random(seed)
        self.vocab_size = target.config.get_text_config().vocab_size

    def add_context(self, *args, **kwargs) -> None:
        pass  # no drafter reads target features

    def select_rows(self, keep: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in keep.tolist()]

    def propose(self, root_tokens: list[int], root_positions: list[int], remaining: list[int]) -> list[CandidateTree]:
        trees = []
        for row, root, position, left in zip(self.rows, root_tokens, root_positions, remaining):
            depth = self.policy.depth_limit(position, left)
            truth = self.references[row][position + 1 : position + 1 + depth]
            drafts = [token if self.rng.random() < self.acceptance else self._wrong(token) for token in truth]
            trees.append(CandidateTree.chain(root, torch.tensor(drafts, dtype=torch.long)))
        return trees

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size


@contextmanager
def _loop_drafting(make_generator):
    """Within the block, our loop drafts with `make_generator(drafter, target)` instead of the drafter's own
    candidate generator (the loop resolves it by name in its module at each call)."""
    from .runtime import decoding

    if not hasattr(decoding, "candidate_generator_for"):
        raise RuntimeError("the oracle benchmark replaces runtime.decoding.candidate_generator_for, which the loop no "
                           "longer has: update bench._loop_drafting to the loop's new drafting hook")
    original = decoding.candidate_generator_for
    decoding.candidate_generator_for = lambda drafter, target, *args, **kwargs: make_generator(drafter, target)
    try:
        yield
    finally:
        decoding.candidate_generator_for = original


def _batch_key(inputs) -> tuple:
    ids = inputs["input_ids"]
    return tuple(ids.shape), ids.cpu().numpy().tobytes()


class OracleRunner:
    """Our loop with an `OracleCandidateGenerator` aiming at `tau`: `drafts` per step (a fixed length, so every step
    speculates), each kept right with `oracle_acceptance(tau, drafts)`. `prepare` computes the references with plain
    greedy `generate`, once per batch, shared by every runner given the same `references` dict."""

    def __init__(self, target, tau: float, drafts: int, references: dict, seed: int = 0):
        from . import DiffusionDrafter

        self.tau = tau
        self.drafts = drafts
        self.acceptance = oracle_acceptance(tau, drafts)
        self.references = references
        self.seed = seed
        # only routes generate() into our loop and sets the block (drafts + 1); its weights never run
        self.carrier = DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=drafts + 1)

    def prepare(self, target, batches: list, max_new_tokens: int) -> None:
        for inputs in batches:
            key = _batch_key(inputs)
            if key in self.references:
                continue
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            prompt_length = inputs["input_ids"].shape[1]
            mask = inputs.get("attention_mask")
            self.references[key] = [
                (row[:prompt_length] if mask is None else row[:prompt_length][mask[r].bool()]).tolist()
                + row[prompt_length:].tolist() for r, row in enumerate(out)]

    def __call__(self, target, inputs, max_new_tokens: int):
        key = _batch_key(inputs)
        if key not in self.references:
            raise RuntimeError("OracleRunner.prepare was not called for this batch: the oracle needs its reference")
        references = self.references[key]
        seed = zlib.crc32(key[1], self.seed)  # corruption independent across batches, the same at every repeat

        def make(drafter, model):
            return OracleCandidateGenerator(drafter, model, references, self.acceptance, self.drafts, seed)

        with _loop_drafting(make):
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  assistant_model=self.carrier, num_assistant_tokens=self.drafts,
                                  return_dict_in_generate=True)
        return out.sequences, StepCounts.of(out.speculation_stats)


def oracle_drafts_for(tau: float) -> int:
    """Drafts per step for an oracle tau when not set: 2 * ceil(tau) - 1, so that n = 2 tau tokens are verified per
    step (the right draft falls about half way into the block, as with a real drafter)."""
    return max(2 * int(-(-tau // 1)) - 1, 1)


def oracle_methods(target, taus: list[float], drafts: int | None = None, seed: int = 0) -> dict[str, Method]:
    """`oracle-<tau>` -> a `Method` running an `OracleRunner` (drafts per step: `drafts`, else `oracle_drafts_for`)."""
    references: dict = {}
    methods = {}
    for tau in taus:
        runner = OracleRunner(target, tau, drafts or oracle_drafts_for(tau), references, seed=seed)
        methods[f"oracle-{tau:g}"] = Method(runner=runner)
    return methods


def oracle_efficiency(rows: list[dict], methods: dict[str, Method], verify_cost) -> list[dict]:
    """Per oracle method and batch size (the `all` rows of `summarize`): requested and achieved tau, throughput, the
    speedup over `ar`, and the loop's efficiency on the decoding phase, where the loop's overhead lives. The prefill
    is the same forward for both (our loop measures it) and is taken out of both times: decode speedup =
    ((ar seconds - prefill) / ar tokens) / ((oracle seconds - prefill) / oracle tokens); the profile predicts
    tau * T_verify(1, rows) / T_verify(n, rows) for it, with n the tokens verified per row per step; efficiency =
    decode speedup / predicted. `verify_cost`: a `VerifyCost` (None: no prediction)."""
    ar = {r["batch_size"]: r for r in rows if r["method"] == "ar" and r["domain"] == "all" and not r.get("skipped")}
    table = []
    for r in rows:
        method = methods.get(r["method"])
        if method is None or not isinstance(method.runner, OracleRunner) or r["domain"] != "all" or r.get("skipped"):
            continue
        runner, batch, n = method.runner, r["batch_size"], r["nodes_per_step"]
        decode = None
        base, prefill = ar.get(batch), r["prefill_seconds"]
        if base is not None and r["seconds"] > prefill and base["seconds"] > prefill:
            decode = round((base["seconds"] - prefill) / base["new_tokens"]
                           / ((r["seconds"] - prefill) / r["new_tokens"]), 3)
        predicted = None
        if verify_cost is not None:
            predicted = round(r["tau"] * verify_cost(1, batch) / verify_cost(n, batch), 3)
        table.append({
            "oracle_tau": runner.tau, "drafts_per_step": runner.drafts, "acceptance": round(runner.acceptance, 3),
            "batch_size": batch, "achieved_tau": r["tau"], "verified_per_step": n, "tokens_per_s": r["tokens_per_s"],
            "speedup_vs_ar": r["speedup_vs_ar"], "decode_speedup_vs_ar": decode, "predicted_speedup": predicted,
            "efficiency": round(decode / predicted, 3) if predicted and decode else None,
            "identical_to_ar": r["identical_to_ar"],
        })
    return table


def oracle_markdown_table(table: list[dict]) -> str:
    lines = ["| oracle tau | batch | drafts/step | achieved tau | tokens verified/step | tokens/s | vs ar | "
             "decode vs ar | predicted decode vs ar | efficiency | identical to ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        x = lambda value: "-" if value is None else f"{value:.2f}x"  # noqa: E731
        efficiency = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {r['oracle_tau']:g} | {r['batch_size']} | {r['drafts_per_step']} | {r['achieved_tau']:.2f} | "
                     f"{r['verified_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{x(r['decode_speedup_vs_ar'])} | {x(r['predicted_speedup'])} | {efficiency} | "
                     f"{'yes' if r['identical_to_ar'] else 'no'} |")
    return "\n".join(lines)


# ----- running --------------------------------------------------------------------------------------------------

@dataclass
class MethodRun:
    """Totals of one method on one (batch size, domain); `skipped`: why it did not run (no totals then)."""

    new_tokens: int = 0
    seconds: float = 0.0
    committed: int = 0
    steps: int = 0
    verified: int = 0
    slots: int = 0
    forwards: int = 0
    prefill_seconds: float = 0.0
    first_round_seconds: float = 0.0
    first_round_tokens: int = 0
    identical: int = 0
    prompts: int = 0
    skipped: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def first_round_tokens_per_s(self) -> float:
        return self.first_round_tokens / self.first_round_seconds if self.first_round_seconds else 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 1.0


_TOTALS = [f.name for f in fields(MethodRun) if f.name != "skipped"]


def _generate(target, method: Method, inputs, max_new_tokens) -> tuple[torch.Tensor, StepCounts | None]:
    """Greedy decoding by `method`; returns (sequences, `StepCounts`, None for plain `generate`)."""
    if method.target_patch is not None:
        with method.target_patch(target):
            return _generate(target, replace(method, target_patch=None), inputs, max_new_tokens)
    if method.runner is not None:
        return method.runner(target, inputs, max_new_tokens)
    kwargs = dict(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **method.generate_kwargs)
    if method.drafter is not None:
        out = target.generate(**kwargs, assistant_model=method.drafter, return_dict_in_generate=True)
        return out.sequences, StepCounts.of(out.speculation_stats)
    if not method.peer:
        return target.generate(**kwargs), None
    with TargetForwardCounter(target) as counter:
        out = target.generate(**kwargs)
    return out, counter.counts(out.shape[1] - inputs["input_ids"].shape[1])


def _rows_up_to_eos(out: torch.Tensor, prompt_length: int, eos_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (what follows is padding)."""
    rows = []
    for row in out[:, prompt_length:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def _eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _encode_batches(tokenizer, prompts: list[dict], batch_size: int, device) -> list[tuple[str, dict]]:
    """(domain, left-padded inputs) per batch; domain is "mixed" when a batch spans several."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = pad_token_id(tokenizer)
    try:
        batches = []
        for start in range(0, len(prompts), batch_size):
            chunk = [prompts[(start + j) % len(prompts)] for j in range(batch_size)]
            domains = {p["domain"] for p in chunk}
            inputs = tokenizer([p["text"] for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            batches.append((domains.pop() if len(domains) == 1 else "mixed", inputs.to(device)))
        return batches
    finally:
        tokenizer.padding_side = side


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


MIN_TIMED_CALLS = 3  # per method and batch size, by default: one timed call drifts by ±10% on this kind of machine


def run_benchmark(target, tokenizer, methods: dict, prompts: list[dict], max_new_tokens: int,
                  batch_size: int = 1, progress: bool = True,
                  rounds: int | None = None) -> dict[tuple[str, int, str], MethodRun]:
    """Run every method (name -> `Method`, or a drafter) plus plain `ar` on every batch of prompts (chat-templated
    `text`), interleaved; return totals per (method, batch size, domain). A method that cannot run at this batch size
    (or a peer whose warm-up fails) gets one `MethodRun` under domain "all" with `skipped` set to the reason.
    `rounds`: every batch is decoded that many times by every method (all batches, then all again): at 16 or 64
    rows a few prompts make one batch, one timed call per method, and this machine's speed drifts by ±10% between
    calls. None: enough rounds for `MIN_TIMED_CALLS` timed calls per method. Times and tokens add up over the
    rounds; prompts and identity count the first, and the first round's time and tokens are also kept apart (a
    method that learns across calls, like our speculation gates, shows what its first call cost)."""
    methods = {"ar": Method(), **{k: m if isinstance(m, Method) else Method(m) for k, m in methods.items()}}
    skipped = {name: m.skip_reason or (m.single_row if batch_size > 1 else None) for name, m in methods.items()}
    skipped = {name: reason for name, reason in skipped.items() if reason}
    batches = _encode_batches(tokenizer, prompts, batch_size, target.device)
    if rounds is None:
        rounds = math.ceil(MIN_TIMED_CALLS / len(batches))
    eos = _eos_ids(target)
    for name, method in methods.items():
        prepare = getattr(method.runner, "prepare", None)
        if prepare is not None and name not in skipped:
            prepare(target, [inputs for _, inputs in batches], max_new_tokens)
    for name, method in methods.items():  # warm-up, not counted
        if name in skipped:
            continue
        try:
            _generate(target, method, batches[0][1], min(8, max_new_tokens))
        except Exception as error:
            if not method.peer:
                raise
            skipped[name] = f"failed here: {_first_line(error)}"
    names = [n for n in methods if n not in skipped]

    results: dict[tuple[str, int, str], MethodRun] = {}
    bar = tqdm(total=rounds * len(batches) * len(names), desc=f"bench batch {batch_size}", disable=not progress)
    for i in range(rounds * len(batches)):
        first_round, (domain, inputs) = i < len(batches), batches[i % len(batches)]
        order = names[i % len(names):] + names[: i % len(names)]
        outputs = {}
        prompt_length = inputs["input_ids"].shape[1]
        for name in order:
            start = time.perf_counter()
            out, counts = _generate(target, methods[name], inputs, max_new_tokens)
            elapsed = time.perf_counter() - start
            outputs[name] = _rows_up_to_eos(out, prompt_length, eos)
            run = results.setdefault((name, batch_size, domain), MethodRun())
            run.prompts += len(outputs[name]) if first_round else 0
            run.seconds += elapsed
            run.new_tokens += sum(len(r) for r in outputs[name])
            if first_round:
                run.first_round_seconds += elapsed
                run.first_round_tokens += sum(len(r) for r in outputs[name])
            if counts is not None:
                run.committed += counts.committed
                run.steps += counts.steps
                run.verified += counts.verified
                run.slots += counts.slots
                run.forwards += counts.forwards
                run.prefill_seconds += counts.prefill_seconds
            bar.update(1)
        for name in names if first_round else ():
            run = results[(name, batch_size, domain)]
            run.identical += sum(a == b for a, b in zip(outputs[name], outputs["ar"]))
    bar.close()
    for name, reason in skipped.items():
        results[(name, batch_size, "all")] = MethodRun(skipped=reason)
    return results


def summarize(results: dict[tuple[str, int, str], MethodRun]) -> list[dict]:
    """Rows per (method, batch size, domain) plus an `all` row per method and batch size; ratios are to `ar` at the
    same batch size. A skipped method has one row per batch size: domain `all` and `skipped` (the reason)."""
    rows = []
    methods = list(dict.fromkeys(m for m, _, _ in results))
    for batch in sorted({b for _, b, _ in results}):
        domains = [d for d in dict.fromkeys(d for (_, b, d), r in results.items() if b == batch and not r.skipped)
                   if d not in ("mixed", "all")]
        for method in methods:
            skip = next((r.skipped for (m, b, _), r in results.items() if m == method and b == batch and r.skipped),
                        None)
            if skip is not None:
                rows.append({"method": method, "batch_size": batch, "domain": "all", "skipped": skip})
                continue
            if not any(m == method and b == batch for m, b, _ in results):
                continue
            for domain in [*domains, "all"]:
                def pick(name):
                    return [r for (m, b, d), r in results.items()
                            if m == name and b == batch and (domain == "all" or d == domain) and not r.skipped]
                total, ar = (MethodRun(**{f: sum(getattr(r, f) for r in runs) for f in _TOTALS})
                             for runs in (pick(method), pick("ar")))
                ar_rate, ar_first = ar.tokens_per_s, ar.first_round_tokens_per_s
                rows.append({
                    "method": method, "batch_size": batch, "domain": domain,
                    "prompts": total.prompts, "tau": round(total.tau, 3),
                    "tokens_per_s": round(total.tokens_per_s, 2),
                    "speedup_vs_ar": round(total.tokens_per_s / ar_rate, 3) if ar_rate else None,
                    "first_round_speedup_vs_ar": (round(total.first_round_tokens_per_s / ar_first, 3)
                                                  if ar_first else None),
                    "identical_to_ar": total.identical == total.prompts,
                    "identical_fraction": round(total.identical / max(total.prompts, 1), 3),
                    "nodes_per_step": round(total.verified / total.steps, 2) if total.steps else 1.0,
                    "slots_per_forward": round(total.slots / total.forwards, 1) if total.forwards else float(batch),
                    "new_tokens": total.new_tokens, "seconds": round(total.seconds, 2),
                    "prefill_seconds": round(total.prefill_seconds, 3),
                })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | batch | domain | rows | tau | tokens verified/row/step | slots/forward | tokens/s | "
             "vs ar (same batch) | first round vs ar | identical to ar |", "|---" * 11 + "|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['batch_size']} | {r['domain']} | - | skipped: {r['skipped']} "
                         + "| " * 6 + "|")
            continue
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['domain']} | {r['prompts']} | {r['tau']:.2f} | "
            f"{r['nodes_per_step']:.1f} | {r['slots_per_forward']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_ar']:.2f}x | {r['first_round_speedup_vs_ar']:.2f}x | "
            f"{r['identical_fraction'] * 100:.0f}% |"
        )
    return "\n".join(lines)


# ----- the machine record ---------------------------------------------------------------------------------------

def verify_cost_curve(target, sizes=CURVE_SIZES) -> dict | None:
    """T_verify(1, n) / T_verify(1, 1) for n in `sizes` from the target's verify-cost profile (measured now, once,
    when this machine has none), T_verify(1, 1) in ms and the profile's file (`hf-diffspec profile` re-measures it);
    None when profiling is off and none is cached."""
    from .runtime.cost_model import VerifyCost, profile_dir, profile_key

    cost = VerifyCost.for_target(target)
    if cost is None:
        return None
    one = cost.profiled(1, 1)
    return {"ms_one_token": round(one * 1000, 2), "ratio": {str(n): round(cost.profiled(n, 1) / one, 3) for n in sizes},
            "profile": str(profile_dir() / f"{profile_key(target)}.json")}


def machine_description(target=None) -> dict:
    """What decides the result: CPU model and ISA features, GPU, threads, versions; with `target`, its device and
    dtype and its measured verify-cost curve."""
    cpu, isa = cpu_record()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "isa_flags": isa,
        "avx512": "avx512f" in isa, "native_bf16": bool({"avx512_bf16", "amx_bf16", "bf16"} & set(isa)),
        "amx": "amx_tile" in isa, "gpu": gpu, "device": gpu or "cpu", "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if target is not None:
        machine.update(target_device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
                       verify_cost_curve=verify_cost_curve(target))
    return machine


def machine_markdown(machine: dict) -> str:
    """The machine record as the lines printed above the results."""
    yes = lambda flag: "yes" if machine.get(flag) else "no"  # noqa: E731
    isa = ", ".join(machine["isa_flags"]) or "none found"
    lines = [f"**Machine:** {machine['cpu']} ({machine['cpu_count']} CPUs; ISA {isa}: AVX-512 {yes('avx512')}, "
             f"native bf16 {yes('native_bf16')}, AMX {yes('amx')}); GPU {machine['gpu'] or 'none'}; torch "
             f"{machine['torch']} with {machine['torch_threads']} threads, transformers {machine['transformers']}"]
    if "dtype" in machine:
        curve = machine.get("verify_cost_curve")
        if curve is None:
            measured = "not measured (HF_DIFFSPEC_AUTO_PROFILE=0 and no profile: run `hf-diffspec profile`)"
        else:
            measured = ", ".join(f"n={n}: {r:.2f}" for n, r in curve["ratio"].items())
            measured += f" (T_verify(1, 1) = {curve['ms_one_token']:.1f} ms; profile {curve['profile']})"
        lines.append(f"**Target:** {machine['dtype']} on {machine['target_device']}; verify cost "
                     f"T_verify(1, n) / T_verify(1, 1): {measured}")
    return "\n\n".join(lines)


def write_json(path: str, rows: list[dict], config: dict, machine: dict | None = None, **extra) -> None:
    """`results` rows, the machine record (`machine_description()` when not given), the config and any `extra`
    sections (e.g. `oracle`)."""
    payload = {"results": rows, "machine": machine or machine_description(), "config": config, **extra}
    atomic_write(path, json.dumps(payload, indent=2))


def plot(rows: list[dict], path: str) -> None:
    """Several batch sizes: throughput vs batch size per method. One batch size: speedup vs ar per domain."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'hf-diffspec[plot]'") from error
    rows = [r for r in rows if not r.get("skipped")]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    batches = sorted({r["batch_size"] for r in rows})
    if len(batches) > 1:
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        for method in methods:
            points = [(r["batch_size"], r["tokens_per_s"]) for r in rows if r["method"] == method and r["domain"] == "all"]
            ax.plot(*zip(*points), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (rows decoded together)")
        ax.set_ylabel("throughput (new tokens/s, whole batch)")
    else:
        domains = list(dict.fromkeys(r["domain"] for r in rows))
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(domains), 3.2))
        width = 0.8 / len(methods)
        for k, method in enumerate(methods):
            values = [next((r["speedup_vs_ar"] for r in rows if r["method"] == method and r["domain"] == d), 0.0)
                      for d in domains]
            ax.bar([i + k * width for i in range(len(domains))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
        ax.set_ylabel("speedup vs plain generate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
