"""Hub-ready folders (`hf_diffspec.save_drafter`): custom_generate/ made from the library, plain-transformers use
without hf_diffspec, push."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_diffspec
from hf_diffspec.cli import main
from hf_diffspec.hub import RUNTIME_DIR, files_to_upload, runtime_files, stage_for_upload
from helpers import tiny_drafter, tiny_target


# Runs in a fresh interpreter in which importing hf_diffspec is impossible.
NO_HF_DIFFSPEC = textwrap.dedent('''
    import sys, importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_diffspec" or name.startswith("hf_diffspec."):
                raise ModuleNotFoundError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    try:
        import hf_diffspec
        raise SystemExit("hf_diffspec must not be importable here")
    except ModuleNotFoundError:
        pass

    import random, torch
    from transformers import AutoModel, AutoModelForCausalLM

    target_dir, drafter_dir = sys.argv[1], sys.argv[2]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    try:
        AutoModel.from_pretrained(drafter_dir, trust_remote_code=False)
        raise SystemExit("remote code ran without trust_remote_code=True")
    except ValueError:
        pass
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)
    assert "hf_diffspec" not in type(drafter).__module__
    ids = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.2)
    ref = target.generate(ids, **kwargs)
    # a fixed length speculates at every step (the speculation gate would decode a random drafter plainly)
    out = target.generate(ids, assistant_model=drafter, custom_generate=drafter_dir, trust_remote_code=True,
                          return_dict_in_generate=True, num_assistant_tokens=3, **kwargs)
    assert torch.equal(out.sequences, ref), "chain: not identical to plain generate"
    stats = out.speculation_stats
    assert stats.drafted_tokens > 0 and stats.plain_steps == 0

    # trees: replace the drafting policy of the loaded remote module by a noisy oracle with wrong siblings
    gen_module = next(m for name, m in sys.modules.items() if name.endswith("custom_generate.drafting"))
    tree_module = next(m for name, m in sys.modules.items() if name.endswith("custom_generate.tree"))
    truth, rng, trees = ref[0].tolist(), random.Random(0), []

    def oracle(self, root_tokens, root_positions, max_depths, ahead=None):
        (root_token,), (root_position,), (max_depth,) = root_tokens, root_positions, max_depths
        tokens, parents, parent = [root_token], [-1], 0
        for tok in truth[root_position + 1 : root_position + 1 + min(max_depth, 7)]:
            wrong = (tok + 1 + rng.randrange(100)) % 128
            tokens += [wrong, tok]
            parents += [parent, parent]
            parent = len(tokens) - 1
        tree = tree_module.CandidateTree(torch.tensor(tokens), parents)
        trees.append(tree)
        return [tree]

    gen_module.DiffusionCandidateGenerator.propose = oracle
    out = target.generate(ids, assistant_model=drafter, custom_generate=drafter_dir, trust_remote_code=True, **kwargs)
    assert torch.equal(out, ref), "tree: not identical to plain generate"
    assert trees and not trees[0].is_chain
    print("OK", stats.tau)
''')


@pytest.fixture
def saved(tmp_path):
    target = tiny_target("llama", seed=21)
    drafter = tiny_drafter(target, block_size=6)
    target.save_pretrained(tmp_path / "target")
    hf_diffspec.save_drafter(drafter, tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


def test_save_pretrained_is_transformers_own_and_save_drafter_adds_the_hub_files(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"), block_size=6)
    drafter.save_pretrained(tmp_path / "plain")
    plain = {p.name for p in (tmp_path / "plain").iterdir()}
    assert {"config.json", "model.safetensors", "configuration_diffusion_drafter.py",
            "modeling_diffusion_drafter.py"} <= plain
    assert "custom_generate" not in plain and "README.md" not in plain
    assert hf_diffspec.save_drafter(drafter, tmp_path / "hub") == tmp_path / "hub"
    hub = {p.name for p in (tmp_path / "hub").iterdir()}
    assert plain | {"custom_generate", "README.md"} == hub  # nothing half-written (no staging folder) is left
    assert "trust_remote_code=True" in (tmp_path / "hub" / "README.md").read_text()


def test_custom_generate_is_the_librarys_own_code(saved):
    _, drafter_dir = saved
    assert "generate.py" in runtime_files() and len(runtime_files()) > 3
    for name in runtime_files():
        assert (drafter_dir / "custom_generate" / name).read_bytes() == (RUNTIME_DIR / name).read_bytes(), name


def test_saved_folder_runs_with_plain_transformers_and_no_hf_diffspec(saved, tmp_path):
    target_dir, drafter_dir = saved
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", NO_HF_DIFFSPEC, str(target_dir), str(drafter_dir)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "OK" in result.stdout


def test_push_uploads_a_complete_folder_only(saved, tmp_path, capsys):
    _, drafter_dir = saved
    files = files_to_upload(drafter_dir)
    assert {"config.json", "model.safetensors", "README.md", "modeling_diffusion_drafter.py",
            "custom_generate/generate.py", "custom_generate/requirements.txt"} <= set(files)
    main(["push", str(drafter_dir), "--repo-id", "me/drafter", "--dry-run"])
    assert "custom_generate/generate.py" in capsys.readouterr().out
    (drafter_dir / "custom_generate" / "generate.py").unlink()
    with pytest.raises(FileNotFoundError, match="custom_generate/generate.py"):
        files_to_upload(drafter_dir)
    (drafter_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        main(["push", str(drafter_dir), "--repo-id", "me/drafter", "--dry-run"])


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-dflash", "smollm2-135m-instruct-d2sd-vp"])
def test_shipped_drafters_stage_into_hub_ready_folders(name, tmp_path):
    """The repository keeps weights, config and card; staging adds the library's current remote code."""
    shipped = Path(__file__).resolve().parent.parent / "checkpoints" / name
    assert not (shipped / "custom_generate").exists()  # a single source of truth for the code
    files = stage_for_upload(shipped, tmp_path)
    assert "custom_generate/generate.py" in files and "modeling_diffusion_drafter.py" in files
    for name in runtime_files():
        assert (tmp_path / "custom_generate" / name).read_bytes() == (RUNTIME_DIR / name).read_bytes(), name
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModel"].startswith("modeling_")
