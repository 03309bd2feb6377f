"""Hub-ready drafter folders: `save_drafter` (weights, the `custom_generate/` folder with our decoding loop, the
model card), and `push`.

`drafter.save_pretrained(dir)` is transformers' own (weights, config, modeling files); `save_drafter(drafter, dir)`
adds what the Hub and plain transformers need, so the folder works without hf_diffspec installed:

    drafter = AutoModel.from_pretrained(dir, trust_remote_code=True)
    target.generate(**inputs, assistant_model=drafter, custom_generate=dir, trust_remote_code=True)

`custom_generate/` is not a hand-kept copy: `write_custom_generate` copies the library's runtime package
(`hf_diffspec/runtime/`, entry point `generate.py`) as a folder at save time, and a test checks that a saved folder
matches the library.
"""

import json
import os
import shutil
from pathlib import Path

# the runtime package travels whole as custom_generate/ (entry point: generate.py)
RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"


def runtime_files() -> list[str]:
    """The runtime's source files, as they are named inside custom_generate/."""
    return sorted(p.name for p in RUNTIME_DIR.glob("*.py"))


REQUIREMENTS = "transformers>=5.24\ntorch\n"
REQUIRED_FILES = ["config.json", "configuration_diffusion_drafter.py", "modeling_diffusion_drafter.py", "README.md",
                  *[f"custom_generate/{name}" for name in runtime_files()]]

_SINGLE = ["configuration_diffusion_drafter.py", "modeling_diffusion_drafter.py"]
_MODELING_FILES = {
    "diffusion_drafter": _SINGLE,
    "dual_diffusion_drafter": [*_SINGLE, "configuration_dual_drafter.py", "modeling_dual_drafter.py"],
}


def write_custom_generate(save_directory) -> Path:
    """Copy the runtime package into `save_directory/custom_generate/` (single-dot relative imports only)."""
    folder = Path(save_directory) / "custom_generate"
    shutil.copytree(RUNTIME_DIR, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (folder / "requirements.txt").write_text(REQUIREMENTS)
    return folder


def refresh_code(folder) -> None:
    """Bring a saved drafter folder's remote code (modeling files and custom_generate/) up to this library's version,
    leaving weights, config and model card untouched."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    from . import modeling as modeling_package  # installed from modeling/ as hf_diffspec.modeling

    modeling = Path(modeling_package.__file__).resolve().parent
    for name in _MODELING_FILES[config["model_type"]]:
        shutil.copyfile(modeling / name, folder / name)
    write_custom_generate(folder)


def save_drafter(drafter, save_directory, training_info: dict | None = None) -> Path:
    """Save `drafter` (a `DiffusionDrafter` or `DualDiffusionDrafter`) as a Hub-ready folder: weights, config with
    `auto_map` and the modeling files (`save_pretrained`), `custom_generate/` with the decoding loop, and a model card.

    `training_info` (what the training pipeline measured) fills the card's training section and is kept as
    `training_info.json`. Without it an existing README.md is left alone. Everything is written to a temporary
    folder first and moved in file by file, config.json last, so an interrupted save never looks complete.
    Returns the folder.
    """
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / ".saving"
    shutil.rmtree(staging, ignore_errors=True)
    drafter.save_pretrained(staging)
    write_custom_generate(staging)
    if training_info is not None:
        (staging / "training_info.json").write_text(json.dumps(training_info, indent=2, default=str))
    if training_info is not None or not (out / "README.md").exists():
        (staging / "README.md").write_text(model_card(drafter, training_info))
    names = sorted(p.name for p in staging.iterdir())
    for name in [n for n in names if n != "config.json"] + ["config.json"]:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        os.replace(staging / name, out / name)
    staging.rmdir()
    return out


def model_card(drafter, training_info: dict | None = None) -> str:
    """README.md of a saved drafter: how to use it (with and without hf_diffspec), its architecture, and, given the
    training pipeline's `training_info`, what target, data and time it was trained with and how well it drafts."""
    info = training_info or {}
    first = getattr(drafter, "first", drafter)  # a dual drafter is described by its first drafter
    cfg = first.config
    target = info.get("target") or cfg.target_name_or_path or cfg.target_model_type or "<target>"
    params = sum(p.numel() for p in drafter.parameters())
    lines = ["---", "library_name: hf-diffspec", "tags: [speculative-decoding, dflash, block-diffusion, drafter]"]
    if info.get("target"):
        lines.append(f"base_model: {info['target']}")
    lines += [
        "---",
        "",
        f"# Block-diffusion drafter for {target}",
        "",
        "A DFlash-style drafter for lossless speculative decoding with hf-diffspec:",
        "",
        "```python",
        "import hf_diffspec",
        f'target, tok = hf_diffspec.load_target("{target}")',
        f'drafter = hf_diffspec.{type(drafter).__name__}.from_pretrained("<this folder>", target=target)',
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)",
        "```",
        "",
        "Without hf_diffspec: `AutoModel.from_pretrained(dir, trust_remote_code=True)`, then "
        "`target.generate(**inputs, assistant_model=drafter, custom_generate=dir, trust_remote_code=True)`.",
        "",
        "## Architecture",
        f"- {cfg.num_hidden_layers} decoder layer(s), hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, block size {cfg.block_size}",
        f"- target features from layers {cfg.target_layer_ids} of {cfg.num_target_layers}; "
        f"{params / 1e6:.2f} M parameters of its own (embeddings and LM head are the target's)",
        "",
    ]
    if not info:
        return "\n".join(lines)
    lines += [
        "## Training",
        "- data: " + ", ".join(f"{d.get('dir')} (target {d.get('target')})" for d in info.get("data", [])),
        f"- {info.get('sequences')} sequences, {info.get('tokens')} tokens; {info.get('steps')} optimizer steps in "
        f"{info.get('train_seconds')} s on {info.get('device')}",
    ]
    curve = info.get("loss_curve") or {}
    if curve:
        lines.append(f"- loss {curve.get('first_loss')} -> {curve.get('last_loss')} (min {curve.get('min_loss')}); "
                     f"training-batch tau at the end {curve.get('last_train_tau')}")
    head = info.get("length_head") or {}
    if head:
        lines.append(
            f"- length head (drafter frozen): binary cross-entropy {head['head_bce']} on the drafter's own acceptance "
            f"(raw confidence as the predictor: {head['confidence_bce']}); mean predicted acceptance "
            f"{head['predicted_acceptance']} vs observed {head['observed_acceptance']} (last logged training batches)"
        )
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
    return "\n".join(lines)


def files_to_upload(folder) -> list[str]:
    """The files `push` would upload (relative paths), after checking the folder is a complete drafter."""
    folder = Path(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    has_weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if not has_weights:
        missing.append("model.safetensors")
    if missing:
        raise FileNotFoundError(
            f"{folder} is not a complete drafter folder; missing {missing}. Save it with hf_diffspec.save_drafter(drafter, dir)."
        )
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") or part in ("checkpoints", "__pycache__")
                                   for part in p.relative_to(folder).parts)
    )


def stage_for_upload(folder, staging) -> list[str]:
    """Copy a drafter folder to `staging` with this library's remote code written fresh (the repository's shipped
    checkpoints keep only weights, config and card; their code is the library's); returns the files to upload."""
    folder, staging = Path(folder), Path(staging)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: is it a drafter folder saved with hf_diffspec.save_drafter?")
    shutil.copytree(folder, staging, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("checkpoints", ".*", "__pycache__"))
    refresh_code(staging)
    return files_to_upload(staging)


def push(folder, repo_id: str, private: bool = False, token: str | None = None, revision: str | None = None) -> str:
    """Create `repo_id` on the Hub (if needed) and upload the drafter folder with current remote code; returns the
    commit URL."""
    import tempfile

    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory() as staging:
        files = stage_for_upload(folder, staging)
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=staging, repo_id=repo_id, revision=revision, allow_patterns=files,
                                   commit_message="Upload hf-diffspec drafter")
    return str(commit)
