"""How `target.generate(**inputs, assistant_model=drafter)` reaches our decoding loop.

This is the only module that touches transformers' generation machinery beyond its public classes.

Why this design (transformers 5.24 offers no registry for assistant types):
- `GenerationMixin.generate` is wrapped once, at `import hf_diffspec`. The wrapper looks at `assistant_model` only:
  a `DiffusionDrafter` is routed to our loop, anything else (including no assistant) calls the original `generate`
  unchanged, so transformers' own assisted generation, prompt lookup, etc. behave exactly as before.
- Our loop is passed to the original `generate` as a `custom_generate` callable, a public API: generate still does
  all of its preparation (generation config, logits processors, stopping criteria incl. stop strings, cache, max
  length, streaming the prompt) and then calls the loop. A callable `custom_generate` does not receive
  `assistant_model` or `streamer`, so the wrapper binds them in a closure.
- Alternatives measured and rejected: overriding the private `_assisted_decoding` needs a per-instance class swap
  (breaks `save_pretrained`'s architectures and pickling); `speculation_type="dflash"` routes to transformers'
  linear-only DFlash generator (no trees, no adaptive length, batch 1); an instance-level `_get_candidate_generator`
  is private and also linear-only. The last one is kept for `assisted_generate_with_stock_loop`, which runs our
  `CandidateGenerator` inside transformers' own `_assisted_decoding` (chains, batch 1).
"""

import functools
import types

from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .decoding import speculative_generate
from .modeling import DiffusionDrafter

_UNSUPPORTED = {
    "num_beams": (1, "beam search"),
    "num_return_sequences": (1, "several return sequences"),
}


def is_diffusion_drafter(assistant) -> bool:
    return isinstance(assistant, DiffusionDrafter)


def _route_to_speculative_loop(model, args, kwargs, drafter, streamer):
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant_model=<DiffusionDrafter> already selects hf_diffspec's loop; drop custom_generate")
    for name, (allowed, what) in _UNSUPPORTED.items():
        value = kwargs.get(name, getattr(kwargs.get("generation_config") or model.generation_config, name, allowed))
        if value not in (None, allowed):
            raise ValueError(f"speculative decoding with a DiffusionDrafter does not support {what} ({name}={value})")

    _move_stop_strings_into_criteria(model, kwargs)

    # generate already streamed the prompt; the loop streams every committed token
    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return speculative_generate(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            drafter=drafter, streamer=streamer, **model_kwargs,
        )

    return _original_generate(model, *args, streamer=streamer, custom_generate=loop, **kwargs)


def _move_stop_strings_into_criteria(model, kwargs) -> None:
    """generate (5.24) drops `tokenizer=` when `custom_generate` is a callable, so stop strings would fail: build
    their criterion here, where the tokenizer is still known."""
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def _dispatching_generate(self, *args, assistant_model=None, streamer=None, **kwargs):
    if is_diffusion_drafter(assistant_model):
        return _route_to_speculative_loop(self, args, kwargs, assistant_model, streamer)
    return _original_generate(self, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)


_original_generate = GenerationMixin.generate
if not getattr(_original_generate, "_hf_diffspec_dispatch", False):
    functools.update_wrapper(_dispatching_generate, _original_generate)
    _dispatching_generate._hf_diffspec_dispatch = True
    GenerationMixin.generate = _dispatching_generate
else:  # module re-imported: keep the first wrapper, find the real generate behind it
    _original_generate = _original_generate.__wrapped__


def assisted_generate_with_stock_loop(target, drafter: DiffusionDrafter, **generate_kwargs):
    """Run transformers' own `_assisted_decoding` with our `DiffusionCandidateGenerator` (chains, batch 1).

    Useful to compare against transformers' reference verification; our loop is what `generate` uses by default.
    """
    from .candidate_generator import DiffusionCandidateGenerator

    def candidate_generator(self, generation_config, *args, **kwargs):
        return DiffusionCandidateGenerator(drafter, self, generation_config.max_length)

    target._get_candidate_generator = types.MethodType(candidate_generator, target)
    try:
        # a non-DiffusionDrafter placeholder would trip the vocab check; pass the drafter past our dispatcher
        return _original_generate(target, assistant_model=drafter, **generate_kwargs)
    finally:
        del target._get_candidate_generator
