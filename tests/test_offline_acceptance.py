"""The offline acceptance length: the training forward at every anchor of the target's own sequences measures what a
`dflash-block` decode accepts."""

import json
from dataclasses import replace

import pytest
import torch

from hf_diffspec import DiffusionDrafter
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer
from hf_diffspec.trainers.configs import DrafterTrainingArguments
from hf_diffspec.trainers.offline_acceptance import (
    block_drafts, decode_walk, measuring_trainer, offline_acceptance, paired_tau_difference, sequence_inputs,
    summarize,
)
from helpers import tiny_drafter, tiny_target

BLOCK = 6
VOCAB = 32


@pytest.fixture(scope="module")
def trained(one_torch_thread, tmp_path_factory):
    """A sharpened tiny target, its greedy continuations of 6 prompts (each cut by max_new_tokens), and a tiny drafter
    trained briefly on them, so that the decode accepts drafts at some steps and not at others."""
    target = tiny_target("llama", seed=5, vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (1, length), generator=generator) for length in (5, 7, 9, 6, 11, 8)]
    records = []
    for i, prompt in enumerate(prompts):
        sequence = target.generate(prompt, max_new_tokens=36, do_sample=False)[0]
        records.append({"input_ids": sequence, "prompt_length": prompt.shape[1], "domain": ("a", "b")[i % 2]})
    drafter = tiny_drafter(target, block_size=BLOCK, seed=5).float()
    args = DrafterTrainingArguments(output_dir=str(tmp_path_factory.mktemp("drafter")), max_steps=30,
                                    learning_rate=3e-3, per_device_train_batch_size=6, num_anchors=24, bf16=False,
                                    save_strategy="no", logging_steps=1000, disable_tqdm=True)
    trainer = BlockDiffusionTrainer(model=drafter, args=args, train_dataset=records, target=target,
                                    data_collator=BlockDiffusionCollator(1, num_anchors=24, seed=0))
    trainer.train()
    drafter.eval()
    return target, drafter, trainer, prompts, records


def decode(target, drafter, prompt, monkeypatch):
    """A `dflash-block` decode (whole block verified every step) of the same length: its tokens, committed tokens
    per step, and the drafts proposed at each anchor."""
    proposed = []
    propose = DiffusionCandidateGenerator.propose

    def recording(self, roots, positions, remaining, ahead=None):
        trees = propose(self, roots, positions, remaining, ahead)
        proposed.append((positions[0], trees[0].tokens[1:].tolist()))
        return trees

    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", recording)
    out = target.generate(prompt, assistant_model=drafter, num_assistant_tokens=BLOCK - 1, max_new_tokens=36,
                          do_sample=False, return_dict_in_generate=True)
    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", propose)
    return out.sequences[0], out.speculation_stats.committed_per_step, proposed


@pytest.mark.parametrize("selector", [False, True])
@pytest.mark.every_step_speculates("compares decoded tau with offline tau step for step")
def test_offline_acceptance_equals_the_decoded_dflash_block_tau(trained, monkeypatch, tmp_path, selector):
    target, drafter, trainer, prompts, records = trained
    if selector:  # drafts chosen left to right by a selector that disagrees with the drafter's argmax
        drafter.save_pretrained(tmp_path)
        drafter = DiffusionDrafter.from_pretrained(tmp_path, target=target, selector_rank=4, selector_top_k=4).eval()
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            for codes in (drafter.selector.previous_codes, drafter.selector.candidate_codes):
                codes.copy_(torch.randn(codes.shape, generator=generator) * 3)
            drafter.selector.proj.weight.mul_(30)
    report = offline_acceptance(trainer, drafter, records)
    committed, steps = 0, 0
    for prompt, record, offline_steps in zip(prompts, records, report["committed_per_step"]):
        sequence, per_step, _ = decode(target, drafter, prompt, monkeypatch)
        assert torch.equal(sequence, record["input_ids"])  # lossless: the same sequence the offline measure reads
        assert offline_steps == per_step  # step by step: every visited anchor commits what the decode committed
        committed, steps = committed + sum(per_step), steps + len(per_step)
    assert report["decode_tau"] == round(committed / steps, 4)
    assert 1.3 < report["decode_tau"] < BLOCK - 0.5  # drafts accepted at some steps, rejected at others
    assert report["unjudged_blocks"] == 0  # the target's own fp32 continuations: every slot is judged
    assert set(report["per_domain"]) == {"a", "b"}
    assert report["blocks"] == sum(len(r["input_ids"]) - r["prompt_length"] - 1 for r in records)
    reach = report["reach"]
    assert len(reach) == BLOCK - 1 and all(a >= b for a, b in zip(reach, reach[1:])) and reach[0] > 0.2
    assert report["acceptance"][0] == reach[0]
    json.dumps(report)  # what the log and the CLI write


@pytest.mark.every_step_speculates("compares decoded steps with offline ones")
def test_a_decode_that_stops_at_eos_is_measured_step_by_step_to_its_end(trained):
    """A decode stops at EOS in the middle of an accepted block; the offline walk cuts that block where the sequence
    ends, so its last step commits what the decode's did (the fixture's decodes end at max_new_tokens instead)."""
    target, drafter, trainer, prompts, records = trained
    stopped, last_steps = [], []
    for prompt, record in zip(prompts, records):
        start = prompt.shape[1]
        answer = record["input_ids"][start:]
        eos = int(answer[len(answer) // 2])  # a token the target writes mid-answer: its first occurrence ends it
        end = start + int((answer == eos).nonzero()[0]) + 1
        out = target.generate(prompt, assistant_model=drafter, num_assistant_tokens=BLOCK - 1, max_new_tokens=36,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True)
        assert torch.equal(out.sequences[0], record["input_ids"][:end])
        steps = out.speculation_stats.committed_per_step
        stopped.append({"input_ids": out.sequences[0], "prompt_length": start, "domain": "a", "steps": steps})
        last_steps.append(steps[-1])
    report = offline_acceptance(trainer, drafter, stopped)
    assert report["committed_per_step"] == [record["steps"] for record in stopped]
    assert max(last_steps) > 1  # some decode reached EOS inside a block of accepted drafts


def test_the_training_forward_drafts_what_the_decode_drafts_at_the_anchors_it_visits(trained, monkeypatch):
    target, drafter, trainer, prompts, records = trained
    for prompt, record in zip(prompts, records):
        _, _, proposed = decode(target, drafter, prompt, monkeypatch)
        anchors = [position for position, _ in proposed]
        inputs = sequence_inputs(record["input_ids"], record["prompt_length"], anchors, "cpu")
        drafts = block_drafts(trainer, drafter, inputs)[0][0]
        for (position, decoded), offline in zip(proposed, drafts.tolist()):
            assert offline[: len(decoded)] == decoded, position  # every draft, accepted or not


def test_decode_walk_and_summary():
    assert decode_walk(torch.tensor([2, 1, 3, 1, 1, 2, 1])) == [2, 3, 2]
    report = summarize([{"taus": torch.tensor([1, 2, 3, 1]), "steps": [1, 2, 1], "unjudged": 1},
                        {"taus": torch.tensor([2, 2]), "steps": [2], "unjudged": 0}], block_size=4)
    assert report["tau"] == round(11 / 6, 4) and report["decode_tau"] == 1.5 and report["unjudged_blocks"] == 1
    assert report["reach"] == [round(4 / 6, 4), round(1 / 6, 4), 0.0]
    assert report["acceptance"] == [round(4 / 6, 4), 0.25, 0.0]
    # clustered by sequence: sum of each sequence's deviations from the mean, squared
    mean = 11 / 6
    expected = ((1 + 2 + 3 + 1 - 4 * mean) ** 2 + (2 + 2 - 2 * mean) ** 2) ** 0.5 / 6
    assert report["tau_se"] == round(expected, 4)


def test_two_drafters_on_the_same_sequences_compare_paired(trained):
    """The paired difference is the difference of the two taus, with a standard error from the per-sequence
    differences (smaller than either tau's own when the drafters agree on most blocks); reports on other sequences
    are refused."""
    target, drafter, trainer, prompts, records = trained
    untrained = tiny_drafter(target, block_size=BLOCK, seed=5).float().eval()
    after = offline_acceptance(trainer, drafter, records)
    before = offline_acceptance(trainer, untrained, records)
    difference, se = paired_tau_difference(after, before)
    assert difference == pytest.approx(sum(after["sequence_tau_sums"]) / after["blocks"]
                                       - sum(before["sequence_tau_sums"]) / before["blocks"])
    assert round(difference, 3) == round(after["tau"] - before["tau"], 3) and difference > 0
    blocks = after["sequence_blocks"]
    deltas = [a - b for a, b in zip(after["sequence_tau_sums"], before["sequence_tau_sums"])]
    expected = sum((d - n * difference) ** 2 for d, n in zip(deltas, blocks)) ** 0.5 / sum(blocks)
    assert se == pytest.approx(expected) and se > 0
    same, zero = paired_tau_difference(after, after)
    assert same == 0 and zero == 0
    fewer = offline_acceptance(trainer, drafter, records[:4])
    with pytest.raises(ValueError, match="different sequences"):
        paired_tau_difference(fewer, before)
    with pytest.raises(ValueError, match="measure both drafters again"):
        paired_tau_difference({k: v for k, v in after.items() if k != "sequence_tau_sums"}, before)


def test_a_variable_prefix_trainer_is_refused(trained):
    from hf_diffspec.trainers.block_diffusion import VariablePrefixTrainer

    target, drafter, _, _, records = trained
    trainer = measuring_trainer(drafter, target)
    trainer.__class__ = VariablePrefixTrainer
    with pytest.raises(ValueError, match="first \\(DFlash\\) drafters"):
        offline_acceptance(trainer, drafter, records)


def test_training_logs_the_offline_acceptance_on_a_schedule_across_a_resume(real_target, tmp_path):
    from safetensors.torch import load_file

    from hf_diffspec.trainers.data import write_generated_data
    from hf_diffspec.trainers.measuring import read_heldout_tau
    from hf_diffspec.trainers.offline_acceptance import OFFLINE_ACCEPTANCE_LOG
    from hf_diffspec.trainers.pipeline import train_drafter

    tokenizer = real_target[1]
    target = tiny_target("llama", seed=3, vocab_size=len(tokenizer))
    data = tmp_path / "data"
    prompts = [{"id": f"p{i}", "prompt": text} for i, text in enumerate(["Name a colour.", "Count to three.",
                                                                          "Say hi.", "Pick a fruit."])]
    write_generated_data(target, tokenizer, "tiny", data, num_samples=4, max_new_tokens=16, batch_size=4,
                         prompts=prompts)
    cfg = DrafterTrainingArguments(output_dir=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=8,
                                   per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, bf16=False,
                                   save_steps=2, offline_acceptance_steps=2, offline_acceptance_data=[str(data)],
                                   offline_acceptance_sequences=2)
    out = train_drafter(target, tokenizer, "tiny", [str(data)], cfg, command="test")
    log = read_heldout_tau(out / OFFLINE_ACCEPTANCE_LOG)
    assert sorted(log) == [0, 2, 4]  # the start, every 2 steps
    assert log[0]["training_tokens"] == 0 < log[2]["training_tokens"] < log[4]["training_tokens"]
    assert all(line["sequences"] == 2 and 1.0 <= line["tau"] <= 4.0 and len(line["reach"]) == 3
               for line in log.values())
    # being measured changes nothing in training
    plain = train_drafter(target, tokenizer, "tiny", [str(data)],
                          replace(cfg, output_dir=str(tmp_path / "plain"), offline_acceptance_steps=0), command="test")
    measured, unmeasured = load_file(out / "model.safetensors"), load_file(plain / "model.safetensors")
    assert all(torch.equal(measured[k], unmeasured[k]) for k in unmeasured)
    resumed = train_drafter(target, tokenizer, "tiny", [str(data)], replace(cfg, max_steps=6, resume=True),
                            command="test")
    assert sorted(read_heldout_tau(resumed / OFFLINE_ACCEPTANCE_LOG)) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="--offline-acceptance-data"):
        DrafterTrainingArguments(output_dir=str(tmp_path / "x"), offline_acceptance_steps=2)
