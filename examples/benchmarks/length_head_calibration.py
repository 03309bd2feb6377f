"""Is a drafter's length head calibrated? Its predicted reach per draft slot (the product of the head's acceptance
probabilities up to the slot) against the reach measured offline on the target's own greedy text, on the same blocks.

    python examples/benchmarks/length_head_calibration.py --drafter checkpoints/smollm2-135m-instruct-dflash \
        --data data/heldout-smollm2 --max-sequences 30

The cost model sizes each step from the predicted reach, so a head that under-predicts verifies too few drafts and
one that over-predicts too many. The campaign trains the drafter, not its head: run this after a new drafter ships.
"""

import argparse
import json

import torch

from hf_diffspec import load_target
from hf_diffspec.cli import DTYPES
from hf_diffspec.drafters import load_drafter
from hf_diffspec.runtime.files import atomic_write
from hf_diffspec.trainers.data import DrafterDataset
from hf_diffspec.trainers.offline_acceptance import (
    ANCHORS_PER_FORWARD, accepted_drafts, measuring_trainer, sequence_inputs,
)


@torch.no_grad()
def reach_pairs(trainer, drafter, dataset, max_sequences: int):
    """(predicted, observed) reach per slot, (blocks, slots) each, over every anchor of the first sequences."""
    predicted, observed = [], []
    for i in range(min(max_sequences, len(dataset))):
        item = dataset[i]
        sequence, prompt_length = item["input_ids"], item["prompt_length"]
        anchors = list(range(prompt_length, len(sequence) - 1))
        for start in range(0, len(anchors), ANCHORS_PER_FORWARD):
            inputs = sequence_inputs(sequence, prompt_length, anchors[start : start + ANCHORS_PER_FORWARD],
                                     trainer.args.device)
            blocks = trainer.block_forward(drafter, inputs)  # one forward for both the drafts and the head
            accepted, _ = accepted_drafts(trainer, drafter, inputs, blocks)
            reach = torch.cumprod(drafter.length_head(blocks.hidden[:, :, 1:]).float().sigmoid(), dim=-1)
            slots = torch.arange(1, reach.shape[-1] + 1)
            predicted.append(reach[0].cpu())
            observed.append((accepted[0].cpu()[:, None] >= slots).float())
    return torch.cat(predicted), torch.cat(observed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=None, help="checkpoint dir (default: the shipped drafter)")
    parser.add_argument("--data", nargs="+", required=True, help="held-out data of the target's own greedy answers")
    parser.add_argument("--max-sequences", type=int, default=30)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--slots", type=int, default=6, help="slots to print")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target, tok = load_target("smollm2-135m-instruct", dtype=DTYPES[args.dtype])
    drafter = load_drafter(args.drafter, target, "smollm2-135m-instruct")
    if drafter.length_head is None:
        raise SystemExit(f"{args.drafter or 'the shipped drafter'} has no length head (length_head: false)")
    dataset = DrafterDataset(args.data, tokenizer=tok)
    predicted, observed = reach_pairs(measuring_trainer(drafter, target), drafter, dataset, args.max_sequences)
    mean_predicted, mean_observed = predicted.mean(0), observed.mean(0)
    print(f"{len(predicted)} blocks of {min(args.max_sequences, len(dataset))} sequences\n")
    print("| slot | predicted reach | observed reach | predicted / observed |\n|---|---|---|---|")
    for k in range(args.slots):
        ratio = mean_predicted[k] / mean_observed[k] if mean_observed[k] > 0 else float("nan")
        print(f"| {k + 1} | {mean_predicted[k]:.4f} | {mean_observed[k]:.4f} | {ratio:.2f} |")
    print(f"\nexpected tau: predicted {1 + mean_predicted.sum():.4f}, observed {1 + mean_observed.sum():.4f}")
    if args.json:
        atomic_write(args.json, json.dumps({"config": vars(args), "blocks": len(predicted),
                                            "predicted_reach": mean_predicted.tolist(),
                                            "observed_reach": mean_observed.tolist()}, indent=1))


if __name__ == "__main__":
    main()
