"""Compare learning curves across runs: `python -m benchmark.compare RUN_DIR... [--metric eval/gold_reward]`.

Reads `metrics.jsonl` of any set of run directories (and, when asked with `--wandb-project` and online, wandb
runs), groups runs by algorithm (the run name without its `__<seed>` suffix), aggregates the seeds of each group,
and writes:
  * a PNG with the metric against episodes and against wall-clock time: per group the mean over seeds with a
    95% bootstrap confidence band;
  * a markdown table of final values: mean, 95% bootstrap CI of the mean, and the interquartile mean (IQM, the
    mean of the middle 50% of runs, as recommended by Agarwal et al. 2021, "Deep RL at the Edge of the
    Statistical Precipice" / rliable).
A run whose metrics file is missing or has corrupt lines is reported; corrupt lines are skipped, and a run with
no value of the metric is left out of its group. Works offline, without any account.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Run:
    name: str
    group: str
    rows: list[dict]
    problems: list[str] = field(default_factory=list)

    def curve(self, metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
        points = [(r[x], r[metric]) for r in self.rows if metric in r and x in r and _finite(r[metric])]
        points.sort(key=lambda p: p[0])
        return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def group_name(run_name: str) -> str:
    """`ppo_tiny-tldr__2` -> `ppo_tiny-tldr`: runs that differ only by seed form one group."""
    return re.sub(r"__\d+$", "", run_name)


def read_run(run_dir: Path) -> Run:
    """A run's metrics rows; unreadable lines are skipped and reported in `problems`."""
    run = Run(name=run_dir.name, group=group_name(run_dir.name), rows=[])
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        run.problems.append(f"{run_dir}: no metrics.jsonl")
        return run
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            run.problems.append(f"{path}:{i}: corrupt line skipped ({line[:40]!r})")
            continue
        if not isinstance(row, dict):
            run.problems.append(f"{path}:{i}: not a JSON object, skipped")
            continue
        run.rows.append(row)
    return run


def read_wandb_runs(project: str, entity: str | None) -> list[Run]:
    """Runs of a wandb project, through the public API (needs network and WANDB_API_KEY from the environment)."""
    import wandb

    api = wandb.Api()
    runs = []
    for r in api.runs(f"{entity}/{project}" if entity else project):
        runs.append(Run(name=r.name, group=group_name(r.name), rows=[dict(row) for row in r.scan_history()]))
    return runs


def bootstrap_ci(values: np.ndarray, n_resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of `values`."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return float(values[0]), float(values[0])
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(n_resamples, len(values)))].mean(axis=1)
    lo, hi = np.percentile(means, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def iqm(values: np.ndarray) -> float:
    """Interquartile mean: drop the lowest and highest 25% of the values (rounded down), average the rest."""
    values = np.sort(np.asarray(values, dtype=float))
    k = int(math.floor(0.25 * len(values)))
    return float(values[k : len(values) - k].mean())


def aggregate_curves(curves: list[tuple[np.ndarray, np.ndarray]], n_points: int = 50) -> dict[str, np.ndarray]:
    """Mean and 95% bootstrap band of several curves on a common grid, over the x range all of them cover
    (each curve is linearly interpolated)."""
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    grid = np.linspace(lo, hi, n_points) if hi > lo else np.array([lo])
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    bands = np.array([bootstrap_ci(ys[:, j]) for j in range(len(grid))])
    return {"x": grid, "mean": ys.mean(axis=0), "low": bands[:, 0], "high": bands[:, 1]}


def summarize(runs: list[Run], metric: str) -> list[dict]:
    """Final value (last logged) of `metric` per run, aggregated per group."""
    finals: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        _, ys = run.curve(metric, "episode" if any("episode" in r for r in run.rows) else "step")
        if len(ys):
            finals[run.group].append(float(ys[-1]))
    table = []
    for group, values in sorted(finals.items()):
        values = np.array(values)
        low, high = bootstrap_ci(values)
        table.append({"group": group, "seeds": len(values), "mean": float(values.mean()), "low": low, "high": high, "iqm": iqm(values)})
    return table


def markdown_table(table: list[dict], metric: str) -> str:
    lines = [f"| algorithm | seeds | final {metric} (mean) | 95% CI | IQM |", "| --- | --- | --- | --- | --- |"]
    for t in table:
        lines.append(f"| {t['group']} | {t['seeds']} | {t['mean']:.3f} | [{t['low']:.3f}, {t['high']:.3f}] | {t['iqm']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], metric: str, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    by_group: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_group[run.group].append(run)
    for ax, x in zip(axes, ("episode", "time")):
        for group, members in sorted(by_group.items()):
            curves = [c for c in (m.curve(metric, x) for m in members) if len(c[0]) > 0]
            if not curves:
                continue
            agg = aggregate_curves(curves)
            ax.plot(agg["x"], agg["mean"], label=f"{group} ({len(curves)} seeds)")
            ax.fill_between(agg["x"], agg["low"], agg["high"], alpha=0.2)
        ax.set_xlabel("episodes" if x == "episode" else "wall-clock seconds")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--metric", default="eval/gold_reward", help="metric to compare")
    parser.add_argument("--out", default="runs/compare", help="output prefix: writes OUT.png and OUT.md")
    parser.add_argument("--wandb-project", default=None, help="also read the runs of this wandb project (online)")
    parser.add_argument("--wandb-entity", default=None, help="wandb entity of that project")
    a = parser.parse_args(argv)
    runs = [read_run(Path(p)) for p in a.runs]
    if a.wandb_project:
        runs += read_wandb_runs(a.wandb_project, a.wandb_entity)
    for run in runs:
        for problem in run.problems:
            print(f"warning: {problem}", file=sys.stderr)
    usable = [r for r in runs if any(a.metric in row for row in r.rows)]
    for r in runs:
        if r not in usable:
            print(f"warning: {r.name} has no value of {a.metric}; left out", file=sys.stderr)
    if not usable:
        print(f"error: no run has the metric {a.metric}", file=sys.stderr)
        return 1
    table = summarize(usable, a.metric)
    out = Path(a.out)
    plot(usable, a.metric, out.with_suffix(".png"))
    md = markdown_table(table, a.metric)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
