"""`hf-diffspec bench`: speed of speculative decoding against plain `generate`, measured as ratios within one run.

Methods run interleaved prompt by prompt (the order rotates), after one warm-up call per method that is not counted,
so that drift of the machine affects all methods alike. Per method and domain it reports tau (tokens committed per
target forward, bonus included), tokens/s, the speedup over `ar` from the same run, and whether the outputs equal
`ar`'s token for token.
"""

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm



@dataclass
class MethodRun:
    """Totals of one method on one domain."""

    new_tokens: int = 0
    seconds: float = 0.0
    committed: int = 0
    steps: int = 0
    verified: int = 0
    identical: int = 0
    prompts: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 1.0


def _generate(target, drafter, inputs, max_new_tokens):
    """Plain greedy generate when `drafter` is None, else speculative; returns (ids, stats or None)."""
    if drafter is None:
        return target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False), None
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
    return out, drafter.last_generation_stats


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


def run_benchmark(target, tokenizer, drafters: dict, prompts: list[dict], max_new_tokens: int,
                  progress: bool = True) -> dict[tuple[str, str], MethodRun]:
    """Run every method (name -> drafter, None for plain `ar`) on every prompt (chat-templated `text`),
    interleaved; return totals per (method, domain)."""
    drafters = {"ar": None, **drafters}  # speedups are ratios to ar measured in the same run
    methods = list(drafters)
    encoded = [tokenizer(p["text"], return_tensors="pt", add_special_tokens=False).to(target.device) for p in prompts]
    for method in methods:  # warm-up, not counted
        _generate(target, drafters[method], encoded[0], min(8, max_new_tokens))

    results: dict[tuple[str, str], MethodRun] = {}
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", disable=not progress)
    for i, (prompt, inputs) in enumerate(zip(prompts, encoded)):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        outputs = {}
        for method in order:
            start = time.perf_counter()
            out, stats = _generate(target, drafters[method], inputs, max_new_tokens)
            elapsed = time.perf_counter() - start
            outputs[method] = out
            run = results.setdefault((method, prompt["domain"]), MethodRun())
            run.prompts += 1
            run.seconds += elapsed
            run.new_tokens += out.shape[1] - inputs["input_ids"].shape[1]
            if stats is not None:
                run.committed += sum(stats.committed_per_step)
                run.steps += len(stats.committed_per_step)
                run.verified += stats.verified_tokens
            bar.update(1)
        for method in methods:
            run = results[(method, prompt["domain"])]
            run.identical += int(torch.equal(outputs[method], outputs["ar"]))
    bar.close()
    return results


def summarize(results: dict[tuple[str, str], MethodRun]) -> list[dict]:
    """Rows per (method, domain) plus an `all` row per method, speedups as ratios to `ar`."""
    rows = []
    methods = list(dict.fromkeys(m for m, _ in results))
    domains = list(dict.fromkeys(d for _, d in results))
    for method in methods:
        for domain in [*domains, "all"]:
            picked = [r for (m, d), r in results.items() if m == method and (domain == "all" or d == domain)]
            base = [r for (m, d), r in results.items() if m == "ar" and (domain == "all" or d == domain)]
            total = MethodRun(
                new_tokens=sum(r.new_tokens for r in picked), seconds=sum(r.seconds for r in picked),
                committed=sum(r.committed for r in picked), steps=sum(r.steps for r in picked),
                verified=sum(r.verified for r in picked),
                identical=sum(r.identical for r in picked), prompts=sum(r.prompts for r in picked),
            )
            ar_rate = sum(r.new_tokens for r in base) / max(sum(r.seconds for r in base), 1e-9)
            rows.append({
                "method": method, "domain": domain, "prompts": total.prompts, "tau": round(total.tau, 3),
                "tokens_per_s": round(total.tokens_per_s, 2),
                "speedup_vs_ar": round(total.tokens_per_s / ar_rate, 3) if ar_rate else None,
                "identical_to_ar": total.identical == total.prompts,
                "identical_fraction": round(total.identical / max(total.prompts, 1), 3),
                "nodes_per_step": round(total.verified / total.steps, 2) if total.steps else 1.0,
                "new_tokens": total.new_tokens, "seconds": round(total.seconds, 2),
            })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | domain | prompts | tau | tokens verified/step | tokens/s | speedup vs ar | identical to ar |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['domain']} | {r['prompts']} | {r['tau']:.2f} | {r['nodes_per_step']:.1f} | "
            f"{r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | {r['identical_fraction'] * 100:.0f}% |"
        )
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], config: dict) -> None:
    payload = {"results": rows, "machine": machine_description(), "config": config}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)  # never leave a half-written file under the final name


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'hf-diffspec[plot]'") from error
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)]
    domains = [d for d in dict.fromkeys(r["domain"] for r in rows)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(domains), 3.2))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        values = [next(r["speedup_vs_ar"] for r in rows if r["method"] == method and r["domain"] == d) for d in domains]
        ax.bar([i + k * width for i in range(len(domains))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
    ax.set_ylabel("speedup vs plain generate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
