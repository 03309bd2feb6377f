"""The block-diffusion training step: its rows of blocks give every block what inference gives it (the context
before its anchor and the block itself), and the same loss and gradients whatever the number of blocks per row."""

import pytest
import torch

import hf_diffspec
from hf_diffspec.trainers.block_diffusion import BlockDiffusionCollator, BlockDiffusionTrainer
from hf_diffspec.trainers.configs import DrafterTrainingArguments
from helpers import tiny_drafter, tiny_target

VOCAB, BLOCK, ANCHORS = 64, 4, 7

DRAFTERS = {
    "dflash": dict(num_hidden_layers=2),
    # a causal layer, a sliding window and DFlash 2's block convolutions: the masks and blocks they need per row
    "causal-window-conv": dict(num_hidden_layers=2, causal_layers=[0], layer_types=["sliding_attention",
                               "full_attention"], sliding_window=6, block_conv=True),
}


@pytest.fixture(scope="module")
def target_and_batch(one_torch_thread):
    """A tiny GQA target and a ragged batch: rows of different lengths, one with fewer candidates than anchors."""
    target = tiny_target("llama", seed=5, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(5)
    records = [{"input_ids": torch.randint(2, VOCAB, (length,), generator=generator), "prompt_length": prompt}
               for length, prompt in ((30, 6), (21, 4), (12, 7))]
    batch = BlockDiffusionCollator(1, num_anchors=ANCHORS, seed=0)(records)
    assert not batch["anchor_mask"][2].all() and batch["anchor_mask"][:2].all()
    return target, batch


def make_trainer(target, drafter, tmp_path, **config):
    args = DrafterTrainingArguments(output_dir=str(tmp_path), num_anchors=ANCHORS, bf16=False, disable_tqdm=True,
                                    report_to=[], **config)
    return BlockDiffusionTrainer(model=drafter, args=args, train_dataset=[], target=target)


def blocks_one_by_one(drafter, target, batch) -> torch.Tensor:
    """(B, n, size, H): each block alone, as inference drafts it: the context before its anchor, no mask."""
    features = drafter.gather_target_features(
        target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True).hidden_states)
    rows = []
    for row, anchors in enumerate(batch["anchors"].tolist()):
        blocks = []
        for anchor in anchors:
            noise = drafter.block_embeds(batch["input_ids"][row, anchor][None], BLOCK)
            positions = torch.arange(anchor + BLOCK)[None]
            blocks.append(drafter(noise_embeds=noise, context_hidden_states=features[row:row + 1, :anchor],
                                  position_ids=positions).last_hidden_state[0])
        rows.append(torch.stack(blocks))
    return torch.stack(rows)


def loss_and_gradients(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_rows_of_blocks_give_each_block_its_context_and_the_dense_steps_loss(target_and_batch, tmp_path, kind):
    target, batch = target_and_batch
    torch.manual_seed(5)
    drafter = hf_diffspec.DiffusionDrafter.from_target(target, block_size=BLOCK, **DRAFTERS[kind]).float()
    if drafter.config.block_conv:  # away from the identity they start as, so that they matter
        with torch.no_grad():
            for layer in drafter.layers:
                for conv in layer.block_convs:
                    conv.base.normal_(0, 0.5)
    trainer = make_trainer(target, drafter, tmp_path)
    with torch.no_grad():
        expected = blocks_one_by_one(drafter, target, batch)
    real = batch["anchor_mask"]  # padding anchors (at 0, never learned) are left out
    results = {}
    for per_row in (0, 1, 3, ANCHORS):  # 0: one row per sequence, the dense mask
        trainer.args.blocks_per_row = per_row
        with torch.no_grad():
            hidden = trainer.block_forward(drafter.forward, batch).hidden
        torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=1e-5)
        results[per_row] = loss_and_gradients(trainer, batch)
    dense_loss, dense_grads = results.pop(0)
    assert dense_loss > 0 and len(dense_grads) > 5
    for per_row, (loss, grads) in results.items():
        torch.testing.assert_close(loss, dense_loss, atol=1e-5, rtol=1e-5)
        assert grads.keys() == dense_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, dense_grads[name], atol=1e-5, rtol=1e-4, msg=f"{per_row}: {name}")


def test_context_rows_must_divide_the_rows_of_blocks():
    target = tiny_target("llama", seed=5, vocab_size=VOCAB)
    drafter = tiny_drafter(target, block_size=BLOCK)
    features = torch.randn(2, 5, drafter.fc.in_features)
    noise = drafter.block_embeds(torch.tensor([3, 4, 5]), BLOCK)
    with pytest.raises(ValueError, match="2 rows for 3 rows of blocks"):
        drafter(noise_embeds=noise, context_hidden_states=features, position_ids=torch.arange(9)[None])
