"""Shared fixtures: the tiny offline world, built once per test session in a temporary directory."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from benchmark.assets import build  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: the learning tests and the real-shape check, minutes each: the README runs them after the others, alone",
    )
    pin_xdist_worker()


def pin_xdist_worker() -> None:
    """Under `pytest -n N`, worker i runs (with every process it starts) on its own share of the cores: the scripts
    size their thread pools by the cores they may use, so the workers stop oversubscribing the CPU."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = cores[int(worker.removeprefix("gw")) % count :: count]
    if count > len(cores) or not share:
        return
    os.sched_setaffinity(0, share)
    os.environ["OMP_NUM_THREADS"] = str(len(share))  # for processes that do not size their pool themselves

    import torch

    torch.set_num_threads(len(share))


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The tiny world (tokenizer, tiny models, tiny-math, tiny-tldr) built from seed 0, about 8 s."""
    out = tmp_path_factory.mktemp("assets")
    build(out, seed=0)
    return out


@pytest.fixture
def ignores_positions():
    """A wrapper around a causal LM whose packed forward ignores the position ids, so every token of a packed row sees
    the whole row (what a model without packing support would do); padded batches pass through unchanged. Every
    script's `check_packing` must reject it."""
    import torch

    class IgnoresPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config, self.set_attn_implementation = inner, inner.config, inner.set_attn_implementation

        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
            if attention_mask is None:  # a packed row: positions 0..T-1, one sequence
                return self.inner(
                    input_ids=input_ids,
                    position_ids=torch.arange(input_ids.shape[1], device=input_ids.device)[None],
                    use_cache=False,
                )
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    return IgnoresPositions
