"""Hub-ready drafter folders: the `custom_generate/` folder with our decoding loop, model cards, and `push`.

A saved drafter folder works with plain transformers (no hf_diffspec installed):

    drafter = AutoModel.from_pretrained(dir, trust_remote_code=True)
    target.generate(**inputs, assistant_model=drafter, custom_generate=dir, trust_remote_code=True)

`custom_generate/` is not a hand-kept copy: `write_custom_generate` copies the library's runtime package
(`hf_diffspec/runtime/`, entry point `generate.py`) as a folder at save time, and a test checks that a saved folder
matches the library.
"""

import json
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


def write_default_model_card(save_directory, config) -> None:
    """A short README.md for folders saved outside the training pipeline (which writes a fuller card)."""
    path = Path(save_directory) / "README.md"
    if path.exists():
        return
    path.write_text(
        "---\nlibrary_name: hf-diffspec\ntags: [speculative-decoding, dflash, block-diffusion, drafter]\n---\n\n"
        f"# Block-diffusion drafter ({config.num_hidden_layers} layers, block size {config.block_size})\n\n"
        f"Target: `{config.target_name_or_path or config.target_model_type}` "
        f"(features of layers {config.target_layer_ids} of {config.num_target_layers}).\n\n"
        "With hf_diffspec: `DiffusionDrafter.from_pretrained(dir, target=target)`, then "
        "`target.generate(**inputs, assistant_model=drafter)`.\n\n"
        "Without it: `AutoModel.from_pretrained(dir, trust_remote_code=True)`, then "
        "`target.generate(**inputs, assistant_model=drafter, custom_generate=dir, trust_remote_code=True)`.\n"
    )


def files_to_upload(folder) -> list[str]:
    """The files `push` would upload (relative paths), after checking the folder is a complete drafter."""
    folder = Path(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    has_weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if not has_weights:
        missing.append("model.safetensors")
    if missing:
        raise FileNotFoundError(
            f"{folder} is not a complete drafter folder; missing {missing}. Save it with drafter.save_pretrained(dir)."
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
        raise FileNotFoundError(f"{folder} has no config.json: is it a drafter folder saved with save_pretrained?")
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
