"""Published DFlash drafters load with `DiffusionDrafter.from_pretrained` as they are, no conversion step.

The fixtures are written by the real classes with their own `save_pretrained`: z-lab's `DFlashDraftModel` and
`DFlash2DraftModel` from PyPI `dflash==0.1.0` and transformers' own DFlash drafter (`MuseGlimmerAssistantModel`),
with random tiny weights and the published field set (nested `dflash_config`, RoPE scaling, sliding-window layers,
DFlash 2's convolutions and selector). Ours must give their forwards' hidden states and logits in fp32, z-lab's loop's
drafts, and outputs identical to plain greedy generate.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, Qwen3Config
from transformers.cache_utils import DFlashCache

import hf_diffspec
from hf_diffspec.cli import main
from hf_diffspec.runtime.drafting import BestFirstTreeCandidateGenerator, DiffusionCandidateGenerator, DrafterContext
from helpers import randomize, tiny_drafter, tiny_target

dflash = pytest.importorskip("dflash.model", reason="z-lab's package: pip install --no-deps dflash==0.1.0")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, LAYER_IDS, BLOCK, MASK_ID = 64, [1, 2, 3], 6, 3
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
ZLAB_VARIANTS = {
    "plain": {},
    "llama3-rope": {"rope_scaling": LLAMA3, "rope_theta": 500000.0},
    # a window shorter than the prompt, so it matters; z-lab makes sliding layers causal
    "sliding-window": {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                       "sliding_window": 5},
    "logit-fields": {"dflash_extra": {"output_multiplier": 0.5, "final_logit_softcapping": 3.0,
                                      "input_embedding_scale": 2.0}},
}


def zlab_config(dflash_extra=None, **fields) -> Qwen3Config:
    """z-lab's published field set: a Qwen3 config, `block_size` and `num_target_layers` at the top level,
    `mask_token_id` and `target_layer_ids` nested in `dflash_config`."""
    values = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512, rope_theta=10000.0,
                  num_target_layers=6, block_size=BLOCK,
                  dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS, **(dflash_extra or {})})
    values.update(fields)
    return Qwen3Config(**values)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4, layers=6)


def forwards(theirs, ours, target, seed=0):
    """(their, our) final hidden states of one block over 9 context tokens, and the logits of its draft slots."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(1, 9, len(LAYER_IDS) * H, generator=generator)
    block = torch.full((1, BLOCK), MASK_ID)
    block[0, 0] = 7
    noise = target.get_input_embeddings()(block)
    positions = torch.arange(9 + BLOCK)[None]
    with torch.no_grad():
        if isinstance(theirs, MuseGlimmerAssistantModel):
            cache = DFlashCache(config=theirs.config)
            cache.set_previous_accepted_tokens(features.shape[1])
            their_hidden = theirs(noise_embeds=noise, context_hidden_states=features, position_ids=positions,
                                  cache=cache).last_hidden_state
            their_logits = target.lm_head(their_hidden[:, 1:])
        else:
            their_hidden = theirs(position_ids=positions, noise_embedding=noise, target_hidden=features)
            their_logits = theirs.compute_logits(their_hidden[:, 1:], target.lm_head)
        our_hidden = ours(noise_embeds=noise, context_hidden_states=features, position_ids=positions).last_hidden_state
        return (their_hidden, our_hidden), (their_logits, ours.compute_logits(our_hidden[:, 1:]))


def zlab_loop_drafts(model, target, ids, max_new_tokens):
    """Drafts of z-lab's own loop (`dflash_generate`) for its whole-block rounds, and its output."""
    drafts = []
    propose = "propose" if isinstance(model, dflash.DFlash2DraftModel) else "compute_logits"
    original = getattr(model, propose)

    def recording(hidden, *args):
        out = original(hidden, *args)
        if hidden.shape[1] == BLOCK - 1:  # z-lab drafts a shorter block near the end; ours never does
            drafts.append((out[0] if propose == "propose" else out.argmax(-1))[0].tolist())
        return out

    setattr(model, propose, recording)
    try:
        out = dflash.dflash_generate(model, target, ids, max_new_tokens, None)
    finally:
        delattr(model, propose)
    return drafts, out


def our_chain_drafts(drafter, target, ids, max_new_tokens, monkeypatch):
    """Drafts of our loop verifying whole chains (z-lab's loop verifies the whole block), and its output."""
    drafts = []
    original = DiffusionCandidateGenerator.propose

    def recording(self, *args, **kwargs):
        trees = original(self, *args, **kwargs)
        drafts.extend(tree.tokens[1:].tolist() for tree in trees)
        return trees

    monkeypatch.setattr(DiffusionCandidateGenerator, "propose", recording)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                          num_assistant_tokens=BLOCK - 1)
    monkeypatch.undo()
    return drafts, out


def assert_same_drafts_and_lossless(zlab_model, folder, target, monkeypatch, max_new_tokens=24):
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    theirs, zlab_out = zlab_loop_drafts(zlab_model, target, ids, max_new_tokens)
    chains = hf_diffspec.DiffusionDrafter.from_pretrained(folder, target=target, draft_tree_budget=None,
                                                          prompt_lookup_num_tokens=0)
    ours, out = our_chain_drafts(chains, target, ids, max_new_tokens, monkeypatch)
    assert torch.equal(zlab_out[:, : ref.shape[1]], ref) and torch.equal(out, ref)
    # the random drafter is rarely accepted: both loops take the same steps, from the same anchors (ours caps a
    # draft at the tokens left to generate)
    assert len(theirs) >= 10 and all(mine == full[: len(mine)] for mine, full in zip(ours, theirs))
    assert sum(len(mine) == BLOCK - 1 for mine in ours) >= 10
    # with the runtime's defaults (trees, prompt lookup): still plain generate's output
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(folder, target=target)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                       do_sample=False), ref)


@pytest.mark.parametrize("variant", list(ZLAB_VARIANTS))
def test_zlab_layouts_load_as_they_are_and_draft_as_zlabs_model(variant, target, tmp_path, monkeypatch):
    zlab_model = randomize(dflash.DFlashDraftModel(zlab_config(**ZLAB_VARIANTS[variant])))
    zlab_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]

    ours = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    config = ours.config
    assert (config.mask_token_id, config.target_layer_ids, config.block_size) == (MASK_ID, LAYER_IDS, BLOCK)
    assert config.num_target_layers == 6 and config.head_dim == 16
    expected = {
        "plain": lambda: config.rope_parameters["rope_type"] == "default" and config.layer_types == ["full_attention"] * 2,
        "llama3-rope": lambda: config.rope_parameters == {**LLAMA3, "rope_theta": 500000.0},
        "sliding-window": lambda: config.sliding_window == 5 and config.causal_layers == [0],
        "logit-fields": lambda: (config.output_multiplier, config.final_logit_softcapping,
                                 config.input_embedding_scale) == (0.5, 3.0, 2.0),
    }
    assert expected[variant]()

    (their_hidden, our_hidden), (their_logits, our_logits) = forwards(zlab_model, ours, target)
    torch.testing.assert_close(our_hidden, their_hidden, rtol=0, atol=2e-5)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=2e-5)
    assert_same_drafts_and_lossless(zlab_model, tmp_path, target, monkeypatch)


def test_the_variants_change_the_drafter(target, tmp_path):
    """Each variant's field changes the forward, so matching z-lab's forward checks that it was mapped."""
    plain = randomize(dflash.DFlashDraftModel(zlab_config()))
    plain.save_pretrained(tmp_path / "plain")
    reference = forwards(plain, hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "plain", target=target), target)
    for variant in ("llama3-rope", "sliding-window", "logit-fields"):
        model = randomize(dflash.DFlashDraftModel(zlab_config(**ZLAB_VARIANTS[variant])))
        model.save_pretrained(tmp_path / variant)
        hidden, logits = forwards(model, hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / variant,
                                                                                      target=target), target)
        assert not torch.allclose(logits[0], reference[1][0], atol=1e-3), variant


@pytest.mark.parametrize("upstream_names", [False, True])
def test_zlab_dflash_2_loads_into_block_conv_and_selector(upstream_names, target, tmp_path, monkeypatch):
    """DFlash 2 (causal convolutions + candidate selector) in z-lab's layout: the config fields map onto
    `block_conv`/`selector_rank`, the tensors onto ours; upstream files name the codebooks without `.weight`."""
    fields = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    zlab_model = randomize(dflash.DFlash2DraftModel(zlab_config(dflash_extra=fields)), seed=3)
    zlab_model.save_pretrained(tmp_path)
    if upstream_names:
        weights = tmp_path / "model.safetensors"
        state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in load_file(weights).items()}
        assert "candidate_selector.predecessor_codebook" in state
        save_file(state, weights, metadata={"format": "pt"})

    ours = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    config = ours.config
    assert config.block_conv and (config.block_conv_kernel, config.block_conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (8, 4) and config.block_size == BLOCK
    (their_hidden, our_hidden), _ = forwards(zlab_model, ours, target)
    torch.testing.assert_close(our_hidden, their_hidden, rtol=0, atol=2e-5)
    assert_same_drafts_and_lossless(zlab_model, tmp_path, target, monkeypatch)


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["full_attention"] * 2])
def test_transformers_dflash_drafter_loads_as_it_is(layer_types, target, tmp_path):
    """transformers' own DFlash drafter layout: `encoder.*` tensor names, top-level DFlash fields, no vocabulary
    size and no target depth recorded (taken from the target and DFlash's layer rule), an inclusive window."""
    native = randomize(MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=LAYER_IDS,
        layer_types=layer_types, sliding_window=4, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=1,
        pad_token_id=1)), seed=5)
    native.save_pretrained(tmp_path)

    ours = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    assert ours.config.num_target_layers == max(LAYER_IDS) + 3 and ours.config.vocab_size == 128
    (their_hidden, our_hidden), (their_logits, our_logits) = forwards(native, ours, target)
    torch.testing.assert_close(our_hidden, their_hidden, rtol=0, atol=2e-5)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=2e-5)
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=ours, max_new_tokens=16, do_sample=False), ref)


@pytest.mark.every_step_speculates("asserts a best-first tree was drafted")
def test_a_published_drafter_gets_the_runtime_defaults_unless_asked_otherwise(target, tmp_path):
    randomize(dflash.DFlashDraftModel(zlab_config())).save_pretrained(tmp_path / "zlab")
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "zlab", target=target)
    defaults = hf_diffspec.DiffusionDrafterConfig.RUNTIME_DEFAULTS
    assert {name: getattr(drafter.config, name) for name in defaults} == defaults
    generators = []
    original = BestFirstTreeCandidateGenerator.propose

    def recording(self, *args, **kwargs):
        generators.append(self)
        return original(self, *args, **kwargs)

    BestFirstTreeCandidateGenerator.propose = recording
    try:
        ids = torch.randint(2, 128, (1, 8))
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    finally:
        BestFirstTreeCandidateGenerator.propose = original
    assert generators  # best-first trees, drafted by the published drafter

    chains = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "zlab", target=target, draft_tree_budget=None,
                                                          prompt_lookup_num_tokens=0)
    assert chains.config.draft_tree_budget is None and chains.config.prompt_lookup_num_tokens == 0
    # our own layout keeps what it was saved with
    tiny_drafter(target).save_pretrained(tmp_path / "ours")
    assert hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "ours").config.draft_tree_budget is None


def test_sliding_window_positions_survive_a_ragged_batch(target, tmp_path):
    """In a batch, a row's cache holds slots it does not see (other rows' longer accepts): the window is measured
    in positions, which the cache keeps beside the keys, so a row drafts as it does alone."""
    fields = {**ZLAB_VARIANTS["sliding-window"], "sliding_window": 8}  # reaches back into the cached context
    randomize(dflash.DFlashDraftModel(zlab_config(**fields))).save_pretrained(tmp_path)
    drafter = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    features = torch.randn(1, 10, len(LAYER_IDS) * H, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10)[None]
    seen = torch.ones(1, 10, dtype=torch.bool)

    def draft(steps, rows=1):
        """Per step: queue (features, positions, visible) and draft the block after them; the last draft."""
        context = DrafterContext(drafter)
        for feats, where, visible in steps:
            context.pending.append((feats.expand(rows, -1, -1), where.expand(rows, -1), visible.expand(rows, -1), None))
            context.all_valid &= bool(visible.all())  # what the loop's add_context tells the context on the host
            last = context.draft_block(torch.tensor([7] * rows), where[0, -1:].expand(rows) + 1, BLOCK)
        return last

    alone = draft([(features, positions, seen)])
    # the same ten tokens committed in two steps, the first followed by a slot this row does not see
    ragged = [(torch.cat([features[:, :6], features[:, :1]], 1), torch.tensor([[0, 1, 2, 3, 4, 5, 6]]),
               torch.tensor([[True] * 6 + [False]])),
              (features[:, 6:], positions[:, 6:], seen[:, 6:])]
    torch.testing.assert_close(draft(ragged), alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(draft(ragged, rows=2), alone.expand(2, -1, -1), rtol=0, atol=1e-5)


def test_convert_reads_a_hub_id_and_agrees_with_from_pretrained(target, tmp_path, monkeypatch):
    """`hf-diffspec convert OWNER/NAME --from zlab` downloads through huggingface_hub.snapshot_download; a config
    without `num_target_layers` gets DFlash's depth (max(layer ids) + 3) by both paths."""
    zlab_model = randomize(dflash.DFlashDraftModel(zlab_config()))
    zlab_model.save_pretrained(tmp_path / "hub")
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    del config["num_target_layers"]
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    downloads = []

    def snapshot_download(repo_id, **kwargs):
        downloads.append(repo_id)
        return str(tmp_path / "hub")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    main(["convert", "z-lab/tiny-DFlash", "--from", "zlab", "--out", str(tmp_path / "ours")])
    assert downloads == ["z-lab/tiny-DFlash"]
    converted = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "ours", target=target)
    direct = hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path / "hub", target=target)
    assert converted.config.num_target_layers == direct.config.num_target_layers == max(LAYER_IDS) + 3
    assert converted.config.draft_tree_budget == direct.config.draft_tree_budget == 15
    for name, tensor in direct.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="in the zlab layout, not 'hf-native': convert it with --from zlab"):
        main(["convert", str(tmp_path / "hub"), "--from", "hf-native", "--out", str(tmp_path / "wrong")])


def test_an_unmapped_published_checkpoint_names_its_layout_not_corruption(target, tmp_path):
    randomize(dflash.DFlashDraftModel(zlab_config())).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    state["layers.0.self_attn.q_gate.weight"] = state.pop("layers.0.self_attn.q_proj.weight")  # a variant we lack
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(OSError, match="zlab DFlash checkpoint .*q_proj.*layout differs") as error:
        hf_diffspec.DiffusionDrafter.from_pretrained(tmp_path, target=target)
    assert "corrupt" not in str(error.value) and "re-download" not in str(error.value)


@pytest.mark.parametrize("variant", ["llama3-rope", "sliding-window", "logit-fields"])
def test_export_keeps_what_changes_the_drafts(variant, target, tmp_path):
    """Exported for vLLM / SGLang (z-lab's layout), a drafter keeps its RoPE scaling, sliding windows and logit
    fields: z-lab's own class loads the export and drafts as the original does."""
    original = randomize(dflash.DFlashDraftModel(zlab_config(**ZLAB_VARIANTS[variant])))
    original.save_pretrained(tmp_path / "zlab")
    main(["convert", str(tmp_path / "zlab"), "--from", "zlab", "--out", str(tmp_path / "ours")])
    main(["export", str(tmp_path / "ours"), "--format", "vllm", "--out", str(tmp_path / "vllm")])
    exported = dflash.DFlashDraftModel.from_pretrained(tmp_path / "vllm").eval()
    (hidden, same_hidden), (logits, same_logits) = forwards(original, exported_as_ours(exported, target), target)
    torch.testing.assert_close(same_hidden, hidden, rtol=0, atol=1e-6)
    torch.testing.assert_close(same_logits, logits, rtol=0, atol=1e-6)


def exported_as_ours(zlab_model, target):
    """A z-lab model viewed through our forward contract, to compare two z-lab models with `forwards`."""

    class View(torch.nn.Module):
        def forward(self, noise_embeds, context_hidden_states, position_ids):
            hidden = zlab_model(position_ids=position_ids, noise_embedding=noise_embeds,
                                target_hidden=context_hidden_states)
            return type("Out", (), {"last_hidden_state": hidden})

        def compute_logits(self, hidden):
            return zlab_model.compute_logits(hidden, target.lm_head)

    return View()


def test_export_refuses_dflash_2_convolutions(target, tmp_path):
    fields = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    randomize(dflash.DFlash2DraftModel(zlab_config(dflash_extra=fields))).save_pretrained(tmp_path / "zlab")
    main(["convert", str(tmp_path / "zlab"), "--from", "zlab", "--out", str(tmp_path / "ours")])
    with pytest.raises(ValueError, match="DFlash 2's block convolutions"):
        main(["export", str(tmp_path / "ours"), "--format", "sglang", "--out", str(tmp_path / "sglang")])
