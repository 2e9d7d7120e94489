"""Run a reproduction suite end to end: `python -m benchmark.run SUITE [--seeds 1 2 3] [--dry-run]`.

Suites:
  tiny        tiny-tldr and tiny-math (CPU, offline): builds the tiny world, then every stage below
  tiny-tldr   SFT -> reward model on tiny-tldr
  tiny-math   SFT -> process reward model on tiny-math

Each stage is one command of an algorithm script, run as a subprocess with its own run directory under
`runs/`. A stage that fails is reported and the suite goes on with the stages that do not depend on it;
a stage that already finished (its `runs/<run_name>/DONE` exists) is skipped when the suite is rerun.
At the end a summary table of each run's final metrics is printed and written to `runs/<suite>_summary.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.assets import ensure_assets
from benchmark.compare import read_run

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Stage:
    run_name: str
    script: str
    preset: str
    extra: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    """run names whose models this stage reads"""

    def command(self, launcher: list[str]) -> list[str]:
        return [*launcher, str(REPO / self.script), self.preset, "--run-name", self.run_name, *self.extra]


def tiny_tldr_stages(seeds: list[int]) -> list[Stage]:
    # SFT and reward model are trained once (seed 1), as in the N+ paper where the RL seeds share them.
    return [
        Stage("sft_tiny-tldr__1", "sft.py", "tiny-tldr"),
        Stage("rm_tiny-tldr__1", "reward_model.py", "tiny-tldr", ["--sft-model-path", "runs/sft_tiny-tldr__1/model"],
              needs=["sft_tiny-tldr__1"]),
    ]


def tiny_math_stages(seeds: list[int]) -> list[Stage]:
    return [
        Stage("sft_tiny-math__1", "sft.py", "tiny-math"),
        Stage("prm_tiny-math__1", "reward_model.py", "tiny-math-prm", ["--sft-model-path", "runs/sft_tiny-math__1/model"],
              needs=["sft_tiny-math__1"]),
    ]


SUITES = {
    "tiny-tldr": tiny_tldr_stages,
    "tiny-math": tiny_math_stages,
    "tiny": lambda seeds: tiny_tldr_stages(seeds) + tiny_math_stages(seeds),
}


def final_metrics(run_dir: Path) -> dict:
    """The last value of every metric in a run's metrics.jsonl; unreadable lines are skipped."""
    last: dict = {}
    for row in read_run(run_dir).rows:
        last.update(row)
    return last


def run_suite(suite: str, seeds: list[int], workdir: Path = Path("."), dry_run: bool = False,
              launcher: list[str] | None = None) -> dict[str, str]:
    """Run the stages of `suite` with `workdir` as the working directory (runs land in workdir/runs)."""
    launcher = launcher or [sys.executable]
    runs_dir = Path(workdir) / "runs"
    stages = SUITES[suite](seeds)
    status: dict[str, str] = {}
    if not dry_run:
        ensure_assets(runs_dir / "assets")
    for stage in stages:
        cmd = stage.command(launcher)
        done = runs_dir / stage.run_name / "DONE"
        if dry_run:
            print(shlex.join(cmd))
            status[stage.run_name] = "dry-run"
            continue
        if done.exists():
            print(f"[skip] {stage.run_name}: finished earlier")
            status[stage.run_name] = "skipped"
            continue
        failed_deps = [d for d in stage.needs if status.get(d) == "failed"]
        if failed_deps:
            print(f"[skip] {stage.run_name}: depends on failed {failed_deps}")
            status[stage.run_name] = "blocked"
            continue
        print(f"[run] {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        log = runs_dir / f"{stage.run_name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.call(cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")})
        if rc == 0:
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps({"seconds": round(time.time() - t0, 1), "command": cmd}) + "\n")
            status[stage.run_name] = "ok"
            print(f"[ok] {stage.run_name} in {time.time() - t0:.0f}s")
        else:
            status[stage.run_name] = "failed"
            print(f"[FAILED] {stage.run_name} (exit {rc}); last lines of {log}:")
            print("\n".join(log.read_text().splitlines()[-5:]))
    if not dry_run:
        lines = [f"# {suite} suite", "", "| run | status | final metrics |", "| --- | --- | --- |"]
        for stage in stages:
            m = final_metrics(runs_dir / stage.run_name)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in m.items() if k.startswith("eval/") and isinstance(v, float) and "confidence" not in k)
            lines.append(f"| {stage.run_name} | {status[stage.run_name]} | {shown} |")
        summary = "\n".join(lines) + "\n"
        (runs_dir / f"{suite}_summary.md").write_text(summary)
        print(summary)
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the RL stages")
    parser.add_argument("--workdir", default=".", help="working directory; runs are written to WORKDIR/runs")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = parser.parse_args()
    status = run_suite(a.suite, a.seeds, Path(a.workdir), a.dry_run)
    sys.exit(1 if any(s == "failed" for s in status.values()) else 0)


if __name__ == "__main__":
    main()
