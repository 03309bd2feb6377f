"""Model cards (README.md) for saved drafters: what target, what data, how long, how well, and the exact command."""

from pathlib import Path


def write_model_card(path: Path, drafter, info: dict) -> None:
    cfg = drafter.config
    params = sum(p.numel() for p in drafter.parameters())
    lines = [
        "---",
        "library_name: hf-diffspec",
        "tags: [speculative-decoding, dflash, block-diffusion, drafter]",
        f"base_model: {info.get('target')}",
        "---",
        "",
        f"# Block-diffusion drafter for {info.get('target')}",
        "",
        "A DFlash-style drafter for lossless speculative decoding with hf-diffspec:",
        "",
        "```python",
        "import hf_diffspec",
        f'target, tok = hf_diffspec.load_target("{info.get("target")}")',
        'drafter = hf_diffspec.DiffusionDrafter.from_pretrained("<this folder>", target=target)',
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)",
        "```",
        "",
        "## Architecture",
        f"- {cfg.num_hidden_layers} decoder layer(s), hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, block size {cfg.block_size}",
        f"- target features from layers {cfg.target_layer_ids} of {cfg.num_target_layers}; "
        f"{params / 1e6:.2f} M parameters of its own (embeddings and LM head are the target's)",
        "",
        "## Training",
        f"- data: {', '.join(_describe(d) for d in info.get('data', []))}",
        f"- {info.get('sequences')} sequences, {info.get('tokens')} tokens; {info.get('steps')} optimizer steps in "
        f"{info.get('train_seconds')} s on {info.get('device')}",
    ]
    curve = info.get("loss_curve") or {}
    if curve:
        lines.append(f"- loss {curve.get('first_loss')} -> {curve.get('last_loss')} (min {curve.get('min_loss')}); "
                     f"training-batch tau at the end {curve.get('last_train_tau')}")
    head = info.get("length_head") or {}
    if head:
        lines += [
            f"- length head (drafter frozen): binary cross-entropy {head['head_bce']} on the drafter's own acceptance "
            f"(raw confidence as the predictor: {head['confidence_bce']}); mean predicted acceptance "
            f"{head['predicted_acceptance']} vs observed {head['observed_acceptance']} (last logged training batches)",
        ]
    lines += ["", "Command:", "", "```bash", str(info.get("command")), "```", ""]
    evaluation = info.get("evaluation")
    if evaluation:
        lines += ["## Measured acceptance (held-out prompts, greedy)", "",
                  f"Command: `{evaluation.get('command', '')}` on {evaluation.get('machine', '')}", "",
                  "| domain | prompts | tau | speedup vs plain generate |", "|---|---|---|---|"]
        for row in evaluation.get("rows", []):
            lines.append(f"| {row['domain']} | {row['prompts']} | {row['tau']:.2f} | {row['speedup_vs_ar']:.2f}x |")
        lines.append("")
    lines += ["Evaluation prompts (HumanEval, MATH-500, MT-Bench) are excluded from the training data by prompt text.", ""]
    path.write_text("\n".join(lines))


def _describe(meta: dict) -> str:
    return f"{meta.get('dir')} (target {meta.get('target')})"
