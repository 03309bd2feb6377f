"""`hf-diffspec bench`: speed of speculative decoding against plain `generate`, measured as ratios within one run.

Methods run interleaved batch by batch (the order rotates), after one warm-up call per method that is not counted,
so that drift of the machine affects all methods alike. At batch size B the prompts are taken B at a time (cycling
to fill the last batch), left-padded, and every method decodes the same batches. Per method (and domain at batch 1)
it reports tau (tokens committed per row per target forward, bonus included), throughput (new tokens over the whole
batch per second, each row counted up to its EOS), the ratio to `ar` at the same batch size from the same run, and
whether each row equals `ar`'s row token for token.

The methods (`build_method_drafters`, names in `SPECULATIVE_METHODS`) are one drafter run several ways, plus D²SD.
"""

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .drafters import load_drafter, shipped_drafter
from .runtime.files import atomic_write, pad_token_id

SPECULATIVE_METHODS = ("dflash", "dflash-block", "dflash-adaptive", "adaflash", "d2sd", "d2sd-reuse", "d2sd-resample")


@dataclass
class Method:
    """What one benchmarked method runs: a drafter (None: plain `generate`) and extra `generate` arguments."""

    drafter: object | None = None
    generate_kwargs: dict = field(default_factory=dict)


def build_method_drafters(methods: list[str], target, target_name: str, drafter: str | None = None,
                          vp_drafter: str | None = None, dflash_length: int | None = None, num_branches: int = 4,
                          tree_budget: int = 16, max_depth: int = 8, branch_length: int = 4) -> dict[str, Method]:
    """Method name -> `Method`, for `ar` and any of `SPECULATIVE_METHODS`:
    - `dflash`: the first drafter verifying a fixed number of drafts per step (`dflash_length`, default the
      drafter's `num_draft_tokens`, else its whole block);
    - `dflash-block`: the same drafter verifying its whole block every step, DFlash's own fixed length;
    - `dflash-adaptive`: the same drafter, lengths chosen per step by the measured cost model from its confidences;
    - `adaflash`: the same drafter, lengths chosen by the cost model from its length head's acceptance predictions;
    - `d2sd` first + VP drafter, `d2sd-reuse` the first drafter re-drafting its own branches (the paper's
      DFlash -> DFlash ablation), `d2sd-resample` branches taken from the first pass's own distributions.

    `drafter` and `vp_drafter` are what `load_drafter` takes (None: the drafters shipped for `target_name`); the
    last four arguments shape D²SD trees.

    Raises:
        ValueError: an unknown method, or one whose requirement is missing (the message says how to provide it).
        FileNotFoundError: a drafter that cannot be found.
    """
    from . import DiffusionDrafter, DualDiffusionDrafter
    from .runtime.cost_model import VerifyCost

    unknown = [m for m in methods if m not in ("ar", *SPECULATIVE_METHODS)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from ar, {', '.join(SPECULATIVE_METHODS)}")
    first = load_drafter(drafter, target, target_name) if set(methods) - {"ar"} else None
    if {"dflash-adaptive", "adaflash"} & set(methods) and VerifyCost.for_target(target) is None:
        dtype = str(target.dtype).replace("torch.", "")
        raise ValueError("dflash-adaptive and adaflash size drafts with the measured cost model: run "
                         f"`hf-diffspec profile --target {target_name} --dtype {dtype}` first")
    tree = dict(num_branches=num_branches, tree_budget=tree_budget, max_depth=max_depth, branch_length=branch_length)
    drafters = {}
    for method in methods:
        if method == "dflash":
            length = dflash_length or first.config.num_draft_tokens or first.config.block_size - 1
            drafters[method] = Method(first, {"num_assistant_tokens": length})
        elif method == "dflash-block":
            drafters[method] = Method(first, {"num_assistant_tokens": first.config.block_size - 1})
        elif method in ("dflash-adaptive", "adaflash"):
            with_head = method == "adaflash"
            if with_head and first.length_head is None:
                raise ValueError("adaflash needs a drafter with a trained length head: train one with `hf-diffspec "
                                 "train length-head --init DRAFTER ...` and pass it as --drafter")
            chosen = first
            if not with_head and first.length_head is not None:  # the same weights, the head left out
                chosen = load_drafter(drafter, target, target_name, length_head=False)
            drafters[method] = Method(chosen)
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


@dataclass
class MethodRun:
    """Totals of one method on one (batch size, domain)."""

    new_tokens: int = 0
    seconds: float = 0.0
    committed: int = 0
    steps: int = 0
    verified: int = 0
    slots: int = 0
    forwards: int = 0
    identical: int = 0
    prompts: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 1.0


def _generate(target, method: Method, inputs, max_new_tokens):
    """Greedy generate with the method's drafter (plain when None); returns (ids, `SpeculationStats` or None)."""
    kwargs = dict(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **method.generate_kwargs)
    if method.drafter is None:
        return target.generate(**kwargs), None
    out = target.generate(**kwargs, assistant_model=method.drafter, return_dict_in_generate=True)
    return out.sequences, out.speculation_stats


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


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
    }


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


def run_benchmark(target, tokenizer, methods: dict, prompts: list[dict], max_new_tokens: int,
                  batch_size: int = 1, progress: bool = True) -> dict[tuple[str, int, str], MethodRun]:
    """Run every method (name -> `Method`, or a drafter) plus plain `ar` on every batch of prompts (chat-templated
    `text`), interleaved; return totals per (method, batch size, domain)."""
    methods = {"ar": Method(), **{k: m if isinstance(m, Method) else Method(m) for k, m in methods.items()}}
    names = list(methods)
    batches = _encode_batches(tokenizer, prompts, batch_size, target.device)
    eos = _eos_ids(target)
    for name in names:  # warm-up, not counted
        _generate(target, methods[name], batches[0][1], min(8, max_new_tokens))

    results: dict[tuple[str, int, str], MethodRun] = {}
    bar = tqdm(total=len(batches) * len(names), desc=f"bench batch {batch_size}", disable=not progress)
    for i, (domain, inputs) in enumerate(batches):
        order = names[i % len(names):] + names[: i % len(names)]
        outputs = {}
        prompt_length = inputs["input_ids"].shape[1]
        for name in order:
            start = time.perf_counter()
            out, stats = _generate(target, methods[name], inputs, max_new_tokens)
            elapsed = time.perf_counter() - start
            outputs[name] = _rows_up_to_eos(out, prompt_length, eos)
            run = results.setdefault((name, batch_size, domain), MethodRun())
            run.prompts += len(outputs[name])
            run.seconds += elapsed
            run.new_tokens += sum(len(r) for r in outputs[name])
            if stats is not None:
                run.committed += sum(stats.committed_per_step)
                run.steps += len(stats.committed_per_step)
                run.verified += stats.verified_tokens
                run.slots += stats.verified_slots
                run.forwards += stats.target_forwards - 1  # the prefill verifies nothing
            bar.update(1)
        for name in names:
            run = results[(name, batch_size, domain)]
            run.identical += sum(a == b for a, b in zip(outputs[name], outputs["ar"]))
    bar.close()
    return results


def summarize(results: dict[tuple[str, int, str], MethodRun]) -> list[dict]:
    """Rows per (method, batch size, domain) plus an `all` row per method and batch size; ratios are to `ar` at the
    same batch size."""
    rows = []
    methods = list(dict.fromkeys(m for m, _, _ in results))
    for batch in sorted({b for _, b, _ in results}):
        domains = [d for d in dict.fromkeys(d for _, b, d in results if b == batch) if d != "mixed"]
        for method in methods:
            for domain in [*domains, "all"]:
                def pick(name):
                    return [r for (m, b, d), r in results.items()
                            if m == name and b == batch and (domain == "all" or d == domain)]
                picked, base = pick(method), pick("ar")
                total = MethodRun(**{f: sum(getattr(r, f) for r in picked) for f in MethodRun.__dataclass_fields__})
                ar_rate = sum(r.new_tokens for r in base) / max(sum(r.seconds for r in base), 1e-9)
                rows.append({
                    "method": method, "batch_size": batch, "domain": domain,
                    "prompts": total.prompts, "tau": round(total.tau, 3),
                    "tokens_per_s": round(total.tokens_per_s, 2),
                    "speedup_vs_ar": round(total.tokens_per_s / ar_rate, 3) if ar_rate else None,
                    "identical_to_ar": total.identical == total.prompts,
                    "identical_fraction": round(total.identical / max(total.prompts, 1), 3),
                    "nodes_per_step": round(total.verified / total.steps, 2) if total.steps else 1.0,
                    "slots_per_forward": round(total.slots / total.forwards, 1) if total.forwards else float(batch),
                    "new_tokens": total.new_tokens, "seconds": round(total.seconds, 2),
                })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | batch | domain | rows | tau | tokens verified/row/step | slots/forward | tokens/s | "
             "vs ar (same batch) | identical to ar |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['domain']} | {r['prompts']} | {r['tau']:.2f} | "
            f"{r['nodes_per_step']:.1f} | {r['slots_per_forward']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_ar']:.2f}x | {r['identical_fraction'] * 100:.0f}% |"
        )
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], config: dict) -> None:
    payload = {"results": rows, "machine": machine_description(), "config": config}
    atomic_write(path, json.dumps(payload, indent=2))


def plot(rows: list[dict], path: str) -> None:
    """Several batch sizes: throughput vs batch size per method. One batch size: speedup vs ar per domain."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'hf-diffspec[plot]'") from error
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
            values = [next(r["speedup_vs_ar"] for r in rows if r["method"] == method and r["domain"] == d)
                      for d in domains]
            ax.bar([i + k * width for i in range(len(domains))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
        ax.set_ylabel("speedup vs plain generate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
