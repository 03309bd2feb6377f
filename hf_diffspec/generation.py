"""How `target.generate(**inputs, assistant_model=drafter)` reaches our decoding loop.

This is the only module that touches transformers' generation machinery beyond its public classes.

Why this design (transformers 5.24 offers no registry for assistant types):
- `GenerationMixin.generate` is wrapped once, at `import hf_diffspec`. The wrapper looks at `assistant_model` only:
  a diffusion drafter is routed to our loop (`runtime.generate.run_speculative`), anything else (including no assistant, or
  an explicit `speculation_type="dflash"`) calls the original `generate` unchanged, so transformers' own assisted
  generation, prompt lookup, DFlash path, etc. behave exactly as before.
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

from transformers import GenerationMixin

from .runtime.drafting import is_diffusion_drafter
from .runtime.generate import run_speculative


def _dispatching_generate(self, *args, assistant_model=None, streamer=None, **kwargs):
    # speculation_type="dflash" explicitly asks for transformers' own DFlash path: respect it
    config = kwargs.get("generation_config") or self.generation_config
    if is_diffusion_drafter(assistant_model) and (kwargs.get("speculation_type") or config.speculation_type) is None:
        return run_speculative(self, args, kwargs, assistant_model, streamer, _original_generate)
    return _original_generate(self, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)


_original_generate = GenerationMixin.generate
if not getattr(_original_generate, "_hf_diffspec_dispatch", False):
    functools.update_wrapper(_dispatching_generate, _original_generate)
    _dispatching_generate._hf_diffspec_dispatch = True
    GenerationMixin.generate = _dispatching_generate
else:  # module re-imported: keep the first wrapper, find the real generate behind it
    _original_generate = _original_generate.__wrapped__


def assisted_generate_with_stock_loop(target, drafter, **generate_kwargs):
    """Run transformers' own `_assisted_decoding` with our `DiffusionCandidateGenerator` (chains, batch 1).

    Useful to compare against transformers' reference verification; our loop is what `generate` uses by default.
    As there, `num_assistant_tokens` fixes how many drafts each step verifies; unset, the cost model decides.
    """
    from .runtime.drafting import candidate_generator_for
    from .runtime.generate import fixed_draft_length

    if drafter.config.model_type != "diffusion_drafter":
        raise ValueError("transformers' assisted decoding verifies chains only; use generate() for D²SD trees")
    # (read before generate fills in its defaults)
    fixed = fixed_draft_length(generate_kwargs.get("generation_config") or target.generation_config, generate_kwargs)

    def candidate_generator(self, generation_config, *args, **kwargs):
        return candidate_generator_for(drafter, self, fixed, max_length=generation_config.max_length)

    target._get_candidate_generator = types.MethodType(candidate_generator, target)
    try:
        # a non-DiffusionDrafter placeholder would trip the vocab check; pass the drafter past our dispatcher
        return _original_generate(target, assistant_model=drafter, **generate_kwargs)
    finally:
        del target._get_candidate_generator
