"""The real-shape check (benchmark/real_check.py): every stage of `benchmark.run tldr` and `benchmark.run math`, as the
suite launches it, on small random-weight models of the real architectures and the real tokenizers and data, under one
process, two DDP processes and DeepSpeed ZeRO-2 and ZeRO-3 (two processes each; DeepSpeed's CPU accelerator here)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmark.real_check import PYTHIA, Sources, build_model, default_assets, env_for, run_check, table

REPO = Path(__file__).resolve().parent.parent
ASSETS = default_assets()
pytestmark = [
    pytest.mark.skipif(ASSETS is None or not ASSETS.is_dir(), reason="no real assets (CLEAN_RLHF_REAL_ASSETS)")
]
# the engines in the order they must run: ZeRO-3 stages read the SFT and reward models that ZeRO-2 trained
ENGINES = ["single", "ddp", "zero2", "zero3"]
# Within the time of CI: every stage of the 1B track and of the math suite under one process and ZeRO-2 (which the
# suites launch their RL stages with), the stages the suites launch with DDP (SFT and reward model), and the 6.9B
# track's ZeRO-3 stages (on SFT and reward models trained under ZeRO-2, as the suite does). The RL scripts under two DDP
# processes are covered on the tiny world (test_ppo_rlhf, test_rloo_remax, test_grpo_math, test_dpo). The 2.8B and
# other 6.9B stages differ from the 1B ones only in batch sizes, which the check overrides; `CLEAN_RLHF_REAL_CHECK=all`
# runs them too (docs/real_check.md has the full table). GRPO also runs under ZeRO-3, which no suite launches.
FULL = os.environ.get("CLEAN_RLHF_REAL_CHECK") == "all"
ONLY = {
    "single": ["pythia-1b", "qwen"],
    "ddp": ["sft_tldr-pythia-1b", "rm_tldr-pythia-1b"],
    "zero2": ["pythia-1b", "qwen", "sft_tldr-pythia-6.9b", "rm_tldr-pythia-6.9b"],
    "zero3": ["pythia-6.9b", "grpo_gsm8k"],
}
MIN_OK = {"single": 13, "ddp": 2, "zero2": 13, "zero3": 5}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("real_check")


@pytest.mark.parametrize("engine", ENGINES)
def test_every_real_stage_runs(workdir, engine):
    result = run_check(
        workdir,
        Sources.from_assets(ASSETS),
        [engine],
        None if FULL else ONLY[engine],
        timeout=600,
        also_zero3=["grpo_gsm8k"],
    )
    print(table(result, [engine]))
    bad = {name: r for (name, _), r in result.items() if not r.startswith(("ok", "not run"))}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    assert sum(r.startswith("ok") for r in result.values()) >= MIN_OK[engine]


def test_a_zero3_model_reloads_equal_to_its_trained_weights(tmp_path):
    model = build_model(tmp_path / "pythia", PYTHIA, str(ASSETS / "tokenizers" / "pythia"))
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        "benchmark/accelerate_configs/deepspeed_zero3.yaml",
        "--num_processes",
        "2",
        "tests/zero3_save_check.py",
        str(model),
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**env_for("zero3"), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    info = json.loads((tmp_path / "result.json").read_text())
    assert info["zero_stage"] == 3 and info["processes"] == 2
    assert info["partitioned"] > 0  # the trained module held only shards of its weights: the save had to gather them
    trained = load_file(tmp_path / "trained.safetensors")
    reloaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "model").named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    assert set(trained) == set(reloaded)
    for k, v in trained.items():
        assert torch.equal(reloaded[k].to(v.dtype), v), k
    assert any(not torch.equal(initial[k].to(v.dtype), v) for k, v in trained.items())
