"""Batched speculative `generate`: several prompts, left-padded, decoded together, and checked token for token
against plain `generate`.

    python examples/batched.py
    python examples/batched.py --max-new-tokens 32

In float32, speculative greedy output is identical to plain greedy output, row by row, padding included: the target
verifies every drafted token and keeps only its own choices. (In bfloat16 a forward over several tokens rounds
differently from a one-token forward, so near-ties can flip; float32 is the dtype to check exactness in.)
Runs offline on a CPU.
"""

import argparse
from pathlib import Path

import torch

import hf_diffspec

SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is 17 * 23?",
    "Give three tips for writing clear documentation.",
    "Name the planets of the solar system.",
]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="a drafter folder (default: the shipped one)")
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

target, tok = hf_diffspec.load_target("smollm2-135m-instruct", dtype=torch.float32)
drafter = hf_diffspec.DiffusionDrafter.from_pretrained(args.drafter, target=target)

tok.padding_side = "left"  # decoder-only models continue from the right end of each row
conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
inputs = tok.apply_chat_template(conversations, add_generation_prompt=True, padding=True, return_tensors="pt",
                                 return_dict=True)

settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
plain = target.generate(**inputs, **settings)
speculative = target.generate(**inputs, **settings, assistant_model=drafter, return_dict_in_generate=True)

prompt_length = inputs["input_ids"].shape[1]
for prompt, row in zip(PROMPTS, speculative.sequences):
    print(f"### {prompt}\n{tok.decode(row[prompt_length:], skip_special_tokens=True).strip()}\n")
print(f"tau {speculative.speculation_stats.tau:.2f} tokens committed per row and speculative step (plain generate: 1)")
identical = torch.equal(plain, speculative.sequences)
print(f"identical to plain generate (float32, {len(PROMPTS)} rows): {identical}")
if not identical:
    raise SystemExit("speculative output differs from plain generate in float32: this is a bug, please report it")
