"""Transformers' plain decoding with the target's linear layers on weights packed once for oneDNN
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what inductor's freezing does on a CPU), against the
layers as they are: how much of the GEMM gap to vLLM's CPU build packing closes (docs/results.md, 2026-12-06).

    python examples/benchmarks/prepacked_linears.py PROMPT_IDS.json     # a JSON list of token ids; bf16, 64 tokens
"""
import json
import sys
import time

import torch
from torch import nn
from hf_diffspec.targets import load_target

class PackedLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.out_features = linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.bias = linear.bias
    def forward(self, x):
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)

ids = torch.tensor([json.load(open(sys.argv[1]))])
target, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
def timed():
    target.generate(ids, **kw)
    best = []
    for _ in range(3):
        t = time.perf_counter(); out = target.generate(ids, **kw); best.append(time.perf_counter() - t)
    return min(best) / 64 * 1000, out
plain_ms, plain_out = timed()
for layer in target.model.layers:
    for parent in (layer.self_attn, layer.mlp):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
packed_ms, packed_out = timed()
print(f"plain {plain_ms:.1f} ms/token, prepacked layers {packed_ms:.1f} ms/token, same tokens: {torch.equal(plain_out, packed_out)}, threads {torch.get_num_threads()}")
