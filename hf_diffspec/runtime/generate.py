"""From a `generate(...)` call with a diffusion drafter to our decoding loop.

`run_speculative` re-enters transformers' `generate` with our loop as a `custom_generate` callable, so generate does
all of its usual preparation (generation config, logits processors, stopping criteria, cache, max length, streaming
the prompt) and then hands over. Two callers share it:
- the dispatcher that `import hf_diffspec` installs (`generation.py`);
- `generate` below, which is what a saved drafter's `custom_generate/generate.py` is (this file, copied at save
  time), so `target.generate(..., assistant_model=drafter, custom_generate=<dir>, trust_remote_code=True)` works
  without hf_diffspec installed. Imports: torch/transformers and sibling runtime modules only.
"""

from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .drafting import first_drafter, is_diffusion_drafter
from .decoding import speculative_generate
from .support import refuse_unsupported

_UNSUPPORTED = {
    "num_beams": (1, "beam search"),
    "num_return_sequences": (1, "several return sequences"),
}


def run_speculative(model, args, kwargs, drafter, streamer, generate_fn):
    """Call `generate_fn` (transformers' generate) with our loop as its `custom_generate` callable."""
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant_model=<DiffusionDrafter> already selects hf_diffspec's loop; drop custom_generate")
    config = kwargs.get("generation_config") or model.generation_config
    for name, (allowed, what) in _UNSUPPORTED.items():
        value = kwargs.get(name, getattr(config, name, allowed))
        if value not in (None, allowed):
            raise ValueError(f"speculative decoding with a DiffusionDrafter does not support {what} ({name}={value})")
    refuse_unsupported(model, config, kwargs)
    _move_stop_strings_into_criteria(config, kwargs)
    num_draft_tokens = fixed_draft_length(config, kwargs)
    prompt_lookup_tokens = _prompt_lookup_tokens(config, kwargs, drafter)

    # generate already streamed the prompt; the loop streams every committed token
    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return speculative_generate(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            drafter=drafter, streamer=streamer, num_draft_tokens=num_draft_tokens,
            prompt_lookup_tokens=prompt_lookup_tokens, **model_kwargs,
        )

    return generate_fn(model, *args, streamer=streamer, custom_generate=loop, **kwargs)


def fixed_draft_length(config, kwargs) -> int | None:
    """`num_assistant_tokens`, transformers' knob for assisted decoding, fixes how many drafts are verified per step
    when the user sets it; unset, the measured cost model decides. Read here, before generate fills in its defaults
    (20, "constant"), which would be indistinguishable from a user's choice."""
    schedule = kwargs.get("num_assistant_tokens_schedule", config.num_assistant_tokens_schedule)
    if schedule not in (None, "constant"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} is for transformers' autoregressive assistants; a diffusion "
            "drafter sizes its drafts with the measured cost model (leave it unset) or verifies a fixed "
            "num_assistant_tokens (schedule 'constant')."
        )
    value = kwargs.get("num_assistant_tokens", config.num_assistant_tokens)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"num_assistant_tokens must be a positive integer, got {value!r}")
    return value


def _prompt_lookup_tokens(config, kwargs, drafter) -> int:
    """Prompt-lookup drafts per step beside the drafter's: `prompt_lookup_num_tokens` (transformers' knob for prompt
    lookup) when the call or its generation config sets it, 0 to turn lookup off; else the drafter's config. Taken
    out of the call, as generate would otherwise build its own prompt-lookup generator."""
    value = kwargs.pop("prompt_lookup_num_tokens", None)
    if value is None:
        value = config.prompt_lookup_num_tokens
    if value is None:
        value = getattr(first_drafter(drafter).config, "prompt_lookup_num_tokens", None) or 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"prompt_lookup_num_tokens must be a non-negative integer (0: no lookup), got {value!r}")
    return value


def _move_stop_strings_into_criteria(config, kwargs) -> None:
    """generate (5.24) drops `tokenizer=` when `custom_generate` is a callable, so stop strings would fail: build
    their criterion here, where the tokenizer is still known."""
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


def generate(*args, model, assistant_model=None, streamer=None, **kwargs):
    """Entry point of a drafter checkpoint's `custom_generate/` folder (keyword-only `model`, as transformers asks)."""
    if not is_diffusion_drafter(assistant_model):
        raise ValueError(
            "this custom_generate folder runs hf_diffspec speculative decoding: pass the diffusion drafter as "
            f"assistant_model= (got {type(assistant_model).__name__})"
        )
    kwargs.pop("trust_remote_code", None)
    return run_speculative(model, args, kwargs, assistant_model, streamer, GenerationMixin.generate)
