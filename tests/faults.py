"""Shared by the fault tests: run a script as a user would, stop it part way with a signal, resume it, and compare
the run with an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
VOLATILE = ("time", "perf/")  # wall-clock figures differ between any two runs


def script_cmd(script: str, *flags: str) -> list[str]:
    return [sys.executable, str(REPO / f"{script}.py"), *flags]


def env() -> dict:
    return {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env())
    assert out.returncode == 0, f"{cmd} failed:\n{out.stderr[-3000:]}"
    return out


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stop_part_way(
    cmd: list[str], run_dir: Path, after_step: int, sig: int = signal.SIGTERM, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Starts `cmd`, waits for a metrics row of `after_step` or later, sends `sig` and waits for the exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env())
    start = time.time()
    while not any(r["step"] >= after_step for r in metric_rows(run_dir)):
        assert proc.poll() is None, f"{cmd} ended before step {after_step}:\n{proc.stderr.read()[-3000:]}"
        assert time.time() - start < timeout, f"no step {after_step} within {timeout} s"
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def assert_same_run(resumed: Path, reference: Path, tolerance: float = 0.0) -> None:
    """The resumed run's metrics (wall-clock figures aside) and final weights equal the uninterrupted run's."""
    got, want = comparable(metric_rows(resumed)), comparable(metric_rows(reference))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g, w)
        for k in w:
            assert abs(g[k] - w[k]) <= tolerance * max(1.0, abs(w[k])), f"step {w['step']} {k}: {g[k]} != {w[k]}"
    a, b = load_file(resumed / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tolerance, rtol=tolerance)
    assert (
        json.loads((resumed / "done.json").read_text())["step"]
        == json.loads((reference / "done.json").read_text())["step"]
    )


def check_stopped(out: subprocess.CompletedProcess, run_dir: Path, sig: int = signal.SIGTERM) -> None:
    """A stop by `sig`: the signal's exit code, one line saying how to continue, a checkpoint, no end marker."""
    assert out.returncode == 128 + sig, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"stopped by {signal.Signals(sig).name} after step" in out.stderr and "--resume" in out.stderr
    assert (run_dir / "checkpoint" / "state.json").exists() and not (run_dir / "done.json").exists()


def check_non_finite_stop(message: str, run_dir: Path, learning_rate: str, unit: str = "update") -> None:
    """A run stopped by a non-finite update: one line naming the update, the learning rate and the last checkpoint,
    whose weights it left finite and as they were; no done.json. Its advice is a new run (--overwrite)."""
    assert message.startswith("error: non-finite") and f"lower --learning-rate (now {learning_rate})" in message
    assert "then start over with --overwrite" in message, message
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert f"at {unit} {state['step'] + 1}:" in message
    assert f"the last checkpoint, after step {state['step']}, stays in {run_dir / 'checkpoint'}" in message
    assert not (run_dir / "done.json").exists()
    weights = load_file(run_dir / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
