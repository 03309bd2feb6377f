"""Running the methods: `run_benchmark` decodes the same batches with every method, interleaved, and adds up what
each call did into one `MethodRun` per (method, batch size, domain).

Methods run interleaved batch by batch (the order rotates), after one warm-up call per method that is not counted,
so that drift of the machine affects all methods alike. At batch size B the prompts are taken B at a time (cycling
to fill the last batch), left-padded, and every method decodes the same batches. What the loop did is one record,
`StepCounts`: from our loop's `SpeculationStats`, or counted from the target's forwards for loops that report no
statistics (`TargetForwardCounter`); a method's calls add up with `+`."""

import math
from dataclasses import dataclass, field, fields, replace

import torch
from tqdm.auto import tqdm

from ..runtime.device_clock import device_time
from ..runtime.files import pad_token_id
from .counting import StepCounts, TargetForwardCounter, eos_token_ids
from .method import Method

MIN_TIMED_CALLS = 3  # per method and batch size, by default: one timed call drifts by ±10% on this kind of machine


@dataclass
class MethodRun:
    """Totals of one method on one (batch size, domain): new tokens and seconds (and those of the first round
    alone), rows identical to `ar`'s, prompts, and what the loop did (`counts`, zeros for plain `generate`); `calls`:
    (tokens, seconds) of each timed call, in the order the batches ran (every method runs each batch once a round, so
    calls pair up across methods). Runs add up with `+`; `skipped`: why the method did not run (no totals then)."""

    new_tokens: int = 0
    seconds: float = 0.0
    first_round_seconds: float = 0.0
    first_round_tokens: int = 0
    identical: int = 0
    prompts: int = 0
    counts: StepCounts = field(default_factory=StepCounts)
    calls: tuple = ()
    skipped: str | None = None

    def __add__(self, other: "MethodRun") -> "MethodRun":
        if self.skipped or other.skipped:
            raise ValueError("a skipped method has no totals to add")
        return MethodRun(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                            if f.name != "skipped"})

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def first_round_tokens_per_s(self) -> float:
        return self.first_round_tokens / self.first_round_seconds if self.first_round_seconds else 0.0

    @property
    def tau(self) -> float:
        return self.counts.tau


def run_method(target, method: Method, inputs, max_new_tokens,
               sampling: dict | None = None) -> tuple[torch.Tensor, StepCounts | None]:
    """Decoding by `method`, greedy or, with `sampling` (generate's `temperature`, `top_k`, `top_p` ...), sampled;
    returns (sequences, `StepCounts`, None for plain `generate`)."""
    if method.target_patch is not None:
        with method.target_patch(target):
            return run_method(target, replace(method, target_patch=None), inputs, max_new_tokens, sampling)
    if method.runner is not None:
        if getattr(method.runner, "samples", False):
            return method.runner(target, inputs, max_new_tokens, sampling)
        return method.runner(target, inputs, max_new_tokens)
    sampling = dict(do_sample=False) if sampling is None else dict(do_sample=True, **sampling)
    kwargs = dict(**inputs, max_new_tokens=max_new_tokens, **sampling, **method.generate_kwargs)
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


def encode_batches(tokenizer, prompts: list[dict], batch_size: int, device) -> list[tuple[str, dict]]:
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


def run_benchmark(target, tokenizer, methods: dict, prompts: list[dict], max_new_tokens: int,
                  batch_size: int = 1, progress: bool = True, rounds: int | None = None,
                  sampling: dict | None = None) -> dict[tuple[str, int, str], MethodRun]:
    """Run every method (name -> `Method`, or a drafter) plus plain `ar` on every batch of prompts (chat-templated
    `text`), interleaved; return totals per (method, batch size, domain). A method that cannot run at this batch size
    (or a peer whose warm-up fails) gets one `MethodRun` under domain "all" with `skipped` set to the reason.
    `rounds`: every batch is decoded that many times by every method (all batches, then all again): at 16 or 64
    rows a few prompts make one batch, one timed call per method, and this machine's speed drifts by ±10% between
    calls. None: enough rounds for `MIN_TIMED_CALLS` timed calls per method. Times and tokens add up over the
    rounds; prompts and identity count the first, and the first round's time and tokens are also kept apart (a
    method that learns across calls, like our speculation gates, shows what its first call cost). `sampling`: the
    sampling settings every method decodes with (generate's `temperature`, `top_k`, `top_p`); None: greedy. Rows
    then differ from `ar`'s by chance, not by error (`identical` counts them all the same)."""
    methods = {"ar": Method(), **{k: m if isinstance(m, Method) else Method(m) for k, m in methods.items()}}
    skipped = {name: m.skip_reason or (m.single_row if batch_size > 1 else None)
               or ("its loop decodes greedily only" if sampling is not None and m.runner is not None
                   and not getattr(m.runner, "samples", False) else None)
               for name, m in methods.items()}
    skipped = {name: reason for name, reason in skipped.items() if reason}
    batches = encode_batches(tokenizer, prompts, batch_size, target.device)
    if rounds is None:
        rounds = math.ceil(MIN_TIMED_CALLS / len(batches))
    eos = eos_token_ids(target)
    for name, method in methods.items():
        prepare = getattr(method.runner, "prepare", None)
        if prepare is not None and name not in skipped:
            prepare(target, [inputs for _, inputs in batches], max_new_tokens)
    for name, method in methods.items():  # warm-up, not counted
        if name in skipped:
            continue
        try:
            run_method(target, method, batches[0][1], min(8, max_new_tokens), sampling)
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
            start = device_time(target.device)  # the previous call's work is not this one's
            out, counts = run_method(target, methods[name], inputs, max_new_tokens, sampling)
            elapsed = device_time(target.device) - start
            outputs[name] = _rows_up_to_eos(out, prompt_length, eos)
            tokens = sum(len(r) for r in outputs[name])
            call = MethodRun(new_tokens=tokens, seconds=elapsed, counts=counts or StepCounts(),
                             calls=((tokens, elapsed),))
            if first_round:
                call.prompts, call.first_round_seconds, call.first_round_tokens = len(outputs[name]), elapsed, tokens
            key = (name, batch_size, domain)
            results[key] = results.get(key, MethodRun()) + call
            bar.update(1)
        for name in names if first_round else ():
            results[(name, batch_size, domain)].identical += sum(a == b for a, b in zip(outputs[name], outputs["ar"]))
    bar.close()
    for name, reason in skipped.items():
        results[(name, batch_size, "all")] = MethodRun(skipped=reason)
    return results
