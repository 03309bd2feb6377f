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


@pytest.mark.parametrize("backend", ["flash_attention_2", "flash_attention_3", "paged|flash_attention_2"])
def test_attention_backends_without_float_masks_are_refused(pair, backend):
    target, drafter = pair
    target.config._attn_implementation = backend
    refused(target, drafter, rf"attn_implementation='{backend.replace('|', '[|]')}'.*attn_implementation='sdpa'")


def test_static_offloaded_and_quantized_caches_are_refused(pair):
    target, drafter = pair
    for implementation in ("static", "offloaded_static", "offloaded", "quantized"):
        refused(target, drafter, rf"cache_implementation='{implementation}'.*Leave cache_implementation unset",
                cache_implementation=implementation)
    static = StaticCache(config=target.config, max_cache_len=32)
    refused(target, drafter, "a cache of type StaticCache.*Pass a DynamicCache", cache=static)
    refused(target, drafter, "a cache of type StaticCache", past_key_values=static)  # its name before 5.24
    refused(target, drafter, r"\(offloaded\).*Pass a DynamicCache", cache=DynamicCache(offloading=True))


def test_encoder_decoder_targets_are_refused(pair):
    _, drafter = pair
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)).eval()
    refused(bart, drafter, "encoder-decoder model.*decoder-only.*assistant model")


def test_targets_with_other_than_full_attention_layers_are_refused(pair):
    """Sliding-window or linear-attention layers are not rolled back by cropping full-attention KV."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _, drafter = pair
    torch.manual_seed(0)
    sliding = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2)).eval()
    refused(sliding, drafter, r"\['sliding_attention'\] layers.*plain generate")


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
