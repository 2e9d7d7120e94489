"""Compare learning curves across runs: `python -m benchmark.compare RUN_DIR... [--metric eval/gold_reward]`.

Reads `metrics.jsonl` of any set of run directories (and, when asked with `--wandb-project` and online, wandb
runs), groups runs by algorithm (the run name without its `__<seed>` suffix), aggregates the seeds of each group,
and writes:
  * a PNG with the metric against episodes and against wall-clock time: per group the mean over seeds, over the x
    range all its runs cover, a marker where the runs evaluated, with a band that the legend names: the 95% bootstrap
    interval of the mean with 3 or more seeds, the min-max of the two seeds with 2, none with 1; `--train-metrics`
    adds panels of per-update training metrics (a point per update);
  * a markdown table of final values: mean, 95% bootstrap CI of the mean (3 or more seeds; with fewer, the seeds'
    values instead: "0.410, 0.520 (2 seeds)"), and the interquartile mean (IQM, the mean of the middle 50% of runs,
    as recommended by Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice" / rliable); next to
    them two sample-efficiency figures with the same intervals, which rank variants whose final values saturate: the
    AUC (the area under each run's evaluation curve over the episodes every run covers, divided by that span: its
    mean value there) and the episodes to reach a threshold (`--threshold`; by default 90% of the way from the start
    to the best group's peak). Under the table, the ranking by AUC and, for each of the three measures, the pairs of
    groups that separate (non-overlapping 95% intervals over 3 or more seeds, as benchmark/frontier.py tests), those
    that do not, and those not tested (fewer seeds).
`--reference rloo` adds the library's shipped runs of rloo on the tracks of the runs given (benchmark/reference.py:
metrics data in the repository, nothing is rerun): a dashed curve with its band under the runs, a row of the table.
A group keeps one colour in every figure of a command (`Colours`).
Only runs that completed their budget count: a run directory without the `done.json` its script writes at the end
(a run stopped by a signal or a crash, or one still running) is left out of the curves and the table with a warning,
since its last value is not a final one. A wandb run counts when its state is "finished" (wandb cannot tell a run
stopped by SIGTERM, which exits cleanly, from a completed one). A run whose metrics file is missing, or whose torn
last row was dropped, is reported; a run with no value of the metric is left out of its group.
What is compared is said, never guessed:
  * a run's final value is the metric at its last logged row that holds it; a run whose final value is NaN or inf
    (every value, or only the last) is counted as diverged: the table's seeds column says "3 (1 diverged)", the mean,
    interval and IQM are over the other seeds, a group whose every seed diverged shows "diverged", and a warning names
    each such run; diverged runs are left out of the curves (an earlier value is never shown as final);
  * a path that does not exist, or a directory without metrics.jsonl, is named in a warning and skipped (not
    reported as a run that did not finish);
  * the same run directory given twice (compared by its resolved path) counts once, with a warning;
  * two run directories of the same name in different folders are different experiments: the groups they belong to
    are kept apart by folder ("ppo_tiny-tldr (runs/a)", "ppo_tiny-tldr (runs/b)"), with a warning naming both paths.
Refused in one `error:` line, before anything is written: a damaged run file, in the line every tool gives it
(benchmark/runfiles.py: a pipe or a device, bytes that are not UTF-8, a row that is not an object of numbers, an
`episode` counter that goes back: the rows of two runs in one file, a done.json that is not an object), runs of
different tracks of the benchmark (by name: `rloo_tiny-tldr__1`, `grpo_tiny-math__1`) in one ranking unless
`--across-tracks`, a `--threshold` that is not finite, an `--out` that cannot be written.
Works offline, without any account.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

from benchmark import frontier, reference, results
from benchmark.curves import (
    Run,
    diverged_runs,
    finished_runs,
    markdown_table,
    mixed_scripts,
    outputs,
    plot,
    provenance_differences,
    read_runs,
    read_wandb_runs,
    summarize,
    track_of,
    warn_problems,
)


def mixed_tracks(runs: list[Run]) -> str:
    """ "" when the runs are on one of the benchmark's tracks at most (their name's `_<track>`, results.TRACKS and
    frontier.TRACKS, and a study's `<track>-study` at its own budget: the same metric name measures another task or
    budget on each, e.g. eval/accuracy of a reward model on tiny-tldr and of a policy on tiny-math), else what each
    track holds; a run of another name is not judged."""
    known = {*results.TRACKS, *frontier.TRACKS}
    known |= {f"{t}-study" for t in known}
    by_track: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        if track_of(r.group) in known:
            by_track[track_of(r.group)].append(r.name)
    if len(by_track) < 2:
        return ""
    return "; ".join(
        f"{track}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for track, names in sorted(by_track.items())
    )


def out_problem(out: Path) -> str:
    """Why OUT.png and OUT.md cannot be written, or "": checked before any work, so a long read is not lost."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    for path in outputs(out):
        if path.is_dir():
            return f"{path} is a folder"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    return ""


def shared_metrics_hint(runs: list[Run]) -> str:
    """What the runs could be compared on: the evaluation metrics every one of them logs, or that they share none."""
    logged = [{k for row in r.rows for k in row if k.startswith("eval/")} for r in runs]
    shared = sorted(set.intersection(*logged)) if logged else []
    if shared:
        return f"they all log {', '.join(shared)}: pass one with --metric"
    return "they share no evaluation metric" if runs else "no run was read"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--metric", default="eval/gold_reward", help="metric to compare")
    parser.add_argument("--out", default="runs/compare", help="output prefix: writes OUT.png and OUT.md")
    parser.add_argument(
        "--train-metrics", nargs="*", default=[], help="per-update metrics plotted below, e.g. objective/reward"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="the value whose episodes to reach the table gives (default: 90%% of the way from the start to the best "
        "group's peak)",
    )
    parser.add_argument(
        "--reference",
        nargs="+",
        default=[],
        metavar="ALGO",
        help="also draw the shipped runs of these algorithms (benchmark/reference_runs/: rloo, or rloo_tiny-tldr for "
        "one track) on the tracks of the runs given, as a band under them, and add them to the table",
    )
    parser.add_argument(
        "--across-tracks",
        action="store_true",
        help="rank runs of different tracks (tiny-tldr, tiny-math, ...) together; refused by default, since one metric "
        "name measures another task on each",
    )
    parser.add_argument("--wandb-project", default=None, help="also read the runs of this wandb project (online)")
    parser.add_argument("--wandb-entity", default=None, help="wandb entity of that project")
    a = parser.parse_args(argv)
    if a.threshold is not None and not math.isfinite(a.threshold):
        raise SystemExit(
            f"error: --threshold {a.threshold} is not a finite number; give a value of {a.metric} (e.g. 0.5), or leave "
            "it out for 90% of the way from the start to the best group's peak"
        )
    if why := out_problem(Path(a.out)):
        raise SystemExit(f"error: --out {a.out}: {why}, so OUT.png and OUT.md cannot be written; pass another --out")
    runs = read_runs([Path(p) for p in a.runs])  # damage (benchmark/runfiles.py) ends here in one `error:` line
    if a.wandb_project:
        runs += read_wandb_runs(a.wandb_project, a.wandb_entity)
    warn_problems(runs)
    runs = finished_runs(runs)
    if a.reference:
        try:
            runs += reference.runs_for(a.reference, runs, a.metric)
        except reference.ReferenceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    usable = [r for r in runs if any(a.metric in row for row in r.rows)]
    for r in runs:
        if r not in usable:
            print(f"warning: {r.name} has no value of {a.metric}; left out", file=sys.stderr)
    if not usable:
        print(f"error: no finished run has the metric {a.metric}; {shared_metrics_hint(runs)}", file=sys.stderr)
        return 1
    if (tracks := mixed_tracks(usable)) and not a.across_tracks:
        raise SystemExit(
            f"error: the runs are of different tracks ({tracks}): one ranking of {a.metric} would mix tasks; compare "
            "each track's runs on their own (or pass --across-tracks)"
        )
    table = summarize(usable, a.metric, a.threshold)
    diverged = diverged_runs(usable, a.metric)
    notes = [
        f"{r.name}: its final {a.metric} is not finite (diverged); counted as a diverged seed of {r.group}, left "
        "out of its mean, interval, IQM and curves"
        for r in diverged
    ]
    notes += [f"every seed of {t['group']} diverged: no final value" for t in table if not t["values"]]
    for line in notes:
        print(f"warning: {line}", file=sys.stderr)
    out_png, out_md = outputs(Path(a.out))
    try:
        plot(
            [r for r in usable if all(r is not d for d in diverged)],
            a.metric,
            out_png,
            f"{a.metric}: {', '.join(sorted({r.group for r in usable}))}",
            tuple(a.train_metrics),
        )
    except OSError as e:  # a folder the check before could not see as read-only (root), a full disk
        raise SystemExit(f"error: --out {a.out}: {out_png} cannot be written ({e}); pass another --out") from None
    md = markdown_table(table, a.metric)
    md += "".join(f"\n> warning: {line}\n" for line in notes)
    differences = provenance_differences(usable) + mixed_scripts(usable)
    for line in differences:
        print(f"warning: {line}", file=sys.stderr)
    unknown = [r.name for r in usable if not r.provenance]
    if unknown and len(unknown) < len(usable):
        print(
            f"warning: {len(unknown)} run(s) record no provenance.json (older runs): {', '.join(unknown[:5])}",
            file=sys.stderr,
        )
    md += "".join(f"\n> warning: {line}\n" for line in differences)
    try:
        out_md.write_text(md)
    except OSError as e:
        raise SystemExit(f"error: --out {a.out}: {out_md} cannot be written ({e}); pass another --out") from None
    print(md)
    print(f"wrote {out_png} and {out_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
