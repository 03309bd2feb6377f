"""The drafter model, its checkpoints, candidate trees and KV-cache compaction."""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, DynamicCache

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.runtime.control_policy import FixedLength
from hf_diffspec.runtime.verify_cache import gather_slots
from hf_diffspec.modeling import default_target_layer_ids
from hf_diffspec.runtime.tree import CandidateTree
from hf_diffspec.runtime.verify_inputs import tree_forward_inputs
from helpers import tiny_drafter, tiny_family_target, tiny_target


def draft_once(drafter, target, ids):
    """Prefill the target, then one chain proposal from the drafter: the whole block, whatever the machine's load (a
    length from the live cost model follows the measured drafting time, which two calls do not share)."""
    out = target(ids, output_hidden_states=drafter.target_feature_layers)
    block = drafter.config.block_size
    gen = DiffusionCandidateGenerator(drafter, target, FixedLength(block - 1, block), max_length=1000)
    gen.add_context(out.hidden_states, slice(None), torch.arange(ids.shape[1])[None])
    return gen.propose([int(ids[0, -1])], [ids.shape[1]], [100])[0]


def test_default_target_layer_ids_follow_dflash():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(4) == [0, 1, 2, 3]


@pytest.mark.every_step_speculates("asserts the length of a drafted block")
def test_from_target_matches_the_target_and_drafts_a_block():
    target = tiny_target("qwen3", layers=8)
    drafter = tiny_drafter(target, block_size=5)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size) == (64, 4, 16, 128)
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5] and cfg.num_target_layers == 8
    tree = draft_once(drafter, target, torch.randint(2, 128, (1, 9)))
    assert tree.is_chain and len(tree) == 5
    assert tree.confidences.shape == (4,) and bool(((tree.confidences > 0) & (tree.confidences <= 1)).all())


def test_drafter_never_modifies_the_target():
    target = tiny_target("llama")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    vocab = target.config.vocab_size
    drafter = tiny_drafter(target)
    target.generate(torch.randint(2, 128, (1, 8)), assistant_model=drafter, max_new_tokens=8)
    assert target.config.vocab_size == vocab
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert not any("embed_tokens" in k or "lm_head" in k for k in drafter.state_dict())


def test_save_and_load_round_trip_gives_identical_drafts(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=6)
    drafter.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_diffusion_drafter.py",
            "modeling_diffusion_drafter.py"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_diffusion_drafter.DiffusionDrafter"
    loaded = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    ids = torch.randint(2, 128, (1, 10))
    assert torch.equal(draft_once(drafter, target, ids).tokens, draft_once(loaded, target, ids).tokens)
    assert isinstance(AutoModel.from_pretrained(tmp_path), hf_diffspec.DiffusionDrafter)
    assert AutoConfig.from_pretrained(tmp_path).block_size == 6


def test_block_conv_starts_as_an_exact_no_op_and_reaches_back_within_the_block_only(tmp_path):
    """DFlash 2's causal convolution: a DFlash checkpoint loaded with block_conv=True drafts exactly as before; once
    trained, position t mixes in x_{t-1} of its own block and nothing of the next block."""
    from hf_diffspec.modeling.modeling_diffusion_drafter import DiffusionDrafterBlockConv

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    drafter.save_pretrained(tmp_path)
    with_conv = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target, block_conv=True)
    assert len(with_conv.layers[0].block_convs) == 2  # around the attention and around the MLP
    noise = torch.randn(2, 8, drafter.config.hidden_size)
    context = torch.randn(2, 5, drafter.fc.in_features)
    same = [m(noise_embeds=noise, context_hidden_states=context).last_hidden_state for m in (drafter, with_conv)]
    assert torch.equal(same[0], same[1])

    conv = with_conv.layers[0].block_convs[0]
    assert isinstance(conv, DiffusionDrafterBlockConv)
    with torch.no_grad():
        conv.base[:, 1].fill_(0.5)
        conv.delta.weight.normal_()
    x = torch.randn(1, 8, drafter.config.hidden_size)  # two blocks of 4
    later = x.clone()
    later[:, 2] += 1.0
    bump = torch.zeros_like(x)
    bump[:, 2] = 1.0
    identity = conv(lambda h: h, x)
    for moved in ((conv(lambda h: h, later) - identity),  # the input changes: both convolutions see it
                  (conv(lambda h: h + bump, x) - identity)):  # the sublayer's output changes: the one after it
        moved = moved.abs().sum(-1)[0]
        assert moved[2] > 0 and moved[3] > 0  # the position itself and the next one
        assert moved[[0, 1, 4, 5, 6, 7]].eq(0).all()  # nothing earlier, nothing in the next block
    with pytest.raises(ValueError, match="block_conv_group_size"):
        hf_diffspec.DiffusionDrafterConfig(block_conv=True, hidden_size=40, block_conv_group_size=16,
                                           num_attention_heads=4, num_key_value_heads=4)


def test_corrupt_or_partial_checkpoints_are_refused(tmp_path):
    target = tiny_target("llama")
    tiny_drafter(target).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state["fc.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(OSError, match="fc.weight"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    state["fc.weight"] = torch.zeros(3, 3)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(OSError, match="fc.weight"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    with open(weights, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(OSError, match="truncated or corrupt"):
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)


def test_unbound_drafter_says_how_to_bind():
    drafter = hf_diffspec.DiffusionDrafter(hf_diffspec.DiffusionDrafterConfig(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        num_target_layers=4))
    with pytest.raises(RuntimeError, match="from_target"):
        drafter.block_embeds(torch.tensor([3]))


@pytest.mark.parametrize("mask_token_id", [None, 7], ids=["learned-mask", "mask-token"])
def test_block_embeds_are_the_anchor_then_masks(mask_token_id):
    target = tiny_family_target("gemma3")  # scaled input embeddings
    drafter = tiny_drafter(target, mask_token_id=mask_token_id)
    anchors = torch.tensor([3, 9])
    block = drafter.block_embeds(anchors, 5)
    assert block.shape == (2, 5, target.config.hidden_size)
    assert torch.equal(block[:, :1], target.get_input_embeddings()(anchors[:, None]))
    assert torch.equal(block[:, 1:], drafter.mask_embeds(2, 4))


def test_binding_to_a_mismatched_target_names_the_mismatch():
    drafter = tiny_drafter(tiny_target("llama", layers=4))
    with pytest.raises(ValueError, match="6 layers"):
        drafter.bind_target(tiny_target("llama", layers=6))
    with pytest.raises(ValueError, match="model_type"):
        drafter.bind_target(tiny_target("qwen3", layers=4))


def test_wrong_feature_width_is_a_clear_error():
    drafter = tiny_drafter(tiny_target("llama"))
    with pytest.raises(ValueError, match="features per token"):
        drafter(torch.zeros(1, 4, 64), context_hidden_states=torch.zeros(1, 3, 64))


def test_tree_structure_mask_and_positions():
    tree = CandidateTree(torch.tensor([5, 6, 7, 8, 9]), [-1, 0, 0, 1, 3])
    assert tree.depths == [0, 1, 1, 2, 3] and tree.children[0] == {6: 1, 7: 2}
    assert tree.path_to(4) == [0, 1, 3, 4] and not tree.is_chain
    short = CandidateTree.chain(3, torch.tensor([4, 2]))
    past_valid = torch.tensor([[True, False, True], [False, True, True]])
    tokens, mask, positions = tree_forward_inputs([tree, short], past_valid, [10, 4], torch.float32)
    assert tokens.tolist() == [[5, 6, 7, 8, 9], [3, 4, 2, 3, 3]]         # the short row is padded with its root
    assert positions.tolist() == [[10, 11, 11, 12, 13], [4, 5, 6, 4, 4]]
    assert mask.shape == (2, 1, 5, 8)
    allowed = mask[:, 0] == 0
    assert allowed[0, :, 0].all() and not allowed[0, :, 1].any()
    assert allowed[0, 4, 3:].tolist() == [True, True, False, True, True]
    assert allowed[0, 2, 3:].tolist() == [True, False, True, False, False]
    assert allowed[1, 2].tolist() == [False, True, True, True, True, True, False, False]
    assert allowed[1, 3].tolist() == [False] * 6 + [True, False]       # padding slots see only themselves
    with pytest.raises(ValueError, match="two children"):
        CandidateTree(torch.tensor([5, 6, 6]), [-1, 0, 0])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_and_compaction_equal_plain_forwards(kind, attn):
    """Two rows, different trees and accepted paths (one not a prefix): every node's logits, and the next step after
    keeping each row's path, equal plain causal forwards of that row alone."""
    target = tiny_target(kind, attn=attn)
    prefix = torch.randint(2, 128, (2, 9))
    cache = DynamicCache()
    target(prefix, cache=cache)
    trees = [CandidateTree(torch.tensor([10, 11, 12, 13, 14, 15]), [-1, 0, 0, 1, 3, 2]),
             CandidateTree.chain(30, torch.tensor([31, 32]))]
    tokens, mask, positions = tree_forward_inputs(trees, torch.ones(2, 9, dtype=torch.bool), [9, 9], torch.float32)
    out = target(tokens, attention_mask=mask, position_ids=positions, cache=cache)
    for row, tree in enumerate(trees):
        for node in range(len(tree)):  # every node's logits equal a plain causal forward of its root path
            path_tokens = tree.tokens[tree.path_to(node)]
            ref = target(torch.cat([prefix[row : row + 1], path_tokens[None]], dim=1)).logits[0, -1]
            assert torch.allclose(out.logits[row, node], ref, atol=1e-5)
    paths = [trees[0].path_to(4), [0]]  # a non-prefix path 0 -> 1 -> 3 -> 4; the chain accepts only its root
    padded = torch.tensor([p + [p[-1]] * (4 - len(p)) for p in paths])
    gather_slots(cache, 9, padded)
    assert cache.get_seq_length() == 9 + 4
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, 10:] = False  # the second row kept one slot; the rest of its column is not its own
    nxt = torch.tensor([[20], [21]])
    step_mask = torch.zeros(2, 1, 1, 14).masked_fill(~torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], 1)[:, None, None], torch.finfo(torch.float32).min)
    step = target(nxt, attention_mask=step_mask, position_ids=torch.tensor([[13], [10]]), cache=cache).logits[:, -1]
    for row in range(2):
        kept = trees[row].tokens[paths[row]]
        ref = target(torch.cat([prefix[row], kept, nxt[row]])[None]).logits[0, -1]
        assert torch.allclose(step[row], ref, atol=1e-5)


def test_features_are_the_selected_hidden_states():
    target = tiny_target("llama", layers=6)
    drafter = tiny_drafter(target)
    ids = torch.randint(2, 128, (1, 5))
    out = target(ids, output_hidden_states=True)
    feats = drafter.gather_target_features(out.hidden_states)
    ids_ = drafter.config.target_layer_ids
    assert feats.shape == (1, 5, 64 * len(ids_))
    assert torch.equal(feats[..., :64], out.hidden_states[ids_[0] + 1])
    assert drafter.target_feature_layers == [i + 1 for i in ids_]  # index 0 of hidden_states is the embeddings
    selected = target(ids, output_hidden_states=drafter.target_feature_layers).hidden_states
    assert torch.equal(drafter.gather_target_features(selected), feats)


def test_modeling_files_import_only_torch_transformers_and_each_other():
    """They are copied into checkpoints for trust_remote_code: nothing of hf_diffspec may come along."""
    folder = Path(hf_diffspec.modeling.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." if node.level == 1 else (node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= {"torch", "transformers", "."}, f"{path.name}: {ast.unparse(node)}"



def _decoding_and_training_outputs(drafter, target):
    """A decoding step (cached context, ragged 4D mask) and a training forward (many blocks, the trainer's block
    mask, a backward pass): outputs and the gradient of fc."""
    from hf_diffspec.trainers.block_diffusion import block_attention_mask

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 12, drafter.fc.in_features, generator=generator)
    cache = DynamicCache()
    drafter.prefill_context(features[:, :8], torch.arange(8)[None].expand(2, -1), cache)
    valid = torch.ones(2, 8 + 4 + 4)
    valid[1, :3] = 0  # the second row's padding
    step = drafter(noise_embeds=drafter.block_embeds(torch.tensor([5, 9])), context_hidden_states=features[:, 8:],
                   position_ids=torch.arange(8, 16)[None].expand(2, -1), attention_mask=valid,
                   cache=cache).last_hidden_state
    anchors = torch.tensor([[2, 6], [3, 7]])
    slots = (anchors[:, :, None] + torch.arange(4)).flatten(1)
    mask = block_attention_mask(anchors, torch.ones(2, 12), 4, torch.float32)
    noise = target.get_input_embeddings()(torch.randint(2, 128, slots.shape, generator=generator))
    drafter.zero_grad()
    hidden = drafter(noise_embeds=noise, context_hidden_states=features,
                     position_ids=torch.cat([torch.arange(12).expand(2, -1), slots], 1), attention_mask=mask,
                     mask_positions=(torch.arange(8) % 4 != 0).expand(2, -1)).last_hidden_state
    hidden.square().sum().backward()
    return step.detach(), hidden.detach(), drafter.fc.weight.grad.clone()


def test_attention_runs_through_transformers_attention_interface():
    """The drafter's attention is transformers' function for `config._attn_implementation`: sdpa (the default) and
    eager give the same outputs and gradients in fp32, in decoding and in training, and a registered function is
    what runs."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    assert drafter.config._attn_implementation == "sdpa"
    sdpa = _decoding_and_training_outputs(drafter, target)
    drafter.set_attn_implementation("eager")
    eager = _decoding_and_training_outputs(drafter, target)
    for a, b in zip(sdpa, eager):  # two kernels: fp32 rounding apart (gradients up to 1.2e-5 on a 2026-12-05 EPYC)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)

    calls = []

    def counting(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("counting_sdpa", counting)
    drafter.set_attn_implementation("counting_sdpa")
    counted = _decoding_and_training_outputs(drafter, target)
    assert len(calls) == 2 * drafter.config.num_hidden_layers
    for a, b in zip(sdpa, counted):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
