"""`hf-diffspec demo`: plain and speculative `generate` on one prompt: exactness checked in float32, speed timed in
bfloat16 (or the dtype asked for).

Exactness: greedy plain and speculative outputs in float32, with every speculative step verifying the drafter's whole
block, so that the check covers as many drafted tokens as it can. In float32 the two must be token for token the same.

Fair timing: one untimed warm-up call of each (the first calls pay for allocation and kernel selection), then `runs`
timed calls of each, interleaved and alternating which goes first so that a machine that speeds up or slows down
affects both alike; the figures are medians. In bfloat16 the timed outputs can part after a while (a forward over
several tokens rounds differently from a one-token one), which the report says in one line.
"""

import statistics
import textwrap
import time
from dataclasses import dataclass

import torch

from .prompts import chat_prompt

__all__ = ["DemoResult", "ExactnessCheck", "check_exactness", "run_demo"]

#: why bfloat16 outputs can differ, said once wherever they do
BF16_ROUNDING = ("a target forward over several tokens rounds differently from a one-token forward, so where two "
                 "tokens are almost tied the choice can flip")


@dataclass
class ExactnessCheck:
    """Greedy plain vs speculative generate in float32 (`check_exactness`)."""

    tokens: int  # new tokens of plain generate
    identical: bool
    identical_prefix: int  # new tokens the two outputs share before the first difference
    drafts_per_step: int  # drafts every speculative step verified
    target_forwards: int  # of the speculative call

    def report(self) -> str:
        if self.identical:
            return (f"Exact (checked in float32): speculative generate's {self.tokens} tokens are plain generate's, "
                    f"token for token (every step verified up to {self.drafts_per_step} drafted tokens: "
                    f"{self.target_forwards} target forwards for {self.tokens} tokens). That is the guarantee: the target checks every drafted token and keeps only "
                    "its own choices, so the drafter changes the speed, never the text.")
        return (f"DIFFERS (checked in float32): speculative output leaves plain generate's after "
                f"{self.identical_prefix} identical tokens, where it must be identical. This is a bug: please report "
                "it with this command line.")


@dataclass
class DemoResult:
    """What `run_demo` measured: the float32 check, new tokens of the timed dtype's warm-up outputs, and per timed run
    its new tokens and seconds."""

    prompt: str
    answer: str
    check: ExactnessCheck
    plain_tokens: int
    speculative_tokens: int
    plain_runs: list[tuple[int, float]]
    speculative_runs: list[tuple[int, float]]
    tau: float
    identical: bool  # the timed dtype's warm-up outputs
    identical_prefix: int
    varying: tuple[str, ...]  # calls ("plain", "speculative") whose timed runs did not all repeat the warm-up
    dtype: torch.dtype
    device_type: str

    @property
    def plain_rate(self) -> float:
        return statistics.median(tokens / seconds for tokens, seconds in self.plain_runs)

    @property
    def speculative_rate(self) -> float:
        return statistics.median(tokens / seconds for tokens, seconds in self.speculative_runs)

    @property
    def speedup(self) -> float:
        return self.speculative_rate / self.plain_rate

    def report(self) -> str:
        runs = len(self.plain_runs)
        where = {"cpu": "CPU", "cuda": "GPU"}.get(self.device_type, "machine")
        dtype = str(self.dtype).replace("torch.", "")
        lines = [
            f"prompt: {self.prompt}",
            "",
            self.answer,
            "",
            _paragraph(self.check.report()),
            "",
            textwrap.fill(f"Speed in {dtype} on this {where}, greedy; medians of {runs} timed run{'s' * (runs > 1)} "
                          "of each (interleaved, after one untimed warm-up run of each):", width=100),
            f"  plain generate:        {self.plain_tokens} tokens, {self.plain_rate:.1f} tokens/s",
            f"  speculative generate:  {self.speculative_tokens} tokens, {self.speculative_rate:.1f} tokens/s, "
            f"{self.tau:.2f} tokens per target forward (plain generate: 1)",
            "",
            _paragraph(f"Speed: {self._speed(where)}"),
        ]
        spread = max(_spread(self.plain_runs), _spread(self.speculative_runs))
        if spread > 1.25:
            lines.append(_paragraph(f"Note: the speed of the same call differed up to {spread:.1f}x between runs: "
                                    "this machine is busy, so the ratio is rough (medians keep single slow runs out)."))
        timed_output = self._timed_output(dtype)
        if timed_output:
            lines.append(_paragraph(timed_output))
        if self.varying:
            lines.append(_paragraph(self._varying_note(dtype)))
        return "\n".join(lines)

    def _timed_output(self, dtype: str) -> str:
        """What the timed dtype's outputs did, when that is worth a line."""
        if self.dtype == torch.float32:
            if self.identical:
                return ""
            return (f"The timed float32 outputs DIFFER after {self.identical_prefix} identical tokens, where they must "
                    "be identical. This is a bug: please report it with this command line.")
        if self.identical:
            return f"In {dtype} the outputs are identical here too (not guaranteed in {dtype}: {BF16_ROUNDING})."
        return (f"In {dtype} the outputs share {self.identical_prefix} tokens, then part: {BF16_ROUNDING} (float32 above "
                "is the exactness check).")

    def _varying_note(self, dtype: str) -> str:
        calls = " and ".join(f"{name} generate" for name in self.varying)
        said = (f"Note: timed runs of {calls} did not all repeat the warm-up's output (the comparison above is the "
                "warm-ups').")
        if self.dtype != torch.float32:
            return (f"{said} In {dtype} that can happen: a forward over a different number of tokens (the cost model "
                    "adapts draft lengths as it measures) rounds differently and can flip a near-tie.")
        if self.device_type == "cuda":
            return f"{said} On a GPU, nondeterministic kernels can do that even in float32."
        return f"{said} In float32 on this {self.device_type} that should not happen: please report it."

    def _speed(self, where: str) -> str:
        ratio = self.speedup
        if ratio >= 1.05:
            return f"{ratio:.2f}x: faster than plain generate on this {where}."
        if ratio > 0.95:
            return f"{ratio:.2f}x: about as fast as plain generate on this {where}."
        why = (f"each speculative step runs the drafter and a target forward over several tokens, and here that costs "
               f"more than committing {self.tau:.2f} tokens per step saves.")
        if self.dtype == torch.float32 and self.device_type == "cpu":
            why += (" In float32 on a CPU a target forward over several tokens costs much more than over one: "
                    "float32 is for checking exactness, bfloat16 for speed.")
        return f"{ratio:.2f}x: slower than plain generate on this {where}: {why}"


def _paragraph(text: str) -> str:
    return textwrap.fill(text, width=100, subsequent_indent="  ")


def _spread(runs: list[tuple[int, float]]) -> float:
    """Fastest over slowest tokens/s of the runs."""
    rates = [tokens / seconds for tokens, seconds in runs]
    return max(rates) / min(rates)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _timed(target, generate_kwargs: dict):
    """(output, seconds) of one `generate` call, waiting for the device to finish."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = target.generate(**generate_kwargs)
    sync()
    return out, time.perf_counter() - start


def _chat_inputs(tokenizer, prompt: str, device) -> dict:
    return tokenizer(chat_prompt(tokenizer, prompt), return_tensors="pt", add_special_tokens=False).to(device)


@torch.no_grad()
def check_exactness(target, tokenizer, drafter, prompt: str, max_new_tokens: int = 96) -> tuple[ExactnessCheck, str]:
    """Greedy plain and speculative `generate` of `prompt` (one chat turn) with a float32 `target`, every speculative
    step verifying the drafter's whole block. Returns the check and the speculative answer's text."""
    if target.dtype != torch.float32:
        raise ValueError(f"the exactness check runs in float32, where speculative greedy output must equal plain "
                         f"generate's token for token; got a {target.dtype} target: load it with dtype=torch.float32")
    inputs = _chat_inputs(tokenizer, prompt, target.device)
    prompt_length = inputs["input_ids"].shape[1]
    drafts = drafter.config.block_size - 1
    plain = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)[0, prompt_length:].tolist()
    # a fixed draft length (transformers' num_assistant_tokens) makes every step speculate
    out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
                          num_assistant_tokens=drafts, return_dict_in_generate=True)
    speculative = out.sequences[0, prompt_length:].tolist()
    check = ExactnessCheck(tokens=len(plain), identical=plain == speculative,
                           identical_prefix=_shared_prefix(plain, speculative), drafts_per_step=drafts,
                           target_forwards=out.speculation_stats.target_forwards)
    return check, tokenizer.decode(speculative, skip_special_tokens=True).strip()


@torch.no_grad()
def run_demo(target, tokenizer, drafter, prompt: str, max_new_tokens: int = 96, runs: int = 3,
             float32_models: tuple | None = None) -> DemoResult:
    """The float32 exactness check (`check_exactness`), then greedy plain and speculative `generate` of `prompt` (one
    chat turn) with `target` and `drafter`: one warm-up call of each, then `runs` timed calls of each, interleaved.

    `float32_models`: `(target, drafter)` in float32 for the check; None checks with `target` and `drafter`
    themselves, which must then be float32."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    check_target, check_drafter = float32_models or (target, drafter)
    check, answer = check_exactness(check_target, tokenizer, check_drafter, prompt, max_new_tokens)

    inputs = _chat_inputs(tokenizer, prompt, target.device)
    prompt_length = inputs["input_ids"].shape[1]
    plain_kwargs = dict(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    speculative_kwargs = dict(**plain_kwargs, assistant_model=drafter, return_dict_in_generate=True)
    plain = target.generate(**plain_kwargs)  # warm-up, not timed
    speculative = target.generate(**speculative_kwargs)
    varying = set()
    timed = {"plain": [], "speculative": []}
    for run in range(runs):
        order = ("plain", "speculative") if run % 2 == 0 else ("speculative", "plain")
        for name in order:
            out, elapsed = _timed(target, plain_kwargs if name == "plain" else speculative_kwargs)
            ids, warm = (out, plain) if name == "plain" else (out.sequences, speculative.sequences)
            timed[name].append((ids.shape[1] - prompt_length, elapsed))
            if not torch.equal(ids, warm):
                varying.add(name)

    plain_new = plain[0, prompt_length:].tolist()
    speculative_new = speculative.sequences[0, prompt_length:].tolist()
    return DemoResult(
        prompt=prompt,
        answer=answer,
        check=check,
        plain_tokens=len(plain_new),
        speculative_tokens=len(speculative_new),
        plain_runs=timed["plain"],
        speculative_runs=timed["speculative"],
        tau=speculative.speculation_stats.tau,
        identical=plain_new == speculative_new,
        identical_prefix=_shared_prefix(plain_new, speculative_new),
        varying=tuple(name for name in ("plain", "speculative") if name in varying),
        dtype=target.dtype,
        device_type=target.device.type,
    )
