"""A published DFlash drafter from the Hugging Face Hub with its target: by default z-lab's `Qwen3-8B-DFlash-b16`
with `Qwen/Qwen3-8B`.

NEEDS THE NETWORK (the target is ~16 GB, the drafter ~2 GB, both fetched from the Hub once) AND A GPU-SIZED MACHINE
(~20 GB of accelerator memory in bfloat16). It is not run in CI.

    python examples/published_drafter.py
    python examples/published_drafter.py --drafter z-lab/Qwen3-4B-DFlash-b16 --target Qwen/Qwen3-4B
    python examples/published_drafter.py --drafter z-lab/gemma-4-31B-it-DFlash --target google/gemma-4-31B-it \
        --chat-template-kwargs '{}'

`DiffusionDrafter.from_pretrained` reads z-lab's layout (`dflash_config` with `mask_token_id` and
`target_layer_ids`) as it is, and any drafter folder saved with hf_diffspec. `--chat-template-kwargs` (JSON) goes to
the tokenizer's chat template; the default, `{"enable_thinking": false}`, is how z-lab's Qwen3 / Qwen3.5 / Qwen3.6
drafters were trained. Prompt the target the way its drafter was trained, or most drafts are rejected (still
lossless, just slower).
"""

import argparse
import json
import time

import torch

import hf_diffspec

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--drafter", default="z-lab/Qwen3-8B-DFlash-b16", help="Hub id or folder of a DFlash drafter")
parser.add_argument("--target", default="Qwen/Qwen3-8B", help="Hub id or folder of the drafter's target")
parser.add_argument("--prompt", default="Write a Python function that merges two sorted lists, with a docstring.")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--chat-template-kwargs", type=json.loads, default={"enable_thinking": False},
                    help='JSON for the chat template (default {"enable_thinking": false}: thinking off, as z-lab\'s '
                         'Qwen drafters were trained; \'{}\' for targets whose template has no such switch)')
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="float32: the exactness check (identical to plain greedy generate)")
args = parser.parse_args()

target, tok = hf_diffspec.load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
drafter = hf_diffspec.DiffusionDrafter.from_pretrained(args.drafter, target=target)

messages = [{"role": "user", "content": args.prompt}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, **args.chat_template_kwargs,
                                 return_tensors="pt", return_dict=True).to(target.device)
settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)


def timed(**kwargs):
    """(output, seconds) of one generate call, waiting for the GPU to finish."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = target.generate(**inputs, **{**settings, **kwargs})
    sync()
    return out, time.perf_counter() - start


timed(max_new_tokens=8)  # warm-up: the first call pays for allocation and kernel selection
plain, plain_seconds = timed()
speculative, speculative_seconds = timed(assistant_model=drafter, return_dict_in_generate=True)

prompt_length = inputs["input_ids"].shape[1]
print(tok.decode(speculative.sequences[0, prompt_length:], skip_special_tokens=True))
stats = speculative.speculation_stats
print(f"\ntau {stats.tau:.2f} tokens committed per target forward (plain generate: 1)")
print(f"plain generate {plain_seconds:.1f} s, speculative {speculative_seconds:.1f} s: "
      f"{plain_seconds / speculative_seconds:.2f}x (one run each, after a warm-up)")
# bf16: a forward over several tokens rounds differently from a one-token one, so a near-tie can flip
same = torch.equal(plain, speculative.sequences)
print(f"identical to plain generate: {same}" + ("" if same or args.dtype == "float32" else
                                                f" ({args.dtype} rounding; float32 is the exactness check)"))
