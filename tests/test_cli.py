"""The command line's parser: every subcommand parses, and the target options are the same wherever a target loads.

No real model is loaded here: what a subcommand does is tested beside the code it runs (test_bench.py, test_formats.py,
test_hub.py, ...).
"""

import pytest
import torch

import hf_diffspec.cli as cli
from hf_diffspec.cli import build_parser, main

SUBCOMMANDS = [[], ["demo"], ["bench"], ["data", "relabel"], ["data", "generate"], ["train", "kd"], ["train", "vp"],
               ["train", "opd"], ["train", "length-head"], ["profile"], ["push"], ["convert"], ["export"]]
#: each subcommand that loads a target, with what else it requires and its default dtype
LOADS_TARGET = {
    "demo": ([], "bf16"),
    "bench": ([], "bf16"),
    "data relabel": (["--out", "o", "--num-samples", "1"], "bf16"),
    "data generate": (["--out", "o", "--num-samples", "1"], "bf16"),
    "profile": ([], "bf16"),
    "train kd": (["--data", "d", "--output_dir", "o"], "auto"),
    "train vp": (["--data", "d", "--output_dir", "o"], "auto"),
    "train opd": (["--output_dir", "o", "--init", "i"], "auto"),
    "train length-head": (["--data", "d", "--output_dir", "o", "--init", "i"], "auto"),
}


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=lambda c: " ".join(c) or "hf-diffspec")
def test_every_help_parses(command, capsys):
    with pytest.raises(SystemExit) as raised:
        main([*command, "--help"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith("usage: hf-diffspec")


@pytest.mark.parametrize("command", LOADS_TARGET)
def test_every_command_that_loads_a_target_takes_the_same_target_options(command):
    required, dtype = LOADS_TARGET[command]
    parser = build_parser()
    defaults = parser.parse_args([*command.split(), *required])
    assert (defaults.target, defaults.dtype, defaults.device) == (cli.DEFAULT_TARGET, dtype, None)
    given = parser.parse_args([*command.split(), *required, "--target", "t", "--dtype", "fp32", "--device", "meta"])
    assert (given.target, given.dtype, given.device) == ("t", "fp32", "meta")
    assert parser.parse_args([*command.split(), *required, "--dtype", "auto"]).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*command.split(), *required, "--dtype", "fp8"])


def test_auto_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    args = build_parser().parse_args(["profile", "--dtype", "auto"])
    monkeypatch.setattr(cli, "fast_bf16", lambda device: True)
    assert cli.target_dtype(args) == torch.bfloat16
    monkeypatch.setattr(cli, "fast_bf16", lambda device: False)
    assert cli.target_dtype(args) == torch.float32
    assert cli.target_dtype(build_parser().parse_args(["profile", "--dtype", "bf16"])) == torch.bfloat16


@pytest.mark.parametrize("argv, flag", [(["bench", "--batch-sizes", "1,x"], "--batch-sizes"),
                                        (["bench", "--batch-sizes", ","], "--batch-sizes"),
                                        (["bench", "--oracle-taus", "2,two"], "--oracle-taus"),
                                        (["profile", "--batch-sizes", "1;2"], "--batch-sizes")])
def test_a_bad_number_list_is_refused_naming_the_option_before_a_target_loads(argv, flag, monkeypatch):
    monkeypatch.setattr(cli, "load_target_of", lambda args: pytest.fail("the target loaded before the check"))
    with pytest.raises(SystemExit, match=f"{flag} takes comma-separated"):
        main(argv)


def test_comma_separated_lists_strip_blanks():
    assert cli.comma_separated(" ar, dflash ,,tree") == ["ar", "dflash", "tree"]
    assert cli.comma_separated("1, 4,16", int, "--batch-sizes takes integers") == [1, 4, 16]
    assert cli.comma_separated("", str) == []


def test_profile_on_a_busy_machine_fails_unless_scripts_ask_to_skip(tmp_path, monkeypatch, capsys):
    """A measurement disturbed by other processes is never saved; `--skip-if-busy` (what the examples pass) says so
    and succeeds, so a script on a busy laptop or runner goes on (generate measures on first use)."""
    from hf_diffspec.runtime import control_profiles as cost_model
    from helpers import tiny_target

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    monkeypatch.setattr(cli, "load_target_of", lambda args: (target, None))
    busy = cost_model.ProfileMeasurement({b: {n: 0.01 * n for n in cost_model.PROFILE_SIZES} for b in (1, 2)},
                                         1.9, 3, "was taken while other processes kept 1.90 cores busy")
    monkeypatch.setattr(cost_model, "measure_profile", lambda *args, **kwargs: busy)
    with pytest.raises(SystemExit, match="not saved: the measurement was taken while other processes"):
        main(["profile", "--batch-sizes", "1,2"])
    main(["profile", "--batch-sizes", "1,2", "--skip-if-busy"])
    assert "generate() measures the profile on first use instead" in capsys.readouterr().out
    assert not cost_model.profile_path(target).exists()


def test_profile_graphs_saves_the_graph_modes_profile_and_is_refused_without_cuda_graphs(tmp_path, monkeypatch,
                                                                                         capsys):
    """`hf-diffspec profile --graphs`: refused where no CUDA graph can be replayed (naming what it needs); with a
    graph backend, measured through it and saved as the profile graphed calls read (`--show` says so)."""
    from hf_diffspec.runtime import control_profiles as cost_model, verify_graphs
    from helpers import tiny_target

    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(tmp_path))
    target = tiny_target("llama")
    monkeypatch.setattr(cli, "load_target_of", lambda args: (target, None))
    with pytest.raises(SystemExit, match="needs a CUDA device.*HF_DIFFSPEC_CUDA_GRAPHS=1"):
        main(["profile", "--graphs"])
    modes = []
    quiet = cost_model.ProfileMeasurement({b: {n: 0.01 * n for n in cost_model.PROFILE_SIZES} for b in (1, 2)},
                                          0.0, 1, None)
    monkeypatch.setattr(cost_model, "measure_profile", lambda *args, graphs=False, **kwargs: (
        modes.append(graphs), quiet)[1])
    monkeypatch.setattr(verify_graphs, "graph_backend", lambda device: object())
    main(["profile", "--batch-sizes", "1,2", "--graphs"])
    assert modes == [True]
    assert cost_model.profile_path(target, graphs=True).is_file() and not cost_model.profile_path(target).exists()
    main(["profile", "--show"])
    assert ", CUDA graphs, " in capsys.readouterr().out
