"""The README's results tables and plots: `python -m benchmark.results [--runs-dir runs | --reference] [--out-dir D]`.

It reads the runs of a runs directory, or with `--reference` the library's shipped reference runs
(benchmark/reference_runs/, `python -m benchmark.reference`), which hold the same metrics rows: the README's tables and
figures are built from that data without rerunning anything. A run's algorithm is its name without `_<track>__<seed>`,
in full (`rloo_batchmean_tiny-tldr__1` is `rloo_batchmean`), and one algorithm has one colour in every figure.

For each tiny track it reads every RL run of the suite (`runs/<algo>_<track>__<seed>`) that completed its budget
(a run without done.json is left out with a warning), and writes `runs/results_<track>.md` (a table: the starting
SFT policy, then each algorithm's final metrics as mean and 95% bootstrap CI over seeds, `0.600 [0.500, 0.700]`,
with 3 or more seeds; with 2 the two values instead, `0.600 (0.500, 0.700: 2 seeds)`; with throughput and peak
memory) and `runs/results_<track>.png` (the learning curves of the track's main metric against episodes and
wall-clock time, a marker per evaluation, mean over seeds with the band the legend names, see `benchmark.compare`;
below them the proxy reward and KL of the training samples, a point per update: TRAIN_METRICS).
The "SFT (start)" row is the evaluation every RL run makes before its first update, so it is measured on
the same prompts with the same code as the final numbers; it counts the SFT runs (the models evaluated), and shows
one value when those evaluations agree. A run whose final main metric is not finite is a diverged seed, as in
`benchmark.compare`: the seeds column says "3 (1 diverged)", its values and curves are left out (never an earlier
value), and a group whose every seed diverged shows "diverged".
The KL-frontier suites (`frontier-tldr`) get `runs/frontier_<track>.md` and `.png` (benchmark/frontier.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmark.curves import (
    MIN_SEEDS_FOR_CI,
    Colours,
    algorithm_of,
    bootstrap_ci,
    finished_runs,
    group_name,
    plot,
    select_runs,
    warn_problems,
)
from benchmark.frontier import NAME, write_frontier
from benchmark.frontier import TRACKS as FRONTIER_TRACKS
from benchmark.suites import CHECK_STAGES

TRACKS = {"tiny-tldr": ["eval/gold_reward", "eval/win_rate"], "tiny-math": ["eval/accuracy", "eval/completion_length"]}
# per-update training metrics plotted under the evaluations: a point per update (offline DPO samples nothing and has
# none); each script's own estimator, so KL compares runs of one algorithm, not algorithms (docs/frontier.md)
TRAIN_METRICS = ("objective/reward", "objective/kl")
TITLES = {
    "tiny-tldr": "tiny-tldr: gold reward of greedy summaries (judge), and the reward model's score while training",
    "tiny-math": "tiny-math: greedy accuracy on the 200 test problems, and the training reward",
}
PERF = ["perf/episodes_per_sec", "perf/peak_mem_gb"]
# grpo_math.py's variants (benchmark/suites.py's tiny-math stages), plotted on their own beside GRPO
GRPO_FAMILY = [
    "grpo",
    "dr-grpo",
    "dapo",
    "gspo",
    "cispo",
    "cispo-prompt",
    "cispo-kl",
    "reinforce-pp-baseline",
    "distill",
    "async-grpo",
    "lora-grpo",
]


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    v = np.array(values, dtype=float)
    if len(v) == 1:
        return f"{v[0]:.3f}"
    if len(v) < MIN_SEEDS_FOR_CI:  # not a 95% CI: the values themselves
        return f"{v.mean():.3f} (" + ", ".join(f"{x:.3f}" for x in sorted(v)) + f": {len(v)} seeds)"
    low, high = bootstrap_ci(v)
    return f"{v.mean():.3f} [{low:.3f}, {high:.3f}]"


def _start_cell(values: list[float]) -> str:
    """The SFT row: every RL run evaluates the SFT policy it starts from before its first update; those are
    evaluations of one model, not seeds, so one value when they agree, else their mean and range."""
    if not values:
        return "-"
    v = np.array(values, dtype=float)
    if np.ptp(v) == 0:
        return f"{v[0]:.3f}"
    return f"{v.mean():.3f} (range {v.min():.3f}-{v.max():.3f} over {len(v)} RL runs' first evaluations)"


def _with_metrics(runs: list) -> list:
    """The runs that have a metrics file (a run directory without one is not a run of the table)."""
    return [r for r in runs if r.path is None or (r.path / "metrics.jsonl").exists()]


def track_table(source, track: str) -> tuple[str, list]:
    """The table of `track` and the runs of its curves; `source`: a runs directory or runs already read (the
    reference data), as `curves.select_runs` takes."""
    metrics = TRACKS[track]
    runs = _with_metrics(select_runs(source, f"*_{track}__*"))  # damage (benchmark/runfiles.py): one `error:` line
    warn_problems(runs)
    # SFT / reward-model stages are not RL algorithms; a check run's 16-problem evaluations from the shipped start
    # (CHECK_STAGES) are no row of the table, nor a start of the SFT row
    runs = [r for r in runs if algorithm_of(r.group) not in ("sft", "rm", "prm") and r.group not in CHECK_STAGES]
    runs = finished_runs(runs)
    start: dict[str, list[float]] = defaultdict(list)
    final: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    diverged: dict[str, list[str]] = defaultdict(list)
    for run in runs:
        evals = [row for row in run.rows if metrics[0] in row]
        if not evals:
            continue
        for m in metrics:
            if m in evals[0] and evals[0].get("episode", 0) == 0:
                start[m].append(float(evals[0][m]))
        if not math.isfinite(float(evals[-1][metrics[0]])):  # as benchmark.compare: never an earlier value
            print(
                f"warning: {run.name}: its final {metrics[0]} is not finite (diverged); counted as a diverged seed of "
                f"{algorithm_of(run.group)}, left out of its values and curves",
                file=sys.stderr,
            )
            diverged[run.group].append(run.name)
            continue
        for m in metrics:
            if m in evals[-1]:  # a secondary metric some scripts do not log is left blank, not an error
                final[run.group][m].append(float(evals[-1][m]))
        for m in PERF:
            vals = [row[m] for row in run.rows if m in row]
            if vals:
                final[run.group][m].append(float(vals[-1]))
        final[run.group]["seconds"].append(float(run.rows[-1].get("time", float("nan"))))
    cols = metrics + PERF + ["seconds"]
    head = "| algorithm | seeds | " + " | ".join(c.split("/")[-1] for c in cols) + " |"
    lines = [head, "|" + " --- |" * (len(cols) + 2)]
    sft_runs = [r for r in select_runs(source, f"sft_{track}__*") if r.finished]
    lines.append(
        f"| SFT (start) | {len(sft_runs) or '-'} SFT run{'s' if len(sft_runs) != 1 else ''} | "
        + " | ".join(_start_cell(start.get(c, [])) for c in metrics)
        + " |"
        + " - |" * (len(PERF) + 1)
    )
    for group in sorted(set(final) | set(diverged)):
        seeds = len(final[group][metrics[0]]) + len(diverged[group])
        cells = (
            [_cell(final[group][c]) for c in cols]
            if final[group][metrics[0]]
            else ["diverged"] + ["-"] * (len(cols) - 1)
        )
        seeds_cell = f"{seeds} ({len(diverged[group])} diverged)" if diverged[group] else f"{seeds}"
        lines.append(f"| {algorithm_of(group)} | {seeds_cell} | " + " | ".join(cells) + " |")
    plotted = [r for r in runs if not any(r.name in names for names in diverged.values())]  # as compare's curves
    return ("\n".join(lines) + "\n" if final or diverged else ""), plotted


# Gao et al. 2024 in miniature: PPO on the success reward alone, plus the raw process reward, plus Clip + Delta
PRM_GROUPS = ["ppo_tiny-math", "ppo-prm-raw_tiny-math", "ppo-prm-clip-delta_tiny-math"]


def prm_table(source) -> str:
    """Final greedy accuracy, answer length and share of answers that end (EOS) on the test problems, and the steps
    per sampled answer in the last update, of the three PPO reward settings; mean [95% CI] over seeds (`_cell`),
    finished runs only. Empty when none of these runs exists."""
    cols = {
        "accuracy": "eval/accuracy",
        "completion_length": "eval/completion_length",
        "eos_rate": "eval/eos_rate",
        "steps per answer (last update)": "objective/num_steps",
    }
    lines = []
    for group in PRM_GROUPS:
        runs = finished_runs(_with_metrics(select_runs(source, f"{group}__*")))
        if not runs:
            continue
        values: dict[str, list[float]] = defaultdict(list)
        for run in runs:
            for name, metric in cols.items():
                rows = [row for row in run.rows if metric in row]
                if rows:
                    values[name].append(float(rows[-1][metric]))
        lines.append(f"| {algorithm_of(group)} | {len(runs)} | " + " | ".join(_cell(values[n]) for n in cols) + " |")
    if not lines:
        return ""
    head = "| reward | seeds | " + " | ".join(cols) + " |\n|" + " --- |" * (len(cols) + 2)
    return head + "\n" + "\n".join(lines) + "\n"


def colour_key(run_name: str) -> str:
    """The algorithm a run's curves are coloured by: `ppo` for `ppo_tiny-tldr__1` and for the frontier's
    `ppo-kl0_tiny-tldr-noisy__1` (one algorithm, one colour, in the results figures and the frontier's)."""
    run_name = run_name.split(" (")[0]  # a shipped run of the second rounding regime: `<name> (default)`
    m = NAME.match(run_name)
    return m["algo"] if m else algorithm_of(group_name(run_name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", default="runs", help="the runs to tabulate (and, by default, where to write)")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="read the shipped reference runs (benchmark/reference_runs/) instead of --runs-dir",
    )
    parser.add_argument(
        "--budget",
        choices=["quick", "full"],
        default="quick",
        help="with --reference: the main job's shipped runs (quick, the default) or those at the presets' full budgets",
    )
    parser.add_argument(
        "--rounding",
        choices=["native", "default"],
        default=None,
        help="with --reference: only the runs of one rounding regime (benchmark.run --rounding); default: both, pooled",
    )
    parser.add_argument("--out-dir", default=None, help="where to write the tables and figures (default: --runs-dir)")
    parser.add_argument("--tracks", nargs="+", default=sorted(TRACKS), choices=sorted(TRACKS), help="the tables")
    a = parser.parse_args(argv)
    runs_dir = Path(a.runs_dir)
    if not a.reference and (a.rounding or a.budget != "quick"):  # they choose among shipped runs, not a folder's
        raise SystemExit("error: --budget and --rounding choose among the shipped runs: pass them with --reference")
    if not a.reference and not runs_dir.is_dir():  # a misspelt directory would tabulate nothing and exit 0
        what = "is not a directory" if runs_dir.exists() else "does not exist"
        raise SystemExit(f"error: --runs-dir {runs_dir} {what}; pass the directory that holds the runs")
    out_dir = Path(a.out_dir) if a.out_dir else runs_dir
    if out_dir.exists() and not out_dir.is_dir():  # checked before any table is drawn
        raise SystemExit(f"error: --out-dir {out_dir} is a file, not a folder for the tables; pass another --out-dir")
    if a.reference:
        from benchmark import reference

        try:
            source = reference.load(budget_name=a.budget, rounding=a.rounding)
            where = f"the reference data ({reference.DIR}, {a.budget}{', ' + a.rounding if a.rounding else ''})"
        except reference.ReferenceError as e:  # a damaged data file: named, with how to restore it
            raise SystemExit(f"error: {e}") from None
    else:
        source, where = runs_dir, str(runs_dir)
    names = [r.name for r in source] if a.reference else [d.name for d in runs_dir.glob("*__*") if d.is_dir()]
    colours = Colours({colour_key(n) for n in names} - {"sft", "rm", "prm"})  # one per algorithm, every figure
    wrote: list[Path] = []  # listed at the end, where they are seen after the tables scrolled by
    for track in a.tracks:
        md, runs = track_table(source, track)
        if not md:
            print(f"{track}: no RL runs under {where}")
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"results_{track}.md").write_text(md)
        wrote.append(out_dir / f"results_{track}.md")
        if runs:  # not when every run diverged
            png = out_dir / f"results_{track}.png"
            plot(runs, TRACKS[track][0], png, TITLES[track], TRAIN_METRICS, colours, algorithm_of)
            wrote.append(png)
        print(f"## {track}\n\n{md}")
        if track == "tiny-math" and (family := [r for r in runs if algorithm_of(r.group) in GRPO_FAMILY]):
            title = "tiny-math: GRPO's variants, greedy accuracy and the training reward"
            png = out_dir / "results_tiny-math_grpo.png"
            plot(family, TRACKS[track][0], png, title, TRAIN_METRICS, colours, algorithm_of)
            wrote.append(png)
        if track == "tiny-math" and (prm := prm_table(source)):
            (out_dir / "results_tiny-math_prm.md").write_text(prm)
            wrote.append(out_dir / "results_tiny-math_prm.md")
            print(f"\n## tiny-math, process rewards (Gao et al. 2024)\n\n{prm}")
    for track in FRONTIER_TRACKS:  # the KL frontier suites (benchmark/frontier.py)
        if (md := write_frontier(source, track, out_dir, colours)) is not None:
            wrote += [out_dir / f"frontier_{track}.md", out_dir / f"frontier_{track}.png"]
            print(f"\n## {track}: {FRONTIER_TRACKS[track][0]} against KL\n\n{md}")
    print("\n".join(["", "wrote:", *(f"  {path}" for path in wrote)]) if wrote else f"wrote nothing under {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
