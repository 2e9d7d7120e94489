"""The real-shape check (benchmark/tools/real_check.py): every stage of `benchmark.run tldr` and `benchmark.run math`,
as the suite launches it, on small random-weight models of the real architectures and the real tokenizers and data,
under one process, two DDP processes, DeepSpeed ZeRO-2 and ZeRO-3 (two processes each; DeepSpeed's CPU accelerator
here) and FSDP2 (two processes over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmark.tools.real_check import PYTHIA, Sources, build_model, default_assets, env_for, run_check, table

REPO = Path(__file__).resolve().parent.parent
ASSETS = default_assets()
pytestmark = [
    pytest.mark.slow,  # the README's second pytest command, after the learning tests: one heavy job at a time
    pytest.mark.skipif(ASSETS is None or not ASSETS.is_dir(), reason="no real assets (CLEAN_RLHF_REAL_ASSETS)"),
]
# the engines in the order they must run: ZeRO-3 and (in CI) FSDP2 stages read the SFT and reward models ZeRO-2 trained
# Within the time of CI (docs/tests.md), every script runs on the real tokenizers and data, and every engine
# the suites launch runs: one process (SFT, reward model, RLOO, ReMax on TL;DR 1B; PPO on GSM8K; Dr. GRPO on MATH),
# two DDP processes (SFT and reward model, as the suites launch them, as two machines), ZeRO-2 (SFT, reward model and
# PPO of the 1B track; GRPO on GSM8K), ZeRO-3 (PPO and DPO of the 1B track on the ZeRO-2 SFT and reward models: the
# 6.9B track's ZeRO-3 stages differ from them only in the model paths and batch sizes, which the check overrides) and
# FSDP2 (PPO of the 1B track on the ZeRO-2 models). Every other cell
# differs from one of these in those, or in flags tested on the tiny world; `CLEAN_RLHF_REAL_CHECK=all` runs every
# stage of both suites under every engine (docs/real_check.md has the full table and its time).
FULL = os.environ.get("CLEAN_RLHF_REAL_CHECK") == "all"
# in CI the 2machines cells stand for ddp's: the same engine and stages, launched as two machines
ENGINES = ["single", *(["ddp"] if FULL else []), "zero2", "zero3", "fsdp", "2machines"]
ONLY = {
    "single": ["^sft_tldr-pythia-1b", "^rm_tldr-pythia-1b", "^rloo_tldr-pythia-1b", "^remax_tldr-pythia-1b"]
    + ["^ppo_gsm8k", "^dr-grpo_math"],
    # DDP as the suites launch it (multi_gpu.yaml, SFT and reward model): the `2machines` cells below run the same
    # engine and stages as two launchers, and more (`CLEAN_RLHF_REAL_CHECK=all` runs the ddp column too)
    "ddp": ["^sft_tldr-pythia-1b", "^rm_tldr-pythia-1b"],
    # (DPO under ZeRO-3 only in CI: the same DeepSpeed path with its parameters partitioned too; CI time, docs/tests.md)
    "zero2": ["^sft_tldr-pythia-1b", "^rm_tldr-pythia-1b", "^ppo_tldr-pythia-1b", "^grpo_gsm8k"],
    "zero3": ["^ppo_tldr-pythia-1b", "^dpo_tldr-pythia-1b"],
    # FSDP2 (fsdp.yaml; no suite launches it): PPO of the 1B track on the ZeRO-2 SFT and reward models (PPO samples
    # with a submodule of its prepared wrapper, `engines.full_weights`); SFT and the reward model under FSDP2 in `all`
    # (CI time, docs/tests.md; the FSDP2 save is checked below)
    "fsdp": ["^ppo_tldr-pythia-1b"],
    # two machines of one process each (issue 41 item 12): the suites' DDP stages (SFT, reward model) here, RLOO and
    # GRPO on the tiny world in tests/test_two_machines.py (which also compares the numbers with one machine's); DPO
    # as two machines in `all` (CI time, docs/tests.md; DPO runs on two processes under ZeRO-2 and ZeRO-3 above)
    "2machines": ["^sft_tldr-pythia-1b", "^rm_tldr-pythia-1b"],
}
MIN_OK = {"single": 6, "ddp": 2, "zero2": 4, "zero3": 2, "fsdp": 1, "2machines": 2}
# the engines whose stages read the SFT and reward models another engine trained (in CI: zero2's)
READ_FROM = {"zero3": "zero2"} if FULL else {"zero3": "zero2", "fsdp": "zero2"}
MIN_OK_FULL = {"single": 13, "ddp": 2, "zero2": 15, "zero3": 6, "fsdp": 25, "2machines": 15}


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
        also_zero3=["^grpo_gsm8k", "^dr-grpo_gsm8k"] if FULL else ONLY["zero3"],
        read_from=READ_FROM,
    )
    print(table(result, [engine]))
    bad = {name: r for (name, _), r in result.items() if not r.startswith(("ok", "not run"))}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    assert sum(r.startswith("ok") for r in result.values()) >= (MIN_OK_FULL if FULL else MIN_OK)[engine]


def trained_and_saved(tmp_path, config: str, check: str, engine: str) -> dict:
    """Launches `tests/<check>` (one step, then `save_model`) on a small Pythia-shaped model under `config` with two
    processes; asserts the saved model/ reloads equal to the trained weights the check wrote (and that they moved), and
    returns the check's result.json."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = build_model(tmp_path / "pythia", PYTHIA, str(ASSETS / "tokenizers" / "pythia"))
    cmd = ["accelerate", "launch", "--config_file", config, "--num_processes", "2", check, str(model), str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**env_for(engine), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trained = load_file(tmp_path / "trained.safetensors")
    reloaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "model").named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    assert set(trained) == set(reloaded)
    for k, v in trained.items():
        assert torch.equal(reloaded[k].to(v.dtype), v), k
    assert any(not torch.equal(initial[k].to(v.dtype), v) for k, v in trained.items())
    return json.loads((tmp_path / "result.json").read_text())


def test_a_zero3_model_reloads_equal_to_its_trained_weights(tmp_path):
    info = trained_and_saved(
        tmp_path, "benchmark/accelerate_configs/deepspeed_zero3.yaml", "tests/zero3_save_check.py", "zero3"
    )
    assert info["zero_stage"] == 3 and info["processes"] == 2
    assert info["partitioned"] > 0  # the trained module held only shards of its weights: the save had to gather them


def test_fsdp_shards_the_model_and_its_save_reloads_equal_to_the_trained_weights(tmp_path):
    """Under fsdp.yaml on CPU the engine is FSDP2 over both processes (accelerate alone would leave it at
    DistributedType.NO: two unrelated processes that each train alone, and still exit 0), and `save_model` gathers
    the shards into the trained weights."""
    info = trained_and_saved(tmp_path, "benchmark/accelerate_configs/fsdp.yaml", "tests/fsdp_save_check.py", "fsdp")
    assert info["distributed_type"] == "DistributedType.FSDP" and info["processes"] == 2, info
    assert info["processes_counted"] == 2 and info["sharded"], info  # collectives reach both processes
    assert info["shards"] > 0, info  # each rank held only shards of the weights: the save had to gather them
