"""The continuation recipe: an EMA of the weights that survives a resume, one cosine whose length a resumed run
keeps, and a loss truncated at a depth."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer
from hf_diffspec.trainers.configs import DrafterTrainingArguments
from hf_diffspec.trainers.continuation import EMA_FILE, ContinuedRun, EMACallback, WarmupCosine
from helpers import tiny_drafter, tiny_target

VOCAB = 32


@pytest.fixture(scope="module")
def target_and_records(one_torch_thread):
    target = tiny_target("llama", seed=7, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(7)
    records = []
    for length in (5, 8, 6, 9):
        prompt = torch.randint(2, VOCAB, (1, length), generator=generator)
        records.append({"input_ids": target.generate(prompt, max_new_tokens=20, do_sample=False)[0],
                        "prompt_length": length})
    return target, records


class WeightsAfterEachStep(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def make_trainer(target, records, out, callbacks=(), **config):
    args = DrafterTrainingArguments(output_dir=str(out), per_device_train_batch_size=2, num_anchors=6, bf16=False,
                                    learning_rate=1e-2, logging_steps=1, disable_tqdm=True, **config)
    drafter = tiny_drafter(target, block_size=4, seed=7).float()
    return BlockDiffusionTrainer(model=drafter, args=args, train_dataset=records, target=target,
                                 data_collator=BlockDiffusionCollator(1, num_anchors=6, seed=0), callbacks=list(callbacks))


def expected_average(start: dict, steps: list[dict], first_step: int, decay: float) -> dict:
    average = {k: v.clone() for k, v in start.items()}
    for step, weights in enumerate(steps, first_step):
        d = min(decay, (1 + step) / (10 + step))
        for k in average:
            average[k].lerp_(weights[k], 1 - d)
    return average


def test_the_weight_average_is_what_training_ends_with_and_a_resume_continues_it(target_and_records, tmp_path):
    target, records = target_and_records
    recorder = WeightsAfterEachStep()
    trainer = make_trainer(target, records, tmp_path, [EMACallback(0.6), recorder], max_steps=4, save_steps=2)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    expected = expected_average(start, recorder.steps, 1, 0.6)
    final = dict(trainer.model.named_parameters())
    assert all(torch.allclose(final[k], v, atol=1e-6) for k, v in expected.items())
    assert not all(torch.allclose(recorder.steps[-1][k], v) for k, v in expected.items())  # not the raw weights
    saved = load_file(tmp_path / "checkpoint-4" / EMA_FILE)
    assert (tmp_path / "checkpoint-2" / EMA_FILE).is_file()
    assert all(torch.allclose(saved[k], v, atol=1e-6) for k, v in expected.items())

    # a resumed run (another process, another machine) continues the same average from the checkpoint's
    recorder = WeightsAfterEachStep()
    resumed = make_trainer(target, records, tmp_path, [EMACallback(0.6), recorder], max_steps=6, save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    expected = expected_average(saved, recorder.steps, 5, 0.6)
    final = dict(resumed.model.named_parameters())
    assert all(torch.allclose(final[k], v, atol=1e-6) for k, v in expected.items())


def test_one_cosine_across_resumes_keeps_the_length_it_started_with(target_and_records, tmp_path):
    target, records = target_and_records
    lrs = lambda trainer: {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}  # noqa: E731
    straight = make_trainer(target, records, tmp_path / "straight", max_steps=6, save_steps=100, schedule_steps=10,
                            warmup_steps=2)
    straight.train()
    first = make_trainer(target, records, tmp_path / "resumed", max_steps=4, save_steps=4, schedule_steps=10,
                         warmup_steps=2)
    first.train()
    # the next run asks for another length: the checkpoint's schedule wins
    second = make_trainer(target, records, tmp_path / "resumed", max_steps=6, save_steps=100, schedule_steps=100,
                          warmup_steps=2)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-4"))
    assert lrs(second)[5] == pytest.approx(lrs(straight)[5]) and lrs(second)[6] == pytest.approx(lrs(straight)[6])
    schedule = WarmupCosine(10, 2)
    assert lrs(straight)[6] == pytest.approx(1e-2 * schedule(5))  # the rate step 6 ran at
    assert schedule(0) > 0 and schedule(1) < schedule(2) == 1.0 and schedule(10) == schedule(50) == 0.0


def test_a_run_continued_on_another_machine_follows_the_same_cosine_and_counts_on(target_and_records, tmp_path):
    """No checkpoint travels, only the drafter: the continuation starts at --schedule-start on the same curve, and its
    training tokens count on from --tokens-seen-start."""
    target, records = target_and_records
    lrs = lambda trainer: {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}  # noqa: E731
    straight = make_trainer(target, records, tmp_path / "straight", max_steps=6, save_steps=100, schedule_steps=10,
                            warmup_steps=2)
    straight.train()
    continued = make_trainer(target, records, tmp_path / "continued", [ContinuedRun(1000)], max_steps=2,
                             save_steps=100, schedule_steps=10, warmup_steps=2, schedule_start=4,
                             tokens_seen_start=1000)
    continued.train()
    assert lrs(continued)[1] == pytest.approx(lrs(straight)[5]) and lrs(continued)[2] == pytest.approx(lrs(straight)[6])
    assert lrs(continued)[1] < 1e-2  # past the warmup and the peak: no second warmup
    seen = continued.state.num_input_tokens_seen
    assert 1000 < seen < 1000 + straight.state.num_input_tokens_seen
    with pytest.raises(ValueError, match="--schedule-steps"):
        DrafterTrainingArguments(output_dir=str(tmp_path / "x"), schedule_start=4)


def test_the_loss_leaves_slots_deeper_than_its_depth_out(target_and_records, tmp_path, monkeypatch):
    target, records = target_and_records
    seen = []
    original = BlockDiffusionTrainer.block_loss

    def recording(self, logits, labels, weights, target_logits_fn):
        seen.append(weights.clone())
        return original(self, logits, labels, weights, target_logits_fn)

    monkeypatch.setattr(BlockDiffusionTrainer, "block_loss", recording)
    batch = BlockDiffusionCollator(1, num_anchors=6, seed=0)(records)
    for depth in (None, 1, 2):
        trainer = make_trainer(target, records, tmp_path / str(depth), max_steps=1, loss_depth=depth)
        trainer.compute_loss(trainer.model, batch)
    everything, depth_1, depth_2 = seen
    assert torch.all(depth_1 == 1.0)  # slot 1 alone: weight exp(0)
    assert len(depth_1) < len(depth_2) < len(everything)
    assert len(depth_2.unique()) == 2 and len(everything.unique()) == 3  # slots 1-2 of 1-3
    assert len(depth_1) == int((everything == 1.0).sum())  # the same slot-1 rows, none lost


def _tiny_target_and_its_answers(real_target, tmp_path):
    """A tiny target with SmolLM2's vocabulary and a data directory of its own greedy answers to two prompts."""
    from hf_diffspec.trainers.data import write_generated_data

    tokenizer = real_target[1]
    target = tiny_target("llama", seed=3, vocab_size=len(tokenizer))
    data = tmp_path / "data"
    write_generated_data(target, tokenizer, "tiny", data, num_samples=2, max_new_tokens=12, batch_size=2,
                         prompts=[{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Count to three."}])
    return target, tokenizer, data


def test_train_kd_with_an_ema_saves_the_average(real_target, tmp_path):
    from hf_diffspec.trainers.pipeline import train_drafter

    target, tokenizer, data = _tiny_target_and_its_answers(real_target, tmp_path)
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=4,
                                   per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, bf16=False,
                                   save_steps=3, ema_decay=0.6)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    average = load_file(out / "checkpoints" / "checkpoint-3" / EMA_FILE)
    raw, saved = load_file(out / "checkpoints" / "checkpoint-3" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in average.items())
    assert not all(torch.equal(raw[k], v) for k, v in average.items())


def test_a_continued_run_logs_its_curve_steps_and_keeps_them_when_resumed(real_target, tmp_path):
    from hf_diffspec.trainers.pipeline import train_drafter

    target, tokenizer, data = _tiny_target_and_its_answers(real_target, tmp_path)
    common = dict(output_dir=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=4,
                  per_device_train_batch_size=2, learning_rate=1e-2, bf16=False, save_steps=1, schedule_steps=8,
                  offline_acceptance_steps=1, offline_acceptance_data=[str(data)])
    # another machine took 2 steps and saw 100 tokens; this one takes 2 more, then is resumed for a third
    train_drafter(target, tokenizer, "tiny", [str(data)],
                  DrafterTrainingArguments(max_steps=2, schedule_start=2, tokens_seen_start=100, **common), command="t")
    train_drafter(target, tokenizer, "tiny", [str(data)],
                  DrafterTrainingArguments(max_steps=3, resume=True, **common), command="t")
    lines = [json.loads(line) for line in (tmp_path / "run" / "offline_acceptance.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 3, 4, 5]
    tokens = [line["training_tokens"] for line in lines]
    assert tokens[0] == 100 and tokens == sorted(tokens) and tokens[-1] > tokens[0]
