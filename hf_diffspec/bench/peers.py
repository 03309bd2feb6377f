"""The peers, what a user would run instead of our loop: transformers' prompt-lookup decoding (`pld`), the same
drafter weights through transformers' own DFlash path (`hf-dflash`) and through z-lab's loop (`zlab`, PyPI package
`dflash`), and a smaller sibling of the target as transformers' assistant model (`ar-assistant`). Their loops report
no statistics, so their tau is counted from the target's forwards (`TargetForwardCounter`). A peer that cannot run
with the given drafter, target or batch size is reported as skipped, with the reason, never replaced by something
else."""

import copy
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from ..formats import export_for_engine, native_dflash_drafter, target_token_mask_reason
from ..targets import load_target, unused_target_token
from .counting import TargetForwardCounter, eos_token_ids
from .method import PEER_METHODS, PROMPT_LOOKUP_TOKENS, Method
from .vllm_peer import vllm_methods

#: built-in target -> the smaller model of its family that `ar-assistant` drafts with (same tokenizer)
ASSISTANT_SIBLINGS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
ASSISTED_ONE_ROW = "transformers' assisted generation decodes batch size 1 only"


def peer_methods(methods: list[str], target, target_name: str, drafter=None, assistant_model=None,
                 prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS, tokenizer=None,
                 draft_tokens: int | None = None) -> dict[str, Method]:
    """Peer name -> `Method` (with a `skip_reason` where it cannot run):
    - `pld`: transformers' prompt-lookup decoding, `prompt_lookup_num_tokens=prompt_lookup_tokens`;
    - `hf-dflash`: `drafter`'s weights as transformers' own DFlash drafter, `speculation_type="dflash"`;
    - `zlab`: `drafter`'s weights in z-lab's `DFlashDraftModel`, decoded by z-lab's `dflash_generate`;
    - `ar-assistant`: `assistant_model` (a model, or a name/path for `load_target`; None: the smaller sibling of
      built-in `target_name`, see `ASSISTANT_SIBLINGS`) as transformers' assistant model;
    - `vllm`, `vllm-dflash`: vLLM's CPU build, plainly and with `drafter` exported for it (`vllm_peer`),
      `draft_tokens` per step (default its block - 1).
    The transformers and z-lab DFlash peers embed MASK as a target token. A drafter that learned its own MASK vector runs there with that
    vector in the row of a token the target never reads (`MaskVectorRow`; needs `tokenizer` to find one)."""
    built = vllm_methods([m for m in methods if m.startswith("vllm")], target, drafter, k=draft_tokens)
    mask_row = None
    if {"hf-dflash", "zlab"} & set(methods) and drafter is not None and tokenizer is not None \
            and drafter.config.mask_token_id is None and drafter.config.draft_role == "first":
        try:
            mask_row = MaskVectorRow(target, unused_target_token(tokenizer, drafter.config.vocab_size),
                                     drafter.mask_embedding)
            drafter = mask_row.drafter(drafter)
        except ValueError:
            pass  # no token is free to carry the vector: the peers say why they skip (`target_token_mask_reason`)
    for method in methods:
        if method in built:
            continue
        if method == "pld":
            built[method] = Method(generate_kwargs={"prompt_lookup_num_tokens": prompt_lookup_tokens},
                                   single_row=ASSISTED_ONE_ROW, peer=True)
        elif method == "hf-dflash":
            built[method] = _hf_dflash_method(drafter)
        elif method == "zlab":
            built[method] = zlab_method(drafter, target)
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


def zlab_method(drafter, target) -> Method:
    """`drafter` exported to the z-lab layout (`formats.export_for_engine`, the layout z-lab, vLLM and SGLang load)
    and loaded by z-lab's `DFlashDraftModel.from_pretrained`, as a user of z-lab's package would."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError:
        return Method(skip_reason="z-lab's package is not installed: pip install 'hf-diffspec[peers]' "
                                  "(or pip install --no-deps dflash==0.1.0)", peer=True)
    reason = target_token_mask_reason(drafter, "z-lab's loop")
    if reason is not None:
        return Method(skip_reason=reason, peer=True)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(Path(tmp) / "ours")
        exported, _ = export_for_engine(Path(tmp) / "ours", Path(tmp) / "zlab", "vllm")
        model = DFlashDraftModel.from_pretrained(exported, dtype=drafter.dtype)
    model = model.to(drafter.device).eval()
    return Method(runner=ZLabRunner(model, dflash_generate, sorted(eos_token_ids(target))),
                  single_row="z-lab's transformers loop decodes batch size 1 only", peer=True)


def _assistant_method(target, target_name: str, assistant_model) -> Method:
    if assistant_model is None:
        assistant_model = ASSISTANT_SIBLINGS.get(str(target_name).lower())
        if assistant_model is None:
            pairs = ", ".join(f"{small} -> {big}" for big, small in ASSISTANT_SIBLINGS.items())
            return Method(skip_reason=f"no smaller sibling known for target {target_name!r} (built-in pairs: {pairs}); "
                                      "pass --assistant-model NAME_OR_PATH", peer=True)
    if isinstance(assistant_model, (str, os.PathLike)):
        assistant_model, _ = load_target(assistant_model, dtype=target.dtype, device=target.device)
    return Method(generate_kwargs={"assistant_model": assistant_model}, single_row=ASSISTED_ONE_ROW, peer=True)
