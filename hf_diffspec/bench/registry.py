"""Method name -> `Method` for every method the benchmark knows (`build_method_drafters`): ours, one drafter run
several ways through our loop plus D²SD, and the peers of `peers.py`. The one module that knows both."""

from pathlib import Path

from ..drafters import load_drafter, shipped_drafter
from ..modeling import DiffusionDrafter, DualDiffusionDrafter
from ..runtime.control_profiles import verify_cost_for
from .method import PEER_METHODS, PROMPT_LOOKUP_TOKENS, SPECULATIVE_METHODS, Method
from .peers import peer_methods


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
    _check_methods(methods)
    needs_drafter = set(methods) & {*SPECULATIVE_METHODS, "hf-dflash", "zlab", "vllm-dflash"}
    # chains for the chain methods, whatever the checkpoint's default (the shipped drafter drafts trees)
    # pure drafter methods: no prompt lookup, whatever the checkpoint's default
    first = (load_drafter(drafter, target, target_name, draft_tree_budget=None, prompt_lookup_num_tokens=None)
             if needs_drafter else None)
    _check_profile(methods, target, target_name)
    tree = dict(num_branches=num_branches, tree_budget=tree_budget, max_depth=max_depth, branch_length=branch_length)
    peers = peer_methods([m for m in methods if m in PEER_METHODS], target, target_name, first,
                         assistant_model=assistant_model, prompt_lookup_tokens=prompt_lookup_tokens,
                         tokenizer=tokenizer, draft_tokens=dflash_length)
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


def _check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m not in ("ar", *SPECULATIVE_METHODS, *PEER_METHODS)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from ar, {', '.join(SPECULATIVE_METHODS)} and the peers "
                         f"{', '.join(PEER_METHODS)}")


def _check_profile(methods: list[str], target, target_name: str) -> None:
    """The methods that size drafts with the cost model need this target's verify-cost profile."""
    if {"dflash", "adaflash", "tree", "tree-lookup"} & set(methods) and verify_cost_for(target) is None:
        dtype = str(target.dtype).replace("torch.", "")
        raise ValueError("dflash, adaflash and tree size drafts with the measured cost model: run "
                         f"`hf-diffspec profile --target {target_name} --dtype {dtype}` first (or leave "
                         "HF_DIFFSPEC_AUTO_PROFILE unset so that it is measured on first use)")
