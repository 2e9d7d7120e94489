"""Shared fixtures: the tiny offline world, built once per test session in a temporary directory."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from benchmark.assets import build  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: learning tests that train for minutes (CI runs them too)")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The tiny world (tokenizer, tiny models, tiny-math, tiny-tldr) built from seed 0, about 8 s."""
    out = tmp_path_factory.mktemp("assets")
    build(out, seed=0)
    return out
