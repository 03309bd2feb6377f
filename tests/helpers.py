"""Shared test helpers: tiny random targets and drafters, oracles that stand in for a well-trained drafter, and the
user-side generate hooks (streamer, stopping criterion, tokenizer) that several test files and
`tests/differential.py` use.

The oracles make tests exercise acceptance (long accepted paths, branches, bonus tokens): `NoisyOracle` proposes the
target's own greedy continuation, corrupted at random, optionally with wrong sibling branches; `oracle_drafter_outputs`
makes a drafter's own forward point at that continuation, so the real drafting code (limits, trees) runs on it. The
loop must be lossless for ANY proposals, so this is a fair test of verification, not of drafting.
"""

import random
import string
import threading

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    StoppingCriteria,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.generation.streamers import BaseStreamer

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.runtime.tree import CandidateTree


def tiny_target(kind: str = "llama", seed: int = 0, vocab_size: int = 128, attn: str = "sdpa", layers: int = 4,
                sharpen: float = 1.0):
    """A tiny random Llama or Qwen3 in fp32. `sharpen` scales its LM head: sharper distributions make random drafts
    agree with the target more often, and a wrong position or prefix change the greedy tokens."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(kind)
    model.set_attn_implementation(attn)
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    # generate() must not stop at the random model's EOS unless a test asks for it
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


# families with sliding-window layers and/or mixture-of-experts MLPs; `tiny_family_target` builds them
FAMILIES = ("gemma3", "gemma4", "gpt_oss", "qwen3_moe", "mistral")


def tiny_family_target(family: str, seed: int = 0, vocab_size: int = 128, window: int = 4, attn: str | None = None,
                       sharpen: float = 1.0):
    """A tiny random fp32 target of one of `FAMILIES`, from transformers' own classes, with a `window`-token sliding
    window: Gemma 3 (sliding and full layers alternating, logit softcapping), Gemma 4 (alternating, per-layer inputs,
    wider full-attention layers, its last two layers reusing earlier layers' KV), gpt-oss (alternating, attention
    sinks, MoE; always eager attention: it has no sdpa), Qwen3-MoE (full attention, MoE) and Mistral (every layer
    sliding). `attn`: sdpa when None."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig,
                              GptOssConfig, GptOssForCausalLM, MistralConfig, MistralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        pad_token_id=1,
    )
    alternating = ["sliding_attention", "full_attention"] * 2
    if family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=window, layer_types=alternating,
                                                   final_logit_softcapping=30.0, query_pre_attn_scalar=16))
    elif family == "gemma4":
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            **common, sliding_window=window, layer_types=alternating, global_head_dim=32, num_kv_shared_layers=2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size, final_logit_softcapping=30.0))
    elif family == "gpt_oss":
        model = GptOssForCausalLM(GptOssConfig(**common, sliding_window=window, layer_types=alternating,
                                               num_local_experts=4, num_experts_per_tok=2))
        attn = "eager"  # no sdpa (sinks), flash kernels refused
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window))
    else:
        raise ValueError(family)
    model.set_attn_implementation(attn or "sdpa")
    if sharpen != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def tiny_hybrid_target(kind: str = "qwen3_5", seed: int = 0, vocab_size: int = 128, attn: str = "sdpa",
                       layers: int = 4, sharpen: float = 1.0):
    """A tiny random Qwen3.5 (`qwen3_5`) or Qwen3.5-MoE (`qwen3_5_moe`) text model, or Qwen3.5's image-text model
    (`qwen3_5_vl`, a one-block vision tower) in fp32: Gated DeltaNet linear-attention layers with a full-attention
    layer after every three, the last layer always full attention (at least 2 layers). `sharpen` as in
    `tiny_target`."""
    torch.manual_seed(seed)
    layers = max(2, layers)
    layer_types = ["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)]
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
    elif kind == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            **common))
    elif kind == "qwen3_5_vl":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=common, vision_config=vision))
    else:
        raise ValueError(kind)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
        for layer in model.get_decoder().layers:  # louder linear layers: a wrong state changes the greedy tokens
            if layer.block_type == "linear_attention":
                layer.linear_attn.out_proj.weight.mul_(4)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


# the classes `AutoModelForCausalLM` returns for real multimodal checkpoints (Gemma 3 / 4), and Qwen3.5's as an
# image-text model loads; `tiny_multimodal_target` builds them
MULTIMODAL = ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe")


def tiny_multimodal_target(kind: str, seed: int = 0, vocab_size: int = 128, window: int = 4, sharpen: float = 1.0):
    """A tiny random fp32 `...ForConditionalGeneration` target (vision tower included, used with text prompts): the
    text model of `tiny_family_target` / `tiny_hybrid_target` inside the composite config real checkpoints have.
    Multimodal placeholder tokens take the top ids of the vocabulary (`random_ids` prompts stay below 120)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma4Config,
                              Gemma4ForConditionalGeneration, Qwen3_5Config, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)

    top = vocab_size - 1
    if kind in ("gemma3", "gemma4"):
        text = tiny_family_target(kind, seed=seed, vocab_size=vocab_size, window=window).config.to_dict()
    else:
        text = tiny_hybrid_target(kind, seed=seed, vocab_size=vocab_size).config.to_dict()
    torch.manual_seed(seed)
    if kind == "gemma3":
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=32, patch_size=8)
        model = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=top - 2,
            eoi_token_index=top - 1, image_token_index=top))
    elif kind == "gemma4":
        model = Gemma4ForConditionalGeneration(Gemma4Config(
            text_config=text, boi_token_id=top - 6, eoi_token_id=top - 5, image_token_id=top - 4,
            video_token_id=top - 3, boa_token_id=top - 2, eoa_token_index=top - 1, audio_token_id=top))
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2)
        config_class, model_class = ((Qwen3_5Config, Qwen3_5ForConditionalGeneration) if kind == "qwen3_5"
                                     else (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration))
        model = model_class(config_class(text_config=text, vision_config=vision, image_token_id=top - 3,
                                         video_token_id=top - 2, vision_start_token_id=top - 1,
                                         vision_end_token_id=top))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
        for module in model.modules():  # louder linear layers, as in `tiny_hybrid_target`
            if getattr(module, "layer_type", None) == "linear_attention" and hasattr(module, "out_proj"):
                module.out_proj.weight.mul_(4)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def randomize(model, seed=0):
    """Random weights at a scale where drafts depend on every tensor (norms around 1): for drafters written by
    z-lab's own classes, which initialise some tensors to zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(1 + noise if "norm" in name else noise)
    return model.eval()


def tiny_drafter(target, block_size: int = 4, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=block_size, **kw)


def tiny_dual_drafter(target, block_size: int = 8, seed: int = 0, vp_seed: int | None = None, **config):
    """A D²SD dual drafter of tiny random drafters: a VP drafter (seeded `vp_seed`) only when `vp_seed` is given;
    `config`: the dual drafter's own settings (num_branches, tree_budget, max_depth, ...)."""
    first = tiny_drafter(target, block_size=block_size, seed=seed)
    vp = tiny_drafter(target, block_size=block_size, seed=vp_seed) if vp_seed is not None else None
    return hf_diffspec.DualDiffusionDrafter.from_drafters(first, vp, **config)


def random_ids(seed: int, length: int, vocab: int = 128, rows: int = 1) -> torch.Tensor:
    """(rows, length) seeded random prompt ids, never 0 or 1 (the tiny targets' BOS and EOS)."""
    return torch.randint(2, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


class PerThreadReference:
    """An oracle reference per thread (`oracle_drafter_outputs`): each thread sets its own prompt's continuation
    before its call (`use`)."""

    def __init__(self):
        self.local = threading.local()

    def use(self, reference) -> None:
        self.local.table = torch.as_tensor(reference)[None]

    def table(self) -> torch.Tensor:
        return self.local.table


def oracle_drafter_outputs(monkeypatch, drafter, target, reference, margin: float = 30.0) -> None:
    """Make `drafter`'s output at position p point at the LM-head row of the reference token at p, with a logit
    `margin` over the other tokens: through the full head it drafts the reference exactly and confidently; through a
    reduced head only where the reference lies in the subset. `reference`: one 1-D sequence (prompt and the target's
    continuation), or one per row of a batch whose rows never leave it early (each row's own prompt without padding
    and its continuation: row positions index it directly), or a `PerThreadReference` (each thread's own). Every
    caller of the drafter's forward sees it."""
    rows = target.get_output_embeddings().weight.detach()
    fixed = None
    if not isinstance(reference, PerThreadReference):
        references = [torch.as_tensor(r) for r in (reference if isinstance(reference, list) else [reference])]
        fixed = torch.nn.utils.rnn.pad_sequence(references, batch_first=True)  # (rows, longest)
    forward = drafter.forward

    def oracle_forward(*args, **kwargs):
        table = fixed if fixed is not None else reference.table()
        out = forward(*args, **kwargs)
        hidden = out.last_hidden_state.clone()
        positions = kwargs["position_ids"][:, -hidden.shape[1]:]
        tokens = table.expand(hidden.shape[0], -1).gather(1, positions.clamp(max=table.shape[1] - 1))
        known = positions < table.shape[1]
        wanted = rows[tokens[known]]
        hidden[known] = (margin * wanted / wanted.pow(2).sum(-1, keepdim=True)).to(hidden.dtype)
        out.last_hidden_state = hidden
        return out

    monkeypatch.setattr(drafter, "forward", oracle_forward)


class NoisyOracle:
    """A `propose` replacement: the reference continuation with each token corrupted with probability `noise`,
    plus, when `branches` > 0, up to that many wrong siblings per depth (a real tree).

    `reference`: a (1, length) tensor, or one 1-D sequence per row of a batch (each row's own prompt + plain
    continuation, without padding: a row's root position indexes it directly)."""

    def __init__(self, reference, vocab_size: int, noise: float = 0.3, branches: int = 0, seed: int = 0):
        rows = reference if isinstance(reference, list) else list(reference)
        self.references = [torch.as_tensor(r).tolist() for r in rows]
        self.vocab_size = vocab_size
        self.noise = noise
        self.branches = branches
        self.rng = random.Random(seed)
        self.trees: list[CandidateTree] = []
        self.active = list(range(len(self.references)))

    def propose(self, generator, root_tokens, root_positions, max_depths, ahead=None):
        active = getattr(generator, "oracle_rows", self.active)  # the rows still decoding in that generator's call
        return [self.tree(generator, self.references[row], root, position, depth)
                for row, root, position, depth in zip(active, root_tokens, root_positions, max_depths)]

    def tree(self, generator, reference, root_token: int, root_position: int, max_depth: int) -> CandidateTree:
        max_depth = min(max_depth, generator.block_size - 1)
        truth = reference[root_position + 1 : root_position + 1 + max_depth]
        tokens, parents = [root_token], [-1]
        parent = 0
        for tok in truth:
            if self.rng.random() < self.noise:
                tok = self.rng.randrange(self.vocab_size)
            siblings = {tok}
            for _ in range(self.branches):
                wrong = self.rng.randrange(self.vocab_size)
                if wrong not in siblings:
                    siblings.add(wrong)
                    tokens.append(wrong)
                    parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        tree = CandidateTree(torch.tensor(tokens), parents)
        self.trees.append(tree)
        return tree


def install_oracle(monkeypatch, oracle: NoisyOracle):
    """Route every `DiffusionCandidateGenerator.propose` to `oracle`, tracking which rows are still decoding (per
    generator: calls in several threads at once each have their own)."""
    init, select_rows = DiffusionCandidateGenerator.__init__, DiffusionCandidateGenerator.select_rows

    def fresh(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.oracle_rows = oracle.active = list(range(len(oracle.references)))

    def select(self, keep, moves=None):
        select_rows(self, keep, moves)
        self.oracle_rows = oracle.active = [self.oracle_rows[i] for i in keep.tolist()]

    monkeypatch.setattr(DiffusionCandidateGenerator, "__init__", fresh)
    monkeypatch.setattr(DiffusionCandidateGenerator, "select_rows", select)
    monkeypatch.setattr(DiffusionCandidateGenerator, "propose",
                        lambda self, *args: oracle.propose(self, *args))


class ProposalRecorder:
    """Records what `cls.propose` returns at every step: `steps` holds (remaining, trees) per call, `remaining`
    being the tokens each row could still commit after its anchor; `trees` is every tree, in order."""

    def __init__(self, monkeypatch, cls=DiffusionCandidateGenerator):
        self.steps: list[tuple[list[int], list[CandidateTree]]] = []
        self.generators = []  # the generator of every step
        propose = cls.propose

        def recording(generator, root_tokens, root_positions, remaining, ahead=None):
            trees = propose(generator, root_tokens, root_positions, remaining, ahead)
            self.steps.append((list(remaining), trees))
            self.generators.append(generator)
            return trees

        monkeypatch.setattr(cls, "propose", recording)

    @property
    def trees(self) -> list[CandidateTree]:
        return [tree for _, trees in self.steps for tree in trees]

    def shapes(self) -> list[list[tuple[list[int], list[int]]]]:
        """Every step's trees as (tokens, parents), comparable across calls."""
        return [[(t.tokens.tolist(), list(t.parents)) for t in trees] for _, trees in self.steps]

    def confidences(self) -> list[torch.Tensor]:
        """Every tree's confidences (float64, in order): what the drafter's forward gave, to compare within a
        tolerance where the tokens alone would hide a small difference."""
        return [torch.as_tensor(t.confidences if t.confidences is not None else [], dtype=torch.float64).cpu()
                for t in self.trees]


def two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square statistic of two count vectors over the same categories (bins empty in both are dropped)."""
    total = a + b
    keep = total > 0
    expected = total[keep] / 2
    return float((((a[keep] - expected) ** 2 + (b[keep] - expected) ** 2) / expected).sum())


def marginal_counts(target, ids, vocab, n, seed_offset, **kwargs) -> torch.Tensor:
    """Counts of (2nd, last) generated tokens over n seeded runs: a (2, vocab) tensor."""
    counts = torch.zeros(2, vocab)
    for seed in range(n):
        torch.manual_seed(seed_offset + seed)
        out = target.generate(ids, **kwargs)
        counts[0, out[0, ids.shape[1] + 1]] += 1
        counts[1, out[0, -1]] += 1
    return counts


def assert_sampling_matches_plain(target, ids, vocab, drafter, limit: float, n: int = 300, drafter_kwargs=None,
                                  **kwargs) -> None:
    """Plain sampling against sampling with `drafter` (`drafter_kwargs` added), independent seeds: the 2nd and the
    last generated token's marginals must pass a two-sample chi-square at `limit` (~ its 0.999 quantile)."""
    plain = marginal_counts(target, ids, vocab, n, 0, **kwargs)
    ours = marginal_counts(target, ids, vocab, n, 90_000, assistant_model=drafter, **(drafter_kwargs or {}), **kwargs)
    for slot in range(2):
        assert two_sample_chi2(plain[slot], ours[slot]) < limit


# ----- user-side generate hooks (what a user would write) -----------------------------------------------------------
class RecordingStreamer(BaseStreamer):
    """Records every chunk `generate` puts, and whether it ended."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


class StopOnTokens(StoppingCriteria):
    """A row stops when its last token is one of `tokens` (row by row, stateless)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens.to(input_ids.device))


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer for the tiny targets, for stop strings: token i is a short string of its own (one character for the
    first 75 ids, then two), text splits into characters and tokens decode by concatenation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = string.ascii_letters + string.digits + "+-*/=<>()[]{}"
    pieces = list(alphabet) + [a + b for a in "xyz" for b in alphabet]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces[:vocab_size])}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def decoy_oracle_drafter_outputs(monkeypatch, drafter, target, reference, decoys: dict[int, int], margin: float = 30.0,
                                 gap: float = 1.0) -> None:
    """`oracle_drafter_outputs`, but unsure where it is fooled: at each position p of `decoys` the drafter's best
    token is `decoys[p]` and its second best the reference token, `gap` logits below (a confidence of ~0.73 for a
    gap of 1), so a main chain drafts the decoy there (rejected), a D²SD prefix tree branches there (the likeliest
    rejection) and the branch's alternative is the reference token. `reference`: one 1-D sequence; positions past
    it are left to the drafter."""
    head = target.get_output_embeddings().weight.detach()
    table = torch.as_tensor(reference)
    hidden_for = []  # per position: the output that gives its logits (least-norm: the other tokens stay low)
    for p, token in enumerate(table.tolist()):
        if p in decoys:
            pair = head[[decoys[p], token]]
            hidden_for.append(torch.linalg.pinv(pair) @ torch.tensor([margin, margin - gap], dtype=head.dtype))
        else:
            hidden_for.append(margin * head[token] / head[token].pow(2).sum())
    hidden_for = torch.stack(hidden_for)
    forward = drafter.forward

    def oracle_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden = out.last_hidden_state.clone()
        positions = kwargs["position_ids"][:, -hidden.shape[1]:]
        known = positions < table.shape[0]
        hidden[known] = hidden_for[positions[known]].to(hidden.dtype)
        out.last_hidden_state = hidden
        return out

    monkeypatch.setattr(drafter, "forward", oracle_forward)


def run_in_threads(calls) -> list:
    """Run each of `calls` in a thread of its own, all released together (as the requests of a server arrive); their
    results in order. An exception raised in a thread is raised here."""
    barrier = threading.Barrier(len(calls))
    results = [None] * len(calls)

    def run(i):
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as error:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def steer_steps(monkeypatch, speculate) -> None:
    """Each step's kind from `speculate` (an iterator of bools) instead of the live controller: True drafts (every
    lookup draft found grafted on); False verifies the lookup drafts alone when a row has some and the next value is
    True, else decodes plainly. Tests that assert on drafting use it: the controller's choices follow the clock."""
    from hf_diffspec.runtime.control_speculation import SpeculationController, StepKind

    def decide(self, rows, ngrams, lookup_lengths):
        deepest = max(lookup_lengths, default=0)
        if next(speculate):
            return StepKind.DRAFT, deepest
        if deepest and next(speculate):
            return StepKind.LOOKUP, deepest
        return StepKind.PLAIN, 0

    monkeypatch.setattr(SpeculationController, "decide", decide)


class DispatchTrace(TorchDispatchMode):
    """Every aten op run inside it: its name, its arguments' shapes, dtypes and scalars, and the memory each tensor
    argument reads or writes, named as a CUDA graph would see it: a tensor made before the forward (weights, cache,
    input buffers) by its storage's address, one made inside it by the order of its allocation (a replay reuses the
    graph's own pool for those)."""

    def __init__(self):
        super().__init__()
        self.ops, self.made, self.allocations = [], {}, 0

    def _name(self, t: torch.Tensor) -> tuple:
        ptr = t.untyped_storage().data_ptr()
        return (self.made.get(ptr, f"at {ptr:#x}"), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        inputs = [self._name(a) if isinstance(a, torch.Tensor) else repr(a) for a in flat]
        read = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
            if ptr is not None and ptr not in read and ptr:  # new memory (not a view or an in-place write)
                self.made[ptr], self.allocations = f"made {self.allocations}", self.allocations + 1
        self.ops.append((str(func), inputs))
        return out


class EmulatedGraphs:
    """CUDA graph semantics on the CPU: a graph reads and writes the memory it was captured over, whatever the loop's
    variables hold later. A capture runs the forward (a warm-up, then the captured run), puts the cache's lengths back
    (`rewind`) and records what the forward reads: the tensors of its closure (tokens, mask, positions), the cache and
    every tensor of the cache's layers (keys, values, lengths), with their addresses. A replay runs the forward again
    on exactly those tensors (the loop's current ones swapped out meanwhile) and writes its results into the captured
    outputs, which stay the ones the loop reads. A captured tensor whose memory moved fails the replay: a graph would
    read freed memory. `shapes`: the (rows, width) of each capture, in order."""

    def __init__(self):
        self.captured, self.replays, self.shapes = {}, 0, []

    @staticmethod
    def _reads(forward) -> tuple[dict, list[dict]]:
        """The closure's variables, and the tensors of each of its cache's layers."""
        cells = {name: cell.cell_contents for name, cell in zip(forward.__code__.co_freevars, forward.__closure__)}
        layers = [{name: value for name, value in vars(layer).items() if isinstance(value, torch.Tensor)}
                  for layer in cells["cache"].layers]
        return cells, layers

    def capture(self, forward, rewind):
        forward()  # the warm-up
        rewind()
        outputs = forward()
        rewind()
        cells, layers = self._reads(forward)
        tensors = [v for v in cells.values() if isinstance(v, torch.Tensor)] + [t for l in layers for t in l.values()]
        self.captured[forward] = (outputs, cells, layers, [(t, t.data_ptr()) for t in tensors])
        inputs = cells["tokens"] if "tokens" in cells else cells["noise_buffer"]  # a verify or a drafter forward
        self.shapes.append(tuple(inputs.shape[:2]))
        return forward, outputs

    @staticmethod
    def _swap(forward, cells: dict, layers: list[dict]) -> None:
        for name, cell in zip(forward.__code__.co_freevars, forward.__closure__):
            cell.cell_contents = cells[name]
        for layer, tensors in zip(cells["cache"].layers, layers):
            for name, tensor in tensors.items():
                setattr(layer, name, tensor)

    def replay(self, graph) -> None:
        self.replays += 1
        static, cells, layers, addresses = self.captured[graph]
        assert all(t.data_ptr() == address for t, address in addresses), "a captured tensor's memory moved"
        now = self._reads(graph)
        assert now[0]["cache"] is cells["cache"], "the loop verifies with another cache than the one captured"
        self._swap(graph, cells, layers)  # the closure's cells are the loop's variables: put back after
        try:
            fresh = graph()
        finally:
            self._swap(graph, *now)
        if isinstance(static, torch.Tensor):  # the drafter's hidden states
            static.copy_(fresh)
            return
        static.logits.copy_(fresh.logits)
        for mine, new in zip(static.hidden_states or (), fresh.hidden_states or ()):  # (none asked: a profile's)
            if mine is not None:  # (the layers the drafter does not read are not returned)
                mine.copy_(new)


class FailingGraphs(EmulatedGraphs):
    """Graphs whose capture fails after its warm-up forward has run (the cache written past the step's keys, its
    lengths advanced), as a kernel that cannot be captured would."""

    def __init__(self):
        super().__init__()
        self.attempts = 0

    def capture(self, forward, rewind):
        self.attempts += 1
        forward()
        raise RuntimeError("operation not permitted when stream is capturing")
