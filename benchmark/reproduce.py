"""Does this install reproduce the library? `python -m benchmark.reproduce [RUNS_DIR]`, run after the main job.

Different CPUs round differently, and RL turns a last-digit difference into another trajectory (one seed of one commit
ends far apart on two hosts: issue 57). So a run is not checked against
our digits but against the spread of the library's own runs of the same command (benchmark/reference_runs/): seeds of
the whole pipeline (each its own SFT and reward model) and, where shipped, both rounding regimes (`--rounding`).

For each finished run of RUNS_DIR (default `runs`) whose group (its name without `__<seed>`) has shipped runs of the
same command (`benchmark.reference.budget`: seed, run name and threads aside) and budget (the main job's, or the
full presets' where it started from full-budget models: `reference.run_budgets`), two numbers of its headline
metric (`eval/gold_reward`, else `eval/accuracy`) are checked against the band of the n shipped runs:
  final  the last evaluation;
  curve  the area under its evaluation curve over the shipped runs' common span of episodes, divided by that span
         (`benchmark.curves.area_under_curve`: the curve's mean value, so that a run that learns later differs);
and the band is a 95% prediction interval for one more run, mean +- t(0.975, n-1) * sd * sqrt(1 + 1/n), widened to at
least +-TOLERANCE (a run whose seeds all reach the judge's ceiling has sd 0; one evaluation prompt of 200 is 0.005).
A group with fewer than MIN_REFERENCE runs of the command is not judged (said so). One line per run, then one verdict:
`reproduces the library: yes`, `no, these runs differ: ...`, or `unknown` when no run could be judged. Exit code 0 for
yes, 1 for no, 2 for unknown. Bad input (no finished run, no run of a shipped group, a damaged data file) is one
`error:` line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmark import reference
from benchmark.curves import area_under_curve, group_name, read_run

MIN_REFERENCE = 3
"""shipped runs of a command below which no band is drawn: two points say nothing of a spread"""
TOLERANCE = 0.03
"""the least half-width of a band, in the metric's unit (gold reward and accuracy are in [0, 1])"""
METRICS = ("eval/gold_reward", "eval/accuracy")
"""the headline metric of a group: the first of these its shipped runs log"""
# t(0.975, df) for df = 1..30 (two-sided 95%); above 30 the normal's 1.96 is within 4%
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T975 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


class ReproduceError(Exception):
    """Input that cannot be judged at all; its message is the `error:` line."""


def prediction_band(values: list[float]) -> tuple[float, float]:
    """The 95% prediction interval of one more draw from the distribution `values` came from (a normal one with
    unknown mean and variance), at least +-TOLERANCE around their mean."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    t = T975[n - 2] if n - 2 < len(T975) else 1.96
    half = max(t * float(x.std(ddof=1)) * math.sqrt(1 + 1 / n), TOLERANCE)
    return float(x.mean()) - half, float(x.mean()) + half


@dataclass
class Verdict:
    run: str
    state: str
    """"ok", "differs" or "not judged" """
    line: str


def curve(rows: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["episode"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float)) and "episode" in r]
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def judge(run_dir: Path, shipped: dict[str, list[dict]]) -> Verdict:
    """One finished run against the shipped runs of its group and command."""
    run = read_run(run_dir)
    name, group = run.name, group_name(run.name)
    argv = json.loads((run_dir / "done.json").read_text()).get("argv")
    full = reference.run_budgets(run_dir) == {"full"}  # RLOO from a full-budget SFT policy is not the main job's
    same = [
        r
        for r in shipped.get(group, [])
        if reference.budget(r.get("argv")) == reference.budget(argv) and reference.full_only(r) == full
    ]
    if len(same) < MIN_REFERENCE:
        other = len(shipped.get(group, [])) - len(same)
        why = f"{len(same)} shipped run(s) of its command" + (f" ({other} of another command)" if other else "")
        return Verdict(name, "not judged", f"{name}: not judged: {why}, fewer than {MIN_REFERENCE}")
    metric = next((m for m in METRICS if any(m in row for r in same for row in r["rows"])), None)
    mine = curve(run.rows, metric) if metric else (np.array([]), np.array([]))
    if metric is None or not len(mine[0]):
        return Verdict(name, "not judged", f"{name}: not judged: it and its reference share no {' or '.join(METRICS)}")
    refs = [curve(r["rows"], metric) for r in same]
    lo, hi = max(c[0][0] for c in refs), min(c[0][-1] for c in refs)
    checks = {"final": ([float(c[1][-1]) for c in refs], float(mine[1][-1]))}
    if hi > lo and mine[0][0] <= lo and mine[0][-1] >= hi:  # the curve covers the shipped span
        checks["curve"] = ([area_under_curve(*c, lo, hi) for c in refs], area_under_curve(*mine, lo, hi))
    out = []
    for what, (values, value) in checks.items():
        low, high = prediction_band(values)
        inside = math.isfinite(value) and low <= value <= high
        out.append((inside, f"{what} {value:.3f} {'in' if inside else 'OUTSIDE'} [{low:.3f}, {high:.3f}]"))
    state = "ok" if all(ok for ok, _ in out) else "differs"
    shown = "; ".join(text for _, text in out)
    return Verdict(name, state, f"{name}: {state}: {metric} {shown} ({len(same)} shipped runs)")


def reproduce(runs_dir: Path, data_dir: Path | None = None) -> tuple[list[Verdict], str, int]:
    """Every finished run of `runs_dir` with a shipped group, judged; the verdict line and its exit code."""
    if not runs_dir.is_dir():
        raise ReproduceError(
            f"{runs_dir} is not a folder of runs (run the main job first: python -m benchmark.run quick)"
        )
    finished = sorted(p.parent for p in runs_dir.glob("*/done.json") if p.is_file())
    if not finished:
        raise ReproduceError(f"{runs_dir} holds no finished run (a run directory with its done.json)")
    shipped: dict[str, list[dict]] = {}
    for path in sorted(Path(data_dir or reference.DIR).glob("*.jsonl.gz")):
        for r in reference.read_group(path):
            shipped.setdefault(group_name(r["name"]), []).append(r)
    mine = [d for d in finished if group_name(d.name) in shipped]
    if not mine:
        raise ReproduceError(
            f"no run of {runs_dir} is of a shipped group (shipped: {', '.join(sorted(shipped)[:4])}, ...; python -m "
            "benchmark.reference list): check the runs of the README's main job (python -m benchmark.run quick)"
        )
    verdicts = [judge(d, shipped) for d in mine]
    differ = [v.run for v in verdicts if v.state == "differs"]
    judged = [v for v in verdicts if v.state != "not judged"]
    if differ:
        return verdicts, f"reproduces the library: no, these runs differ: {', '.join(differ)}", 1
    if not judged:
        return verdicts, "reproduces the library: unknown (no run has enough shipped runs of its command)", 2
    return verdicts, f"reproduces the library: yes ({len(judged)} runs inside the shipped bands)", 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", nargs="?", default="runs", help="the runs to check (default: runs)")
    parser.add_argument("--data", default=None, help="the reference data (default: benchmark/reference_runs)")
    a = parser.parse_args(argv)
    try:
        verdicts, line, code = reproduce(Path(a.runs_dir), Path(a.data) if a.data else None)
    except (ReproduceError, reference.ReferenceError) as e:
        raise SystemExit(f"error: {e}") from None
    print("\n".join([*(v.line for v in verdicts), line]))
    return code


if __name__ == "__main__":
    sys.exit(main())
