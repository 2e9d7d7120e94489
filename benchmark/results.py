"""The README's results tables and plots: `python -m benchmark.results [--runs-dir runs]`.

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

from benchmark.compare import MIN_SEEDS_FOR_CI, bootstrap_ci, finished_runs, plot, read_run
from benchmark.frontier import TRACKS as FRONTIER_TRACKS
from benchmark.frontier import write_frontier

TRACKS = {"tiny-tldr": ["eval/gold_reward", "eval/win_rate"], "tiny-math": ["eval/accuracy", "eval/completion_length"]}
# per-update training metrics plotted under the evaluations: a point per update (offline DPO samples nothing and has
# none); each script's own estimator, so KL compares runs of one algorithm, not algorithms (docs/frontier.md)
TRAIN_METRICS = ("objective/reward", "objective/kl")
TITLES = {
    "tiny-tldr": "tiny-tldr: gold reward of greedy summaries (judge), and the reward model's score while training",
    "tiny-math": "tiny-math: greedy accuracy on the 200 test problems, and the training reward",
}
PERF = ["perf/episodes_per_sec", "perf/peak_mem_gb"]
# grpo_math.py's variants (benchmark/run.py's tiny-math stages), plotted on their own beside GRPO
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


def track_table(runs_dir: Path, track: str) -> tuple[str, list]:
    metrics = TRACKS[track]
    runs = [read_run(d) for d in sorted(runs_dir.glob(f"*_{track}__*")) if (d / "metrics.jsonl").exists()]
    # SFT / reward-model stages are not RL algorithms
    runs = finished_runs([r for r in runs if r.group.split("_")[0] not in ("sft", "rm", "prm")])
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
                f"{run.group.split('_')[0]}, left out of its values and curves",
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
    sft_runs = [d for d in runs_dir.glob(f"sft_{track}__*") if (d / "done.json").exists()]
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
        lines.append(f"| {group.split('_')[0]} | {seeds_cell} | " + " | ".join(cells) + " |")
    plotted = [r for r in runs if not any(r.name in names for names in diverged.values())]  # as compare's curves
    return ("\n".join(lines) + "\n" if final or diverged else ""), plotted


# Gao et al. 2024 in miniature: PPO on the success reward alone, plus the raw process reward, plus Clip + Delta
PRM_GROUPS = ["ppo_tiny-math", "ppo-prm-raw_tiny-math", "ppo-prm-clip-delta_tiny-math"]


def prm_table(runs_dir: Path) -> str:
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
        runs = finished_runs(
            [read_run(d) for d in sorted(runs_dir.glob(f"{group}__*")) if (d / "metrics.jsonl").exists()]
        )
        if not runs:
            continue
        values: dict[str, list[float]] = defaultdict(list)
        for run in runs:
            for name, metric in cols.items():
                rows = [row for row in run.rows if metric in row]
                if rows:
                    values[name].append(float(rows[-1][metric]))
        lines.append(f"| {group.split('_')[0]} | {len(runs)} | " + " | ".join(_cell(values[n]) for n in cols) + " |")
    if not lines:
        return ""
    head = "| reward | seeds | " + " | ".join(cols) + " |\n|" + " --- |" * (len(cols) + 2)
    return head + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--tracks", nargs="+", default=sorted(TRACKS))
    a = parser.parse_args(argv)
    runs_dir = Path(a.runs_dir)
    wrote: list[Path] = []  # listed at the end, where they are seen after the tables scrolled by
    for track in a.tracks:
        md, runs = track_table(runs_dir, track)
        if not md:
            print(f"{track}: no RL runs under {runs_dir}")
            continue
        (runs_dir / f"results_{track}.md").write_text(md)
        wrote.append(runs_dir / f"results_{track}.md")
        if runs:  # not when every run diverged
            plot(runs, TRACKS[track][0], runs_dir / f"results_{track}.png", TITLES[track], TRAIN_METRICS)
            wrote.append(runs_dir / f"results_{track}.png")
        print(f"## {track}\n\n{md}")
        if track == "tiny-math" and (family := [r for r in runs if r.group.split("_")[0] in GRPO_FAMILY]):
            title = "tiny-math: GRPO's variants, greedy accuracy and the training reward"
            plot(family, TRACKS[track][0], runs_dir / "results_tiny-math_grpo.png", title, TRAIN_METRICS)
            wrote.append(runs_dir / "results_tiny-math_grpo.png")
        if track == "tiny-math" and (prm := prm_table(runs_dir)):
            (runs_dir / "results_tiny-math_prm.md").write_text(prm)
            wrote.append(runs_dir / "results_tiny-math_prm.md")
            print(f"\n## tiny-math, process rewards (Gao et al. 2024)\n\n{prm}")
    for track in FRONTIER_TRACKS:  # the KL frontier suites (benchmark/frontier.py)
        if (md := write_frontier(runs_dir, track)) is not None:
            wrote += [runs_dir / f"frontier_{track}.md", runs_dir / f"frontier_{track}.png"]
            print(f"\n## {track}: {FRONTIER_TRACKS[track][0]} against KL\n\n{md}")
    print("\n".join(["", "wrote:", *(f"  {path}" for path in wrote)]) if wrote else f"wrote nothing under {runs_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
