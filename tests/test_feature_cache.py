"""Cached target features (`hf-diffspec data features`, `--cached-features`): the step they feed gives the live
step's loss and gradients without a target forward, the cache resumes, and a cache that does not match is refused."""

import json

import pytest
import torch

import hf_diffspec
from hf_diffspec.cli import main
from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer
from hf_diffspec.trainers.configs import DrafterTrainingArguments, OnPolicyDistillationConfig
from hf_diffspec.trainers.data import DrafterDataset, ShardWriter
from hf_diffspec.trainers.feature_cache import FEATURES_DIR, write_target_features
from helpers import char_tokenizer, tiny_target

VOCAB, BLOCK = 64, 4


@pytest.fixture(scope="module")
def target_and_data(one_torch_thread, tmp_path_factory):
    """A tiny target and two shards of its own continuations, of different lengths."""
    target = tiny_target("llama", seed=7, vocab_size=VOCAB)
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.pad_token = "a"
    data = tmp_path_factory.mktemp("cache") / "data"
    writer = ShardWriter(data, "tiny", tokenizer, source="generated", shard_size=3)
    generator = torch.Generator().manual_seed(7)
    for i in range(5):
        prompt = torch.randint(2, VOCAB, (1, 3 + i), generator=generator)
        sequence = target.generate(prompt, max_new_tokens=10 + 3 * i, do_sample=False, pad_token_id=0)[0]
        writer.add(f"s{i}", sequence.tolist(), prompt.shape[1], "chat")
    writer.flush()
    return target, tokenizer, data


def new_drafter(target, seed=0):
    torch.manual_seed(seed)
    return hf_diffspec.DiffusionDrafter.from_target(target, num_hidden_layers=1, block_size=BLOCK).float()


def loss_and_gradients(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def test_cached_features_give_the_live_steps_loss_and_gradients_without_a_target_forward(target_and_data, tmp_path):
    target, tokenizer, data = target_and_data
    drafter = new_drafter(target)
    assert write_target_features(target, drafter, data, dtype=torch.float32, batch_size=2) == 2
    live = DrafterDataset(data, tokenizer=tokenizer)
    cached = DrafterDataset(data, tokenizer=tokenizer, cached_features=(target, drafter.target_feature_layers))
    records = [cached[i] for i in range(len(cached))]
    assert records[0]["target_features"].shape == (len(live[0]["input_ids"]), drafter.fc.in_features)
    cached_batch = BlockDiffusionCollator(0, num_anchors=6, seed=1)(records)
    live_batch = BlockDiffusionCollator(0, num_anchors=6, seed=1)([live[i] for i in range(len(live))])
    assert torch.equal(cached_batch["anchors"], live_batch["anchors"])

    args = DrafterTrainingArguments(output_dir=str(tmp_path), bf16=False, disable_tqdm=True, report_to=[],
                                    target_consistent_labels=False)
    trainer = BlockDiffusionTrainer(model=drafter, args=args, train_dataset=[], target=target)
    live_loss, live_grads = loss_and_gradients(trainer, live_batch)
    forward = target.forward
    target.forward = None  # a cached step must not call the target
    try:
        cached_loss, cached_grads = loss_and_gradients(trainer, cached_batch)
    finally:
        target.forward = forward
    assert live_loss > 0 and len(live_grads) > 5
    torch.testing.assert_close(cached_loss, live_loss, atol=1e-5, rtol=1e-5)
    assert cached_grads.keys() == live_grads.keys()
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, live_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_cache_resumes_and_refuses_other_layers_weights_and_missing_shards(target_and_data, tmp_path):
    target, tokenizer, data = target_and_data
    drafter = new_drafter(target)
    write_target_features(target, drafter, data, dtype=torch.float32)
    cache = data / FEATURES_DIR
    assert write_target_features(target, drafter, data, dtype=torch.float32) == 0  # all there: nothing redone
    (cache / "shard-00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="hf-diffspec data features"):
        DrafterDataset(data, cached_features=(target, drafter.target_feature_layers))
    assert write_target_features(target, drafter, data, dtype=torch.float32) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary file left

    with pytest.raises(ValueError, match="this drafter reads"):
        DrafterDataset(data, cached_features=(target, [1, 2]))
    other = tiny_target("llama", seed=8, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="other target weights"):
        DrafterDataset(data, cached_features=(other, drafter.target_feature_layers))
    with pytest.raises(ValueError, match="another dtype"):  # one cache per dtype: never a mix of both
        write_target_features(target, drafter, data, dtype=torch.bfloat16)
    with pytest.raises(FileNotFoundError, match="no cached target features"):
        DrafterDataset(tmp_path / "nothing", cached_features=(target, drafter.target_feature_layers))
    with pytest.raises(ValueError, match="drop --cached-features for opd"):
        OnPolicyDistillationConfig(output_dir=str(tmp_path), init="x", cached_features=True)


def test_data_features_train_with_cached_features_and_eval_acceptance_from_the_command_line(target_and_data, tmp_path, capsys):
    target, tokenizer, data = target_and_data
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    copy = tmp_path / "data"
    copy.mkdir()
    for path in data.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    main(["data", "features", str(copy), "--target", str(tmp_path / "target"), "--dtype", "fp32",
          "--features-dtype", "bf16"])
    assert "2 shards written" in capsys.readouterr().out
    meta = json.loads((copy / FEATURES_DIR / "meta.json").read_text())
    assert meta["dtype"] == "bfloat16"
    main(["train", "kd", "--target", str(tmp_path / "target"), "--dtype", "fp32", "--data", str(copy),
          "--out", str(tmp_path / "drafter"), "--cached-features", "--num-layers", "1", "--block-size", str(BLOCK),
          "--max_steps", "2", "--batch-size", "2", "--num-anchors", "4"])
    info = json.loads((tmp_path / "drafter" / "training_info.json").read_text())
    assert info["steps"] == 2 and info["config"]["cached_features"] is True
    # the trained drafter's offline acceptance length on the same sequences, with its report written
    main(["eval", "acceptance", "--drafter", str(tmp_path / "drafter"), "--data", str(copy), "--target",
          str(tmp_path / "target"), "--dtype", "fp32", "--json", str(tmp_path / "acceptance.json")])
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert report["sequences"] == 5 and report["tau"] >= 1 and "chat" in report["per_domain"]
