"""How `python -m benchmark.run` runs a suite's stages (benchmark/run.py's docstring says what a user sees): for each
stage, whether to skip, resume, rerun or run it (`decide`: its done.json's command, the script's path and sha256, the
models it read, the rounding regime), then each launched as a subprocess with its own run directory and log, `--jobs`
at a time, with the status display, SIGTERM passed on, and the summary table at the end (`run_suite`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark import runfiles
from benchmark.assets import ensure_assets
from benchmark.curves import provenance_differences, read_run
from benchmark.status import BLOCKED, DONE, FAILED, RUNNING, SKIPPED, Display, StageStatus, headline, log_tail
from benchmark.suites import (
    CHECK_STAGES,
    LEARNING_FRONTIER_STAGES,
    MAIN_FRONTIER_STAGES,
    QUICK_STAGES,
    REPO,
    SUITES,
    Stage,
)
from clean_rlhf_utils import ownership, storage

# flags that change how a run is launched, not what it computes: left out when commands are compared
LAUNCH_FLAGS = {"--resume": 0, "--overwrite": 0, "--num-threads": 1}  # flag: number of values it takes


def same_run_args(argv: list[str]) -> list[str]:
    """`argv` without LAUNCH_FLAGS, for comparing the command of a finished or stopped run with a stage's."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in LAUNCH_FLAGS:
            i += 1 + (LAUNCH_FLAGS[flag] if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def _read_json(path: Path) -> dict | None:
    """A run's or a stage's JSON object through the one checked reader (a pipe is never read), None when it is not
    there or damaged (`_damage` says how)."""
    try:
        return runfiles.read_object(path)
    except runfiles.RunFileError:
        return None


def _damage(path: Path) -> str:
    """What the one checked reader says of a damaged `path` ("" when it holds a JSON object)."""
    try:
        runfiles.read_object(path)
    except runfiles.RunFileError as e:
        return e.message
    return ""


def _difference(was: list[str], now: list[str]) -> str:
    """The arguments that differ, common start and end left out: `was '--total-episodes 512', now (none)`."""
    k = 0
    while k < min(len(was), len(now)) and was[k] == now[k]:
        k += 1
    j = 0
    while j < min(len(was), len(now)) - k and was[len(was) - 1 - j] == now[len(now) - 1 - j]:
        j += 1

    def show(a: list[str]) -> str:
        return repr(shlex.join(a[k : len(a) - j])) if a[k : len(a) - j] else "(none)"

    return f"was {show(was)}, now {show(now)}"


SUITE_DIR = "_suite"  # the suite's own files under runs/: each stage's record and log


def stage_record(runs_dir: Path, run_name: str) -> Path:
    """Where the suite records the arguments it launched a stage with: outside the run directory, which the script's
    `--overwrite` deletes and which a new run must find empty, and in `runs/_suite/` with the stages' logs, so that a
    glob of run directories (`runs/ppo_tiny-tldr__*`) takes run directories only."""
    return runs_dir / SUITE_DIR / f"{run_name}.stage.json"


def note_end(record: Path, rc: int) -> None:
    """The stage's end (time and exit code) added to its record, for `benchmark.tools.timeline`; a record that cannot
    be read (a stage launched by an older suite) is left as it is."""
    data = _read_json(record)
    if not isinstance(data, dict) or "launched" not in data:
        return
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(data | {"ended": round(time.time(), 3), "rc": rc}) + "\n")
    os.replace(tmp, record)


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def stopped_lines(name: str, rc: int, run_dir: Path, log: Path) -> list[str]:
    """What a stage stopped by the suite's signal left: "resumes it" only when a complete checkpoint is there (its
    state.json whole: `storage.checkpoint_to_resume`), else that the command starts it over; and the stage's last
    `error:` line (a checkpoint that failed on a full disk), which is otherwise only in its log."""
    checkpoint, _ = storage.checkpoint_to_resume(run_dir)
    if checkpoint is not None:
        step = (storage.read_state(checkpoint) or {}).get("step")
        first = f"[stopped] {name} (exit {rc}); the same command resumes it from {checkpoint.name}/ (step {step})"
    else:
        first = f"[stopped] {name} (exit {rc}); it left no complete checkpoint: the same command starts it over"
    text = log.read_text(errors="replace") if log.is_file() else ""
    errors = [line.strip() for line in text.splitlines() if line.strip().startswith("error:")]
    return [first, *(f"    {line}" for line in errors[-1:])]


def script_change(recorded, script: Path, launched: str | None = None) -> str | None:
    """Why a run whose record (done.json's or provenance.json's `script`: its path relative to the checkout, or its
    file name for a fork outside it, and the sha256 of its bytes) says it was made by another file than `script` as it
    is now; None when it was made by this file with these bytes. The cache is keyed by the code, not only by the
    arguments: a fork edited after its first study, or another file of the same name, runs again. For a fork outside
    the checkout, whose run names no folder, `launched` is the file the suite started it with (its stage record)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str) or not recorded.get("path"):
        return "its record does not say which script made it (no path and sha256)"
    was = Path(str(recorded["path"]))
    if recorded.get("outside"):  # the file name only: the suite's own record says which file it launched
        where = Path(launched) if launched else None
        same_file = not script.resolve().is_relative_to(REPO) and was.name == script.name
        same_file = same_file and (where is None or where.resolve() == script.resolve())
    else:
        where = was if was.is_absolute() else REPO / was
        same_file = where.resolve() == script.resolve()
    if not same_file:
        return f"it was made by {where or recorded['path']}, and this stage runs {script}"
    now = _sha256(script)
    if now is None:
        return f"its script {script} cannot be read"
    if now != recorded["sha256"] and recorded.get("edited_while_running"):  # its record names the bytes that ran
        return f"{script.name} was edited while it ran (sha256 {recorded['sha256'][:12]} ran, {now[:12]} now)"
    if now != recorded["sha256"]:
        return f"{script.name} changed since it ran (sha256 {recorded['sha256'][:12]} then, {now[:12]} now)"
    return None


# Rounding regimes (issue 57): CPUs round differently (vector width, reduction order) and RL turns a last digit into
# another run, so a claim must hold on more than one. `--rounding default` runs every stage with torch's portable
# kernels (ATEN_CPU_CAPABILITY=default: no AVX2 / AVX-512 in ATen's own kernels; the BLAS is unchanged), a second host
# on one machine. Its runs go to WORKDIR/rounding-default/runs, never beside the native ones.
ROUNDING = {"native": {}, "default": {"ATEN_CPU_CAPABILITY": "default"}}
REGIME_ENV = ("ATEN_CPU_CAPABILITY",)


def regime_change(run_dir: Path) -> str | None:
    """Why a run was made under another rounding regime than the one stages get now (this process's environment, which
    they inherit); None when the same, or for a run that predates the record (provenance.json's `numerics_env`)."""
    started = ((_read_json(run_dir / "provenance.json") or {}).get("started") or {}).get("host") or {}
    recorded = started.get("numerics_env")
    if not isinstance(recorded, dict):
        return None
    for key in REGIME_ENV:
        if recorded.get(key) != os.environ.get(key):
            was, now = recorded.get(key) or "(unset)", os.environ.get(key) or "(unset)"
            return f"it ran with {key}={was} and the suite runs with {now}: another rounding regime"
    return None


def regime_workdir(workdir: Path, rounding: str) -> Path:
    """Where a suite of `rounding` runs: WORKDIR itself for the machine's own regime, WORKDIR/rounding-<name> else."""
    return Path(workdir) if rounding == "native" else Path(workdir) / f"rounding-{rounding}"


def needs_fingerprint(runs_dir: Path, needs: list[str]) -> dict[str, str | None]:
    """The sha256 of each needed run's done.json (its command, script hash and finishing time): the suite records it
    when it launches a stage, so a stage built on a model that was rebuilt later, by another invocation, runs again."""
    return {name: _sha256(runs_dir / name / "done.json") for name in needs}


def refuse_foreign(runs_dir: Path, run_name: str, action: str, why: str) -> tuple[str, str]:
    """`decide`'s answer, or ("refuse", why) for a rerun whose directory (deleted by `--overwrite`) is not recognisably
    a run of this library (`storage.not_a_run_problem`): the suite never deletes what is not a run."""
    if action == "rerun":
        problem = storage.not_a_run_problem(
            runs_dir / run_name, "rerunning it (--overwrite)", "move what is yours out of it"
        )
        if problem:
            return "refuse", problem.removeprefix("error: ")
    return action, why


def decide(
    runs_dir: Path,
    run_name: str,
    args: list[str],
    rebuilt: list[str] = (),
    script: Path | None = None,
    needs: list[str] = (),
) -> tuple[str, str]:
    """What the suite does with a stage whose command arguments (after the script path) are `args`, and why:
    "skip" (done.json with these arguments, made by `script` as it is now from the models it needs as they are now),
    "resume" (checkpoint, no done.json, launched with these arguments by `script` as it is now), "rerun" (the
    directory exists otherwise: launched with --overwrite) or "run" (no directory). `rebuilt`: the stages it needs
    that were run in this invocation, so that what it finished earlier was built on older models. `script` None: the
    arguments alone decide (a caller that does not know the file)."""
    run_dir, args = runs_dir / run_name, same_run_args(args)
    if not run_dir.exists():
        return "run", "new run"
    if rebuilt:
        return "rerun", f"it needs {', '.join(rebuilt)}, run again now"
    done = _read_json(run_dir / "done.json")
    record = _read_json(stage_record(runs_dir, run_name))
    if done is not None:
        was = same_run_args([str(a) for a in done.get("argv") or []])
        if was != args:
            return (
                "rerun",
                f"its done.json is from another command, the budget or flags differ: {_difference(was, args)}",
            )
        launched = (record or {}).get("script")
        changed = script_change(done.get("script"), script, launched) or regime_change(run_dir) if script else None
        if changed:
            return "rerun", changed
        built_on = (record or {}).get("needs")
        if isinstance(built_on, dict):  # a record without it (older suites, a run by hand): the arguments decide
            now = needs_fingerprint(runs_dir, [n for n in needs if n in built_on])
            older = [n for n, h in now.items() if h != built_on[n]]
            if older:
                return "rerun", f"it was built on an earlier {', '.join(older)}, which was run again since"
        return "skip", "finished earlier with the same command and script (done.json)"
    if os.path.lexists(run_dir / "done.json"):
        return "rerun", f"its done.json is damaged ({_damage(run_dir / 'done.json')})"
    if storage.checkpoint_to_resume(run_dir)[0] is None:
        return "rerun", "it did not finish (no done.json) and has no complete checkpoint to resume"
    if record is None:
        return "rerun", "it did not finish and there is no record of the command that started it"
    was = same_run_args([str(a) for a in record.get("argv") or []])
    if was != args:
        return "rerun", f"it did not finish, and was started by another command: {_difference(was, args)}"
    if script is not None:
        started = ((_read_json(run_dir / "provenance.json") or {}).get("started") or {}).get("script")
        changed = script_change(started, script, record.get("script")) or regime_change(run_dir)
        if changed:
            return "rerun", f"it did not finish, and not with this script: {changed}"
    return "resume", "it stopped part way (a checkpoint, no done.json); same command and script"


def final_metrics(run_dir: Path) -> dict:
    """The last value of every metric in a run's metrics.jsonl, {} when it is damaged (the suite's display goes on;
    the tools that judge the run name the damage)."""
    last: dict = {}
    try:
        rows = read_run(run_dir).rows
    except runfiles.RunFileError:
        return {}
    for row in rows:
        last.update(row)
    return last


LAUNCH = {"run": [], "rerun": ["--overwrite"], "resume": ["--resume"]}  # flags appended per decision


SEED_RANGE = (0, 2**31 - 1)  # the scripts' `--seed` range (clean_rlhf_utils/args.py)


def check_seeds(seeds: list[int]) -> None:
    """The suites' and the study's `--seeds`, refused in one line when the suite starts rather than by each stage
    later: out of the scripts' range, or given twice (two stages of one name)."""
    low, high = SEED_RANGE
    bad = [s for s in seeds if not low <= s <= high]
    if bad:
        raise SystemExit(
            f"error: --seeds {' '.join(map(str, bad))}: a seed must be in [{low}, {high}] (the scripts' --seed)"
        )
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise SystemExit(f"error: --seeds gives {' '.join(map(str, twice))} more than once; give each seed once")
    if not seeds:
        raise SystemExit("error: --seeds is empty; give at least one seed")


def accelerate_config_problem(path: Path) -> str | None:
    """Why `accelerate launch --config_file PATH` would fail on the file itself, found with accelerate's own reader
    before anything is launched (accelerate would stop each stage with a traceback of its own); None when it loads."""
    if not path.is_file():
        return f"the accelerate config {path} {'is not a regular file' if path.exists() else 'does not exist'}"
    try:
        from accelerate.commands.config.config_args import load_config_from_file

        load_config_from_file(str(path))
    except Exception as e:  # YAML errors, accelerate's ValueErrors: whatever `accelerate launch` would stop on
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        return f"the accelerate config {path} is not one accelerate can read ({type(e).__name__}: {first})"
    return None


def check_accelerate_configs(stages: list[Stage], workdir: Path, dry_run: bool = False) -> None:
    """Every accelerate config the stages launch with (from the working directory, as `accelerate launch` reads it)
    loads, before the first stage: one line naming the file; a dry run, which launches nothing, prints it instead."""
    for name in sorted({st.accelerate_config for st in stages if st.accelerate_config}):
        problem = accelerate_config_problem(Path(workdir) / f"benchmark/accelerate_configs/{name}.yaml")
        if problem:
            line = f"{problem}; restore it (git checkout -- benchmark/accelerate_configs) or fix it"
            if not dry_run:
                raise SystemExit(f"error: {line}")
            print(f"# [warning] {line}")


@dataclass(frozen=True)
class Output:
    """A place the suite writes: checked before the first stage, so that it never fails there after the others ran."""

    path: Path
    folder: bool
    """a folder the suite makes or writes in; else a file it writes"""
    what: str
    """what it holds, for the message: `the log of stage ppo_tiny-tldr__1`"""
    shorten: str = "pass another --workdir"
    """what to do when its name is too long for the file system"""


def short(name: str) -> str:
    """A name as a message shows it: its start and end only when it is long (a 300-byte --name)."""
    return name if len(name) <= 60 else f"{name[:40]}...{name[-12:]}"


def name_max(folder: Path) -> int:
    """The longest file name the file system of `folder` (or of its nearest existing parent) takes; 255 if unknown."""
    for p in [Path(folder).absolute(), *Path(folder).absolute().parents]:
        if _is_dir(p):
            try:
                return os.pathconf(p, "PC_NAME_MAX")
            except (OSError, ValueError):
                break
    return 255


def _is_dir(path: Path) -> bool:
    """Whether `path` is a folder; False where asking fails (a name too long for its file system)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def not_a_folder(path: Path) -> Path | None:
    """The first of `path` and its parents that is there but is not a folder (a file, a broken link): what stops the
    suite making `path`; None when none is."""
    path = Path(path)
    for p in [*reversed(path.parents), path]:
        try:
            if (p.exists() or p.is_symlink()) and not p.is_dir():
                return p
        except OSError:  # a name too long to look at: the caller's check of names, or its mkdir, says so
            return None
    return None


def suite_outputs(suite: str, stages: list[Stage], runs_dir: Path) -> list[Output]:
    """Every place `run_suite` writes: its folders, lock, summary, and each stage's run directory, log and record."""
    suite_dir = runs_dir / SUITE_DIR
    out = [
        Output(runs_dir, True, "its runs"),
        Output(suite_dir, True, "each stage's log and record"),
        Output(ownership.lock_file(suite_dir), False, "its lock (one suite at a time)"),
        # a suite's name is the library's; only a study's (`study_<name>`) can be too long
        Output(runs_dir / f"{suite}_summary.md", False, "its summary table", "give a shorter --name"),
    ]
    if any(st.preset.startswith("tiny") for st in stages):
        out.append(Output(runs_dir / "assets", True, "the tiny world"))
    for st in stages:
        rename = f"give {short(Path(st.script).name)} a shorter file name (a study names its runs after its scripts)"
        name = short(st.run_name)
        out += [
            Output(runs_dir / st.run_name, True, f"the run of stage {name}", rename),
            Output(suite_dir / f"{st.run_name}.log", False, f"the log of stage {name}", rename),
            Output(stage_record(runs_dir, st.run_name), False, f"the record of stage {name}", rename),
        ]
    return out


def _kind_problem(o: Output) -> str | None:
    """The one-line error of an output a file holds where a folder must be, or the other way round."""
    blocked = not_a_folder(o.path if o.folder else o.path.parent)
    if blocked is not None:
        kind = "a broken link" if blocked.is_symlink() and not blocked.exists() else "a file"
        where = "there" if blocked == o.path else f"in {o.path if o.folder else o.path.parent}"
        return f"error: {blocked} is {kind}, not a folder, and the suite writes {o.what} {where}; move it or pass " + (
            "another --workdir"
        )
    if not o.folder and o.path.is_dir():
        return f"error: {o.path} is a folder, and the suite writes {o.what} there; move it or pass another --workdir"
    return None


def output_problem(workdir: Path, outputs: list[Output]) -> str | None:
    """The first place of `outputs` the suite could not write, or None: a name longer than its file system takes (all
    names first: the file system answers a look at one with an error of its own), then `_kind_problem`; `workdir`
    first, a file there stops everything."""
    limit = name_max(workdir)
    part = next((p for p in Path(workdir).absolute().parts if len(p.encode()) > limit), None)
    if part is not None:
        return (
            f"error: --workdir {short(str(workdir))}: its part {short(part)} is {len(part.encode())} bytes long, more "
            f"than the {limit} its file system takes; pass another --workdir"
        )
    blocked = not_a_folder(workdir)
    if blocked is not None:
        return f"error: --workdir {workdir}: {blocked} is a file, not a folder; pass a folder (runs go to WORKDIR/runs)"
    limits: dict[Path, int] = {}
    for o in outputs:
        limit = limits.setdefault(o.path.parent, name_max(o.path.parent))
        if len(o.path.name.encode()) > limit:
            return (
                f"error: {o.path.parent / short(o.path.name)} ({o.what}) would be a file name of "
                f"{len(o.path.name.encode())} bytes, more than the {limit} its file system takes; {o.shorten}"
            )
    return next(filter(None, map(_kind_problem, outputs)), None)


def check_outputs(workdir: Path, outputs: list[Output]) -> None:
    """`output_problem` as the suite's `error:` line (SystemExit), before the first stage."""
    problem = output_problem(workdir, outputs)
    if problem:
        raise SystemExit(problem)


def write_problem(folder: Path) -> str | None:
    """Why `folder` (or, before it is made, its nearest existing parent) cannot be written (`Read-only file system`),
    tried with a file made and removed; None when it can."""
    here = next(p for p in [Path(folder).absolute(), *Path(folder).absolute().parents] if _is_dir(p))
    probe = here / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_writable(runs_dir: Path, stages: list[Stage], workdir: Path, quick: bool) -> str | None:
    """Why `runs_dir` cannot be written (`write_problem`), where every stage is to be skipped (a finished suite rerun
    on a read-only copy, for its summary); None where it can. One `error:` line (SystemExit) where a stage would run
    there (a dry run's decisions), before the first."""
    unwritable = write_problem(runs_dir)
    if not unwritable:
        return None
    todo = []
    for st in stages:
        decision = decide(runs_dir, st.run_name, st.args(quick), (), st.file(workdir), st.needs)
        if refuse_foreign(runs_dir, st.run_name, *decision)[0] != "skip":
            todo.append(short(st.run_name))
    if todo:
        raise SystemExit(
            f"error: {runs_dir} cannot be written ({unwritable}), and {len(todo)} of the suite's {len(stages)} stages "
            f"would run ({', '.join(todo[:3])}{', ...' * (len(todo) > 3)}); pass a --workdir you can write"
        )
    return unwritable


def run_suite(
    suite: str,
    seeds: list[int],
    workdir: Path = Path("."),
    dry_run: bool = False,
    launcher: list[str] | None = None,
    jobs: int = 1,
    only: list[str] | None = None,
    quick: bool = False,
    live: bool | None = None,
    stages: list[Stage] | None = None,
) -> dict[str, str]:
    """Run the stages of `suite` with `workdir` as the working directory (runs land in workdir/runs).

    `jobs` > 1 runs that many independent stages at once, each with one thread per job's share of the cores (on a 2-core
    CPU, two 1-thread runs get more done than one 2-thread run of these tiny models). `only` keeps the stages whose
    algorithm (run name before `_`, e.g. `ppo`) or algorithm and track (run name before `__`, e.g. `ppo_tiny-tldr`) is
    listed, plus the stages they need. `quick` appends each stage's shorter budget (`Stage.quick`). Suite `quick`: the
    tiny suite's QUICK_STAGES, the frontier's MAIN_FRONTIER_STAGES and CHECK_STAGES (or `only`), always `quick`; suite
    `learning` adds LEARNING_FRONTIER_STAGES. `live`: redraw a status block on the terminal (benchmark/status.py); False
    prints event lines only, None (the default) does so when stdout is not a terminal. `stages`: these instead of the
    suite's (the study's)."""
    if jobs < 1:  # 0 never starts a stage and waits for one forever
        raise SystemExit(f"error: --jobs is {jobs}; it must be at least 1")
    check_seeds(seeds)
    asked = only
    if suite in ("quick", "learning"):
        main_job = QUICK_STAGES + MAIN_FRONTIER_STAGES + CHECK_STAGES
        only, quick = only or main_job + (LEARNING_FRONTIER_STAGES if suite == "learning" else []), True
    launcher = launcher or [sys.executable]
    runs_dir = Path(workdir) / "runs"
    stages = stages if stages is not None else SUITES[suite](seeds)
    if only:
        keep = {
            st.run_name for st in stages if st.run_name.split("_")[0] in only or st.run_name.rsplit("__", 1)[0] in only
        }
        for st in stages:  # the SFT/RM stages the kept ones depend on
            if st.run_name in keep:
                keep |= set(st.needs)
        stages = [st for st in stages if st.run_name in keep]
        names = {
            part for st in SUITES[suite](seeds) for part in (st.run_name.split("_")[0], st.run_name.rsplit("__", 1)[0])
        }
        unknown = sorted(set(asked or []) - names)
        if unknown:  # a misspelt name would run nothing and exit 0
            raise SystemExit(
                f"error: --only {' '.join(unknown)} names no stage of suite {suite}; its names are {sorted(names)}"
            )
    check_accelerate_configs(stages, workdir, dry_run)
    check_outputs(workdir, suite_outputs(suite, stages, runs_dir))
    status: dict[str, str] = {}
    if dry_run:
        for stage in stages:  # what is needed comes first; "dry-run" marks a stage that would be run now
            rebuilt = [d for d in stage.needs if status.get(d) == "dry-run"]
            decision = decide(runs_dir, stage.run_name, stage.args(quick), rebuilt, stage.file(workdir), stage.needs)
            action, why = refuse_foreign(runs_dir, stage.run_name, *decision)
            if action == "skip":
                print(f"# [skip] {stage.run_name}: {why}")
                status[stage.run_name] = "skipped"
                continue
            if action == "refuse":
                print(f"# [refused] {stage.run_name}: {why}")
                status[stage.run_name] = "failed"
                continue
            if action != "run":
                print(f"# [{action}] {stage.run_name}: {why}")
            print(shlex.join(stage.command(launcher, quick) + LAUNCH[action]))
            status[stage.run_name] = "dry-run"
        return status
    unwritable = check_writable(runs_dir, stages, workdir, quick)
    if unwritable:  # a finished suite rerun to see its summary needs no write: without its lock, as nothing launches
        return _run_suite(suite, stages, runs_dir, workdir, launcher, jobs, quick, live, unwritable)
    # one suite at a time in a runs directory: a second would relaunch the first one's stages into the same logs
    # (runs/_suite/<stage>.log) and show the first one's lines as its own failure
    refused = ownership.take_lock(runs_dir / SUITE_DIR)
    if refused:
        owner = refused.split(" is in use by ", 1)[-1].split("; wait for it", 1)[0]
        raise SystemExit(
            f"error: another suite runs in {runs_dir} ({owner}); wait for it to end or stop it, or give this one "
            "another --workdir"
        )
    try:
        return _run_suite(suite, stages, runs_dir, workdir, launcher, jobs, quick, live)
    finally:
        ownership.release_lock(runs_dir / SUITE_DIR)


def _write_summary(summary: str, path: Path, unwritable: str | None) -> None:
    """The summary table, printed and written to `path`; printed only where its folder cannot be written
    (`unwritable`: why), and one line says so."""
    print(summary, flush=True)
    if unwritable:
        print(
            f"warning: {path.parent} cannot be written ({unwritable}): every stage had finished, so nothing ran; the "
            f"summary is printed, not written to {path.parent / short(path.name)}",
            file=sys.stderr,
            flush=True,
        )
        return
    path.write_text(summary)
    print(f"wrote {path}\nstage logs and records: {path.parent / SUITE_DIR}/", flush=True)


def _run_suite(
    suite: str,
    stages: list[Stage],
    runs_dir: Path,
    workdir: Path,
    launcher: list[str],
    jobs: int,
    quick: bool,
    live: bool | None,
    unwritable: str | None = None,
) -> dict[str, str]:
    """`run_suite` once it holds the runs directory's suite lock; `unwritable`: why the runs directory cannot be
    written, where every stage is to be skipped (nothing is written: the summary is printed only)."""
    status: dict[str, str] = {}
    if not unwritable and any(stage.preset.startswith("tiny") for stage in stages):  # the tiny world, on first use
        ensure_assets(runs_dir / "assets")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # allowed ones
    threads = max(1, cores // max(jobs, 1))
    suite_dir = runs_dir / SUITE_DIR
    display = Display(  # every line below goes through it: on a terminal, above the redrawn block
        f"{suite} suite",
        [
            StageStatus(st.run_name, script=Path(st.script).name, log=str(suite_dir / f"{st.run_name}.log"))
            for st in stages
        ],
        jobs,
        live,
    )
    pending = list(stages)
    running: dict[str, tuple[subprocess.Popen, float, Path, object]] = {}
    stopping: list[int] = []  # the signals the suite got: passed on to the running stages, which checkpoint and stop

    def pass_on(signum, frame) -> None:  # a terminal's hangup stops the stages as SIGTERM does
        stopping.append(signum)
        for proc, *_ in running.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
                except ProcessLookupError:
                    pass

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, pass_on) for sig in handled} if main_thread else {}
    try:
        while (pending and not stopping) or running:
            for stage in [] if stopping else list(pending):  # stopped: no new stage starts
                if len(running) >= jobs:
                    break
                bad = [d for d in stage.needs if status.get(d) in ("failed", "blocked")]
                if bad:
                    status[stage.run_name] = "blocked"
                    display[stage.run_name].state, display[stage.run_name].note = (
                        BLOCKED,
                        f"needs failed {', '.join(bad)}",
                    )
                    display.event(f"[skip] {stage.run_name}: depends on failed {bad}")
                    pending.remove(stage)
                    continue
                if any(d in running or any(p.run_name == d for p in pending) for d in stage.needs):
                    continue  # wait for what it needs: whether it was run now decides whether this stage can be kept
                rebuilt = [d for d in stage.needs if status.get(d) == "ok"]
                decision = decide(
                    runs_dir, stage.run_name, stage.args(quick), rebuilt, stage.file(workdir), stage.needs
                )
                action, why = refuse_foreign(runs_dir, stage.run_name, *decision)
                if action == "skip":
                    status[stage.run_name] = "skipped"
                    display[stage.run_name].state = SKIPPED
                    display[stage.run_name].headline = headline(final_metrics(runs_dir / stage.run_name))
                    display.event(f"[skip] {stage.run_name}: {why}")
                    pending.remove(stage)
                    continue
                if action == "refuse":  # its directory holds what is not a run: left as it is
                    status[stage.run_name] = "failed"
                    display[stage.run_name].state, display[stage.run_name].note = FAILED, "not a run's directory"
                    display[stage.run_name].log = ""
                    display.event(f"[FAILED] {stage.run_name}: {why}")
                    pending.remove(stage)
                    continue
                if not (Path(workdir) / stage.script).exists() and not (REPO / stage.script).exists():
                    status[stage.run_name] = "failed"
                    display[stage.run_name].state, display[stage.run_name].note = (
                        FAILED,
                        f"{stage.script} does not exist",
                    )
                    display[stage.run_name].log = ""  # nothing was launched, so there is no log to read
                    display.event(f"[missing] {stage.run_name}: {stage.script} does not exist")
                    pending.remove(stage)
                    continue
                cmd = stage.command(launcher, quick)
                if jobs > 1 and not stage.accelerate_config:
                    cmd += ["--num-threads", str(threads)]
                cmd += LAUNCH[action]
                shown = display[stage.run_name]
                shown.state, shown.started, shown.progress = RUNNING, time.time(), None
                display.event(
                    *([f"[{action}] {stage.run_name}: {why}"] if action != "run" else []), f"[run] {shlex.join(cmd)}"
                )
                record = stage_record(runs_dir, stage.run_name)
                record.parent.mkdir(parents=True, exist_ok=True)
                if action != "resume":  # a resumed run keeps the record of the command that started it
                    built_on = needs_fingerprint(runs_dir, stage.needs)  # the models it reads, as they are now
                    launched = str(stage.file(workdir).resolve())  # the file: a fork's run records its name only
                    record.write_text(
                        json.dumps(
                            {"argv": stage.args(quick), "command": cmd, "script": launched, "needs": built_on}
                            | {"launched": round(time.time(), 3), "threads": threads if jobs > 1 else None}
                        )
                        + "\n"
                    )
                log = runs_dir / SUITE_DIR / f"{stage.run_name}.log"  # beside the stage's record
                f = open(log, "a" if action == "resume" else "w", encoding="utf-8")  # as the display reads it
                if action == "resume":
                    f.write(f"\n--- resumed: {shlex.join(cmd)}\n")
                    f.flush()
                env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
                env["PYTHONIOENCODING"] = "utf-8"  # its output goes to the log, a file: not the terminal's encoding
                if jobs > 1:
                    env["OMP_NUM_THREADS"] = str(threads)
                # a session of its own: a terminal's Ctrl-C reaches the suite alone, which passes it on once (a
                # second SIGINT stops a script at once, without its checkpoint)
                proc = subprocess.Popen(
                    cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                running[stage.run_name] = (proc, time.time(), log, f)
                pending.remove(stage)
            for name, (proc, t0, log, f) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                f.close()
                del running[name]
                shown = display[name]
                shown.seconds = time.time() - t0
                note_end(stage_record(runs_dir, name), rc)  # the suite's timeline (benchmark.tools.timeline)
                if rc == 0:
                    status[name] = "ok"
                    shown.state, shown.headline = DONE, headline(final_metrics(runs_dir / name))
                    lines = [f"[ok] {name} in {shown.seconds:.0f}s" + (f": {shown.headline}" if shown.headline else "")]
                    if not (runs_dir / name / "done.json").exists():
                        lines.append(
                            f"warning: {name} exited 0 without writing {runs_dir / name / 'done.json'}; it will be run "
                            "again by the next invocation"
                        )
                    display.event(*lines)
                elif stopping:  # stopped by the signal the suite passed on: a rerun resumes its checkpoint, if any
                    status[name] = "stopped"
                    shown.state, shown.note = FAILED, f"stopped (exit {rc})"
                    display.event(*stopped_lines(name, rc, runs_dir / name, log))
                else:
                    status[name] = "failed"
                    shown.state, shown.note = FAILED, f"exit {rc}"
                    # the log's last lines as a terminal shows them (a tqdm bar once, not each update), indented
                    tail = log_tail(log.read_text(errors="replace"))
                    display.event(
                        f"[FAILED] {name} (exit {rc}); last lines of {log}:", *(f"    {line}" for line in tail)
                    )
            if running:
                display.tick()
                time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc, *_ in running.values():  # the suite itself failed: it leaves no stage running without it
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    for stage in pending:  # never started: the suite was stopped
        status[stage.run_name] = "stopped"
    display.close()
    lines = [f"# {suite} suite", "", "| run | status | final metrics |", "| --- | --- | --- |"]
    for stage in stages:
        m = final_metrics(runs_dir / stage.run_name)
        shown = ", ".join(
            f"{k} {v:.3f}"
            for k, v in m.items()
            if k.startswith("eval/") and isinstance(v, float) and "confidence" not in k
        )
        lines.append(f"| {stage.run_name} | {status[stage.run_name]} | {shown} |")
    finished = [read_run(runs_dir / st.run_name) for st in stages if (runs_dir / st.run_name / "done.json").exists()]
    lines += ["", *(f"> warning: {line}" for line in provenance_differences(finished))]  # mixed code or hosts
    summary = "\n".join(lines).rstrip() + "\n"
    _write_summary(summary, runs_dir / f"{suite}_summary.md", unwritable)
    if stopping:
        name = signal.Signals(stopping[0]).name
        print(f"stopped by {name}: every stage it started has ended; run the same command to go on", flush=True)
        raise SystemExit(128 + stopping[0])
    return status
