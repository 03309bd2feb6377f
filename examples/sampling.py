"""Speculative sampling (temperature, top-p): each token is drawn from exactly the distribution plain `generate`
would draw it from, so the drafter changes the speed, never what can be said or how likely it is.

    python examples/sampling.py
    python examples/sampling.py --temperature 0.7 --top-p 0.9 --seed 1 --max-new-tokens 48

At each position the target draws its token from its own distribution p (after temperature and top-p) given the
text committed so far, and a draft is kept only where it is the token drawn (drafts sampled from a known distribution
q are kept with probability min(1, p/q) instead, a rejected one replaced from the residual max(0, p - q)): every token
is distributed as p. The speculative and plain samples below are two samples of that one distribution; with the same
seed they use the random numbers differently, so their texts usually differ.
Runs offline on a CPU.
"""

import argparse
from pathlib import Path

import torch

import hf_diffspec

SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompt", default="Write a short poem about the sea.")
parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="a drafter folder (default: the shipped one)")
parser.add_argument("--temperature", type=float, default=0.8)
parser.add_argument("--top-p", type=float, default=0.95)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--num-assistant-tokens", type=int, default=7,
                    help="drafts verified per step, fixed (0: let the measured cost model choose, plain steps included)")
args = parser.parse_args()

target, tok = hf_diffspec.load_target("smollm2-135m-instruct", dtype=torch.float32)
drafter = hf_diffspec.DiffusionDrafter.from_pretrained(args.drafter, target=target)

messages = [{"role": "user", "content": args.prompt}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
prompt_length = inputs["input_ids"].shape[1]
settings = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
# a fixed draft length (transformers' num_assistant_tokens) makes every step speculative, so tau shows how many drafts
# sampling accepts; unset, the cost model sizes drafts and takes plain steps where drafting would not pay
drafting = dict(num_assistant_tokens=args.num_assistant_tokens) if args.num_assistant_tokens else {}

torch.manual_seed(args.seed)  # with a fixed draft length, the same seed gives the same sample again
speculative = target.generate(**inputs, **settings, **drafting, assistant_model=drafter, return_dict_in_generate=True)
torch.manual_seed(args.seed)
plain = target.generate(**inputs, **settings)

print("speculative sample:\n" + tok.decode(speculative.sequences[0, prompt_length:], skip_special_tokens=True))
print("\nplain sample, same seed:\n" + tok.decode(plain[0, prompt_length:], skip_special_tokens=True))
stats = speculative.speculation_stats
print(f"\ntemperature {args.temperature}, top-p {args.top_p}, seed {args.seed}: tau {stats.tau:.2f} tokens committed per "
      f"step (plain generate: 1), {stats.plain_steps} plain steps (no drafter forward)")
