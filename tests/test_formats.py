"""Formats in and out: z-lab DFlash and transformers-native checkpoints, transformers' own DFlash path, engine export.

No real z-lab checkpoint can be downloaded here, so the fixture is built from the published config fields and tensor
names with random weights. transformers' own DFlash drafter (MuseGlimmerAssistantModel) is an independent
implementation of the same math: drafts must be identical through every route.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.generation import candidate_generator as hf_candidates

import hf_diffspec
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.cli import main
from helpers import tiny_drafter, tiny_target

H, INTER, LAYERS, HEADS, KV, HEAD_DIM, BLOCK, MASK_ID = 64, 128, 2, 4, 2, 16, 6, 3
LAYER_IDS = [1, 2, 3]


def zlab_config() -> dict:
    """The fields of z-lab's published DFlash configs (dflash_config nested, block_size top-level)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": BLOCK, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS},
        "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 512, "layer_types": ["full_attention"] * LAYERS, "sliding_window": None,
        "vocab_size": 128, "tie_word_embeddings": False, "dtype": "float32",
    }


def zlab_weights(seed=0) -> dict:
    """z-lab tensor names: layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.{gate,up,down}_proj, norms, fc,
    hidden_norm, norm."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    state = {"fc.weight": rand(H, H * len(LAYER_IDS)), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H), p + "self_attn.k_proj.weight": rand(KV * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": rand(KV * HEAD_DIM, H), p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM), p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(INTER, H), p + "mlp.up_proj.weight": rand(INTER, H),
            p + "mlp.down_proj.weight": rand(H, INTER),
            p + "input_layernorm.weight": 1 + rand(H), p + "post_attention_layernorm.weight": 1 + rand(H),
        })
    return state


@pytest.fixture
def zlab_dir(tmp_path):
    folder = tmp_path / "zlab"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(zlab_config()))
    save_file(zlab_weights(), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def native_drafter(zlab_state) -> MuseGlimmerAssistantModel:
    """transformers' own DFlash drafter with the same weights (the documented conversion: two renames)."""
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=HEAD_DIM, rms_norm_eps=1e-6, block_size=BLOCK, mask_token_id=MASK_ID,
        target_layer_ids=LAYER_IDS, layer_types=["full_attention"] * LAYERS, vocab_size=128,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    model = MuseGlimmerAssistantModel(cfg)
    renames = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({renames.get(k, k): v for k, v in zlab_state.items()})
    return model.eval()


def record_hf_drafts(monkeypatch):
    drafts = []
    original = hf_candidates.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            drafts.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(hf_candidates.DFlashTokenCandidateGenerator, "get_candidates", recording)
    return drafts


def record_our_drafts(monkeypatch):
    drafts = []
    original = DiffusionCandidateGenerator.propose

    def recording(self, *args, **kwargs):
        trees = original(self, *args, **kwargs)
        drafts.extend(t.tokens[1:].tolist() for t in trees if len(t) > 1)
        return trees

    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", recording)
    return drafts


@pytest.mark.every_step_speculates("compares the drafts of every step across routes")
def test_zlab_checkpoint_drafts_identically_in_every_route(zlab_dir, tmp_path, monkeypatch):
    target = tiny_target("qwen3", seed=4, layers=6)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=20, do_sample=False)
    ref = target.generate(ids, **kwargs)

    main(["convert", str(zlab_dir), "--from", "zlab", "--out", str(tmp_path / "ours")])
    # chains, as transformers' DFlash path drafts (a published drafter otherwise gets trees and prompt lookup)
    ours = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "ours", target=target, draft_tree_budget=None,
                                                        prompt_lookup_num_tokens=0)
    assert ours.config.mask_token_id == MASK_ID and ours.config.target_layer_ids == LAYER_IDS

    hf_drafts = record_hf_drafts(monkeypatch)
    native_out = target.generate(ids, assistant_model=native_drafter(zlab_weights()), speculation_type="dflash", **kwargs)
    native_drafts = list(hf_drafts)
    hf_drafts.clear()
    ours_in_hf = target.generate(ids, assistant_model=ours, speculation_type="dflash", **kwargs)
    ours_in_hf_drafts = list(hf_drafts)
    loop_drafts = record_our_drafts(monkeypatch)
    ours_in_loop = target.generate(ids, assistant_model=ours, **kwargs)

    assert torch.equal(native_out, ref) and torch.equal(ours_in_hf, ref) and torch.equal(ours_in_loop, ref)
    assert native_drafts and ours_in_hf_drafts == native_drafts
    # our loop caps drafts at the remaining budget; compare what both proposed
    assert len(loop_drafts) == len(native_drafts)
    assert all(a == b[: len(a)] for a, b in zip(loop_drafts, native_drafts))


def test_hf_native_checkpoint_converts(tmp_path):
    native = native_drafter(zlab_weights(seed=2))
    native.save_pretrained(tmp_path / "native")
    main(["convert", str(tmp_path / "native"), "--from", "hf-native", "--out", str(tmp_path / "ours")])
    assert (tmp_path / "ours" / "custom_generate" / "generate.py").is_file()  # a Hub-ready folder
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    for name, tensor in zlab_weights(seed=2).items():
        assert torch.equal(ours[name], tensor), name


def test_export_for_engines_round_trips(zlab_dir, tmp_path, capsys):
    main(["convert", str(zlab_dir), "--from", "zlab", "--out", str(tmp_path / "ours")])
    main(["export", str(tmp_path / "ours"), "--format", "vllm", "--out", str(tmp_path / "vllm")])
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["model_type"] == "qwen3"
    assert exported["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}
    assert exported["block_size"] == BLOCK and exported["num_target_layers"] == 6
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    assert set(weights) == set(zlab_weights()) and all(torch.equal(weights[k], v) for k, v in zlab_weights().items())
    main(["export", str(tmp_path / "ours"), "--format", "sglang", "--out", str(tmp_path / "sglang")])
    assert "exported for sglang" in capsys.readouterr().out


def test_export_refuses_what_engines_cannot_run(tmp_path):
    target = tiny_target("llama")
    tiny_drafter(target).save_pretrained(tmp_path / "owned_mask")
    with pytest.raises(ValueError, match="MASK embedding.*--format vllm"):
        main(["export", str(tmp_path / "owned_mask"), "--format", "sglang", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="--target"):  # "auto" picks the MASK token with the target's tokenizer
        main(["export", str(tmp_path / "owned_mask"), "--format", "vllm", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        main(["export", str(tmp_path / "owned_mask"), "--format", "vllm", "--out", str(tmp_path / "x"),
              "--mask-token-id", "100000"])
    assert not (tmp_path / "x").exists()  # nothing half-written
    vp = tiny_drafter(target, mask_token_id=3, draft_role="variable_prefix")
    vp.save_pretrained(tmp_path / "vp")
    with pytest.raises(ValueError, match="variable_prefix"):
        main(["export", str(tmp_path / "vp"), "--format", "sglang", "--out", str(tmp_path / "y")])
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "vp"), "--format", "tgi", "--out", str(tmp_path / "z")])


def test_broken_external_checkpoints_name_the_problem(zlab_dir, tmp_path):
    state = zlab_weights()
    del state["layers.1.mlp.up_proj.weight"]
    state["fc.weight"] = torch.zeros(H, H)
    save_file(state, zlab_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=r"zlab DFlash checkpoint .*layers\.1\.mlp\.up_proj\.weight.*fc\.weight.*download"):
        main(["convert", str(zlab_dir), "--from", "zlab", "--out", str(tmp_path / "o")])
    config = zlab_config()
    del config["dflash_config"]
    (zlab_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mask_token_id"):
        main(["convert", str(zlab_dir), "--from", "zlab", "--out", str(tmp_path / "o")])


def test_the_shipped_drafter_exports_to_vllm_with_its_learned_mask_and_draft_vocabulary(tmp_path):
    """The shipped SmolLM2 drafter learned its own MASK vector and drafts over a reduced vocabulary: the vLLM export
    carries the vector as an unused target token plus mask_embedding.pt, and the vocabulary as vLLM's draft head
    (the target's rows, d2t offsets), so vLLM drafts what our loop drafts (examples/vllm_round_trip.sh serves it)."""
    from hf_diffspec.drafters import shipped_drafter
    from hf_diffspec.targets import load_target, unused_target_token

    shipped = shipped_drafter("smollm2-135m-instruct")
    main(["export", str(shipped), "--format", "vllm", "--out", str(tmp_path / "vllm"),
          "--target", "smollm2-135m-instruct", "--draft-vocabulary"])
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.float32)
    ours = load_file(shipped / "model.safetensors")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    token = unused_target_token(tokenizer, target.vocab_size)
    assert config["dflash_config"]["mask_token_id"] == token and token not in tokenizer.all_special_ids
    mask = torch.load(tmp_path / "vllm" / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == token and torch.equal(mask["embedding"], ours["mask_embedding"])
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    ids = ours["draft_vocab_ids"]
    assert config["draft_vocab_size"] == len(ids) == 16384
    assert torch.equal(weights["d2t"] + torch.arange(len(ids)), ids)
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight.detach()[ids].to(weights["lm_head.weight"]))
    assert not {"mask_embedding", "draft_vocab_ids"} & set(weights)
    assert not any(k.startswith("length_head") for k in weights)
    assert all(torch.equal(weights[k], v) for k, v in ours.items() if k.startswith(("layers.", "fc.", "norm.")))
    main(["export", str(shipped), "--format", "vllm", "--out", str(tmp_path / "full"),
          "--target", "smollm2-135m-instruct", "--mask-token-id", str(token)])
    full = load_file(tmp_path / "full" / "model.safetensors")
    assert "d2t" not in full and "lm_head.weight" not in full  # vLLM then shares the target's head
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())
