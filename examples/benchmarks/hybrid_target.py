"""Hybrid targets (Qwen3.5-shaped: Gated DeltaNet linear attention beside full attention, random weights): what the
linear layers' rollback costs, what trees buy, and speed against plain `generate`.

    python examples/benchmarks/hybrid_target.py rollback [--size 135m] [--accepted 1,3,6] [--verified 8]
    python examples/benchmarks/hybrid_target.py tau [--size tiny] [--acceptance 0.6] [--depth 4]
    python examples/benchmarks/hybrid_target.py speed [--size 135m] [--rows 1,4,16] [--tau 3]

- `rollback`: one linear layer's rollback after a verify of `--verified` tokens that accepted `--accepted`: before
  (the layer re-run on its recorded inputs, projections included, as the loop did before the state-only rollback)
  and now (the convolution and the recurrence alone, `verify_recurrent._advance`). Prints the projection weight bytes
  each one reads per layer and per step (counted), and the seconds (timed: run it on a quiet machine).
- `tau`: tokens per step of our loop with an oracle that keeps each draft right with probability `--acceptance`:
  a chain of `--depth` drafts, a tree with one more sibling per depth (right where the chain's draft is wrong, with
  the same probability), and a chain with as many drafts as the tree has. Counted, so load-independent.
- `speed`: tokens per second of plain `generate` and of our loop with an oracle chain at tau `--tau`, at each batch
  size of `--rows` (timed: run it on a quiet machine).

`--size`: `tiny` (the tests' shape) or `135m` (SmolLM2-135M's widths and depth, 3 linear layers per full one).
"""

import argparse
import copy
import json
import random
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hf_diffspec.bench.oracle import OracleCandidateGenerator, _loop_drafting, oracle_acceptance
from hf_diffspec.modeling import DiffusionDrafter
from hf_diffspec.runtime.verify_recurrent import CONSUMED_PROJECTIONS, _advance
from hf_diffspec.runtime.verify_cache import full_kv_cache
from hf_diffspec.runtime.tree import CandidateTree

SIZES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4),
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=28,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8),
}


def hybrid_target(size: str, seed: int = 0):
    torch.manual_seed(seed)
    shape = SIZES[size]
    layers = shape["num_hidden_layers"]
    config = Qwen3_5TextConfig(**shape, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                               layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                            for i in range(layers)])
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits: random drafts and prompts give less flat continuations
        model.lm_head.weight.mul_(4)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


@torch.no_grad()
def rollback(args):
    model = hybrid_target(args.size)
    index, module = next((i, layer.linear_attn) for i, layer in enumerate(model.model.layers)
                         if layer.block_type == "linear_attention")
    linear = len([layer for layer in model.model.layers if layer.block_type == "linear_attention"])
    hidden = model.config.hidden_size
    cache = full_kv_cache(model.config)
    module(hidden_states=torch.randn(args.rows, 32, hidden), cache=cache)
    inputs = torch.randn(args.rows, args.verified, hidden)
    saved = (cache.layers[index].conv_states[0].clone(), cache.layers[index].recurrent_states[0].clone())
    consumed = {name: getattr(module, name)(inputs) for name in CONSUMED_PROJECTIONS}
    projections = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    weight_bytes = sum(getattr(module, name).weight.nbytes for name in projections)
    results = []
    for accepted in args.accepted:
        nodes = torch.arange(accepted).expand(args.rows, -1)

        def before():
            layer = cache.layers[index]
            layer.conv_states[0].copy_(saved[0])
            layer.recurrent_states[0].copy_(saved[1])
            module(hidden_states=inputs[:, :accepted], cache=cache)

        def now():
            _advance(module, cache.layers[index], saved, consumed, nodes, torch.full((args.rows,), accepted))

        row = dict(accepted=accepted, verified=args.verified, rows=args.rows,
                   projection_bytes_per_layer_before=weight_bytes, projection_bytes_per_layer_now=0,
                   projection_bytes_per_step_before=weight_bytes * linear, linear_layers=linear)
        for name, run in (("before", before), ("now", now)):
            for _ in range(3):
                run()
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            row[f"seconds_per_layer_{name}"] = (time.perf_counter() - start) / args.repeats
            row[f"seconds_per_step_{name}"] = row[f"seconds_per_layer_{name}"] * linear
        results.append(row)
        print(json.dumps(row))
    return results


class TreeOracle(OracleCandidateGenerator):
    """`OracleCandidateGenerator` with one sibling per depth beside the chain's draft: the right token where the
    chain's draft is wrong, with the same probability, else another wrong token."""

    def propose(self, root_tokens, root_positions, remaining, ahead=None):
        trees = []
        for row, root, position, left in zip(self.rows, root_tokens, root_positions, remaining):
            depth = self.policy.depth_limit(position, left)
            tokens, parents, main = [root], [-1], 0
            for truth in self.references[row][position + 1 : position + 1 + depth]:
                right = self.rng.random() < self.acceptance
                draft = truth if right else self._wrong(truth)
                sibling = truth if not right and self.rng.random() < self.acceptance else self._wrong(truth)
                if sibling == draft:
                    sibling = self._wrong(draft)
                tokens += [draft, sibling]
                parents += [main, main]
                main = len(tokens) - 2
            trees.append(CandidateTree(tokens, parents, device=self.drafter.device))
        return trees


def oracle_run(model, ids, references, generator, drafts: int, max_new_tokens: int, seed: int):
    carrier = DiffusionDrafter.from_target(model, num_hidden_layers=1, block_size=drafts + 1)

    def make(drafter, target):
        return generator(drafter, target, references, acceptance, drafts, seed)

    acceptance = generator.acceptance_value
    with _loop_drafting(make):
        return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=carrier,
                              num_assistant_tokens=drafts, return_dict_in_generate=True)


def tau(args):
    model = hybrid_target(args.size)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (args.rows, 8), generator=torch.Generator().manual_seed(0))
    plain = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
    references = [row.tolist() for row in plain]
    results = {}
    for name, generator, drafts in (("chain", OracleCandidateGenerator, args.depth),
                                    ("tree", TreeOracle, args.depth),
                                    ("chain_same_nodes", OracleCandidateGenerator, 2 * args.depth)):
        generator = type(name, (generator,), {"acceptance_value": args.acceptance})
        taus, nodes = [], 0
        for seed in range(args.seeds):
            out = oracle_run(model, ids, references, generator, drafts, args.tokens, seed)
            assert torch.equal(out.sequences, plain), "lossless: the loop must give plain generate's tokens"
            taus.append(out.speculation_stats.tau)
            nodes = out.speculation_stats.verified_tokens / max(1, out.speculation_stats.target_forwards - 1)
        results[name] = dict(tau=sum(taus) / len(taus), nodes_per_forward=nodes)
    print(json.dumps(dict(acceptance=args.acceptance, depth=args.depth, rows=args.rows, **results)))
    return results


def speed(args):
    model = hybrid_target(args.size)
    vocab = model.config.vocab_size
    drafts = max(2 * int(-(-args.tau // 1)) - 1, 1)
    results = []
    for rows in args.rows_list:
        ids = torch.randint(2, vocab, (rows, args.prompt), generator=torch.Generator().manual_seed(rows))
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm up
        start = time.perf_counter()
        plain = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
        plain_seconds = time.perf_counter() - start
        generator = type("Oracle", (OracleCandidateGenerator,),
                         {"acceptance_value": oracle_acceptance(args.tau, drafts)})
        references = [row.tolist() for row in plain]
        start = time.perf_counter()
        out = oracle_run(model, ids, references, generator, drafts, args.tokens, seed=0)
        ours_seconds = time.perf_counter() - start
        assert torch.equal(out.sequences, plain), "lossless: the loop must give plain generate's tokens"
        row = dict(rows=rows, tokens=rows * args.tokens, tau=out.speculation_stats.tau,
                   plain_tokens_per_s=rows * args.tokens / plain_seconds,
                   ours_tokens_per_s=rows * args.tokens / ours_seconds, speedup=plain_seconds / ours_seconds,
                   linear_state_replays=out.speculation_stats.linear_state_replays)
        results.append(row)
        print(json.dumps(row))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["rollback", "tau", "speed"])
    parser.add_argument("--size", choices=list(SIZES), default=None)
    parser.add_argument("--rows", default=None, help="rollback/tau: one batch size; speed: a comma-separated list")
    parser.add_argument("--accepted", default="1,3,6")
    parser.add_argument("--verified", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--acceptance", type=float, default=0.6)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(0)
    if args.what == "rollback":
        args.size, args.rows = args.size or "135m", int(args.rows or 1)
        args.accepted = [int(a) for a in args.accepted.split(",")]
        results = rollback(args)
    elif args.what == "tau":
        args.size, args.rows = args.size or "tiny", int(args.rows or 1)
        results = tau(args)
    else:
        args.size = args.size or "135m"
        args.rows_list = [int(r) for r in (args.rows or "1,4,16").split(",")]
        results = speed(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(what=args.what, args=copy.deepcopy(vars(args)), results=results), f, indent=2)


if __name__ == "__main__":
    main()
