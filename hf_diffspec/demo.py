"""`hf-diffspec demo`: plain and speculative `generate` on one prompt, timed fairly, and what is exact said plainly.

Fair timing: one untimed warm-up call of each (the first calls pay for allocation and kernel selection), then
`runs` timed calls of each, interleaved and alternating which goes first so that a machine that speeds up or slows
down affects both alike; the figures are medians. The report says whether the speculative output is token for token
the plain one, what that means in the dtype used, and whether speculation was faster or slower on this machine.
"""

import statistics
import textwrap
import time
from dataclasses import dataclass

import torch

from .prompts import chat_prompt

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    """What `run_demo` measured: new tokens of the warm-up outputs, and per timed run its new tokens and seconds."""

    prompt: str
    answer: str
    plain_tokens: int
    speculative_tokens: int
    plain_runs: list[tuple[int, float]]
    speculative_runs: list[tuple[int, float]]
    tau: float
    identical: bool
    identical_prefix: int  # new tokens the two outputs share before the first difference
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
            textwrap.fill(f"Greedy decoding in {dtype} on this {where}; medians of {runs} timed run{'s' * (runs > 1)} "
                          "of each (interleaved, after one untimed warm-up run of each):", width=100),
            f"  plain generate:        {self.plain_tokens} tokens, {self.plain_rate:.1f} tokens/s",
            f"  speculative generate:  {self.speculative_tokens} tokens, {self.speculative_rate:.1f} tokens/s, "
            f"{self.tau:.2f} tokens per target forward (plain generate: 1)",
            "",
            _paragraph("Speed", self._speed(where)),
        ]
        spread = max(_spread(self.plain_runs), _spread(self.speculative_runs))
        if spread > 1.25:
            lines.append(_paragraph("Note", f"the speed of the same call differed up to {spread:.1f}x between runs: "
                                    "this machine is busy, so the ratio is rough (medians keep single slow runs out)."))
        lines.append(_paragraph("Output", self._exactness(dtype)))
        if self.varying:
            lines.append(_paragraph("Note", self._varying_note(dtype)))
        return "\n".join(lines)

    def _varying_note(self, dtype: str) -> str:
        calls = " and ".join(f"{name} generate" for name in self.varying)
        said = f"timed runs of {calls} did not all repeat the warm-up's output (the comparison above is the warm-ups')."
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

    def _exactness(self, dtype: str) -> str:
        exact_dtype = self.dtype == torch.float32
        rounding = ("the target scores several tokens in one forward, which rounds slightly differently from one "
                    "token at a time, so where two tokens are almost tied the choice can flip")
        if self.identical and exact_dtype:
            return ("speculative output is token-for-token identical to plain generate. In float32 that is the "
                    "guarantee: the target checks every drafted token and keeps only its own choices, so the drafter "
                    "changes the speed, never the text.")
        if self.identical:
            return (f"speculative output is token-for-token identical to plain generate on this prompt. In {dtype} "
                    f"that is not guaranteed for every prompt: {rounding}. `--dtype fp32` is the exactness check.")
        if not exact_dtype:
            return (f"speculative output equals plain generate for the first {self.identical_prefix} tokens, then "
                    f"differs. In {dtype} that is expected: {rounding}, and the texts then go separate ways (every "
                    "token is still the target's own choice given the text before it). `--dtype fp32` is the "
                    "exactness check: there the outputs must be identical.")
        return (f"speculative output DIFFERS from plain generate after {self.identical_prefix} identical tokens, in "
                "float32, where it must be identical. This is a bug: please report it with this command line.")


def _paragraph(label: str, text: str) -> str:
    return textwrap.fill(f"{label}: {text}", width=100, subsequent_indent="  ")


def _spread(runs: list[tuple[int, float]]) -> float:
    """Fastest over slowest tokens/s of the runs."""
    rates = [tokens / seconds for tokens, seconds in runs]
    return max(rates) / min(rates)


def _timed(target, generate_kwargs: dict):
    """(output, seconds) of one `generate` call, waiting for the device to finish."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = target.generate(**generate_kwargs)
    sync()
    return out, time.perf_counter() - start


@torch.no_grad()
def run_demo(target, tokenizer, drafter, prompt: str, max_new_tokens: int = 96, runs: int = 3) -> DemoResult:
    """Greedy plain and speculative `generate` of `prompt` (one chat turn): one warm-up call of each, then `runs`
    timed calls of each, interleaved."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    inputs = tokenizer(chat_prompt(tokenizer, prompt), return_tensors="pt", add_special_tokens=False).to(target.device)
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
    prefix = next((i for i, (a, b) in enumerate(zip(plain_new, speculative_new)) if a != b),
                  min(len(plain_new), len(speculative_new)))
    return DemoResult(
        prompt=prompt,
        answer=tokenizer.decode(speculative_new, skip_special_tokens=True).strip(),
        plain_tokens=len(plain_new),
        speculative_tokens=len(speculative_new),
        plain_runs=timed["plain"],
        speculative_runs=timed["speculative"],
        tau=speculative.speculation_stats.tau,
        identical=plain_new == speculative_new,
        identical_prefix=prefix,
        varying=tuple(name for name in ("plain", "speculative") if name in varying),
        dtype=target.dtype,
        device_type=target.device.type,
    )
