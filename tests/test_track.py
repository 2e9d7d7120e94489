"""`--track` (issue 43): every script mirrors metrics.jsonl to Weights & Biases. With wandb 0.31 all seven crashed at
start (`wandb.util.generate_id` is gone); the run id is now made by `runs.start_wandb`. A stand-in `wandb` package
(first on PYTHONPATH) records what a script hands to wandb, so each script's rows, names and steps are checked against
its metrics.jsonl; one run goes through the real wandb, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bad_inputs import World, base_flags
from tests.faults import stop_part_way

REPO = Path(__file__).resolve().parent.parent

FAKE_WANDB = """
import json, os
def _write(**record):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")
class _Run:
    def log(self, row, step=None):
        _write(kind="log", row=row, step=step)
    def finish(self):
        _write(kind="finish")
def init(**kw):
    if os.environ.get("FAKE_WANDB_FAIL"):
        raise RuntimeError("api_key not configured (no-tty).\\n  call wandb.login(key=[your_api_key])")
    _write(kind="init", id=kw["id"], resume=kw["resume"], name=kw["name"], config=sorted(kw["config"]))
    return _Run()
"""

SHORT = {  # base_flags' runs, shortened where a preset's own budget is long
    "grpo_math": ["--total-steps", "2", "--questions-per-device", "2", "--num-generations", "4"]
    + ["--micro-batch-size", "4", "--pass-k", "0", "--eval-every", "1"],
    "dpo": ["--per-device-train-batch-size", "8", "--num-eval-examples", "4", "--num-eval-pairs", "8"],
}


def _fake_env(tmp_path) -> dict:
    """PYTHONPATH with the stand-in wandb first, and the file it writes to."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True, exist_ok=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    return {"PYTHONPATH": f"{fake}:{REPO}", "FAKE_WANDB_LOG": str(tmp_path / "wandb.jsonl")}


def _run(cmd, tmp_path, **env):
    env = {**os.environ, **_fake_env(tmp_path), **env}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _records(tmp_path) -> list[dict]:
    path = tmp_path / "wandb.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# the mirror is tracking.py's, the rows each script's: SFT (evaluations), PPO (the most metrics a row), GRPO (pass@k
# rows) and DPO (offline and online rows); reward_model, rloo and remax log as these do (CI time, docs/tests.md)
@pytest.mark.parametrize("script", ["sft", "ppo_rlhf", "grpo_math", "dpo"])
def test_track_mirrors_every_metrics_row(assets, tmp_path, script):
    w = World(assets=assets, tmp=tmp_path, rm=tmp_path)  # (no case here uses the reward model)
    cmd = [sys.executable, str(REPO / f"{script}.py"), *base_flags(script, w), *SHORT.get(script, []), "--track"]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "bad"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = _records(tmp_path)
    assert [r["kind"] for r in records] == ["init"] + ["log"] * len(rows) + ["finish"]
    assert records[0]["id"] == (run_dir / "wandb_id").read_text() and records[0]["name"] == "bad"
    assert records[0]["config"] == sorted(json.loads((run_dir / "config.json").read_text()))
    assert [(r["row"], r["step"]) for r in records[1:-1]] == [(row, row["step"]) for row in rows]
    # issue 43 item 6: the last line a run prints names its directory and its model
    assert proc.stdout.strip().splitlines()[-1] == f"run finished: {run_dir} (model: {run_dir / 'model'})"
    # issue 43: every run records what produced it (its git commit, library versions and host)
    started = json.loads((run_dir / "provenance.json").read_text())["started"]
    assert len(started["git"]["commit"]) == 40 and started["versions"]["torch"] == torch.__version__
    assert started["host"]["cores"] == os.cpu_count() and started["host"]["cpu"]


def test_track_resume_continues_the_same_wandb_run(assets, tmp_path, monkeypatch):
    w = World(assets=assets, tmp=tmp_path, rm=tmp_path)
    flags = [*base_flags("sft", w), "--max-train-samples", "64", "--save-every", "1", "--track"]
    cmd = [sys.executable, str(REPO / "sft.py"), *flags]
    run_dir = tmp_path / "runs" / "bad"
    for name, value in _fake_env(tmp_path).items():  # `stop_part_way` starts the command with this environment
        monkeypatch.setenv(name, value)
    stopped = stop_part_way(cmd, run_dir, 2)
    assert stopped.returncode != 0 and (run_dir / "checkpoint").exists(), stopped.stderr[-2000:]
    proc = _run([*cmd, "--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inits = [r for r in _records(tmp_path) if r["kind"] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == (run_dir / "wandb_id").read_text()
    assert all(r["resume"] == "allow" for r in inits)
    record = json.loads((run_dir / "provenance.json").read_text())  # what started it, and what resumed it
    assert len(record["resumed"]) == 1 and record["resumed"][0]["git"] == record["started"]["git"]


def test_a_tracking_failure_at_start_is_one_line_and_leaves_no_directory(assets, tmp_path):
    cmd = [sys.executable, str(REPO / "sft.py"), *base_flags("sft", World(assets, tmp_path, tmp_path)), "--track"]
    proc = _run(cmd, tmp_path, FAKE_WANDB_FAIL="1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --track: wandb did not start (api_key not configured (no-tty). call wandb.login")
    assert not (tmp_path / "runs" / "bad").exists()  # the next try needs no --overwrite
    again = _run(cmd, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]


def test_track_with_the_real_wandb_offline(assets, tmp_path):
    """The installed wandb (pyproject's tested range), offline: the run starts, logs and finishes."""
    pytest.importorskip("wandb")
    cmd = [sys.executable, str(REPO / "sft.py"), *base_flags("sft", World(assets, tmp_path, tmp_path)), "--track"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = (tmp_path / "runs" / "bad" / "wandb_id").read_text()
    assert list((tmp_path / "runs" / "bad" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
