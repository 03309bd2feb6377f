"""What our loop cannot run losslessly is refused before the target's first forward, naming what to use instead."""

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, DynamicCache, StaticCache

from helpers import tiny_drafter, tiny_target


@pytest.fixture
def pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target)


def refused(target, drafter, match, **kwargs):
    """The error `generate(assistant_model=drafter, **kwargs)` raises, asserting the target never ran."""
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(torch.randint(2, 128, (1, 6)), assistant_model=drafter, max_new_tokens=4, **kwargs)
    finally:
        hook.remove()
    assert not calls


@pytest.mark.parametrize("backend", ["paged|flash_attention_2", "paged|sdpa", "kernels-community/vllm-flash-attn3"])
def test_attention_backends_without_float_masks_are_refused(pair, backend):
    target, drafter = pair
    target.config._attn_implementation = backend
    refused(target, drafter, rf"attn_implementation='{backend.replace('|', '[|]')}'.*attn_implementation='sdpa'")


def test_offloaded_and_quantized_caches_are_refused(pair):
    """cache_implementation='static' is the capture-ready step (tests/test_static_verify.py); a StaticCache passed
    in is still refused: the loop sizes its own."""
    target, drafter = pair
    for implementation in ("offloaded_static", "offloaded", "quantized"):
        refused(target, drafter, rf"cache_implementation='{implementation}'.*Leave cache_implementation unset",
                cache_implementation=implementation)
    static = StaticCache(config=target.config, max_cache_len=32)
    refused(target, drafter, "a cache of type StaticCache.*Pass a DynamicCache", cache=static)
    refused(target, drafter, "a cache of type StaticCache", past_key_values=static)  # its name before 5.24
    try:
        offloaded = DynamicCache(offloading=True)
    except RuntimeError as error:  # a CUDA build of torch without a driver cannot make the cache's prefetch stream
        pytest.skip(f"DynamicCache(offloading=True) cannot be built on this machine: {error}")
    refused(target, drafter, r"\(offloaded\).*Pass a DynamicCache", cache=offloaded)


def test_encoder_decoder_targets_are_refused(pair):
    _, drafter = pair
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)).eval()
    refused(bart, drafter, "encoder-decoder model.*decoder-only.*assistant model")


def test_targets_with_layers_a_crop_cannot_roll_back_are_refused(pair):
    """Chunked-attention layers (Llama 4) are not rolled back by cropping KV and are not masked by this loop."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    _, drafter = pair
    torch.manual_seed(0)
    chunked = Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8, num_local_experts=2)).eval()
    refused(chunked, drafter, r"\['chunked_attention'\] layers.*plain generate")


def test_sliding_window_targets_are_refused_only_where_their_window_cannot_be_masked():
    """Sliding layers of different windows, bidirectional (embedding) configurations and a cache that drops the keys
    of sliding layers (one built with the model's config) are refused; the same target otherwise runs."""
    from helpers import tiny_family_target

    target = tiny_family_target("gemma3")
    drafter = tiny_drafter(target)
    refused(target, drafter, r"DynamicCache built with the model's config.*Pass DynamicCache\(\)",
            cache=DynamicCache(config=target.config))
    bidirectional = tiny_family_target("gemma3")
    bidirectional.config.use_bidirectional_attention = True
    refused(bidirectional, drafter, "bidirectional attention.*causal")
    windows = tiny_family_target("gemma3")
    windows.config.per_layer_config = {0: {"sliding_window": 4}, 2: {"sliding_window": 8}}
    refused(windows, drafter, r"different windows \[4, 8\].*plain generate")
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False),
                       target.generate(ids, max_new_tokens=4, do_sample=False))


def test_supported_settings_still_run(pair):
    """The checks refuse only what they name: sdpa and eager targets with a dynamic cache decode as before."""
    target, drafter = pair
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    for backend in ("sdpa", "eager"):
        target.set_attn_implementation(backend)
        ref = target.generate(ids, max_new_tokens=6, do_sample=False)
        for kwargs in ({}, {"cache_implementation": "dynamic"}, {"cache": DynamicCache()}):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False, **kwargs)
            assert torch.equal(out, ref)


def test_paged_attention_in_a_sub_config_is_refused():
    """A multimodal model loaded with attn_implementation={"text_config": "paged|flash_attention_2"} sets the text
    model's implementation alone; the top-level one says nothing. (FlashAttention 2 / 3 themselves are taken:
    tests/test_verify_attention.py.)"""
    from types import SimpleNamespace

    from transformers import Gemma3Config, GenerationConfig

    from hf_diffspec.runtime.support import refuse_unsupported

    config = Gemma3Config(text_config=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=32),
                          vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                             num_attention_heads=2),
                          attn_implementation={"text_config": "paged|flash_attention_2"})
    assert config._attn_implementation is None
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|flash_attention_2' \(in text_config\).*'sdpa'"):
        refuse_unsupported(SimpleNamespace(config=config), GenerationConfig(), {})


def test_a_target_without_sdpa_is_told_to_use_eager():
    from helpers import tiny_family_target

    target = tiny_family_target("gpt_oss")
    target.config._attn_implementation = "flash_attention_2"
    refused(target, tiny_drafter(target), r"attn_implementation='eager' \(or 'flex_attention'; GptOssForCausalLM "
                                          r"has no SDPA")
