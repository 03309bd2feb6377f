"""Drafter training: data shards, collator, block masks, the KD Trainer (full, resumed, LoRA), bad input."""

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

import hf_diffspec
from hf_diffspec.runtime.control_profiles import save_profile
from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, block_attention_mask
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter, write_generated_data
from hf_diffspec.trainers.configs import DrafterTrainingArguments, LengthHeadConfig, OnPolicyDistillationConfig
from hf_diffspec.trainers.pipeline import train_drafter
from helpers import tiny_target

PROMPTS = [{"id": f"p{i}", "prompt": text} for i, text in enumerate([
    "Name three colours.", "Say hello in French.", "Count to five.", "What is a cat?",
    "Give me a fruit.", "Describe the sea.", "Spell 'tree'.", "Pick a number.",
])]


@pytest.fixture(scope="module")
def tokenizer(real_target):
    return real_target[1]


@pytest.fixture(scope="module")
def target_and_data(tokenizer, tmp_path_factory):
    """A tiny random target with SmolLM2's vocabulary, and its own greedy answers as training data."""
    target = tiny_target("llama", seed=3, vocab_size=len(tokenizer), layers=4)
    data = tmp_path_factory.mktemp("data") / "generated"
    n = write_generated_data(target, tokenizer, "tiny", data, num_samples=8, max_new_tokens=40, batch_size=4,
                             prompts=PROMPTS)
    assert n == 8
    return target, data


def test_data_shards_are_complete_resumable_and_checked(target_and_data, tokenizer):
    target, data = target_and_data
    files = sorted(p.name for p in data.iterdir())
    assert files == ["meta.json", "shard-00000.json", "shard-00000.npz"]
    assert not any(name.startswith(".") for name in files)  # no temporary file left behind
    ds = DrafterDataset(data, tokenizer=tokenizer)
    assert len(ds) == 8 and all(ds[i]["prompt_length"] < len(ds[i]["input_ids"]) for i in range(8))
    assert json.loads((data / "shard-00000.json").read_text())["dtype"] == str(target.dtype).removeprefix("torch.")
    # resuming writes nothing new
    assert write_generated_data(target, tokenizer, "tiny", data, num_samples=8, max_new_tokens=40,
                                prompts=PROMPTS) == 8
    assert sorted(p.name for p in data.iterdir()) == files


def test_data_from_another_tokenizer_is_refused(target_and_data, tokenizer, tmp_path):
    _, data = target_and_data
    meta = json.loads((data / "meta.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": "0000", "target": "gpt-x"}))
    with pytest.raises(ValueError, match="different tokenizer"):
        DrafterDataset(other, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="another tokenizer"):
        ShardWriter(other, "x", tokenizer, source="relabel")


def test_empty_missing_and_corrupt_data_are_clear_errors(target_and_data, tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json"):
        DrafterDataset(tmp_path)
    ShardWriter(tmp_path / "empty", "tiny", tokenizer, source="relabel")
    with pytest.raises(ValueError, match="no training sequences"):
        DrafterDataset(tmp_path / "empty")
    broken = tmp_path / "broken"
    ShardWriter(broken, "tiny", tokenizer, source="relabel")
    (broken / "shard-00000.json").write_text(json.dumps({"ids": ["a"], "domains": ["chat"], "source": "relabel"}))
    (broken / "shard-00000.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="corrupt data shard"):
        DrafterDataset(broken)


def test_a_failed_shard_write_leaves_no_partial_file(tokenizer, tmp_path, monkeypatch):
    """Disk full (or any error) while writing: nothing that looks like a complete shard stays behind."""
    writer = ShardWriter(tmp_path, "tiny", tokenizer, source="relabel")
    writer.add("a", [1, 2, 3, 4], 2, "chat")

    def disk_full(file, **arrays):
        file.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", disk_full)
    with pytest.raises(OSError, match="No space"):
        writer.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]
    monkeypatch.undo()
    writer.flush()  # the record is still buffered: a retry writes it
    assert len(DrafterDataset(tmp_path)) == 1


def test_collator_samples_anchors_on_response_tokens():
    collate = BlockDiffusionCollator(pad_token_id=0, num_anchors=4, seed=0)
    batch = collate([{"input_ids": torch.arange(1, 11), "prompt_length": 6},
                     {"input_ids": torch.arange(1, 6), "prompt_length": 3}])
    assert batch["input_ids"].shape == (2, 10) and batch["attention_mask"][1].tolist() == [1] * 5 + [0] * 5
    a0 = batch["anchors"][0][batch["anchor_mask"][0]].tolist()
    assert len(a0) == 3 and all(6 <= a <= 8 for a in a0)  # anchor and the next token are response tokens
    assert batch["anchors"][1][batch["anchor_mask"][1]].tolist() == [3]


def test_collator_anchors_differ_between_processes_workers_and_epochs():
    """Every process and dataloader worker draws its own anchors (a generator copied into the workers would repeat
    the same ones in each), fresh every epoch, and the same again for the same seed."""
    rows = [{"input_ids": torch.arange(1, 41), "prompt_length": 2}] * 4  # the same row: only the anchors differ

    def anchors(process_index=0, workers=0):
        collate = BlockDiffusionCollator(pad_token_id=0, num_anchors=4, seed=0, process_index=process_index)
        torch.manual_seed(0)  # the dataloader draws its workers' seeds from it, anew for every epoch
        loader = DataLoader(rows, batch_size=2, collate_fn=collate, num_workers=workers)
        return [batch["anchors"] for _ in range(2) for batch in loader]  # two epochs of two batches

    def distinct(batches):
        return len({tuple(b.flatten().tolist()) for b in batches})

    alone, other_process = anchors(), anchors(process_index=1)
    assert distinct(alone) == 4 and distinct(alone + other_process) == 8
    with_workers = anchors(workers=2)  # each epoch: worker 0 collates the first batch, worker 1 the second
    assert distinct(with_workers) == 4
    assert all(torch.equal(a, b) for a, b in zip(with_workers, anchors(workers=2)))  # seeded: the same again


def test_block_mask_sees_strictly_earlier_context_and_its_own_block_only():
    anchors = torch.tensor([[2, 4]])
    mask = block_attention_mask(anchors, torch.ones(1, 6, dtype=torch.long), 3, torch.float32)
    allowed = (mask[0, 0] == 0)
    assert allowed.shape == (6, 6 + 6)
    assert allowed[0, :6].tolist() == [True, True, False, False, False, False]  # block 0: context < 2
    assert allowed[3, :6].tolist() == [True, True, True, True, False, False]    # block 1: context < 4
    assert allowed[:3, 6:].tolist() == [[True] * 3 + [False] * 3] * 3
    assert allowed[3:, 6:].tolist() == [[False] * 3 + [True] * 3] * 3


def test_target_consistent_labels_stop_at_the_first_disagreement():
    """A slot is supervised only while the text between the anchor and it is the target's own greedy choice."""
    from hf_diffspec.trainers.block_diffusion import BlockDiffusionTrainer

    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels_at = torch.tensor([[0, 6, 7, 1, 9, 10]])  # the target would have written 1 where the text has 8
    slots = torch.tensor([[[0, 1, 2, 3], [2, 3, 4, 5]]])  # blocks anchored at 0 and 2
    given = torch.zeros_like(slots, dtype=torch.bool)
    given[..., 0] = True  # the anchor itself
    consistent = BlockDiffusionTrainer.consistent_with_target(input_ids, labels_at, slots, given)
    # anchor 0: text 6, 7 agree, so slot 3's label follows the target's chain; anchor 2: 8 disagrees at slot 1,
    # so slot 1 (the target's choice after 7: the first token, always its own) is kept and slots 2, 3 are not
    assert consistent.tolist() == [[[True, True, True, True], [True, True, False, False]]]
    given[0, 1, 1] = True  # a real prefix token (variable-prefix blocks) is given, not drafted: it never disagrees
    consistent = BlockDiffusionTrainer.consistent_with_target(input_ids, labels_at, slots, given)
    assert consistent[0, 1].tolist() == [True, True, True, True]


@pytest.mark.every_step_speculates("compares tau before and after training")
def test_kd_training_learns_the_targets_continuations(target_and_data, tokenizer, tmp_path):
    target, data = target_and_data
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "drafter"), num_layers=1, block_size=4, num_anchors=32,
                                   per_device_train_batch_size=4, max_steps=100, learning_rate=3e-3, logging_steps=10,
                                   bf16=False, save_steps=1000)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    info = json.loads((out / "training_info.json").read_text())
    assert info["steps"] == 100 and info["loss_curve"]["last_loss"] < info["loss_curve"]["first_loss"]
    assert (out / "README.md").read_text().startswith("---")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # the target is never trained
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(out, target=target)
    # on a training prompt the trained drafter predicts the target's continuation: several tokens per forward
    ds = DrafterDataset(data)
    prompt = ds[0]["input_ids"][: ds[0]["prompt_length"]][None]
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                           return_dict_in_generate=True)
    assert torch.equal(ref, spec.sequences)
    assert spec.speculation_stats.tau > 1.25  # an untrained drafter gets 1.0 on a 49k vocabulary

    # resume: a second run continues from the saved trainer checkpoint instead of starting over
    cfg2 = replace(cfg, output_dir=str(tmp_path / "resumable"), max_steps=4, save_steps=2)
    train_drafter(target, tokenizer, "tiny", [str(data)], cfg2, command="test")
    cfg3 = replace(cfg2, max_steps=6, resume=True)
    resumed = train_drafter(target, tokenizer, "tiny", [str(data)], cfg3, command="test")
    assert json.loads((resumed / "training_info.json").read_text())["steps"] == 6

    # LoRA fine-tuning of the trained drafter through peft: adapter saved, merged into a plain drafter
    cfg4 = replace(cfg, output_dir=str(tmp_path / "lora"), init=str(out), lora=True, max_steps=5)
    lora_out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg4, command="test")
    assert (lora_out / "adapter" / "adapter_config.json").exists()
    merged = hf_diffspec.DiffusionDrafter.from_pretrained(lora_out, target=target)
    assert not any("lora" in k for k in merged.state_dict())
    assert not all(torch.equal(merged.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_heldout_tau_is_logged_on_a_schedule_and_the_curve_continues_after_a_resume(target_and_data, tokenizer,
                                                                                     tmp_path):
    from hf_diffspec.trainers.measuring import HELDOUT_TAU_LOG, read_heldout_tau

    target, data = target_and_data
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "curve"), num_layers=1, block_size=4, num_anchors=8,
                                   per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, bf16=False,
                                   save_steps=2, heldout_tau_steps=2, heldout_tau_prompts=1,
                                   heldout_tau_max_new_tokens=6)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    log = read_heldout_tau(out / HELDOUT_TAU_LOG)
    assert sorted(log) == [0, 2, 4]  # the start, every 2 steps
    assert log[0]["training_tokens"] == 0 < log[2]["training_tokens"] < log[4]["training_tokens"]
    assert all(1.0 <= line["tau"] <= 4.0 for line in log.values())  # the anchor alone .. the whole block
    assert set(log[4]["tau_per_domain"]) == {"code", "math", "chat"} and log[4]["prompts"] == 3
    # being measured changes nothing in training: the same run without the schedule ends with the same weights
    plain = train_drafter(target, tokenizer, "tiny", [str(data)],
                          replace(cfg, output_dir=str(tmp_path / "plain"), heldout_tau_steps=0), command="test")
    assert not (plain / HELDOUT_TAU_LOG).exists()
    measured, unmeasured = load_file(out / "model.safetensors"), load_file(plain / "model.safetensors")
    assert all(torch.equal(measured[k], unmeasured[k]) for k in unmeasured)
    resumed = train_drafter(target, tokenizer, "tiny", [str(data)], replace(cfg, max_steps=7, resume=True),
                            command="test")
    log = read_heldout_tau(resumed / HELDOUT_TAU_LOG)
    assert sorted(log) == [0, 2, 4, 6, 7]  # on from the checkpoint of step 4, and the end
    assert log[4]["training_tokens"] < log[6]["training_tokens"] < log[7]["training_tokens"]
    (out / HELDOUT_TAU_LOG).write_text((out / HELDOUT_TAU_LOG).read_text() + '{"step": 8, "trai')  # killed mid-line
    assert sorted(read_heldout_tau(out / HELDOUT_TAU_LOG)) == [0, 2, 4, 6, 7]


def test_resume_without_a_checkpoint_says_so(target_and_data, tokenizer, tmp_path):
    target, data = target_and_data
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "none"), num_layers=1, block_size=4, max_steps=2,
                                   resume=True, bf16=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_drafter(target, tokenizer, "tiny", [str(data)], cfg)


def test_block_loss_hook_sees_the_targets_distributions(target_and_data, tokenizer, tmp_path):
    """Subclasses (reverse-KL distillation) get the target's logits at exactly the supervised slots."""
    from transformers import TrainingArguments

    from hf_diffspec.trainers.block_diffusion import BlockDiffusionTrainer

    target, data = target_and_data
    seen = {}

    class Probe(BlockDiffusionTrainer):
        def block_loss(self, logits, labels, weights, target_logits_fn):
            target_logits = target_logits_fn()
            seen["match"] = torch.equal(target_logits.argmax(-1), labels)
            seen["shape"] = (target_logits.shape == logits.shape)
            return super().block_loss(logits, labels, weights, target_logits_fn)

    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True)
    trainer = Probe(model=drafter, args=args, train_dataset=DrafterDataset(data), target=target,
                    data_collator=BlockDiffusionCollator(pad_token_id=0, num_anchors=8, seed=0))
    trainer.train()
    assert seen == {"match": True, "shape": True}


def test_init_from_target_layers_copies_matching_weights(target_and_data):
    from hf_diffspec.trainers.pipeline import build_drafter

    target, _ = target_and_data
    cfg = DrafterTrainingArguments(output_dir="unused", num_layers=2, block_size=4, init_from_target_layers=True)
    drafter = build_drafter(target, cfg)
    source = target.model.layers[-1].self_attn.q_proj.weight
    assert torch.equal(drafter.layers[1].self_attn.q_proj.weight, source.float())
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight.float())


def test_reverse_kl_is_exact_over_the_vocabulary():
    from hf_diffspec.trainers.block_diffusion import reverse_kl

    student, teacher = torch.randn(3, 11), torch.randn(3, 11)
    ps, pt = student.softmax(-1), teacher.softmax(-1)
    manual = (ps * (ps.log() - pt.log())).sum(-1)
    assert torch.allclose(reverse_kl(student, teacher), manual, atol=1e-6)
    assert torch.allclose(reverse_kl(teacher, teacher), torch.zeros(3), atol=1e-6)
    t = 2.0
    ps2, pt2 = (student / t).softmax(-1), (teacher / t).softmax(-1)
    assert torch.allclose(reverse_kl(student, teacher, t), (ps2 * (ps2.log() - pt2.log())).sum(-1) * t * t, atol=1e-5)


def test_on_policy_rounds_train_on_the_live_systems_trajectories(target_and_data, tokenizer, tmp_path):
    from hf_diffspec.trainers.pipeline import run_opd

    target, data = target_and_data
    init = tmp_path / "init"
    hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(init)
    cfg = OnPolicyDistillationConfig(output_dir=str(tmp_path / "opd"), init=str(init), rounds=2, samples_per_round=3,
                                     max_new_tokens=12, block_size=4, num_anchors=16, per_device_train_batch_size=2,
                                     num_train_epochs=2, learning_rate=3e-3, bf16=False, logging_steps=1)
    prompts = [{**p, "domain": "chat"} for p in PROMPTS]
    final = run_opd(target, tokenizer, "tiny", prompts, cfg, command="test")
    assert final == tmp_path / "opd" / "round-1" / "drafter"
    history = json.loads((tmp_path / "opd" / "opd_history.json").read_text())
    assert [h["round"] for h in history] == [0, 1] and history[1]["init"].endswith("round-0/drafter")
    # round 0's data is what the speculative system produced from round 0's prompts: the target's greedy outputs
    ds = DrafterDataset(tmp_path / "opd" / "round-0" / "data")
    assert len(ds) == 3
    prompt = ds[0]["input_ids"][: ds[0]["prompt_length"]][None]
    assert torch.equal(ds[0]["input_ids"][None], target.generate(prompt, max_new_tokens=12, do_sample=False))
    info = json.loads((final / "training_info.json").read_text())
    assert info["config"]["kind"] == "opd" and info["steps"] > 0
    before = hf_diffspec.DiffusionDrafter.from_pretrained(init, target=target).state_dict()
    after = hf_diffspec.DiffusionDrafter.from_pretrained(final, target=target).state_dict()
    assert not all(torch.equal(before[k], after[k]) for k in before)
    # resuming skips finished rounds
    again = run_opd(target, tokenizer, "tiny", prompts, cfg, command="test")
    assert again == final


def test_reverse_kl_loss_clips_each_positions_share():
    from hf_diffspec.trainers.block_diffusion import ReverseKLTrainer, reverse_kl

    trainer = ReverseKLTrainer.__new__(ReverseKLTrainer)  # the loss needs no model: just its parameters
    trainer.alpha, trainer.kl_clip, trainer.temperature = 0.8, 0.01, 1.0
    trainer._metrics = {"reverse_kl": []}
    trainer.accelerator = SimpleNamespace(num_processes=1)
    logits, teacher = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9)
    labels, weights = teacher.argmax(-1), torch.tensor([1.0, 0.8, 0.6, 0.5])
    loss = trainer.block_loss(logits, labels, weights, lambda: teacher)
    n = weights.sum()
    ce = (weights * torch.nn.functional.cross_entropy(logits, labels, reduction="none")).sum() / n
    kl = reverse_kl(logits, teacher)
    expected = 0.8 * ce + 0.2 * (weights * torch.clamp(kl / n, max=0.01)).sum()
    assert torch.allclose(loss, expected)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_length_head_trains_alone_on_the_drafters_own_acceptance(target_and_data, tokenizer, tmp_path, monkeypatch):
    target, data = target_and_data
    kd = dict(num_layers=1, block_size=4, num_anchors=32, per_device_train_batch_size=4, learning_rate=3e-3,
              bf16=False, save_steps=1000)
    drafter_dir = train_drafter(target, tokenizer, "tiny", [str(data)], DrafterTrainingArguments(
        output_dir=str(tmp_path / "kd"), max_steps=40, logging_steps=40, **kd), command="test")
    # 65 steps, logged every 10: the closing summary also carries the last 5 steps' head metrics, without a loss
    cfg = LengthHeadConfig(output_dir=str(tmp_path / "head"), init=str(drafter_dir), max_steps=65, logging_steps=10,
                           **kd)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    before = hf_diffspec.DiffusionDrafter.from_pretrained(drafter_dir, target=target)
    after = hf_diffspec.DiffusionDrafter.from_pretrained(out, target=target)
    assert after.config.length_head and after.length_head is not None
    trained = after.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in before.state_dict().items())  # only the head changed
    info = json.loads((out / "training_info.json").read_text())
    assert info["loss_curve"]["last_loss"] < info["loss_curve"]["first_loss"]
    assert set(info["length_head"]) == {"head_bce", "confidence_bce", "predicted_acceptance", "observed_acceptance"}
    # the checkpoint drafts losslessly and the head sizes the drafts when a cost profile exists
    calls = []
    after.length_head.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")  # the synthetic profile is kept as saved
    save_profile(target, {1: {1: 1.0, 2: 1.0, 3: 1.1}})
    prompt = DrafterDataset(data)[0]["input_ids"][:5][None]
    assert torch.equal(target.generate(prompt, assistant_model=after, max_new_tokens=12, do_sample=False),
                       target.generate(prompt, max_new_tokens=12, do_sample=False))
    assert calls, "the length head should feed the cost model"


def test_a_checkpoint_missing_its_length_head_says_so(tmp_path):
    target = tiny_target("llama")
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=4).add_length_head()
    drafter.save_pretrained(tmp_path / "d")
    loaded = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "d", target=target)
    assert torch.equal(loaded.length_head.out.weight, drafter.length_head.out.weight)
    weights = load_file(tmp_path / "d" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("length_head.")}, tmp_path / "d" / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(OSError, match="length head"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "d", target=target)
    plain = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "d", target=target, length_head=False)
    assert plain.length_head is None


def test_activation_checkpointing_recomputes_the_layers_and_trains_the_same_drafter(target_and_data, tokenizer,
                                                                                   tmp_path, monkeypatch):
    from hf_diffspec.modeling.modeling_diffusion_drafter import DiffusionDrafterMLP

    target, data = target_and_data
    calls = []
    forward = DiffusionDrafterMLP.forward
    monkeypatch.setattr(DiffusionDrafterMLP, "forward", lambda self, x: calls.append(1) or forward(self, x))
    weights = {}
    for checkpointing in (False, True):
        calls.clear()
        cfg = DrafterTrainingArguments(output_dir=str(tmp_path / str(checkpointing)), num_layers=1, block_size=4,
                                       num_anchors=8, per_device_train_batch_size=2, max_steps=2, bf16=False,
                                       save_steps=1000, activation_checkpointing=checkpointing)
        weights[checkpointing] = load_file(train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
                                           / "model.safetensors")
        # one MLP call per step in the forward, and with checkpointing one more when the backward recomputes it
        assert len(calls) == 2 * (1 + checkpointing)
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor)


def test_bf16_training_is_the_default_only_where_bf16_is_native(monkeypatch, tmp_path):
    """Emulated bf16 (a CPU without AVX512-BF16/AMX) trains many times slower than fp32, so it is not the default."""
    from hf_diffspec.trainers import configs

    for native in (False, True):
        monkeypatch.setattr(configs, "fast_bf16", lambda device=None, native=native: native)
        assert configs.DrafterTrainingArguments(output_dir=str(tmp_path), use_cpu=True).bf16 is native
    assert configs.DrafterTrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=False).bf16 is False


def test_dflash_2_parts_are_added_to_a_dflash_drafter_and_trained(target_and_data, tokenizer, tmp_path):
    """--block-conv / --selector-rank on --init: the DFlash drafter gains DFlash 2's convolutions or candidate
    selector (no-ops at first) and trains them."""
    target, data = target_and_data
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "dflash"), num_layers=1, block_size=4, num_anchors=8,
                                   per_device_train_batch_size=2, max_steps=2, learning_rate=3e-3, bf16=False,
                                   save_steps=1000)
    first = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    cfg2 = replace(cfg, output_dir=str(tmp_path / "dflash2"), init=str(first), block_conv=True, max_steps=3)
    second = hf_diffspec.DiffusionDrafter.from_pretrained(
        train_drafter(target, tokenizer, "tiny", [str(data)], cfg2, command="test"), target=target)
    assert second.config.block_conv
    assert any(conv.delta.weight.abs().sum() > 0 for conv in second.layers[0].block_convs)
    # the candidate selector likewise: added as a no-op, trained by its k-way cross-entropy
    # more anchors than response tokens: padding anchors sit at position 0, which has no token before it
    cfg3 = replace(cfg, output_dir=str(tmp_path / "selector"), init=str(first), selector_rank=8, max_steps=3,
                   num_anchors=64)
    third = train_drafter(target, tokenizer, "tiny", [str(data)], cfg3, command="test")
    selector = hf_diffspec.DiffusionDrafter.from_pretrained(third, target=target).selector
    assert selector is not None and selector.candidate_codes.abs().sum() > 0
    history = json.loads((third / "training_info.json").read_text())
    assert history["config"]["selector_rank"] == 8
    # --train-only-added: the selector learns, the drafter it was added to stays exactly as it was
    before = load_file(first / "model.safetensors")
    cfg4 = replace(cfg3, output_dir=str(tmp_path / "selector-only"), train_only_added=True)
    fourth = load_file(train_drafter(target, tokenizer, "tiny", [str(data)], cfg4, command="test") / "model.safetensors")
    assert fourth["selector.candidate_codes"].abs().sum() > 0
    assert all(torch.equal(fourth[name], tensor) for name, tensor in before.items())
    with pytest.raises(ValueError, match="--train-only-added"):
        train_drafter(target, tokenizer, "tiny", [str(data)], replace(cfg, train_only_added=True), command="test")
    # under LoRA the new parts are trained whole (peft would freeze them as no-ops otherwise)
    cfg5 = replace(cfg3, output_dir=str(tmp_path / "selector-lora"), lora=True, lora_rank=4)
    fifth = load_file(train_drafter(target, tokenizer, "tiny", [str(data)], cfg5, command="test") / "model.safetensors")
    assert fifth["selector.candidate_codes"].abs().sum() > 0


def test_a_drafter_learns_to_embed_mask_as_an_unused_target_token(target_and_data, tokenizer, tmp_path):
    """--mask-token-id auto on --init: the drafter's own MASK embedding is replaced by a target token that the target
    never reads (what DFlash engines load), training adapts it, and transformers' DFlash path can then load it."""
    from hf_diffspec.formats import native_dflash_drafter
    from hf_diffspec.targets import unused_target_token
    from hf_diffspec.trainers.pipeline import resolve_mask_token_id

    target, data = target_and_data
    vocab = target.get_input_embeddings().num_embeddings
    unused = unused_target_token(tokenizer, vocab)
    template = tokenizer.chat_template
    assert unused not in tokenizer.all_special_ids and tokenizer.convert_ids_to_tokens(unused) not in template
    assert tokenizer.added_tokens_decoder[unused].special
    assert unused_target_token(tokenizer, vocab + 8) == len(tokenizer)  # a padding row beyond the tokenizer
    assert resolve_mask_token_id("7", tokenizer, vocab) == 7 and resolve_mask_token_id(None, tokenizer, vocab) is None
    with pytest.raises(ValueError, match="token id or 'auto'"):
        resolve_mask_token_id("mask", tokenizer, vocab)

    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "own"), num_layers=1, block_size=4, num_anchors=8,
                                   per_device_train_batch_size=2, max_steps=2, learning_rate=3e-3, bf16=False,
                                   save_steps=1000)
    own = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    with pytest.raises(ValueError, match="MASK embedding"):
        native_dflash_drafter(hf_diffspec.DiffusionDrafter.from_pretrained(own, target=target))
    cfg2 = replace(cfg, output_dir=str(tmp_path / "token"), init=str(own), mask_token_id="auto", max_steps=3)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg2, command="test")
    assert "mask_embedding" not in load_file(out / "model.safetensors")
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(out, target=target)
    assert drafter.config.mask_token_id == unused and drafter.mask_embedding is None
    # MASK is the target's embedding row now
    assert torch.equal(drafter.mask_embeds(1, 2)[0, 0], target.get_input_embeddings().weight[unused])
    native_dflash_drafter(drafter)  # loads as transformers' own DFlash drafter
    prompt = DrafterDataset(data)[0]["input_ids"][:6][None]
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(ref, target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False))
