"""The pieces every comparison of runs is made of (`python -m benchmark.compare`, the results tables, the frontier,
the study, the reference bands): a run's files read through the one checked reader (`Run`, `read_run`, `read_runs`:
benchmark/runfiles.py), which runs count (`finished_runs`, `keep_apart`), what may differ between them
(`provenance_differences`, `mixed_scripts`), the statistics (bootstrap intervals, IQM, AUC, episodes to a threshold,
separations and the smallest detectable difference), the markdown table and the figure. benchmark/compare.py's
docstring says what a comparison reports; this module imports no other of benchmark/ but runfiles.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmark import runfiles


@dataclass
class Run:
    name: str
    group: str
    rows: list[dict]
    problems: list[str] = field(default_factory=list)
    finished: bool = True
    """whether the run completed its budget: its done.json exists (run directories) or it is "finished" (wandb)"""
    unfinished_why: str = ""
    provenance: dict | None = None
    """what produced it (provenance.json: git commit, library versions, host); None for a run that predates it"""
    path: Path | None = None
    """the run directory as given (None for a wandb run or a shipped reference run)"""
    reference: bool = False
    """a run of the shipped reference data (benchmark/reference.py): drawn dashed, under the runs compared"""
    done: dict | None = None
    """its done.json (run directories of finished runs), read and checked"""
    argv: list | None = None
    """a shipped reference run's command (its done.json's `argv`), by which `--reference` matches budgets"""

    def x_axis(self) -> str:
        return "episode" if any("episode" in r for r in self.rows) else "step"

    def curve(self, metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
        points = [(r[x], r[metric]) for r in self.rows if metric in r and x in r and _finite(r[metric])]
        points.sort(key=lambda p: p[0])
        return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)

    def final(self, metric: str) -> float | None:
        """The metric at the last row (in episodes, else steps) that holds it, NaN when that value is not a finite
        number (a diverged run: never an earlier value); None when no row holds it."""
        x = self.x_axis()
        points = [(r[x], r[metric]) for r in self.rows if metric in r and isinstance(r.get(x), (int, float))]
        if not points:
            return None
        value = max(enumerate(points), key=lambda p: (p[1][0], p[0]))[1][1]  # the last logged among equal x
        return float(value) if _finite(value) else math.nan


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def group_name(run_name: str) -> str:
    """`ppo_tiny-tldr__2` -> `ppo_tiny-tldr`: runs that differ only by seed form one group."""
    return re.sub(r"__\d+$", "", run_name)


def read_run(run_dir: Path) -> Run:
    """A run's files read and checked by the one reader (`benchmark.runfiles`): its metrics rows, its done.json (an
    object, or it is unfinished) and its provenance. Damage is a `RunFileError`, the tool's one `error:` line: a
    file that is a pipe or a device, bytes that are not UTF-8, a row that is not an object of numbers, an `episode`
    counter that goes back (two runs' rows in one file), a done.json that is not an object, a finished run without
    its metrics.jsonl. A torn last row is dropped and said in `problems` (`warn_problems` prints them)."""
    run = Run(name=run_dir.name, group=group_name(run_dir.name), rows=[], path=run_dir)
    if os.path.lexists(run_dir / "done.json"):
        run.done = runfiles.read_object(run_dir / "done.json")
    else:
        run.finished = False
        run.unfinished_why = "no done.json" + (
            ": its DONE is from an older benchmark.run, which did not check the budget"
            if (run_dir / "DONE").exists()
            else ""
        )
    if os.path.lexists(run_dir / "provenance.json"):
        started = runfiles.read_object(run_dir / "provenance.json").get("started")
        if not isinstance(started, dict):
            raise runfiles.RunFileError(
                f"{run_dir / 'provenance.json'} has no `started` record: {runfiles.WHY['provenance.json']}"
            )
        run.provenance = started
    path = run_dir / "metrics.jsonl"
    if not os.path.lexists(path):
        if run.finished:
            runfiles.read_metrics(path)  # its one line: a finished run's rows are lost
        run.problems.append(f"{run_dir}: no metrics.jsonl")
        return run
    metrics = runfiles.read_metrics(path)
    run.rows = metrics.rows
    if metrics.torn:
        run.problems.append(metrics.torn)
    return run


def warn_problems(runs: list[Run]) -> None:
    """Each run's problems (a torn last row dropped, no metrics.jsonl yet) as `warning:` lines on stderr."""
    for run in runs:
        for problem in run.problems:
            print(f"warning: {problem}", file=sys.stderr)


def select_runs(source, pattern: str) -> list[Run]:
    """The runs whose name matches the glob `pattern` (`rloo_tiny-tldr__*`), from a runs directory (each matching
    directory, read by `read_run`) or from runs already read (a list: the shipped reference data,
    `benchmark.reference.load`), in name order. A hidden directory (`.ppo__1.previous`, a finished run that a rerun
    with --overwrite keeps until it finishes) is not a run: a shell glob skips it, and so does this."""
    if isinstance(source, (str, Path)):
        return [read_run(d) for d in sorted(Path(source).glob(pattern)) if d.is_dir() and not d.name.startswith(".")]
    return sorted((r for r in source if fnmatch.fnmatchcase(r.name, pattern)), key=lambda r: r.name)


def read_wandb_runs(project: str, entity: str | None) -> list[Run]:
    """Runs of a wandb project, through the public API (needs network and WANDB_API_KEY from the environment)."""
    import wandb

    api = wandb.Api()
    runs = []
    for r in api.runs(f"{entity}/{project}" if entity else project):
        runs.append(
            Run(
                name=r.name,
                group=group_name(r.name),
                rows=[dict(row) for row in r.scan_history()],
                finished=r.state == "finished",
                unfinished_why=f"wandb state {r.state!r}",
            )
        )
    return runs


def read_runs(paths: list[Path]) -> list[Run]:
    """The runs of the run directories `paths`, each path that is not one named in a warning on stderr and skipped: a
    file (a log beside the run directories that a shell glob of runs/<group>__* takes), a path that does not exist, a
    directory without metrics.jsonl. The same directory given twice (by its resolved path) is read once. Runs of the
    same name from different folders are different experiments: their groups are split by folder (`keep_apart`)."""
    runs, seen = [], {}
    for p in paths:
        if not p.exists():
            print(f"warning: {p} does not exist; skipped", file=sys.stderr)
        elif p.is_file():
            print(f"warning: {p} is a file, not a run directory; skipped", file=sys.stderr)
        elif not runfiles.is_run_dir(p):
            inside = sum(1 for d in p.iterdir() if runfiles.is_run_dir(d))
            hint = f" (it holds {inside} run directories: pass them, {p}/*)" if inside else ""
            print(f"warning: {p} holds no metrics.jsonl, so it is not a run directory{hint}; skipped", file=sys.stderr)
        elif p.resolve() in seen:
            print(
                f"warning: {p} is the run directory {seen[p.resolve()]} given again (both are {p.resolve()}); "
                "counted once",
                file=sys.stderr,
            )
        else:
            seen[p.resolve()] = p
            runs.append(read_run(p))
    return keep_apart(runs)


def keep_apart(runs: list[Run]) -> list[Run]:
    """Two run directories of the same name in different folders (runs/a/ppo__1, runs/b/ppo__1) are two experiments,
    not two seeds: every group holding such a name is split by folder, "ppo (runs/a)" and "ppo (runs/b)", and its runs
    are named by their paths; a warning names both paths."""
    by_name: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        if r.path is not None:
            by_name[r.name].append(r)
    clashes = {name: rs for name, rs in by_name.items() if len(rs) > 1}
    split = {r.group for rs in clashes.values() for r in rs}
    for name, rs in clashes.items():
        paths = " and ".join(str(r.path) for r in rs)
        print(
            f"warning: two run directories are named {name} ({paths}): different experiments, not seeds of one; "
            f"group {rs[0].group} is kept apart by folder",
            file=sys.stderr,
        )
    for r in runs:
        if r.path is not None and r.group in split:
            r.name, r.group = str(r.path), f"{r.group} ({r.path.parent})"
    return runs


def finished_runs(runs: list[Run]) -> list[Run]:
    """The runs that completed their budget; each other one is named in a warning on stderr."""
    for r in runs:
        if not r.finished:
            print(f"warning: {r.name} did not finish its budget ({r.unfinished_why}); left out", file=sys.stderr)
    return [r for r in runs if r.finished]


NUMERIC_PACKAGES = ("torch", "transformers")
"""the libraries whose version changes a number of these scripts (kernels, model code); the others installed (trl,
deepspeed, wandb, ...) are recorded in provenance.json but do not enter a comparison's warnings"""


def provenance_differences(runs: list[Run]) -> list[str]:
    """One line for each thing that changes a number and that the runs combined here differ in (git commit, the
    version of torch or transformers, the CPU and what sets its rounding, the GPUs): such curves and intervals mix code
    or machines (tiny-math's SFT start moved 0.165 -> 0.225 between two CPUs). Nothing else is warned about (a fork's
    uncommitted file is its own label's script: `mixed_scripts` warns when one label mixes scripts). Runs without
    provenance.json (older ones) are not compared."""
    known = [r for r in runs if r.provenance]
    lines = []
    facts = {
        "git commit": lambda p: (p.get("git") or {}).get("commit"),
        "CPU": lambda p: (p.get("host") or {}).get("cpu"),
        "GPUs": lambda p: ", ".join((p.get("host") or {}).get("gpus") or []) or "none",
    }
    for name in NUMERIC_PACKAGES:
        if any(name in (r.provenance.get("versions") or {}) for r in known):
            facts[name] = lambda p, name=name: (p.get("versions") or {}).get(name)

    def host(p: dict) -> dict:
        return p.get("host") or {}

    rounding = {  # what sets the digits on a CPU (issue 57); not recorded by older runs, which are left out of it
        "CPU vector flags": lambda p: " ".join(host(p)["cpu_flags"]) if host(p).get("cpu_flags") is not None else None,
        "torch CPU capability (rounding regime)": lambda p: host(p).get("cpu_capability"),
        "BLAS": lambda p: host(p).get("blas"),
        "threads per run": lambda p: host(p).get("threads"),
    }
    for what, get in {**facts, **rounding}.items():
        values = defaultdict(list)
        for r in known:
            if what not in rounding or get(r.provenance) is not None:
                values[str(get(r.provenance))].append(r.name)
        if len(values) > 1:
            counts = "; ".join(f"{v}: {len(names)} run(s)" for v, names in sorted(values.items()))
            lines.append(f"the runs differ in {what} ({counts})")
    return lines


def mixed_scripts(runs: list[Run]) -> list[str]:
    """One line for each label whose runs ran scripts of different sha256 (provenance.json's `script`, issue 49): a
    copy edited between seeds, or two variants under one name, are not seeds of one algorithm."""
    hashes = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.provenance and (r.provenance.get("script") or {}).get("sha256"):
            hashes[r.group][r.provenance["script"]["sha256"][:12]].append(r.name)
    return [
        f"{group} groups runs of different scripts (sha256 "
        + "; ".join(f"{h}: {', '.join(n)}" for h, n in by.items())
        + ")"
        for group, by in sorted(hashes.items())
        if len(by) > 1
    ]


def bootstrap_ci(
    values: np.ndarray, n_resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
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


MIN_SEEDS_FOR_CI = 3
"""below this many seeds an interval is not a 95% CI: the seeds' values are shown instead"""


def band_kind(n_seeds: int) -> str | None:
    """What the band around a mean of `n_seeds` curves is: "95% CI" (bootstrap), "min-max" (2 seeds) or None (1)."""
    return "95% CI" if n_seeds >= MIN_SEEDS_FOR_CI else "min-max" if n_seeds == 2 else None


def aggregate_curves(curves: list[tuple[np.ndarray, np.ndarray]], n_points: int | None = None) -> dict:
    """Mean and band of several curves on a common grid, over the x range all of them cover (each curve is linearly
    interpolated). The grid is every x at which one of the curves was logged inside that range, so that a marker on
    the mean stands where the runs evaluated (seeds evaluate at the same episodes); `n_points` asks for an even grid
    instead. `band` says what low and high are (`band_kind`): the 95% bootstrap band of the mean with 3 or more
    curves, the min and max of 2, the curve itself for 1."""
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    if n_points is not None:
        grid = np.linspace(lo, hi, n_points) if hi > lo else np.array([lo])
    else:
        xs = np.unique(np.concatenate([x for x, _ in curves]))
        grid = xs[(xs >= lo) & (xs <= hi)]
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    band = band_kind(len(curves))
    if band == "95% CI":
        bands = np.array([bootstrap_ci(ys[:, j]) for j in range(len(grid))])
        low, high = bands[:, 0], bands[:, 1]
    else:
        low, high = ys.min(axis=0), ys.max(axis=0)
    return {"x": grid, "mean": ys.mean(axis=0), "low": low, "high": high, "band": band, "seeds": len(curves)}


def diverged_runs(runs: list[Run], metric: str) -> list[Run]:
    """The runs whose final value of `metric` (`Run.final`) is NaN or inf."""
    return [r for r in runs if r.final(metric) is not None and math.isnan(r.final(metric))]


def common_span(runs: list[Run], metric: str, x: str = "episode") -> tuple[float, float] | None:
    """The range of `x` that every run's curve of `metric` covers (the latest first point, the earliest last one): the
    span over which runs of different budgets are compared. None when no run has a point, or the curves do not overlap
    (one run's last evaluation comes before another's first)."""
    curves = [c for c in (r.curve(metric, x) for r in runs) if len(c[0])]
    if not curves:
        return None
    lo, hi = max(float(c[0][0]) for c in curves), min(float(c[0][-1]) for c in curves)
    return (lo, hi) if hi >= lo else None


def area_under_curve(x: np.ndarray, y: np.ndarray, lo: float, hi: float) -> float:
    """The area under the evaluation curve (linear between evaluations) from `lo` to `hi`, divided by `hi - lo`: the
    mean value of the metric over that span of episodes, in the metric's own unit; the value at `lo` when the span is
    one point. A run that learns sooner has the larger area for the same final value."""
    inside = x[(x > lo) & (x < hi)]
    grid = np.concatenate([[lo], inside, [hi]])
    values = np.interp(grid, x, y)
    if hi <= lo:
        return float(values[0])
    return float(((values[1:] + values[:-1]) / 2 * np.diff(grid)).sum() / (hi - lo))


def episodes_to_reach(x: np.ndarray, y: np.ndarray, threshold: float, hi: float) -> float | None:
    """The first evaluated episode (up to `hi`) at which the metric is at or above `threshold`; None if none is."""
    reached = x[(y >= threshold) & (x <= hi)]
    return float(reached[0]) if len(reached) else None


def default_threshold(runs: list[Run], metric: str, span: tuple[float, float]) -> float | None:
    """90% of the way from the runs' mean value at the start of the span to the highest mean over seeds that a group
    reaches at one of its evaluations inside the span; None when no group rises above the start (a threshold at the
    start would be "reached" at episode 0 by every run, a result that says nothing)."""
    lo, hi = span
    start = float(np.mean([np.interp(lo, *r.curve(metric, "episode")) for r in runs]))
    top = max(
        float(agg["mean"][(agg["x"] >= lo) & (agg["x"] <= hi)].max())
        for agg in group_curves(runs, metric, "episode").values()
    )
    return start + 0.9 * (top - start) if top > start else None


def summarize(runs: list[Run], metric: str, threshold: float | None = None) -> list[dict]:
    """Final value (`Run.final`, the last logged) of `metric` per run, aggregated per group. A run whose final value is
    not finite counts among the group's seeds and is named in `diverged`; the mean, interval and IQM are over the
    others (NaN when every seed diverged).

    Sample efficiency, over the episodes every finite run covers (`common_span`), per run then per group: `auc`, the
    area under its evaluation curve divided by the span (`area_under_curve`), and `reach`, the episodes it takes to
    reach `threshold` (`episodes_to_reach`; the default: `default_threshold`), None for a run that never does. Each
    row also holds the `span` and `threshold` used (None when the runs have no episodes or do not overlap)."""
    finals: dict[str, list[float]] = defaultdict(list)
    diverged: dict[str, list[str]] = defaultdict(list)
    for run in runs:
        value = run.final(metric)
        if value is not None:
            finals[run.group].append(value)
            if math.isnan(value):
                diverged[run.group].append(run.name)
    finite = [r for r in runs if r.final(metric) is not None and not math.isnan(r.final(metric))]
    span = common_span(finite, metric) if all(r.x_axis() == "episode" for r in finite) else None
    if span is not None and threshold is None:
        threshold = default_threshold(finite, metric, span)
    aucs: dict[str, list[float]] = defaultdict(list)
    reach: dict[str, list[float | None]] = defaultdict(list)
    for run in finite if span is not None else []:
        x, y = run.curve(metric, "episode")
        aucs[run.group].append(area_under_curve(x, y, *span))
        if threshold is not None:
            reach[run.group].append(episodes_to_reach(x, y, threshold, span[1]))
    table = []
    for group, all_values in sorted(finals.items()):
        values = np.array([v for v in all_values if not math.isnan(v)])
        low, high = bootstrap_ci(values) if len(values) else (math.nan, math.nan)
        table.append(
            {
                "group": group,
                "seeds": len(all_values),
                "diverged": diverged[group],
                "mean": float(values.mean()) if len(values) else math.nan,
                "low": low,
                "high": high,
                "iqm": iqm(values) if len(values) else math.nan,
                "values": [float(v) for v in values],
                "auc": aucs[group],
                "reach": reach[group],
                "span": span,
                "threshold": threshold if span is not None else None,
            }
        )
    return table


def interval_cell(t: dict) -> str:
    """The table's interval: `[low, high]` (95% bootstrap CI) from 3 or more finite seeds; below that their values."""
    n = len(t["values"])
    if n >= MIN_SEEDS_FOR_CI:
        return f"[{t['low']:.3f}, {t['high']:.3f}]"
    shown = ", ".join(f"{v:.3f}" for v in sorted(t["values"]))
    return f"{shown} ({n} seeds)" if n > 1 else shown or "-"


def estimate_cell(values: list[float], digits: int = 3) -> str:
    """`mean [low, high]` (95% bootstrap interval of the mean) from 3 or more values; below that the mean and the
    values, `0.465 (0.410, 0.520: 2 seeds)`, or the one value."""
    if not values:
        return "-"
    v = np.asarray(values, dtype=float)
    if len(v) >= MIN_SEEDS_FOR_CI:
        low, high = bootstrap_ci(v)
        return f"{v.mean():.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} (" + ", ".join(f"{x:.{digits}f}" for x in sorted(v)) + f": {len(v)} seeds)"


def reach_cell(reach: list[float | None]) -> str:
    """Episodes to the threshold (`estimate_cell`); with a seed that never reached it, how many did."""
    got = [r for r in reach if r is not None]
    if len(got) < len(reach):
        return f"{len(got)} of {len(reach)} seeds reached it" + (f" (mean {np.mean(got):.0f})" if got else "")
    return estimate_cell(got, 0)


def separation(table: list[dict], name: str, values_of, higher_is_better: bool = True) -> dict[str, list[str]]:
    """The pairs of groups that one measure (`values_of(row)`: a list of per-seed values, or None when the measure
    does not apply to the row) tells apart: "separated" when both have 3 or more seeds and their 95% bootstrap
    intervals of the mean do not overlap (`a > b`, the better first), "not separated" when they overlap (`a ~ b`),
    "not tested" for a pair with a group of fewer seeds. The test `benchmark.frontier` makes at each KL budget."""
    out: dict[str, list[str]] = {"separated": [], "not separated": [], "not tested": []}
    rows = [(t["group"], values_of(t)) for t in table]
    rows = [(g, np.asarray(v, dtype=float)) for g, v in rows if v is not None and len(v)]
    for i, (a, va) in enumerate(rows):
        for b, vb in rows[i + 1 :]:
            if min(len(va), len(vb)) < MIN_SEEDS_FOR_CI:
                out["not tested"].append(f"{name}: {a} ? {b}")
                continue
            (la, ha), (lb, hb) = bootstrap_ci(va), bootstrap_ci(vb)
            b_better = vb.mean() > va.mean() if higher_is_better else vb.mean() < va.mean()
            first, second = (b, a) if b_better else (a, b)
            if ha < lb or hb < la:
                out["separated"].append(f"{name}: {first} > {second}")
            else:
                out["not separated"].append(f"{name}: {first} ~ {second}")
    return out


def detectable(table: list[dict], measures) -> list[tuple[str, float]]:
    """Per measure (`(name, values_of, higher_is_better)`), the smallest difference of means that two of the table's
    groups with the widest seed spread would show as separated: their 95% bootstrap intervals, centred on their means,
    stop overlapping once the means are half the sum of the two widths apart. Groups of 3 or more seeds only."""
    out = []
    for name, values_of, _ in measures:
        widths = []
        for t in table:
            v = values_of(t)
            if v is not None and len(v) >= MIN_SEEDS_FOR_CI:
                low, high = bootstrap_ci(np.asarray(v, dtype=float))
                widths.append(high - low)
        if len(widths) >= 2:
            a, b = sorted(widths)[-2:]
            out.append((name, (a + b) / 2))
    return out


def separation_lines(table: list[dict], metric: str) -> list[str]:
    """What the table can and cannot rank: the ranking by sample efficiency (AUC), then, per measure (final value,
    AUC, episodes to the threshold), the pairs of groups that separate, those that do not, those not tested."""
    measures = [
        (f"final {metric}", lambda t: t["values"], True),
        ("AUC", lambda t: t["auc"], True),
        # a group with a seed that never reached the threshold has no interval of its episodes
        ("episodes to threshold", lambda t: t["reach"] if None not in t["reach"] else None, False),
    ]
    found: dict[str, list[str]] = {"separated": [], "not separated": [], "not tested": []}
    for name, values_of, higher in measures:
        for kind, pairs in separation(table, name, values_of, higher).items():
            found[kind] += pairs
    ranked = sorted((t for t in table if t["auc"]), key=lambda t: -float(np.mean(t["auc"])))
    lines = []
    if ranked:
        lines.append(
            "Ranking by AUC (mean over seeds): "
            + "".join(
                ("" if i == 0 else " = " if np.mean(t["auc"]) == np.mean(ranked[i - 1]["auc"]) else " > ")
                + f"{t['group']} {np.mean(t['auc']):.3f}"
                for i, t in enumerate(ranked)
            )
            + "."
        )
    lines.append(
        f"Separated (non-overlapping 95% intervals over {MIN_SEEDS_FOR_CI} or more seeds): "
        + ("; ".join(found["separated"]) or "none")
        + "."
    )
    lines.append("Not separated (the intervals overlap): " + ("; ".join(found["not separated"]) or "none") + ".")
    power = detectable(table, measures[:2])
    if power:  # so that "not separated" reads as "no difference larger than this"
        lines.append(
            "Smallest difference these seeds can separate (half the sum of two groups' 95% interval widths, the "
            "widest pair): " + ", ".join(f"{name} {d:.3f}" for name, d in power) + "."
        )
    few = [t for t in table if len(t["values"]) < MIN_SEEDS_FOR_CI]
    if found["not tested"] and few:  # a pair with such a group is not tested
        lines.append(
            f"Not tested (fewer than {MIN_SEEDS_FOR_CI} seeds, so no 95% interval): "
            + ", ".join(f"{t['group']} ({len(t['values'])} seed{'s' if len(t['values']) != 1 else ''})" for t in few)
            + "."
        )
    return lines


def markdown_table(table: list[dict], metric: str) -> str:
    """One row per group; a group with diverged seeds says how many ("3 (1 diverged)"), one whose every seed diverged
    shows "diverged" for its final value. When the runs log episodes, two sample-efficiency columns (`summarize`:
    the AUC, the episodes to the threshold) and, under the table, what they separate (`separation_lines`)."""
    few = [len(t["values"]) < MIN_SEEDS_FOR_CI for t in table]
    head = (
        "95% CI" if not any(few) else "seed values" if all(few) else f"95% CI (values below {MIN_SEEDS_FOR_CI} seeds)"
    )
    span = next((t["span"] for t in table if t.get("span") is not None), None)
    threshold = table[0]["threshold"]
    extra = ["AUC"] + ([f"episodes to {threshold:.3f}"] if threshold is not None else []) if span is not None else []
    lines = [
        f"| algorithm | seeds | final {metric} (mean) | {head} | IQM |" + "".join(f" {c} |" for c in extra),
        "|" + " --- |" * (5 + len(extra)),
    ]
    for t in table:
        seeds = f"{t['seeds']} ({len(t['diverged'])} diverged)" if t.get("diverged") else f"{t['seeds']}"
        cells = (estimate_cell(t["auc"]), reach_cell(t["reach"]))[: len(extra)]
        more = "".join(f" {c} |" for c in cells)
        if not t["values"]:
            lines.append(f"| {t['group']} | {seeds} | diverged | - | - |" + more)
            continue
        lines.append(f"| {t['group']} | {seeds} | {t['mean']:.3f} | {interval_cell(t)} | {t['iqm']:.3f} |" + more)
    if not extra:
        return "\n".join(lines) + "\n"
    lo, hi = span
    lines += [
        "",
        f"AUC: the area under each run's `{metric}` curve over episodes {lo:g}-{hi:g} (the span every run covers, "
        f"linear between evaluations), divided by {hi - lo:g}: its mean value over the span. "
        + (
            f"Episodes to {threshold:.3f}: the first evaluation at or above it (90% of the way from the start to the "
            "best group's peak unless --threshold is given). "
            if threshold is not None
            else "No group rises above the runs' mean start, so there is no threshold to reach (no episodes column). "
        )
        + "Mean [95% bootstrap interval] over seeds with 3 or more, else the values.",
        "",
        *separation_lines(table, metric),
    ]
    return "\n".join(lines) + "\n"


def group_curves(runs: list[Run], metric: str, x: str) -> dict[str, dict]:
    """Per group, `aggregate_curves` of its runs' curves of `metric` against `x` (runs without a value left out)."""
    by_group: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_group[run.group].append(run)
    out = {}
    for group, members in sorted(by_group.items()):
        curves = [c for c in (m.curve(metric, x) for m in members) if len(c[0]) > 0]
        if curves:
            out[group] = aggregate_curves(curves)
    return out


def curve_label(group: str, agg: dict) -> str:
    """`ppo_tiny-tldr (band: 95% bootstrap interval over 3 seeds)`, `(band: min-max of 2 seeds)`, `(1 seed)`."""
    n = agg["seeds"]
    if agg["band"] == "95% CI":
        return f"{group} (band: 95% bootstrap interval over {n} seeds)"
    return f"{group} (band: min-max of {n} seeds)" if agg["band"] == "min-max" else f"{group} (1 seed)"


def track_of(group: str) -> str:
    """`rloo_batchmean_tiny-tldr` -> `tiny-tldr`: what `algorithm_of` leaves off."""
    m = re.search(r"_([^_\s()]+)(?: \(.*\))?$", group)  # a group kept apart by folder: `ppo_tiny-tldr (runs/a)`
    return m[1] if m else ""


def outputs(out: Path) -> tuple[Path, Path]:
    """`--out OUT`: OUT.png and OUT.md, the whole name kept (`runs/rloo.lr1e-5` -> `runs/rloo.lr1e-5.png`); an OUT
    given with one of the two suffixes is taken without it."""
    base = out.with_suffix("") if out.suffix in (".png", ".md") else out
    return Path(f"{base}.png"), Path(f"{base}.md")


def hosts_of(runs: list[Run]) -> int:
    """How many machines the runs ran on, as far as their provenance says (CPU, its rounding, GPUs); 1 without it."""
    seen = set()
    for r in runs:
        host = (r.provenance or {}).get("host") or {}
        if host:
            seen.add((host.get("cpu"), host.get("cpu_capability"), tuple(host.get("gpus") or ())))
    return max(1, len(seen))


def algorithm_of(group: str) -> str:
    """`rloo_batchmean_tiny-tldr` -> `rloo_batchmean`: the group without its last `_<track>` (a track or preset name
    holds no `_`), a folder kept apart stays (`ppo (runs/a)`); a name without `_` is its own."""
    m = re.match(r"^(.+)_[^_\s()]+((?: \(.*\))?)$", group)
    return m[1] + m[2] if m else group


class Colours:
    """One colour per key for every figure of one command: the first key asked for gets the first colour, and so on
    (tab20, its dark shades first, then its light ones). `Colours(keys)` hands them out in sorted order at once, so
    that the same set of groups gets the same colours whatever figure is drawn first."""

    def __init__(self, keys=()) -> None:
        self.of: dict[str, tuple] = {}
        for k in sorted(keys):
            self[k]

    def __getitem__(self, key: str) -> tuple:
        if key not in self.of:
            import matplotlib

            i = len(self.of)
            self.of[key] = matplotlib.colormaps["tab20"].colors[2 * i % 20 + (i // 10) % 2]
        return self.of[key]


def plot(
    runs: list[Run],
    metric: str,
    out_png: Path,
    title: str | None = None,
    train_metrics: tuple[str, ...] = (),
    colours: Colours | None = None,
    key=None,
) -> None:
    """The mean curve of each group against episodes and wall-clock time, with its band (`curve_label`) and a marker
    at each evaluation; below them, per `train_metrics`, the per-update training metric against episodes (each
    update a point: the curve between two evaluations). One legend for the figure, under it; `title` names what is
    plotted. The caller leaves unfinished runs out (`finished_runs`). A group's colour is `colours[key(group)]`
    (default: a new `Colours` of this figure's groups, keyed by the group): pass one `Colours` to every figure of a
    command for one colour per group across them. Reference runs (`Run.reference`) are dashed, their band lighter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(metric, "episode"), (metric, "time")] + [(m, "episode") for m in train_metrics]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows + 1), squeeze=False)
    key = key or (lambda g: g)
    colours = colours if colours is not None else Colours({key(r.group) for r in runs})
    # drawn under the runs compared with it; a figure of reference runs alone (results --reference) is drawn plainly
    reference = {r.group for r in runs if r.reference} if any(not r.reference for r in runs) else set()
    handles: dict[str, object] = {}
    for ax, (m, x) in zip(axes.flat, panels):
        for group, agg in group_curves(runs, m, x).items():
            evaluation = m == metric
            color = colours[key(group)]
            (line,) = ax.plot(
                agg["x"],
                agg["mean"],
                "--" if group in reference else "-",
                marker="o" if evaluation else ".",
                markersize=4 if evaluation else 2,
                color=color,
                zorder=2 if group in reference else 3,  # the runs compared over the reference
            )
            if agg["band"] is not None:
                ax.fill_between(
                    agg["x"],
                    agg["low"],
                    agg["high"],
                    alpha=0.12 if group in reference else 0.2,
                    color=color,
                    zorder=1 if group in reference else 2,
                )
            if evaluation:
                handles.setdefault(curve_label(group, agg), line)
        ax.set_xlabel("episodes" if x == "episode" else "wall-clock seconds")
        if x == "time" and hosts_of(runs) > 1:  # seconds of two machines do not compare
            ax.text(
                0.5,
                0.02,
                f"runs of {hosts_of(runs)} machines: their seconds do not compare",
                transform=ax.transAxes,
                ha="center",
                fontsize=8,
                color="darkred",
            )
        ax.set_ylabel(m)
        ax.set_title(
            f"{m} (evaluations: markers)" if m == metric else f"{m} (training samples, each update)", fontsize=9
        )
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title or metric, fontsize=11)
    ncol = min(3, max(1, len(handles)))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8)
    fig.tight_layout(rect=(0, 0.04 * ((len(handles) + ncol - 1) // ncol) / rows, 1, 1))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
