"""Run a reproduction suite end to end: `python -m benchmark.run SUITE [--seeds 1 2 3] [--dry-run]`.

Suites:
  quick          the README's main job: SFT and RM, then PPO, RLOO, ReMax, DPO, online DPO (tiny-tldr) and GRPO
                 (tiny-math) at their `--quick` budgets, and a quick KL frontier on tiny-tldr-noisy that ranks them
                 (PPO without a KL penalty, RLOO, offline DPO; CPU, offline; the tiny world is built on first use)
  learning       `quick` plus GRPO on tiny-math's KL frontier, at `--quick` budgets: the schedule of
                 tests/test_learning.py
  tiny           tiny-tldr and tiny-math at the presets' full budgets
  tiny-tldr      SFT -> reward model -> PPO, RLOO, ReMax, DPO, online DPO on tiny-tldr
  tiny-math      SFT -> process reward model -> GRPO and its variants on tiny-math
  frontier-tldr  the KL frontier on tiny-tldr-noisy: each algorithm at several KL penalties (docs/frontier.md)
  frontier-math  the KL frontier on tiny-math
  frontier       both frontiers
  tldr           the N+ reproduction on TL;DR with Pythia (GPUs, the hub)
  math           GSM8K with Qwen2.5-0.5B-Instruct and MATH with Qwen2.5-Math-1.5B (GPUs, the hub)
  study          `--scripts A.py B.py`: each script (a fork of a library script, or one of them) on the tracks that
                 can separate variants of its family, then their ranking with 95% intervals and the figure
                 (benchmark/study.py)

Each stage is one command of an algorithm script, run as a subprocess with its own run directory under
`runs/`. A stage that fails is reported and the suite goes on with the stages that do not depend on it.
When the suite is rerun, a stage is
  skipped   when the script's `runs/<run_name>/done.json` (written at the end of a run that completed its budget)
            holds the same command arguments (a `--quick` run does not count as done for the full suite) and the
            path and sha256 of the very file that would run now (an edited fork, or another file of the same name,
            runs again), and the models it read are the ones there now (the sha256 of each needed run's done.json,
            recorded in `runs/_suite/<run_name>.stage.json` when it was launched);
  resumed   (`--resume`) when the run stopped part way (a checkpoint, no done.json) and was started by the same
            command, as recorded in that stage record, and by the same file (its provenance.json);
  rerun     (`--overwrite`) otherwise when its directory exists: another command, another script, no checkpoint, or
            a stage it needs was (re)run, now or by another invocation since. The line before it says why.
`--num-threads`, `--resume` and `--overwrite` do not count as a different command. SIGTERM or SIGINT to the suite
(a hangup as SIGTERM) is passed on to the running stages, each in a session of its own; the suite starts no other,
waits for them to checkpoint and exit (`[stopped] <run_name>`), and exits with the signal's code: the same command
resumes them. `--dry-run` prints what would
be run, with these decisions. At the end a summary table of each run's final metrics is printed and written to
`runs/<suite>_summary.md`, and the paths of what was written are printed.

Before it launches anything, every place the suite writes is checked (WORKDIR/runs, `runs/_suite/` with each stage's
log and record, the lock, the summary, each run's directory; a study's tables and figures): a file where a folder
must be, a folder where a file must be, or a name longer than the file system takes is one `error:` line. On a runs
directory that cannot be written (a read-only copy), a suite whose every stage had finished prints its summary, and a
study its report, without writing them, and one line says so; one with a stage to run is refused in one line.
One suite runs in a runs directory at a time (a lock, `runs/._suite.lock`): a second one is refused in one line
naming the first one's process, before it launches or logs anything (it would relaunch the first one's stages into
the same logs). While it runs, each stage's output (tqdm bars included) goes to `runs/_suite/<run_name>.log`, and the
suite shows
its status (benchmark/status.py): each stage waiting; running, with its time so far, progress, rate and time left
from the last tqdm update in its log (`ppo_tiny-tldr__1  running  1m02s  12/32 updates  0.90 it/s  22s left`, or
`starting` before the first); done, with its time and final headline metric (`eval/gold_reward`, `eval/accuracy`);
skipped; blocked by a failed stage it needs; or failed, with its log's path. Above them, the elapsed time and an
estimate of what is left: tqdm's remaining time of the running stages and, for the waiting ones, the durations of
finished stages of the same algorithm or script, spread over the `--jobs` slots (`unknown` until there is one).
On a terminal that status is a block redrawn in place about once a second, below the event lines. Otherwise (CI,
`nohup`, a pipe; or with `--plain`) the output is one line per event, without ANSI codes: `[run] <command>` when a
stage starts, `[ok] <run_name> in <s>s: <headline metric>`, `[FAILED] <run_name> (exit <code>); last lines of <log>:`
(then those lines, indented), `[skip] <run_name>: <why>` (finished earlier, or blocked: `depends on failed [...]`),
`[resume]` / `[rerun] <run_name>: <why>` before its `[run]`; a `[progress]` line (elapsed, estimate, each running
stage's progress) every minute; and `[end]` when the last stage ends.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmark import reference, reproduce, study
from benchmark.launch import ROUNDING, check_seeds, not_a_folder, output_problem, regime_workdir, run_suite
from benchmark.suites import SUITES


def regime_folder(workdir: Path, rounding: str, dry_run: bool) -> None:
    """WORKDIR/rounding-<name>, made unless a dry run; one `error:` line where a file stands in its way, or where it
    cannot be made."""
    folder = regime_workdir(workdir, rounding)
    blocked = not_a_folder(folder)
    if blocked is not None and blocked != folder:
        raise SystemExit(
            f"error: --workdir {workdir}: {blocked} is a file, not a folder; pass a folder (runs of --rounding "
            f"{rounding} go to WORKDIR/{folder.name}/runs)"
        )
    if blocked is not None:
        raise SystemExit(
            f"error: --rounding {rounding}: {folder} is a file, not a folder, and the suite of --rounding {rounding} "
            "runs there; move it or pass another --workdir"
        )
    long = output_problem(workdir, [])  # a part of WORKDIR too long for a file name
    if long:
        raise SystemExit(long)
    if dry_run or folder.is_dir():  # a dry run makes nothing; a folder there is used as it is (read-only too)
        return
    try:
        folder.mkdir(parents=True)
    except OSError as e:
        raise SystemExit(
            f"error: --rounding {rounding}: {folder} cannot be made ({e.strerror or e}); pass a --workdir you can write"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted([*SUITES, "study"]))
    parser.add_argument(
        "--scripts", nargs="+", default=None, help="suite study: the scripts to compare (rloo_batchmean.py rloo.py)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the RL stages")
    parser.add_argument("--workdir", default=".", help="working directory; runs are written to WORKDIR/runs")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="independent stages run at once (the cores split between them; with 1, a stage takes every core)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="keep these algorithms (ppo, grpo) or algorithm_track names (ppo_tiny-tldr) and what they need",
    )
    parser.add_argument(
        "--quick", action="store_true", help="shorter RL runs (the learning tests); not the README's numbers"
    )
    parser.add_argument(
        "--shared-starts",
        action="store_true",
        help="study: every seed from seed 1's SFT and reward model (paired); default: each seed its own",
    )
    parser.add_argument("--name", default=None, help="study: the name of its outputs (default: the scripts' names)")
    parser.add_argument(
        "--tracks",
        nargs="+",
        default=None,
        help="study: these tracks of each script's family (its study tracks, and the longer ones of "
        "benchmark/study.py's MORE_TRACKS); default: its study tracks",
    )
    parser.add_argument(
        "--rounding",
        choices=sorted(ROUNDING),
        default="native",
        help="native: the machine's kernels; default: ATEN_CPU_CAPABILITY=default, a second rounding regime on one "
        "machine, its runs under WORKDIR/rounding-default/",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="one line per event even on a terminal (no redrawn status block); the default off a terminal",
    )
    if hasattr(sys.stdout, "reconfigure"):  # a run or path name of any letters on an ASCII-only stdout: escaped
        sys.stdout.reconfigure(errors="backslashreplace")
    a = parser.parse_args()
    live = False if a.plain else None  # None: the block on a terminal, event lines otherwise
    if (a.suite == "study") != (a.scripts is not None):
        raise SystemExit("error: --scripts goes with the suite study, and the study needs it")
    check_seeds(a.seeds)
    if a.rounding != "native":
        if a.suite in ("tldr", "math"):
            raise SystemExit(
                f"error: --rounding {a.rounding} is for the tiny world on a CPU, not the GPU suite {a.suite}"
            )
        os.environ.update(ROUNDING[a.rounding])  # every stage inherits it; the cache compares it (regime_change)
        regime_folder(Path(a.workdir), a.rounding, a.dry_run)
        a.workdir = str(regime_workdir(Path(a.workdir), a.rounding))
        regime = " ".join(f"{k}={v}" for k, v in ROUNDING[a.rounding].items())
        print(f"# rounding {a.rounding}: {regime}; runs in {a.workdir}/runs")
    if a.suite == "study":
        suite_only = [flag for flag, given in (("--only", a.only is not None), ("--quick", a.quick)) if given]
        if suite_only:  # the study runs every track of each script's family at its own budgets
            raise SystemExit(
                f"error: {' and '.join(suite_only)} {'act' if len(suite_only) > 1 else 'acts'} on the suites, not the "
                "study, which runs each script on every "
                "track of its family at the study's budgets (benchmark/study.py); leave them out"
            )
        status = study.run_study(
            a.scripts,
            a.seeds,
            Path(a.workdir),
            a.dry_run,
            jobs=a.jobs,
            live=live,
            shared_starts=a.shared_starts,
            name=a.name,
            tracks=a.tracks,
        )
        sys.exit(1 if any(s == "failed" for s in status.values()) else 0)
    study_only = [
        flag
        for flag, given in (
            ("--shared-starts", a.shared_starts),
            ("--name", a.name is not None),
            ("--tracks", a.tracks is not None),
        )
        if given
    ]
    if study_only:  # the suites always train each seed's own models and write SUITE_summary.md
        verb = "act" if len(study_only) > 1 else "acts"
        raise SystemExit(f"error: {' and '.join(study_only)} {verb} on the study, not the suites; leave them out")
    status = run_suite(a.suite, a.seeds, Path(a.workdir), a.dry_run, jobs=a.jobs, only=a.only, quick=a.quick, live=live)
    if a.suite == "quick" and not a.dry_run:  # the main job ends with whether this install reproduces the library
        try:
            verdicts, line, _ = reproduce.reproduce(Path(a.workdir) / "runs")
            print("\n".join(["", "# python -m benchmark.reproduce", *(v.line for v in verdicts), line]), flush=True)
        except (reproduce.ReproduceError, reference.ReferenceError) as e:
            print(f"\n# python -m benchmark.reproduce: {e}", flush=True)
    sys.exit(1 if any(s == "failed" for s in status.values()) else 0)


if __name__ == "__main__":
    main()
