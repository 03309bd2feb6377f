"""Held-out tau against training tokens, from the logs that `hf-diffspec train kd --heldout-tau-steps N` writes
(OUT/heldout_tau.jsonl): a PNG with one curve per run, and the same points as a markdown table on stdout.

    python examples/benchmarks/plot_heldout_tau.py runs/a runs/b --labels "regenerated data" "relabelled text" \
        --out curve.png

A run that was interrupted and resumed (on this machine or another) is one curve: the log is appended to.
"""

import argparse
import sys
from pathlib import Path

from hf_diffspec.trainers.measuring import HELDOUT_TAU_LOG, read_heldout_tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="training output folders (or heldout_tau.jsonl files)")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: the folder names)")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs")
    curves = {}
    for k, run in enumerate(args.runs):
        path = Path(run) / HELDOUT_TAU_LOG if Path(run).is_dir() else Path(run)
        lines = read_heldout_tau(path)
        if not lines:
            parser.error(f"{path}: no held-out tau measured there (train with --heldout-tau-steps N)")
        curves[args.labels[k] if args.labels else Path(run).name] = [lines[s] for s in sorted(lines)]

    domains = sorted({d for lines in curves.values() for line in lines for d in line["tau_per_domain"]})
    print(f"| run | step | training tokens | {' | '.join(domains)} | all |")
    print("|---|---|---|" + "---|" * (len(domains) + 1))
    for label, lines in curves.items():
        for line in lines:
            per_domain = " | ".join(f"{line['tau_per_domain'].get(d, float('nan')):.3f}" for d in domains)
            print(f"| {label} | {line['step']} | {line['training_tokens']:,} | {per_domain} | {line['tau']:.3f} |")
    sys.stdout.flush()

    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{args.out} not drawn: it needs matplotlib (pip install 'hf-diffspec[plot]'); the table "
                         "above holds the same points") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for label, lines in curves.items():
        ax.plot([line["training_tokens"] / 1e6 for line in lines], [line["tau"] for line in lines], marker="o",
                label=label)
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("held-out tau (whole block verified)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
