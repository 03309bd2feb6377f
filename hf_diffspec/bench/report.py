"""What the benchmark reports: per method (and domain at batch 1) tau (tokens committed per row per target forward,
bonus included; 1.0 for plain `generate`), throughput (new tokens over the whole batch per second, each row counted
up to its EOS), the ratio to `ar` at the same batch size from the same run, and whether each row equals `ar`'s row
token for token; as rows (`summarize`), a markdown table, JSON (with the machine record) and a plot."""

import json
import random

from ..machine import machine_description
from ..runtime.files import atomic_write
from .runner import MethodRun


def summarize(results: dict[tuple[str, int, str], MethodRun]) -> list[dict]:
    """Rows per (method, batch size, domain) plus an `all` row per method and batch size; ratios are to `ar` at the
    same batch size. A skipped method has one row per batch size: domain `all` and `skipped` (the reason)."""
    rows = []
    methods = list(dict.fromkeys(m for m, _, _ in results))
    for batch in sorted({b for _, b, _ in results}):
        domains = [d for d in dict.fromkeys(d for (_, b, d), r in results.items() if b == batch and not r.skipped)
                   if d not in ("mixed", "all")]
        for method in methods:
            skip = next((r.skipped for (m, b, _), r in results.items() if m == method and b == batch and r.skipped),
                        None)
            if skip is not None:
                rows.append({"method": method, "batch_size": batch, "domain": "all", "skipped": skip})
                continue
            if not any(m == method and b == batch for m, b, _ in results):
                continue
            for domain in [*domains, "all"]:
                def total(name) -> MethodRun:
                    return sum((r for (m, b, d), r in results.items()
                                if m == name and b == batch and (domain == "all" or d == domain) and not r.skipped),
                               MethodRun())
                run, ar = total(method), total("ar")
                counts, ar_rate, ar_first = run.counts, ar.tokens_per_s, ar.first_round_tokens_per_s
                rows.append({
                    "method": method, "batch_size": batch, "domain": domain,
                    "prompts": run.prompts, "tau": round(run.tau, 3),
                    "tokens_per_s": round(run.tokens_per_s, 2),
                    "speedup_vs_ar": round(run.tokens_per_s / ar_rate, 3) if ar_rate else None,
                    "speedup_interval": speedup_interval(run.calls, ar.calls) if method != "ar" else None,
                    "first_round_speedup_vs_ar": (round(run.first_round_tokens_per_s / ar_first, 3)
                                                  if ar_first else None),
                    "identical_to_ar": run.identical == run.prompts,
                    "identical_fraction": round(run.identical / max(run.prompts, 1), 3),
                    "nodes_per_step": round(counts.verified / counts.steps, 2) if counts.steps else 1.0,
                    "slots_per_forward": round(counts.slots / counts.forwards, 1) if counts.forwards else float(batch),
                    "new_tokens": run.new_tokens, "seconds": round(run.seconds, 2),
                    "prefill_seconds": round(counts.prefill_seconds, 3),
                    "steps_by_kind": {"draft": counts.draft_steps, "lookup": counts.lookup_steps,
                                      "plain": counts.plain_steps},
                })
    return rows


def speedup_interval(calls: tuple, ar_calls: tuple, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """A 95% paired bootstrap interval of the speedup over `ar`: the timed calls (batches of a round, paired with
    `ar`'s call on the same batch) resampled with replacement, each resample's ratio of tokens per second. None with
    fewer than 3 paired calls."""
    pairs = list(zip(calls, ar_calls))
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        tokens, seconds = sum(c[0] for c, _ in drawn), sum(c[1] for c, _ in drawn)
        ar_tokens, ar_seconds = sum(a[0] for _, a in drawn), sum(a[1] for _, a in drawn)
        ratios.append((tokens / seconds) / (ar_tokens / ar_seconds))
    ratios.sort()
    return [round(ratios[int(0.025 * resamples)], 3), round(ratios[int(0.975 * resamples) - 1], 3)]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | batch | domain | rows | tau | tokens verified/row/step | slots/forward | tokens/s | "
             "vs ar (same batch) [95% interval] | first round vs ar | identical to ar |", "|---" * 11 + "|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['batch_size']} | {r['domain']} | - | skipped: {r['skipped']} "
                         + "| " * 6 + "|")
            continue
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['domain']} | {r['prompts']} | {r['tau']:.2f} | "
            f"{r['nodes_per_step']:.1f} | {r['slots_per_forward']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_ar']:.2f}x{_interval(r)} | {r['first_round_speedup_vs_ar']:.2f}x | "
            f"{r['identical_fraction'] * 100:.0f}% |"
        )
    return "\n".join(lines)


def _interval(row: dict) -> str:
    interval = row.get("speedup_interval")
    return f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""


def write_json(path: str, rows: list[dict], config: dict, machine: dict | None = None, **extra) -> None:
    """`results` rows, the machine record (`machine_description()` when not given), the config and any `extra`
    sections (e.g. `oracle`)."""
    payload = {"results": rows, "machine": machine or machine_description(), "config": config, **extra}
    atomic_write(path, json.dumps(payload, indent=2))


def plot(rows: list[dict], path: str) -> None:
    """Several batch sizes: throughput vs batch size per method. One batch size: speedup vs ar per domain."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'hf-diffspec[plot]'") from error
    rows = [r for r in rows if not r.get("skipped")]
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
            values = [next((r["speedup_vs_ar"] for r in rows if r["method"] == method and r["domain"] == d), 0.0)
                      for d in domains]
            ax.bar([i + k * width for i in range(len(domains))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
        ax.set_ylabel("speedup vs plain generate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
