"""The speculative decoding loop: draft a tree, verify it in one target forward, commit what the target itself picks.

    prefill (prompt) ──► first token ──► loop:
        drafter.propose(anchor)                 ──► CandidateTree (a chain is a tree with one branch)
        target(tree, 4D additive mask, depth positions, cached prefix)
        walk the tree with the target's processed logits; commit token by token (stopping criteria, streamer)
        keep the accepted path in the KV cache; its target hidden states become the drafter's new context

It is the `custom_generate` callable that `generate()` runs once it has prepared logits processors, stopping
criteria, the cache and the generation config (see `generation.py`), so every standard generate option applies.
Lossless: every committed token is chosen by the target from its processed distribution given the exact committed
prefix (argmax when greedy, a sample otherwise); drafts only decide how many of those choices one forward can check.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .candidate_generator import DiffusionCandidateGenerator, feature_layers
from .kv_cache import keep_accepted_path
from .verification import choose_token, choose_token_among_drafts


@dataclass
class SpeculationStats:
    """What one speculative `generate` call did. `tau` is tokens committed per target forward (bonus included)."""

    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    new_tokens: int = 0
    committed_per_step: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        steps = self.committed_per_step
        return sum(steps) / len(steps) if steps else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "committed_per_step"}
        out["speculative_steps"] = len(self.committed_per_step)
        out["tau"] = self.tau
        return out


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the `SpeculationStats` of the call (as `speculation_stats`)."""

    speculation_stats: SpeculationStats | None = None


class _Committer:
    """Appends committed tokens one at a time, exactly as `_sample` would: scores, streamer, stopping criteria."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer):
        self.input_ids = input_ids
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.config = generation_config
        self.streamer = streamer
        self.scores, self.raw_logits = [], []

    def choose_and_commit(self, raw_logits: torch.Tensor, drafts=None) -> tuple[int, bool]:
        """Pick the target's token from its raw logits (1, vocab) given the committed prefix; return (token, done).
        `drafts`: [(token, q)] of the children drawn from known distributions, for rejection sampling."""
        raw = raw_logits.to(dtype=torch.float32, copy=True)
        scores = self.logits_processor(self.input_ids, raw.clone())
        if self.config.do_sample and drafts:
            token = choose_token_among_drafts(scores, drafts)
        else:
            token = choose_token(scores, self.config.do_sample)
        if self.config.output_scores:
            self.scores.append(scores)
        if self.config.output_logits:
            self.raw_logits.append(raw)
        self.input_ids = torch.cat([self.input_ids, token[:, None]], dim=-1)
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        done = bool(self.stopping_criteria(self.input_ids, scores).all())
        return int(token), done


def _draft_temperature(generation_config) -> float | None:
    """When sampling, drafts are drawn too (at the user's temperature) so that rejection sampling can use them."""
    if not generation_config.do_sample:
        return None
    return float(generation_config.temperature or 1.0)


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    drafter=None,
    streamer=None,
    **model_kwargs,
):
    """Speculative decoding with a diffusion drafter; called by `generate()` as a `custom_generate` callable."""
    start_time = time.perf_counter()
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"hf_diffspec speculative decoding currently supports batch size 1, got {input_ids.shape[0]}; "
            "loop over the prompts (batched speculative decoding arrives with AdaFlash)."
        )
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and input_ids.shape[1] >= max_positions:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the target's context holds {max_positions}; "
            "shorten the prompt so that there is room for new tokens."
        )
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("speculative decoding needs a KV cache; do not pass use_cache=False")
    attention_mask = model_kwargs.get("attention_mask")
    valid = (
        torch.ones(input_ids.shape[1], dtype=torch.bool, device=input_ids.device)
        if attention_mask is None else attention_mask[0].bool()
    )

    stats = SpeculationStats()
    drafting = DiffusionCandidateGenerator(drafter, model, generation_config.max_length,
                                           sample_temperature=_draft_temperature(generation_config))
    layers = feature_layers(drafter)
    commit = _Committer(input_ids, logits_processor, stopping_criteria, generation_config, streamer)

    # Prefill: the prompt, then the first token (drafting needs an anchor).
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[None]
    out = model(
        input_ids, attention_mask=attention_mask, position_ids=positions,
        cache=cache, use_cache=True, output_hidden_states=layers, logits_to_keep=1,
    )
    stats.target_forwards += 1
    drafting.add_context(out.hidden_states, slice(None), positions[0], valid)
    anchor, done = commit.choose_and_commit(out.logits[:, -1])
    cache_valid = valid
    stats.prefill_time_s = time.perf_counter() - start_time

    while not done:
        root_position = int(cache_valid.sum())
        remaining = generation_config.max_length - commit.input_ids.shape[1]
        t0 = time.perf_counter()
        tree = drafting.propose(anchor, root_position, max_depth=remaining - 1)
        t1 = time.perf_counter()
        if len(tree) > 1:
            stats.draft_forwards += 1
            stats.drafted_tokens += len(tree) - 1

        tokens = tree.tokens.to(model.device)
        out = model(
            tokens[None],
            attention_mask=tree.attention_mask(cache_valid, model.dtype),
            position_ids=tree.position_ids(root_position, model.device),
            cache=cache, use_cache=True, output_hidden_states=layers,
        )
        stats.target_forwards += 1
        stats.verified_tokens += len(tree)

        node, path = 0, [0]
        while True:
            drafts = None
            if tree.draft_probs is not None:
                drafts = [(token, tree.draft_probs[child]) for token, child in tree.children[node].items()]
            anchor, done = commit.choose_and_commit(out.logits[:, node], drafts)
            child = tree.children[node].get(anchor)
            if done or child is None:
                break
            node = child
            path.append(node)
        stats.committed_per_step.append(len(path))
        keep_accepted_path(cache, cache_valid.shape[0], path, len(tree))
        cache_valid = torch.cat([cache_valid, torch.ones(len(path), dtype=torch.bool, device=cache_valid.device)])
        drafting.add_context(
            out.hidden_states, torch.tensor(path, device=tokens.device),
            root_position + torch.arange(len(path), device=tokens.device),
        )
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += time.perf_counter() - t1

    if streamer is not None:
        streamer.end()
    stats.new_tokens = commit.input_ids.shape[1] - input_ids.shape[1]
    stats.total_time_s = time.perf_counter() - start_time
    drafter.last_generation_stats = stats

    if not generation_config.return_dict_in_generate:
        return commit.input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=commit.input_ids,
        scores=tuple(commit.scores) if generation_config.output_scores else None,
        logits=tuple(commit.raw_logits) if generation_config.output_logits else None,
        cache=cache if generation_config.use_cache else None,
        speculation_stats=stats,
    )
