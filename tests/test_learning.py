"""Learning tests: the tiny suite end to end (SFT, reward model, PRM), and that the models actually learn.

These train for minutes on a 2-core CPU, so they carry the `slow` marker; CI runs them too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.run import final_metrics

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def suite_dir(assets, tmp_path_factory) -> Path:
    """Runs `python -m benchmark.run tiny` (the README's main job) once in a fresh working directory."""
    workdir = tmp_path_factory.mktemp("suite")
    shutil.copytree(assets, workdir / "runs" / "assets")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmark.run", "tiny", "--workdir", str(workdir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir


@pytest.mark.slow
def test_tiny_tldr_sft_imitates_references_and_rm_learns_gold_preferences(suite_dir):
    sft = final_metrics(suite_dir / "runs" / "sft_tiny-tldr__1")
    # the SFT policy learns to write summaries that end with EOS and cover facts about as well as the references
    assert sft["eval/eos_rate"] == 1.0
    assert sft["eval/gold_reward"] > 0.5
    # and it leaves room for RL: the best possible summary scores 1.0
    assert sft["eval/gold_reward"] < 0.9
    rm = final_metrics(suite_dir / "runs" / "rm_tiny-tldr__1")
    assert rm["eval/accuracy"] >= 0.85, rm
    assert abs(rm["eval/reference_reward_mean"]) < 1e-4


@pytest.mark.slow
def test_tiny_math_sft_accuracy_leaves_room_and_prm_learns_steps(suite_dir):
    sft = final_metrics(suite_dir / "runs" / "sft_tiny-math__1")
    assert 0.2 <= sft["eval/accuracy"] <= 0.6, sft
    prm = final_metrics(suite_dir / "runs" / "prm_tiny-math__1")
    assert prm["eval/step_accuracy"] >= 0.85, prm


@pytest.mark.slow
def test_rerunning_the_suite_skips_finished_runs(suite_dir):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmark.run", "tiny", "--workdir", str(suite_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    assert proc.stdout.count("[skip]") == 4 and "[run]" not in proc.stdout
    done = json.loads((suite_dir / "runs" / "sft_tiny-tldr__1" / "DONE").read_text())
    assert done["command"][2] == "tiny-tldr"
