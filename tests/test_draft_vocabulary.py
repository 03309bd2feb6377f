"""A reduced draft vocabulary: saved and loaded with the weights, never drafts outside itself, keeps generation
lossless, trains over its V' logits only, and is chosen from the response tokens of drafter data."""

import collections
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModel, TrainingArguments

import hf_diffspec
from hf_diffspec.cli import main
from hf_diffspec.formats import export_for_engine, reduce_vocabulary
from hf_diffspec.trainers.block_diffusion import (
    BlockDiffusionCollator,
    BlockDiffusionTrainer,
    LengthHeadTrainer,
    ReverseKLTrainer,
)
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter
from hf_diffspec.trainers.draft_vocabulary import count_response_tokens, most_frequent_tokens
from helpers import ProposalRecorder, oracle_drafter_outputs, random_ids, tiny_drafter, tiny_target

VOCAB = 128


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    return random_ids(seed, length, VOCAB)


def subset_missing(tokens: torch.Tensor, every: int = 3) -> torch.Tensor:
    """Every id except every `every`-th distinct id of `tokens`: a subset that misses some of them."""
    dropped = torch.unique(tokens)[::every]
    keep = torch.ones(VOCAB, dtype=torch.bool)
    keep[dropped] = False
    return keep.nonzero().flatten()


def test_reduced_vocabulary_saves_and_loads_with_the_weights(tmp_path):
    target = tiny_target()
    ids = torch.tensor([40, 3, 17, 99, 1])
    drafter = tiny_drafter(target).set_draft_vocabulary(ids)
    assert drafter.config.draft_vocab_size == 5 and drafter.draft_vocab_ids.tolist() == [1, 3, 17, 40, 99]
    hf_diffspec.save_drafter(drafter, tmp_path / "reduced")
    assert json.loads((tmp_path / "reduced" / "config.json").read_text())["draft_vocab_size"] == 5
    weights = load_file(tmp_path / "reduced" / "model.safetensors")
    assert weights["draft_vocab_ids"].tolist() == [1, 3, 17, 40, 99]
    assert not any("lm_head" in k or "embed_tokens" in k for k in weights)  # the target's head is never copied

    loaded = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "reduced", target=target.to(torch.bfloat16))
    assert loaded.draft_vocab_ids.dtype == torch.long and loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.draft_vocab_ids, drafter.draft_vocab_ids)
    remote = AutoModel.from_pretrained(tmp_path / "reduced", trust_remote_code=True)  # the copied modeling files
    assert remote.config.draft_vocab_size == 5 and remote.draft_vocab_ids.tolist() == [1, 3, 17, 40, 99]

    # the default is the full vocabulary: nothing extra in the weights, so existing checkpoints load unchanged
    full = tiny_drafter(target)
    assert full.config.draft_vocab_size is None and full.draft_vocab_ids is None
    assert "draft_vocab_ids" not in full.state_dict()
    assert "draft_vocab_ids" not in drafter.set_draft_vocabulary(None).state_dict()


def test_bad_reduced_vocabularies_are_clear_errors(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="sorted and distinct"):
        drafter.set_draft_vocabulary([3, 3, 5])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        drafter.set_draft_vocabulary([3, 128])
    with pytest.raises(ValueError, match="draft_vocab_size must be between"):
        hf_diffspec.DiffusionDrafterConfig(vocab_size=10, draft_vocab_size=11)
    with pytest.raises(ValueError, match="draft_vocab_ids="):
        hf_diffspec.DiffusionDrafter.from_target(target, draft_vocab_size=8)
    hf_diffspec.save_drafter(drafter.set_draft_vocabulary([1, 2, 3]), tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    del weights["draft_vocab_ids"]
    save_file(weights, tmp_path / "d" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match="no draft_vocab_ids"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "d", target=target)


def test_logits_are_the_targets_on_the_subset_and_minus_inf_elsewhere():
    target = tiny_target()
    ids = torch.arange(0, VOCAB, 3)
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, draft_vocab_ids=ids, num_hidden_layers=1)
    hidden = torch.randn(2, 5, 64)
    full = target.get_output_embeddings()(hidden)
    logits = drafter.compute_logits(hidden)
    assert logits.shape == full.shape
    assert torch.allclose(logits[..., ids], full[..., ids], atol=1e-6)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[..., outside]).all()
    reduced, columns = drafter.compute_draft_vocab_logits(hidden)
    assert reduced.shape == (2, 5, len(ids)) and torch.equal(columns, ids)
    # the slice follows the target: re-cast, it is sliced again
    target.to(torch.float64)
    assert drafter.compute_logits(hidden.double()).dtype == torch.float64


@pytest.mark.parametrize("kind,seed", [("llama", 0), ("qwen3", 1)])
@pytest.mark.every_step_speculates("asserts tau and every drafted token")
def test_greedy_generation_is_identical_and_drafts_stay_in_the_subset(monkeypatch, kind, seed):
    target = tiny_target(kind, seed=seed)
    ids = prompt(seed)
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    subset = subset_missing(ref[0, ids.shape[1]:])
    drafter = tiny_drafter(target, block_size=8).set_draft_vocabulary(subset)
    oracle_drafter_outputs(monkeypatch, drafter, target, ref[0])
    proposals = ProposalRecorder(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    drafted = torch.cat([tree.tokens[1:] for tree in proposals.trees])
    assert drafted.numel() and torch.isin(drafted, subset).all()
    assert not torch.isin(ref[0, ids.shape[1]:], subset).all(), "the subset must miss some of the target's tokens"
    assert out.speculation_stats.tau > 1.1, "drafts inside the subset are accepted"


@pytest.mark.every_step_speculates("asserts every drafted token")
def test_sampled_drafts_stay_in_the_subset(monkeypatch):
    target = tiny_target(seed=2)
    subset = torch.arange(0, VOCAB, 2)
    drafter = tiny_drafter(target, block_size=6).set_draft_vocabulary(subset)
    proposals = ProposalRecorder(monkeypatch)
    torch.manual_seed(0)
    target.generate(prompt(5), assistant_model=drafter, max_new_tokens=30, do_sample=True, temperature=1.5)
    drafted = torch.cat([tree.tokens[1:] for tree in proposals.trees])
    assert drafted.numel() and torch.isin(drafted, subset).all()


def greedy_records(target, n: int = 4) -> list[dict]:
    """The target's own greedy continuations of random prompts, as training records."""
    records = []
    for seed in range(n):
        ids = prompt(100 + seed, length=8)
        out = target.generate(ids, max_new_tokens=24, do_sample=False)
        records.append({"input_ids": out[0], "prompt_length": ids.shape[1]})
    return records


@pytest.mark.parametrize("trainer_class", [BlockDiffusionTrainer, ReverseKLTrainer, LengthHeadTrainer])
def test_training_runs_over_the_subset_and_ignores_labels_outside_it(trainer_class, tmp_path):
    target = tiny_target(seed=4)
    records = greedy_records(target)
    responses = torch.cat([r["input_ids"][r["prompt_length"]:] for r in records])
    subset = subset_missing(responses, every=2)
    drafter = tiny_drafter(target, block_size=4).set_draft_vocabulary(subset).float()
    if trainer_class is LengthHeadTrainer:
        drafter.add_length_head()
    seen = {}

    class Probe(trainer_class):
        def block_forward(self, model, inputs):
            seen["blocks"] = blocks = super().block_forward(model, inputs)
            return blocks

        def block_loss(self, logits, labels, weights, target_logits_fn):
            seen.update(logits=logits.detach(), labels=labels, teacher=target_logits_fn())
            return super().block_loss(logits, labels, weights, target_logits_fn)

    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, learning_rate=1e-2, save_strategy="no")
    trainer = Probe(model=drafter, args=args, train_dataset=records, target=target,
                    data_collator=BlockDiffusionCollator(pad_token_id=0, num_anchors=8, seed=0))
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    if trainer_class is LengthHeadTrainer:
        return  # its loss is the head's: no vocabulary involved beyond the drafts it judges
    blocks = seen["blocks"]
    labels = blocks.labels[blocks.selected]
    inside = torch.isin(labels, subset)
    assert 0 < int(inside.sum()) < len(labels), "some labels must fall outside the subset"
    assert seen["logits"].shape == (int(inside.sum()), len(subset))  # the cross-entropy runs over V' logits
    assert torch.equal(subset[seen["labels"]], labels[inside])
    assert seen["teacher"].shape == seen["logits"].shape


class StubTokenizer:
    """Just what data directories and the vocabulary counter read from a tokenizer."""

    chat_template = None
    eos_token_id = 1
    all_special_ids = [0, 1]

    def get_vocab(self):
        return {f"t{i}": i for i in range(VOCAB)}

    def __len__(self):
        return VOCAB


def test_most_frequent_tokens_picks_frequent_response_tokens_and_eos(tmp_path):
    tok = StubTokenizer()
    writer = ShardWriter(tmp_path / "data", "tiny", tok, source="generated")
    prompt_ids = [50] * 20  # the most frequent token overall, but only in prompts: never counted
    writer.add("a", prompt_ids + [7] * 6 + [9] * 4 + [11, 1], len(prompt_ids), "chat")
    writer.add("b", prompt_ids + [7] * 4 + [9] * 2 + [12, 12], len(prompt_ids), "chat")
    writer.flush()

    counts = count_response_tokens(tmp_path / "data", tokenizer=tok)
    assert counts.shape == (VOCAB,) and counts[7] == 10 and counts[9] == 6 and counts[50] == 0
    assert most_frequent_tokens([tmp_path / "data"], 4, tokenizer=tok).tolist() == [0, 1, 7, 9]
    assert most_frequent_tokens(tmp_path / "data", 5, tokenizer=tok).tolist() == [0, 1, 7, 9, 12]
    dataset = DrafterDataset(tmp_path / "data")
    assert most_frequent_tokens(dataset, 2, always_include=[1]).tolist() == [1, 7]
    with pytest.raises(ValueError, match="EOS"):
        most_frequent_tokens(dataset, 2)
    with pytest.raises(ValueError, match="more than size"):
        most_frequent_tokens(dataset, 1, always_include=[1, 2])


def test_convert_reduces_a_saved_drafter_and_export_drops_the_subset(tmp_path, capsys):
    target = tiny_target()
    drafter = tiny_drafter(target, mask_token_id=5)
    hf_diffspec.save_drafter(drafter, tmp_path / "full")
    out = reduce_vocabulary(tmp_path / "full", tmp_path / "reduced", [9, 1, 4])
    reduced = hf_diffspec.DiffusionDrafter.from_pretrained(out, target=target)
    assert reduced.draft_vocab_ids.tolist() == [1, 4, 9]
    assert all(torch.equal(reduced.state_dict()[k], v) for k, v in drafter.state_dict().items())
    _, notes = export_for_engine(out, tmp_path / "vllm", "vllm")
    assert any("reduced draft vocabulary" in note for note in notes)
    assert "draft_vocab_ids" not in load_file(tmp_path / "vllm" / "model.safetensors")
    with pytest.raises(SystemExit, match="--reduce-vocab"):
        main(["convert", str(tmp_path / "full"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--data"):
        main(["convert", str(tmp_path / "full"), "--reduce-vocab", "8", "--out", str(tmp_path / "x")])


class _AtenCalls(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_draft_head_runs_as_one_matrix_product_in_the_loop():
    """The drafter's head (its draft-vocabulary rows of the target's LM head) takes a 2-D matmul at every drafting
    step. With a 3-D input the matmul took a batched path that copied the head's weight at every step of the loop
    (SmolLM2 in bf16 on a CPU: 11.4 ms a call against 2.1 ms): one `aten.bmm` per drafting step."""
    target = tiny_target("llama", seed=0)
    drafter = tiny_drafter(target, block_size=8)
    drafter.set_draft_vocabulary(torch.arange(0, target.config.vocab_size, 2))
    ids = torch.randint(2, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=16, do_sample=False, num_assistant_tokens=4)  # every step drafts
    with _AtenCalls() as counted:
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=16, do_sample=False))
    assert out.speculation_stats.draft_steps > 0
    assert counted.calls["aten.bmm.default"] == 0, counted.calls["aten.bmm.default"]
