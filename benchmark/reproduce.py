"""Does this install reproduce the library? `python -m benchmark.reproduce [RUNS_DIR]`, run after the main job.

Different CPUs round differently, and RL turns a last-digit difference into another trajectory (one seed of one commit
ends far apart on two hosts: issue 57). But the first updates are not chaotic: the same seed's runs under two rounding
regimes agree there to about the 6th digit, while almost every algorithmic change moves a loss, a KL or an advantage
statistic by far more (issue 66). So a run of a shipped group (its name without `__<seed>`, with shipped runs of the
same command: `benchmark.reference.budget`, seed, run name and threads aside, and budget: `reference.run_budgets`) in
RUNS_DIR (default `runs`) gets two checks against the library's own runs (benchmark/reference_runs/):

  early  its first updates (the training rows every script logs: losses, KL, rewards, advantages, learning rate,
         gradient norm), statistic by statistic, against the shipped runs of its own seed. The window is the
         first updates in which every shipped seed's two rounding regimes agree (at most EARLY_ROWS rows); the
         tolerance at each update and statistic is MARGIN times the largest gap between two regimes of one seed
         there, plus a floor (`early_tolerances`). It names the first update and statistic that differs. It
         cannot apply (and says why) to a run made with other torch or transformers versions, another BLAS (MKL
         here), another thread count than those checked (THREADS), on a GPU, or of a seed the reference does
         not hold. An unfinished run (no done.json) gets this check alone, the command read from its
         provenance.json. GRPO's main-job run starts from the host's own tiny-math SFT policy, which two
         regimes already round apart, so its tolerances are as wide as two sample sets';
         `grpo-fixed-start_tiny-math` starts from a shipped policy (benchmark/starts/) and gives GRPO its 8.
  end    its headline metric (`eval/gold_reward`, else `eval/accuracy`) against the band of the shipped runs of its
         command, each distinct run once (two regimes that gave the same curve are one run): `final` (the
         last evaluation), `curve` (the mean of its evaluation curve over the shipped runs' common span of episodes:
         `benchmark.curves.area_under_curve`), `peak` (its best evaluation: PPO without a KL penalty passes its gold
         peak and then falls anywhere), `gain` (final minus its own first evaluation) and `rise` (peak minus it), the
         last two one-sided: a run that learns less than the library's fails. A band is a 95% prediction interval
         for one more run, mean +- t(0.975, n-1) * sd * sqrt(1 + 1/n), n the seeds (a seed's two regimes are not two
         draws), sd over the distinct runs, at least +-TOLERANCE; the one-sided bounds at 95% likewise. A band that
         holds the start (the shipped runs' first evaluation) or covers the metric's whole range [0, 1], and a bound
         not above 0, judge nothing: `cannot tell`. A check run (`suites.CHECK_STAGES`, evaluated on 16 problems) gets
         no end check.

A run differs when its early check does; where that check cannot apply, when its end result is outside a band. Past
the early window a run is chaotic: an honest one falls outside a 95% band once in 20, so an end result outside after
a passed early check is named in the verdict, not counted as a difference. One line per run, with each check's
result, then one verdict: `reproduces the library: yes`, `no, these runs differ:
...`, or `unknown` when no check could judge any run. A run that stopped before the span a check needs (fewer
updates than the early window, evaluations that do not span the shipped runs' episodes) is `incomplete, not judged`,
never `ok`, unless a check saw a difference; the verdict names it. Exit code 0 for yes, 1 for no, 2 for unknown. Bad
input (no run, no run of a shipped group, a damaged data file, a damaged run file: benchmark/runfiles.py, the line
every tool gives it) is one `error:` line. `--check-references` judges every shipped
run by the band of the others of its group (each seed left out in turn): honest seeds must fall inside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmark import reference, runfiles
from benchmark.curves import area_under_curve, group_name, read_run, warn_problems
from benchmark.suites import CHECK_STAGES

MIN_REFERENCE = 3
"""shipped seeds of a command below which no band is drawn: two points say nothing of a spread"""
TOLERANCE = 0.05
"""the least half-width of a band, in the metric's unit (gold reward and accuracy are in [0, 1]): seeds that all reach
the judge's ceiling have sd 0, and an honest one ended 0.042 below it (ppo_tiny-tldr, issue 66)"""
METRICS = ("eval/gold_reward", "eval/accuracy")
"""the headline metric of a group: the first of these its shipped runs log"""
RANGE = (0.0, 1.0)
"""the headline metrics' range: a band that covers it judges nothing"""
# t(0.975, df) for df = 1..30 (two-sided 95%); above 30 the normal's 1.96 is within 4%
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T975 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
# t(0.95, df) for df = 1..10 (one-sided 95%); above 10 the normal's 1.645 is within 10%
T95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812]

EARLY_ROWS = reference.EARLY_ROWS
AGREE = 0.05
"""two regimes of one seed agree at an update while every statistic's gap is below this share of its scale (+ ABS):
rounding keeps them within about 1e-3 of it (PPO's clip fraction and approximate KL, tiny numbers, the loosest); a
different sampled token takes them apart by 0.1 or more"""
MARGIN = 10.0
"""the early tolerance: this many times the largest gap between two regimes of one seed at that update"""
REL_FLOOR, ABS = 1e-5, 1e-6
"""the early tolerance's floor: this share of a statistic's size, plus ABS (a statistic both regimes give exactly)"""
THREADS = (1, 2)
"""thread counts (`--num-threads`) whose honest runs were shown inside the early tolerance (tests/test_mutations.py)"""
VERSIONS = ("torch", "transformers")
"""libraries whose version must equal the references' for the early check to apply"""
UNCOMPARED = ("time", "epoch")
"""row keys the early check leaves out (with `perf/*`: speed and memory are the host's, not the algorithm's)"""


class ReproduceError(Exception):
    """Input that cannot be judged at all; its message is the `error:` line."""


def prediction_band(values: list[float], seeds: int | None = None) -> tuple[float, float]:
    """The 95% prediction interval of one more draw from the distribution `values` came from (a normal one with
    unknown mean and variance), at least +-TOLERANCE around their mean. `seeds`: how many independent seeds the values
    come from (two rounding regimes of one seed are not two draws): the unit of n and of the t quantile's degrees of
    freedom (default: every value its own)."""
    x = np.asarray(values, dtype=float)
    n = seeds or len(x)
    t = T975[n - 2] if n - 2 < len(T975) else 1.96
    half = max(t * float(x.std(ddof=1)) * math.sqrt(1 + 1 / n), TOLERANCE)
    return float(x.mean()) - half, float(x.mean()) + half


def lower_bound(values: list[float], seeds: int | None = None) -> float:
    """The one-sided 95% prediction bound below which one more draw falls 5% of the time, at least TOLERANCE below
    the mean (`seeds` as in `prediction_band`)."""
    x = np.asarray(values, dtype=float)
    n = seeds or len(x)
    t = T95[n - 2] if n - 2 < len(T95) else 1.645
    return float(x.mean()) - max(t * float(x.std(ddof=1)) * math.sqrt(1 + 1 / n), TOLERANCE)


@dataclass
class Verdict:
    run: str
    state: str
    """"ok", "differs", "cannot tell" (no check could judge), "incomplete, not judged" (it stopped before the span a
    check needs, and no check saw a difference) or "not judged" """
    line: str
    early: str = ""
    """the early check's outcome: "ok" (every update it logged of the window within tolerance: an unfinished run's
    may be fewer than the window, and its state "incomplete, not judged"), "differs" or "" (it could not apply)"""
    end: str = ""
    """the end result's: "ok", "differs", "incomplete" or "" (cannot tell, unfinished, or no band)"""


def curve(rows: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["episode"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float)) and "episode" in r]
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def distinct(records: list[dict]) -> list[dict]:
    """The records whose rows differ once wall-clock time and speed are left out: two rounding regimes that gave one
    curve are one run, not two draws (counted twice, a band is about half as wide as its runs allow)."""
    seen, out = set(), []
    for r in records:
        rows = [
            {k: v for k, v in row.items() if k not in UNCOMPARED and not k.startswith("perf/")} for row in r["rows"]
        ]
        text = json.dumps(rows, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append(r)
    return out


# ---- the early check ----


def training_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if reference.is_training_row(r)][:EARLY_ROWS]


def statistics(row: dict) -> dict[str, float]:
    """The numbers of a training row that the early check compares."""
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in UNCOMPARED and not k.startswith("perf/")
    }


def seed_of(name: str) -> str | None:
    m = re.search(r"__(\d+)$", name)
    return m.group(1) if m else None


def early_tolerances(records: list[dict]) -> tuple[list[dict[str, float]], str]:
    """From the shipped runs of one command, the early window and its tolerances: for each update of the window, each
    statistic's tolerance (MARGIN x the largest gap between two regimes of one seed at that update or before, plus
    the floor). The window ends before the first update where some seed's regimes part (a gap above AGREE of the
    statistic's scale: its largest size over the seeds' first EARLY_ROWS updates); "" or why there is no window."""
    by_seed: dict[str, list[list[dict[str, float]]]] = {}
    for r in records:
        by_seed.setdefault(r["name"], []).append([statistics(row) for row in training_rows(r["rows"])])
    pairs = [runs for runs in by_seed.values() if len(runs) >= 2]
    if not pairs:
        return [], "no seed is shipped under two rounding regimes, so no tolerance is measured"
    depth = min(len(run) for runs in pairs for run in runs)
    keys = set.intersection(*(set(row) for runs in pairs for run in runs for row in run[:depth])) if depth else set()
    scale = {k: max(abs(row[k]) for runs in pairs for run in runs for row in run[:depth]) for k in keys}

    def gap(i: int, k: str) -> float:
        return max(max(run[i][k] for run in runs) - min(run[i][k] for run in runs) for runs in pairs)

    # a statistic the regimes part on at the first update is 0 but for rounding (RLOO's mean policy loss: +-3e-6, as
    # its leave-one-out advantages sum to 0): it is held to its tolerance, but does not end the window
    noise = {k for k in keys if gap(0, k) > AGREE * scale[k] + ABS}
    out: list[dict[str, float]] = []
    worst = dict.fromkeys(keys, 0.0)  # the largest gap so far: rounding differences grow, they do not heal
    for i in range(depth):
        tol = {}
        for k in sorted(keys):
            if gap(i, k) > AGREE * scale[k] + ABS and k not in noise:
                return out, ""
            worst[k] = max(worst[k], gap(i, k))
            size = max(abs(run[i][k]) for runs in pairs for run in runs)
            tol[k] = MARGIN * worst[k] + REL_FLOOR * size + ABS
        out.append(tol)
    return out, "" if out else "the shipped runs log no update"


def cannot_apply(provenance: dict | None, records: list[dict]) -> str:
    """Why the early check cannot apply to a run made as `provenance` says, against `records`; "" when it can."""
    if not provenance:
        return "the run has no provenance.json (its libraries and threads are unknown)"
    host = provenance.get("host") or {}
    if host.get("gpus"):
        return "the run was made on a GPU; the references on a CPU"
    versions = provenance.get("versions") or {}
    for lib in VERSIONS:
        theirs = {((r.get("provenance") or {}).get("versions") or {}).get(lib) for r in records}
        if versions.get(lib) not in theirs:
            shipped = ", ".join(sorted(str(v) for v in theirs))
            return f"{lib} {versions.get(lib)} here, {shipped} in the references"
    blas = {((r.get("provenance") or {}).get("host") or {}).get("blas") for r in records}
    if host.get("blas") not in blas:  # another library's matrix products round otherwise: not measured
        return f"matrix products by {host.get('blas')} here, by {', '.join(sorted(map(str, blas)))} in the references"
    threads = host.get("threads")
    if threads not in THREADS:
        return f"{threads} threads here; the tolerance is checked at {', '.join(map(str, THREADS))} (--num-threads)"
    return ""


def early_check(
    name: str, rows: list[dict], provenance: dict | None, same: list[dict], finished: bool = True
) -> tuple[str, str, bool]:
    """("ok" | "differs" | "", the text, whether the run logged the whole window): the run's first updates against the
    shipped runs of its seed; an unfinished run's as far as it went."""
    seed = seed_of(name)
    mine = [r for r in same if seed_of(r["name"]) == seed]
    if not mine:
        return "", f"early: cannot apply (the reference holds no run of seed {seed})", True
    why = cannot_apply(provenance, same)
    if why:
        return "", f"early: cannot apply ({why})", True
    window, why = early_tolerances(same)
    if not window:
        return "", f"early: cannot apply ({why})", True
    ours, size = training_rows(rows), len(window)
    window = window[: len(ours)]
    refs = [training_rows(r["rows"]) for r in mine]
    for i, tol in enumerate(window):
        at = f"update {i + 1} (step {ours[i].get('step')})"
        for k in ("step", "episode"):
            if any(ref[i].get(k) != ours[i].get(k) for ref in refs):
                return "differs", f"early: differs at {at}: its {k} {ours[i].get(k)} vs {refs[0][i].get(k)}", True
        row = statistics(ours[i])
        worst = None
        for k, t in tol.items():
            values = [statistics(ref[i]).get(k) for ref in refs]
            if any(v is None for v in values):
                continue
            if k not in row:
                return "differs", f"early: differs at {at}: it logs no {k}", True
            gap = max(0.0, min(values) - row[k], row[k] - max(values)) if math.isfinite(row[k]) else math.inf
            if gap > t and (worst is None or gap / t > worst[0]):
                worst = (gap / t, k, row[k], values, t)
        if worst:
            _, k, v, values, t = worst
            shipped = " / ".join(f"{x:.6g}" for x in values)
            return "differs", f"early: differs at {at}: {k} {v:.6g} vs {shipped} [tolerance {t:.2g}]", True
    if len(window) < size:  # it stopped before the span it is judged on: its verdict is "incomplete, not judged"
        how = "unfinished" if not finished else "its metrics.jsonl ends there"
        return "ok", f"early: incomplete, {len(window)} of {size} updates logged and within tolerance ({how})", False
    return "ok", f"early: {size} updates within tolerance", True


# ---- the end result ----


def end_checks(rows: list[dict], same: list[dict]) -> tuple[str, list[str], str]:
    """("ok" | "differs" | "", each check's text, the metric): the run's headline metric against the bands of the
    distinct shipped runs."""
    metric = next((m for m in METRICS if any(m in row for r in same for row in r["rows"])), None)
    mine = curve(rows, metric) if metric else (np.array([]), np.array([]))
    if metric is None or not len(mine[0]):
        return "", [f"end: it and its reference share no {' or '.join(METRICS)}"], ""
    refs = [curve(r["rows"], metric) for r in same]
    seeds = len({seed_of(r["name"]) for r in same})
    starts = [float(c[1][0]) for c in refs]
    lo, hi = max(c[0][0] for c in refs), min(c[0][-1] for c in refs)
    if mine[0][0] > lo or mine[0][-1] < hi:  # a first or last evaluation missing: no final, gain or curve to judge
        span = f"episodes {mine[0][0]:g}-{mine[0][-1]:g}, the shipped runs' {lo:g}-{hi:g}"
        return "incomplete", [f"end: incomplete, its evaluations do not span the shipped runs' ({span})"], metric
    checks = {
        "final": ([float(c[1][-1]) for c in refs], float(mine[1][-1])),
        "peak": ([float(c[1].max()) for c in refs], float(mine[1].max())),
    }
    if hi > lo and mine[0][0] <= lo and mine[0][-1] >= hi:  # the curve covers the shipped span
        checks["curve"] = ([area_under_curve(*c, lo, hi) for c in refs], area_under_curve(*mine, lo, hi))
    out, states = [], []
    for what, (values, value) in checks.items():
        low, high = prediction_band(values, seeds)
        if low <= max(starts) or (low <= RANGE[0] and high >= RANGE[1]):
            why = "covers the metric's range" if low <= RANGE[0] and high >= RANGE[1] else "holds the start"
            out.append(f"{what} {value:.3f}: cannot tell (band [{low:.3f}, {high:.3f}] {why})")
            continue
        inside = math.isfinite(value) and low <= value <= high
        states.append(inside)
        out.append(f"{what} {value:.3f} {'in' if inside else 'OUTSIDE'} [{low:.3f}, {high:.3f}]")
    # one-sided: a run that learns less than the library's fails. gain: the final over the start; rise: the best
    # evaluation over the start (PPO without a KL penalty rises to its gold peak, then falls anywhere)
    for what, ends, end in (
        ("gain", [c[1][-1] for c in refs], mine[1][-1]),
        ("rise", [c[1].max() for c in refs], mine[1].max()),
    ):
        bound = lower_bound([float(e - c[1][0]) for e, c in zip(ends, refs)], seeds)
        value = float(end - mine[1][0])
        if bound > 0:
            inside = math.isfinite(value) and value >= bound
            states.append(inside)
            out.append(f"{what} {value:+.3f} {'>=' if inside else 'BELOW'} {bound:+.3f}")
        else:
            out.append(f"{what} {value:+.3f}: cannot tell (the shipped runs' bound {bound:+.3f} is not above 0)")
    state = "" if not states else "ok" if all(states) else "differs"
    return state, out, metric


def judge(run_dir: Path, shipped: dict[str, list[dict]]) -> Verdict:
    """One run (finished, or unfinished with its provenance's command) against the shipped runs of its group and
    command."""
    run = read_run(run_dir)  # damage (benchmark/runfiles.py): one `error:` line, the same as every tool's
    warn_problems([run])  # a torn last row dropped
    name, group = run.name, group_name(run.name)
    if run.finished:
        argv = (run.done or {}).get("argv")
    else:
        argv = (run.provenance or {}).get("argv")
        if argv is None:
            return Verdict(name, "not judged", f"{name}: not judged: unfinished, and its provenance has no command")
    full = reference.run_budgets(run_dir) == {"full"}  # RLOO from a full-budget SFT policy is not the main job's
    same = [
        r
        for r in shipped.get(group, [])
        if reference.budget(r.get("argv")) == reference.budget(argv) and reference.full_only(r) == full
    ]
    runs = distinct(same)
    if len({seed_of(r["name"]) for r in runs}) < MIN_REFERENCE:
        other = len(shipped.get(group, [])) - len(same)
        why = f"{len({seed_of(r['name']) for r in runs})} shipped seed(s) of its command" + (
            f" ({other} of another command)" if other else ""
        )
        return Verdict(name, "not judged", f"{name}: not judged: {why}, fewer than {MIN_REFERENCE}")
    early, early_text, whole = early_check(name, run.rows, run.provenance, same, run.finished)
    if group in CHECK_STAGES:  # its 16-problem evaluations move by 1/16: no band of 3 seeds holds an honest one
        end, end_text = "", "end: a check run, judged by its first updates alone"
    elif run.finished:
        end, texts, metric = end_checks(run.rows, runs)
        end_text = f"{metric} " + "; ".join(texts) if metric and end != "incomplete" else texts[0]
    else:
        end, end_text = "", "end: unfinished (no done.json), not judged"
    # the early check decides where it applies: past its window a run is chaotic, and its end result falls outside a
    # 95% band in 1 honest run of 20 (13 runs: half of the main jobs would end "no"); where it cannot apply, the end
    # result decides
    # a run that stopped before the span a check needs (`incomplete`) is not judged, unless a check saw a difference
    if early == "differs" or (early != "ok" and end == "differs"):
        state = "differs"
    elif end == "incomplete" or not whole:
        state = "incomplete, not judged"
    else:
        state = early or end or "cannot tell"
    line = f"{name}: {state}: {early_text}; {end_text} ({len(runs)} distinct shipped runs)"
    return Verdict(name, state, line, early, end)


def shipped_groups(data_dir: Path | None) -> dict[str, list[dict]]:
    shipped: dict[str, list[dict]] = {}
    paths = sorted(Path(data_dir or reference.DIR).glob("*.jsonl.gz"))
    if data_dir is not None and not paths:  # not the runs' fault: the data is missing
        what = "holds no reference data (*.jsonl.gz)" if Path(data_dir).is_dir() else "is not a folder"
        raise ReproduceError(f"--data {data_dir} {what}; leave --data out for the library's (benchmark/reference_runs)")
    for path in paths:
        for r in reference.read_group(path):
            shipped.setdefault(group_name(r["name"]), []).append(r)
    return shipped


def reproduce(runs_dir: Path, data_dir: Path | None = None) -> tuple[list[Verdict], str, int]:
    """Every run of `runs_dir` with a shipped group, judged; the verdict line and its exit code."""
    if not runs_dir.is_dir():
        raise ReproduceError(
            f"{runs_dir} is not a folder of runs (run the main job first: python -m benchmark.run quick)"
        )
    found = [d for d in sorted(runs_dir.iterdir()) if d.name[0] != "." and runfiles.is_run_dir(d)]
    found = [d for d in found if os.path.lexists(d / "done.json") or os.path.lexists(d / "provenance.json")]
    if not found:
        inner = runs_dir / "runs"
        hint = f": its runs are in {inner} (python -m benchmark.reproduce {inner})" if inner.is_dir() else ""
        raise ReproduceError(
            f"{runs_dir} holds no finished run (a run directory with its metrics.jsonl and done.json, or an unfinished "
            f"one's provenance.json){hint}"
        )
    shipped = shipped_groups(data_dir)
    mine = [d for d in found if group_name(d.name) in shipped]
    if not mine:
        raise ReproduceError(
            f"no run of {runs_dir} is of a shipped group (shipped: {', '.join(sorted(shipped)[:4])}, ...; python -m "
            "benchmark.reference list): check the runs of the README's main job (python -m benchmark.run quick)"
        )
    verdicts = [judge(d, shipped) for d in mine]
    differ = [v.run for v in verdicts if v.state == "differs"]
    judged = [v for v in verdicts if v.state == "ok"]
    incomplete = [v.run for v in verdicts if v.state.startswith("incomplete")]
    unjudged = f"; incomplete, not judged: {', '.join(incomplete)}" if incomplete else ""
    if differ:
        return verdicts, f"reproduces the library: no, these runs differ: {', '.join(differ)}{unjudged}", 1
    if not judged:
        return verdicts, f"reproduces the library: unknown (no check could judge any run{unjudged})", 2
    early = sum(v.early == "ok" for v in judged)
    end = sum(v.end == "ok" for v in judged)
    outside = [v.run for v in verdicts if v.end == "differs"]  # after an early check that passed
    if outside:
        note = f"; end results outside their bands after a passed early check (the runs' spread): {', '.join(outside)}"
        yes = f"reproduces the library: yes ({len(judged)} runs: {early} early checks passed{note}{unjudged})"
        return verdicts, yes, 0
    passed = f"{early} early checks and {end} end results passed"
    return verdicts, f"reproduces the library: yes ({len(judged)} runs: {passed}{unjudged})", 0


def check_references(data_dir: Path | None = None) -> tuple[list[str], int]:
    """Every shipped run judged by the band of the other distinct runs of its group and command (its seed left out
    in turn, both regimes): the lines of the runs outside, and how many were judged."""
    out, judged = [], 0
    for group, records in sorted(shipped_groups(data_dir).items()):
        if group in CHECK_STAGES:
            continue
        commands: dict[tuple, list[dict]] = {}
        for r in records:
            commands.setdefault((tuple(reference.budget(r.get("argv"))), reference.full_only(r)), []).append(r)
        for same in commands.values():
            for r in distinct(same):
                others = distinct([o for o in same if seed_of(o["name"]) != seed_of(r["name"])])
                if len({seed_of(o["name"]) for o in others}) < 2:
                    continue
                state, texts, metric = end_checks(r["rows"], others)
                judged += 1
                if state == "differs":
                    out.append(f"{r['name']} ({reference.regime(r)}): {metric} " + "; ".join(texts))
    return out, judged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", nargs="?", default="runs", help="the runs to check (default: runs)")
    parser.add_argument("--data", default=None, help="the reference data (default: benchmark/reference_runs)")
    parser.add_argument(
        "--check-references",
        action="store_true",
        help="judge every shipped run by the band of its group's other seeds (no runs needed)",
    )
    a = parser.parse_args(argv)
    try:
        if a.check_references:
            lines, judged = check_references(Path(a.data) if a.data else None)
            print("\n".join([*lines, f"{judged - len(lines)} of {judged} shipped runs inside their others' bands"]))
            return 1 if lines else 0
        verdicts, line, code = reproduce(Path(a.runs_dir), Path(a.data) if a.data else None)
    except (ReproduceError, reference.ReferenceError) as e:
        raise SystemExit(f"error: {e}") from None
    try:
        print("\n".join([*(v.line for v in verdicts), line]), flush=True)
    except BrokenPipeError:  # `reproduce | head -1`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the interpreter's exit flushes it)
    return code


if __name__ == "__main__":
    sys.exit(main())
