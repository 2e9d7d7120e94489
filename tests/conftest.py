"""Shared fixtures: the tiny offline world, built once per test session in a temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from benchmark.assets import build  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


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


def run_learning_suite(workdir: Path, timeout: int) -> subprocess.CompletedProcess:
    """`benchmark.run learning` for seed 1 in `workdir`: the README's main job and the quick frontier's runs."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "benchmark.run", "learning", "--seeds", "1", "--jobs", "2", "--workdir", str(workdir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def suite_dir(assets, tmp_path_factory) -> Path:
    """Runs the quick tiny suite and the quick frontier's runs (seed 1) once in a fresh working directory: the
    learning tests judge them, the mutation tests start from their models."""
    workdir = tmp_path_factory.mktemp("suite")
    shutil.copytree(assets, workdir / "runs" / "assets")
    proc = run_learning_suite(workdir, timeout=2700)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir


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
