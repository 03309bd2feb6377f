"""Folders laid out like the published checkpoints of the README's "Use a published drafter" commands, at tiny size:
a random target whose `config.json` has the real checkpoint's model type, architecture, composite (multimodal)
config, layer types and sliding window, with a tokenizer and chat template; beside it a random drafter saved by
z-lab's own `DFlashDraftModel` (PyPI `dflash`) in its published layout (`dflash_config` with `mask_token_id` and
`target_layer_ids`). `tests/test_first_call.py` runs `examples/published_drafter.py` on each, as the README does with
Hub ids:

    python tests/published_rehearsal.py gpt-oss-20b /tmp/rehearsal   # prints the two folders and the command
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `helpers` when run as a script

import torch  # noqa: E402

from helpers import char_tokenizer, randomize  # noqa: E402

VOCAB, HIDDEN = 128, 64
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2)
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def qwen3_6_35b_a3b():
    """Qwen3.6-35B-A3B: `qwen3_5_moe`, Qwen3_5MoeForConditionalGeneration, Gated DeltaNet with a full-attention layer
    every 4th (`full_attention_interval` 4), MoE, a vision tower."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(TEXT, model_type="qwen3_5_moe_text", num_hidden_layers=4, full_attention_interval=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 4,
                              video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1)
    return Qwen3_5MoeForConditionalGeneration(config), {"enable_thinking": False}


def qwen3_8b():
    """Qwen3-8B: `qwen3`, Qwen3ForCausalLM, full attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**TEXT, num_hidden_layers=4)), {"enable_thinking": False}


def gemma_4_31b_it():
    """gemma-4-31B-it: `gemma4`, Gemma4ForConditionalGeneration, five sliding-window layers (window 1024) to one
    global layer, wider global heads."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(TEXT, model_type="gemma4_text", num_hidden_layers=6, sliding_window=1024,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], global_head_dim=32,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0)
    top = VOCAB - 1
    config = Gemma4Config(text_config=text, boi_token_id=top - 6, eoi_token_id=top - 5, image_token_id=top - 4,
                          video_token_id=top - 3, boa_token_id=top - 2, eoa_token_index=top - 1, audio_token_id=top)
    return Gemma4ForConditionalGeneration(config), {}


def gpt_oss_20b():
    """gpt-oss-20b: `gpt_oss`, GptOssForCausalLM, sliding-window (128) and full layers alternating, attention sinks,
    MoE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**TEXT, num_hidden_layers=4, sliding_window=128,
                          layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4,
                          num_experts_per_tok=2)
    return GptOssForCausalLM(config), {"reasoning_effort": "low"}


PUBLISHED = {"Qwen3.6-35B-A3B": qwen3_6_35b_a3b, "Qwen3-8B": qwen3_8b, "gemma-4-31B-it": gemma_4_31b_it,
             "gpt-oss-20b": gpt_oss_20b}


def zlab_drafter(target_layers: int, folder: Path) -> None:
    """A random drafter saved by z-lab's `DFlashDraftModel`: their published field set (a Qwen3 config, `block_size`
    and `num_target_layers` at the top, `mask_token_id` / `target_layer_ids` in `dflash_config`)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**{**TEXT, "max_position_embeddings": 2048}, num_hidden_layers=1, block_size=8,
                         num_target_layers=target_layers,
                         dflash_config={"mask_token_id": 100, "target_layer_ids": [1, target_layers - 2]})
    randomize(DFlashDraftModel(config)).save_pretrained(folder)


def write(name: str, root: Path) -> tuple[Path, Path, dict]:
    """(target folder, drafter folder, chat template kwargs) of the published pair `name`, written under `root`."""
    torch.manual_seed(0)
    target, template_kwargs = PUBLISHED[name]()
    with torch.no_grad():  # sharper logits: random drafts agree with the target now and then
        target.get_output_embeddings().weight.mul_(3)
    target_dir, drafter_dir = root / name, root / f"{name}-DFlash"
    target.save_pretrained(target_dir)
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "a", "b", "c"  # ids 0, 1, 2
    tokenizer.save_pretrained(target_dir)
    zlab_drafter(target.config.get_text_config().num_hidden_layers, drafter_dir)
    return target_dir, drafter_dir, template_kwargs


if __name__ == "__main__":
    import json

    target_dir, drafter_dir, kwargs = write(sys.argv[1], Path(sys.argv[2]))
    print(f"python examples/published_drafter.py --target {target_dir} --drafter {drafter_dir} --device cpu "
          f"--dtype float32 --chat-template-kwargs '{json.dumps(kwargs)}'")
