"""The offline failure mode, and two-process data parallel runs on CPU (gloo) through accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import free_port, launch_cmd

REPO = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_OFFLINE", None)
    # An endpoint that refuses connections at once stands for "no network", here and on machines that have one.
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    env["HF_HOME"] = extra.pop("hf_home")
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "argv, missing, flag",
    [
        (["sft.py", "tldr-pythia-1b"], "EleutherAI/pythia-1b-deduped", "--model-name-or-path"),
        (["reward_model.py", "tldr-pythia-1b"], "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr", "--sft-model-path"),
        (
            ["sft.py", "tiny-tldr", "--dataset-name-or-path", "someone/no-such-dataset"],
            "someone/no-such-dataset",
            "--dataset-name-or-path",
        ),
    ],
)
def test_unreachable_hub_fails_fast_with_a_clear_message(assets, tmp_path, argv, missing, flag):
    args = [sys.executable, str(REPO / argv[0]), *argv[1:], "--output-dir", str(tmp_path / "runs")]
    if argv[1] == "tiny-tldr":
        args += ["--model-name-or-path", str(assets / "models" / "tiny-neox")]
    env = _env(hf_home=str(tmp_path / "hf"))
    t0 = time.time()  # the same script's start-up (imports, parsing), measured now: tests share the CPU
    subprocess.run([sys.executable, str(REPO / argv[0]), "--help"], cwd=tmp_path, env=env, capture_output=True)
    startup, t0 = time.time() - t0, time.time()
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    assert elapsed < startup + 10, f"took {elapsed:.1f}s to fail, {elapsed - startup:.1f}s beyond its start-up"
    assert missing in proc.stderr and flag in proc.stderr and "local" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr  # a message for a person, not a stack trace


def _launch(
    args: list[str], cwd: Path, hf_home: Path, nproc: int = 2, timeout: int = 300
) -> subprocess.CompletedProcess:
    cmd = launch_cmd(*args, nproc=nproc)
    proc = subprocess.run(cmd, cwd=cwd, env=_env(hf_home=str(hf_home)), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_process_data_parallel_step_gives_identical_weights(assets, tmp_path):
    out = tmp_path / "ddp"
    # a script path, not `-m module`: accelerate's module mode does not set up the process group here
    proc = _launch([str(REPO / "benchmark" / "tools" / "ddp_check.py"), str(out), str(assets)], REPO, tmp_path / "hf")
    assert "2 process(es), backend gloo" in proc.stdout + proc.stderr
    r0, r1 = load_file(out / "rank0_of2.safetensors"), load_file(out / "rank1_of2.safetensors")
    initial = load_file(assets / "models" / "tiny-neox" / "model.safetensors")
    assert r0.keys() == r1.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks differ on {k}"
    assert any(not torch.allclose(r0[k], initial[k]) for k in r0 if k in initial), "the weights did not move"
    # the same three steps in one process on the union batch give the same weights
    subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "tools" / "ddp_check.py"), str(out), str(assets)],
        cwd=REPO,
        env=_env(hf_home=str(tmp_path / "hf")),
        check=True,
        capture_output=True,
        timeout=300,
    )
    single = load_file(out / "rank0_of1.safetensors")
    for k in r0:
        torch.testing.assert_close(r0[k], single[k], atol=1e-6, rtol=1e-5)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_and_reward_model_run_on_two_processes(assets, tmp_path):
    common = [
        "--output-dir",
        str(tmp_path / "runs"),
        "--per-device-train-batch-size",
        "8",
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--per-device-eval-batch-size",
        "4",
    ]
    _launch(
        [
            str(REPO / "sft.py"),
            "tiny-tldr",
            "--run-name",
            "sft2",
            "--model-name-or-path",
            str(assets / "models" / "tiny-neox"),
            "--dataset-name-or-path",
            str(assets / "tiny-tldr" / "sft"),
            "--max-train-samples",
            "64",
            "--num-eval-examples",
            "8",
            "--num-train-epochs",
            "1",
            *common,
        ],
        tmp_path,
        tmp_path / "hf",
    )
    rows = _rows(tmp_path / "runs" / "sft2" / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [8 * 2 * (i + 1) for i in range(4)]  # 64 rows = 4 steps of 2 x 8
    assert "eval/gold_reward" in rows[-1]
    assert (tmp_path / "runs" / "sft2" / "model" / "model.safetensors").exists()

    _launch(
        [
            str(REPO / "reward_model.py"),
            "tiny-tldr",
            "--run-name",
            "rm2",
            "--sft-model-path",
            str(tmp_path / "runs" / "sft2" / "model"),
            "--dataset-name-or-path",
            str(assets / "tiny-tldr" / "preference"),
            "--norm-dataset-name-or-path",
            str(assets / "tiny-tldr" / "sft"),
            "--max-train-samples",
            "32",
            "--num-eval-examples",
            "16",
            "--num-norm-examples",
            "20",
            *common,
        ],
        tmp_path,
        tmp_path / "hf",
    )
    rows = _rows(tmp_path / "runs" / "rm2" / "metrics.jsonl")
    assert abs(rows[-1]["eval/reference_reward_mean"]) < 1e-4
    assert "eval/accuracy" in [k for r in rows for k in r]


@pytest.mark.parametrize(
    "engine, dtype", [("single", "float32"), ("single", "bfloat16"), ("ddp", "float32"), ("zero2", "float32")]
)
def test_saved_weights_are_the_trained_weights_in_the_loaded_dtype_under_every_engine(assets, tmp_path, engine, dtype):
    """`save_model` writes the dtype the model was loaded in (`--dtype`) whatever the engine. DDP under bf16 mixed
    precision (autocast) trains float32 weights and saves them. DeepSpeed ZeRO-2 under bf16 trains a bf16 copy and keeps
    float32 master weights in its optimizer: it saved the bf16 copy (issue 41 item 11), now the masters, equal to what
    DeepSpeed's own checkpoint gives through `zero_to_fp32`, and rounding to the bf16 copy."""
    if engine == "zero2":
        pytest.importorskip("deepspeed")
    model_dir, out = assets / "models" / "tiny-llama", tmp_path / "out"
    script = [str(REPO / "tests" / "save_dtype_check.py"), str(model_dir), str(out), dtype]
    env = _env(hf_home=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if engine == "single":
        cmd = [sys.executable, *script]
    elif engine == "ddp":
        cmd = launch_cmd(*script)
        cmd[cmd.index("--mixed_precision") + 1] = "bf16"
    else:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator (gloo collectives)
        config = REPO / "benchmark" / "accelerate_configs" / "deepspeed_zero2.yaml"  # bf16 mixed precision
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd = [*launch, "--num_processes", "2", "--main_process_port", str(free_port()), *script]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((out / "result.json").read_text())
    assert (info["processes"], info["deepspeed"]) == (1 if engine == "single" else 2, engine == "zero2")
    saved, trained = load_file(out / "model" / "model.safetensors"), load_file(out / "trained.safetensors")
    module, initial = load_file(out / "module.safetensors"), load_file(model_dir / "model.safetensors")
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == dtype
    assert {v.dtype for v in saved.values()} == {getattr(torch, dtype)}
    assert trained.keys() <= saved.keys() and len(trained) > 0
    for k, v in trained.items():  # the trained weights, bit for bit (DeepSpeed: its float32 masters)
        assert torch.equal(saved[k], v.to(saved[k].dtype)), k
    assert any(not torch.equal(saved[k].float(), initial[k].float()) for k in trained), "the weights did not move"
    if engine == "zero2":  # the engine held bf16 copies; the masters round to them and carry more precision
        assert info["mixed_precision"] == "bf16" and {v.dtype for v in module.values()} == {torch.bfloat16}
        assert all(torch.equal(saved[k].to(torch.bfloat16), module[k]) for k in trained)
        assert any(not torch.equal(saved[k], saved[k].to(torch.bfloat16).float()) for k in trained)
    if engine == "ddp":
        assert info["mixed_precision"] == "bf16"  # autocast: the weights themselves stay float32
