"""Host time per decoding step apart from the model forwards, on a tiny random target (a forward of ~1 ms on a CPU),
so that the loop's own work dominates: our loop (chains, best-first trees, trees + prompt lookup) against z-lab's
`dflash_generate` and transformers' assisted decoding (a one-layer assistant), at batch 1 and 16. Greedy, random
weights, every call generating the same number of tokens (min_new_tokens). Timings on a shared machine are
indicative: read the ratios within one run.

    python examples/benchmarks/host_time.py [--device cuda] [--max-new-tokens 64] [--layers 4] [--vocab 512]
        [--do-sample] [--json out.json]

`--do-sample` samples with Qwen3's shipped settings (temperature 0.6, top-k 20, top-p 0.95); `--vocab 49152`
gives the target SmolLM2's vocabulary, whose size is what sampling's warpers pay for at every verified position.

`--layers 36` gives the target an 8B model's depth (Qwen3-8B, Llama-3-8B: 32-36 layers) at the same tiny width: what
the loop does per layer of the KV cache (crop, move accepted tree paths) then shows in the host time and calls.
"""

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_diffspec
from hf_diffspec.bench.host_time import compare_host_time, host_time_markdown


def tiny_llama(layers: int, seed: int, device: str, vocab: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = LlamaForCausalLM(config).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--layers", type=int, default=4, help="target layers (the drafter has one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512, help="the target's vocabulary (SmolLM2's: 49152)")
    parser.add_argument("--do-sample", action="store_true", help="sample at temperature 0.6, top-k 20, top-p 0.95")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = tiny_llama(args.layers, 0, args.device, args.vocab)
    torch.manual_seed(1)
    # MASK is a target token (3) so that z-lab's package can load the same drafter
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=8, mask_token_id=3,
                                                       draft_tree_width=2).to(args.device).eval()
    assistant = tiny_llama(1, 2, args.device, args.vocab)
    gen = torch.Generator().manual_seed(0)
    phrase = torch.randint(4, args.vocab, (16, 12), generator=gen)
    prompts = torch.cat([phrase, torch.randint(4, args.vocab, (16, 4), generator=gen), phrase], dim=1).to(args.device)
    sampling = dict(temperature=0.6, top_k=20, top_p=0.95) if args.do_sample else None
    results = compare_host_time(target, drafter, prompts, args.max_new_tokens,
                                batches=[int(b) for b in args.batches.split(",")], assistant=assistant,
                                repeats=args.repeats, sampling=sampling)
    print(host_time_markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
