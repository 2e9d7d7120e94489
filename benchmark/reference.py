"""The library's own results on the tiny world, shipped as data: `python -m benchmark.reference build|list`.

`python -m benchmark.reference build RUNS_DIR` reads every finished run of RUNS_DIR (a run directory with its
`done.json`) and writes its metrics rows to `benchmark/reference_runs/<group>.jsonl.gz` (group: the run name without
`__<seed>`), one JSON line per run: its name, the command arguments of its `done.json`, the `started` part of its
`provenance.json` (commit, library versions, host) and its rows, cut to what the tables and figures read: every
evaluation (`eval/*`), the training metrics of KEEP and each row's `step`, `episode` and `time` (the last row is kept
whole: it holds the run's duration). Nothing else of a run (models, samples, checkpoints) is kept. A group already
shipped keeps its other runs: building from a directory of seeds 2 and 3 adds them beside seed 1 (`--fresh` drops
what was there). The files are gzip without a timestamp: the same runs give the same bytes.
A record is keyed by its run name and its rounding regime (`benchmark.run --rounding`: seed 1 under
`ATEN_CPU_CAPABILITY=default` ships beside seed 1 under the machine's own kernels). A run already there under the same
name and regime is replaced only by a run of the same command (`budget`) and script (its
sha256, when both record one); another one (another budget, older code) is refused in one line that says what
changes, unless `--replace` is given (then each replacement is said). Build deletes or replaces only files it wrote:
every `*.jsonl.gz` it would drop (`--fresh`) or rewrite must be one group's records; a damaged one is named in one
line with how to restore it (`git checkout` for the shipped data). A metrics.jsonl that is not one run's rows (its
episode counter goes back: two runs appended to one file) is refused, not shipped.

`python -m benchmark.reference list` prints the shipped algorithms, their tracks and seeds. The data is read by
`python -m benchmark.compare RUN_DIR... --reference rloo` (the user's runs over the reference band) and by
`python -m benchmark.results --reference` (the README's tables and figures), without rerunning anything.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import gzip
import io
import json
import os
import re
import sys
import zlib
from collections import defaultdict
from pathlib import Path

from benchmark import runfiles
from benchmark.curves import Run, algorithm_of, group_name, read_run, track_of, warn_problems
from benchmark.suites import SUITES

DIR = Path(__file__).resolve().parent / "reference_runs"
KEEP = ("objective/reward", "objective/kl", "objective/num_steps", "perf/episodes_per_sec", "perf/peak_mem_gb")
"""the training metrics kept beside the evaluations: the results figures' panels, the PRM table, the speed columns"""
ROW_KEYS = ("step", "episode", "time")
EARLY_ROWS = 8
"""the first training rows kept whole: every statistic the script logs per update, for reproduce's early check"""


def is_training_row(row: dict) -> bool:
    """A row a script logged for an update (a loss, a KL, a reward...), not an evaluation's or the last one's."""
    return any(not k.startswith(("eval/", "perf/")) and k not in (*ROW_KEYS, "epoch") for k in row)


class ReferenceError(Exception):
    """A request the shipped data cannot answer; its message is the `error:` line."""


def compact(rows: list[dict]) -> list[dict]:
    """The rows the tables and figures read: those with an evaluation or a KEEP metric, each cut to those and
    ROW_KEYS, and the last row (cut the same way), which holds the run's wall-clock time; the first EARLY_ROWS
    training rows are kept whole (`benchmark.reproduce`'s early check)."""
    out, early = [], 0
    for i, row in enumerate(rows):
        if early < EARLY_ROWS and is_training_row(row):
            early += 1
            out.append(dict(row))
            continue
        kept = {k: v for k, v in row.items() if k.startswith("eval/") or k in KEEP}
        if kept or i == len(rows) - 1:
            out.append({**{k: row[k] for k in ROW_KEYS if k in row}, **kept})
    return out


def record(run_dir: Path) -> dict:
    """One line of the data: a finished run's name, command, provenance and compacted rows."""
    run = read_run(run_dir)  # damage (benchmark/runfiles.py): one `error:` line, the same as every tool's
    warn_problems([run])  # a torn last row dropped
    return {
        "name": run.name,
        "argv": (run.done or {}).get("argv"),
        "budget": sorted(run_budgets(run_dir)),
        "provenance": run.provenance,
        "rows": compact(run.rows),
    }


def budget(argv: list | None) -> list[str]:
    """A run's command without what differs between seeds of one experiment (`--seed`, `--run-name`, and any flag
    that points the run at a model of its own seed, `runs/<stage>__<seed>/model`: the SFT policy and reward model
    `--sft-model-path runs/sft_<track>__<seed>/model`, whose seed-1 paths are the presets' so that seed 1 names none,
    and a track's own models such as `--teacher-model-path` or `--prm-path`, which seed 1 names too) or does not change
    what it computes (`--num-threads`, `--resume`, `--overwrite`)."""
    out, args = [], [str(a) for a in argv or []]
    named = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--run-name"]
    seed = re.search(r"__(\d+)$", named[0]) if named else None
    seed = seed.group(1) if seed else next((args[i + 1] for i in range(len(args) - 1) if args[i] == "--seed"), "1")
    own_start = re.compile(rf"(\./)?runs/[^/]+__{re.escape(seed)}/model/?")
    i = 0
    while i < len(args):
        if args[i] in ("--seed", "--run-name", "--num-threads"):
            i += 2
            continue
        if args[i].startswith("--") and i + 1 < len(args) and own_start.fullmatch(args[i + 1]):
            i += 2
            continue
        if args[i] not in ("--resume", "--overwrite"):
            out.append(args[i])
        i += 1
    return out


FULL = " (full)"
"""what a run at a preset's full budget (`benchmark.run tiny`) is shown with beside its namesake of the main job"""


@functools.cache
def suite_budgets() -> dict[str, dict[tuple[str, ...], set[str]]]:
    """Each suite stage's group -> each of its commands (`budget`) -> `quick` (`--quick`: the README's main job),
    `full` (the preset's budget: `benchmark.run tiny`), or both where the stage has no shorter budget."""
    out: dict[str, dict[tuple[str, ...], set[str]]] = defaultdict(lambda: defaultdict(set))
    for stages in SUITES.values():
        for st in stages([1]):  # another seed's command differs in what `budget` leaves out
            for label, quick in (("full", False), ("quick", True)):
                out[group_name(st.run_name)][tuple(budget(st.args(quick)))].add(label)
    return out


@functools.cache
def suite_needs() -> dict[str, list[str]]:
    """Each suite stage's group -> the groups of the runs whose models it starts from (`Stage.needs`)."""
    return {group_name(st.run_name): [group_name(n) for n in st.needs] for s in SUITES.values() for st in s([1])}


def budgets_of(r: dict, known: dict | None = None) -> set[str]:
    """The budgets a record was made at: those `run_budgets` found when it was built, else (an older record) those its
    command is a suite's command of (`suite_budgets`): {"quick"}, {"full"}, both, or none (a study's, or a command
    no suite runs)."""
    if isinstance(r.get("budget"), list):
        return set(r["budget"])
    known = suite_budgets() if known is None else known
    return set(known.get(group_name(r["name"]), {}).get(tuple(budget(r.get("argv"))), ()))


def run_budgets(run_dir: Path) -> set[str]:
    """The budgets a finished run was made at: those its command is a suite's command of, narrowed by the runs of
    its seed whose models it started from, where the folder holds them (`suite_needs`): RLOO's tiny-math command is
    the same at both budgets, but RLOO from the full budget's SFT policy is a run of the full budget."""
    out = budgets_of({"name": run_dir.name, "argv": runfiles.read_done_argv(run_dir)})
    seed = run_dir.name.rsplit("__", 1)[-1]
    for need in suite_needs().get(group_name(run_dir.name), []):
        if (run_dir.parent / f"{need}__{seed}" / "done.json").is_file():
            out &= run_budgets(run_dir.parent / f"{need}__{seed}")
    return out


def full_only(r: dict, known: dict | None = None) -> bool:
    """A run at a preset's full budget whose group the main job also runs at its shorter one: shown and keyed apart
    (`<name> (full)`), so that the two budgets are never pooled as seeds of one experiment."""
    return budgets_of(r, known) == {"full"}


def write_group(path: Path, records: list[dict]) -> None:
    """`records` sorted by name (and rounding regime) as gzip'd JSON lines, without the gzip timestamp (the same runs,
    the same bytes)."""
    text = "".join(json.dumps(r) + "\n" for r in sorted(records, key=key))
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode())
    tmp = path.with_name(path.name + ".tmp")  # a build stopped halfway leaves the file it had, never half of one
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def restore_hint(path: Path) -> str:
    """How to get a damaged data file back: git for the shipped data, a rebuild elsewhere."""
    if path.resolve().parent == Path(DIR).resolve():
        repo = Path(__file__).resolve().parent.parent
        rel = path.resolve().relative_to(repo) if path.resolve().is_relative_to(repo) else path
        return f"restore it with `git checkout -- {rel}` (the shipped data)"
    return f"rebuild it (python -m benchmark.reference build RUNS_DIR --out {path.parent}) or move it away"


def read_group(path: Path) -> list[dict]:
    """The records of one data file. Raises ReferenceError, naming the file and how to restore it (`restore_hint`),
    when it is not gzip'd JSON lines of records (each an object with a `name` and its `rows`)."""
    try:
        records = [
            json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()
        ]
        why = "it holds no run" if not records else ""
        for i, r in enumerate(records, start=1):
            if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not isinstance(r.get("rows"), list):
                why = why or f"line {i} is not a run's record (an object with a name and its rows)"
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = f"{type(e).__name__}: {e}"
    if why:
        raise ReferenceError(f"{path} is damaged ({why}); {restore_hint(path)}")
    return records


def own_group(path: Path) -> list[dict]:
    """The records of a data file that build may rewrite or drop: refused (ReferenceError) unless every record is a
    run of the group the file is named for, the only kind of file build writes."""
    records = read_group(path)
    group = path.name.removesuffix(".jsonl.gz")
    others = sorted({r["name"] for r in records if group_name(r["name"]) != group})
    if others:
        raise ReferenceError(
            f"{path} holds runs of another group than {group} ({', '.join(others[:3])}): it is not a file that "
            "benchmark.reference build wrote, so it is neither replaced nor deleted; move it away or pass another --out"
        )
    return records


def regime(r: dict) -> str:
    """The rounding regime a record's run was made under (`benchmark.run --rounding`): `native`, or the value of
    ATEN_CPU_CAPABILITY its provenance recorded (`default`). Runs of one name under two regimes are two records."""
    env = (((r.get("provenance") or {}).get("host") or {}).get("numerics_env")) or {}
    return env.get("ATEN_CPU_CAPABILITY") or "native"


def key(r: dict) -> tuple[str, str, bool]:
    """What identifies a record in a group: its run name, its rounding regime, and whether it is a run at a preset's
    full budget (`full_only`: seed 1 at the full budget ships beside seed 1 of the main job)."""
    return r["name"], regime(r), full_only(r)


def script_sha(r: dict) -> str | None:
    """The sha256 of the script of a record (its provenance), None for a run that predates the record of it."""
    return ((r.get("provenance") or {}).get("script") or {}).get("sha256")


def changes(old: dict, new: dict) -> list[str]:
    """What replacing the record `old` by `new` changes in what they computed: the command (`budget`), the script
    (sha256, when both record one), and whether the origin can be shown: a run without provenance.json (no script
    hash; its regime read as native) never silently replaces a record that has one."""
    out = []
    if script_sha(old) and not script_sha(new):
        out.append(f"origin: the run has no script sha256 (no provenance.json), the record has {script_sha(old)[:12]}")
    if budget(old.get("argv")) != budget(new.get("argv")):
        out.append(f"command `{' '.join(budget(old.get('argv')))}` -> `{' '.join(budget(new.get('argv')))}`")
    if script_sha(old) and script_sha(new) and script_sha(old) != script_sha(new):
        out.append(f"script sha256 {script_sha(old)[:12]} -> {script_sha(new)[:12]}")
    return out


def build(runs_dir: Path, out_dir: Path | None = None, fresh: bool = False, replace: bool = False) -> list[str]:
    """Writes the data of every finished run in `runs_dir`; returns one line per group written (and one per record
    replaced with `replace`). A run that did not finish (no done.json) is named on stderr and left out. Everything is
    checked before the first file is written or deleted: the files it would drop or rewrite are its own (`own_group`),
    and a run replacing a record of the same name has its command and script (`changes`) unless `replace`."""
    if not runs_dir.is_dir():
        raise ReferenceError(f"{runs_dir} is not a directory of runs")
    out_dir = Path(out_dir or DIR)
    if out_dir.exists() and not out_dir.is_dir():
        raise ReferenceError(f"--out {out_dir} is a file, not a folder for the data; pass another --out")
    found: dict[str, list[dict]] = defaultdict(list)
    for d in sorted(runs_dir.iterdir()):
        if d.name.startswith(".") or not runfiles.is_run_dir(d):  # `.<run>.previous`: kept by --overwrite
            continue
        if not (d / "done.json").exists():
            print(f"warning: {d} did not finish (no done.json); left out", file=sys.stderr)
            continue
        found[group_name(d.name)].append(record(d))
    if not found:
        raise ReferenceError(f"{runs_dir} holds no finished run (a directory with metrics.jsonl and done.json)")
    try:  # one build at a time per data folder (a lock on the folder itself: no file left in the data)
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(out_dir, os.O_RDONLY)
    except OSError as e:
        raise ReferenceError(f"--out {out_dir} cannot be written ({e}); pass another --out") from None
    try:  # two builds at once would each rewrite a group without the other's runs
        fcntl.flock(lock, fcntl.LOCK_EX)
        return write_data(runs_dir, out_dir, found, fresh, replace)
    finally:
        os.close(lock)


def write_data(runs_dir: Path, out_dir: Path, found: dict[str, list[dict]], fresh: bool, replace: bool) -> list[str]:
    """`build`'s reading and writing of the data folder, under its lock."""
    # the files it drops (--fresh: all) or rewrites (its groups'), each checked to be its own; no other is read
    touched = sorted(out_dir.glob("*.jsonl.gz")) if fresh and out_dir.is_dir() else []
    touched += [p for g in sorted(found) if (p := out_dir / f"{g}.jsonl.gz").exists() and p not in touched]
    there = {p: own_group(p) for p in touched}
    replaced, rewritten = [], []
    for group, records in sorted(found.items()):
        old = {key(r): r for r in there.get(out_dir / f"{group}.jsonl.gz", [])}
        for r in records:
            if key(r) in old and (what := changes(old[key(r)], r)):
                replaced.append(f"{r['name']} in {out_dir / f'{group}.jsonl.gz'}: {'; '.join(what)}")
            elif key(r) in old and old[key(r)] != r:  # the same command and script, other numbers: said, not asked
                rewritten.append(f"replaced {r['name']} ({regime(r)}) in {out_dir / f'{group}.jsonl.gz'}: other rows")
    if replaced and not replace:
        more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
        raise ReferenceError(
            f"a run would replace the record of another run of the same name: {replaced[0]}{more}; pass --replace to "
            "replace it, or build into another --out"
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old_path in there:
                old_path.unlink()
        lines = [f"replaced {line}" for line in replaced] + rewritten
        for group, records in sorted(found.items()):
            path = out_dir / f"{group}.jsonl.gz"
            new = {key(r) for r in records}  # a run of the same name under another rounding regime is kept beside it
            kept = [r for r in there.get(path, []) if key(r) not in new] if not fresh else []
            write_group(path, kept + records)
            for full in (False, True):  # the main job's and the full budget's runs are kept apart (`full_only`)
                commands = {" ".join(budget(r.get("argv"))) for r in kept + records if full_only(r) == full}
                if len(commands) > 1:  # e.g. a command no suite runs beside the main job's: pooled as seeds
                    print(
                        f"warning: {group}{FULL if full else ''} now holds runs of different commands (budgets): "
                        f"{' | '.join(sorted(commands))}",
                        file=sys.stderr,
                    )
            seeds = sorted(seeds_of(kept + records))
            lines.append(
                f"{path.name}: {len(records)} run(s) from {runs_dir}"
                + (f", {len(kept)} kept from before" if kept else "")
                + f"; seeds {', '.join(seeds)}; {path.stat().st_size / 1024:.1f} KiB"
            )
    except OSError as e:
        raise ReferenceError(f"--out {out_dir} cannot be written ({e}); pass another --out") from None
    return lines


def seeds_of(records: list[dict]) -> list[str]:
    """Each record's seed, with its rounding regime when not the machine's own: `1`, `1 (default)`."""
    return [r["name"].rsplit("__", 1)[-1] + ("" if regime(r) == "native" else f" ({regime(r)})") for r in records]


def load(data_dir: Path | None = None, budget_name: str | None = None, rounding: str | None = None) -> list[Run]:
    """Every shipped run (in `data_dir`, default DIR), as `benchmark.compare` reads a run directory (finished, with
    its provenance); a run of the second rounding regime named `<name> (default)` beside its native namesake, and a
    run at a preset's full budget `<name> (full)` in the group `<group> (full)` (`full_only`), beside the main job's.
    `budget_name` "quick" leaves out the full budget's runs, "full" the main job's (a command both run stays), and
    then names none `(full)`: one budget's runs read as the runs of its folder; `rounding` ("native", "default")
    keeps the runs of that rounding regime alone."""
    runs, known = [], suite_budgets()
    for path in sorted(Path(data_dir or DIR).glob("*.jsonl.gz")):
        for r in read_group(path):
            budgets = budgets_of(r, known)
            if (budget_name and budgets and budget_name not in budgets) or (rounding and regime(r) != rounding):
                continue
            full = budgets == {"full"} and not budget_name  # both budgets read together: the full one named apart
            tags = [t for t in ("full" if full else "", regime(r) if regime(r) != "native" else "") if t]
            runs.append(
                Run(
                    name=r["name"] + (f" ({', '.join(tags)})" if tags else ""),
                    group=group_name(r["name"]) + (FULL if full else ""),
                    rows=r["rows"],
                    provenance=r.get("provenance"),
                    reference=True,
                    argv=r.get("argv"),
                )
            )
    return runs


def script_of(run: Run) -> str | None:
    """The script that made a shipped run, by its provenance (`rloo` for `rloo.py`), or None for a record without it."""
    path = ((run.provenance or {}).get("script") or {}).get("path")
    return Path(str(path)).stem if path else None


def no_track_hint(name: str, on: list[str], tracks: set[str], groups: list[str], family: dict) -> str:
    """What to pass instead when `--reference name` has no group on the runs' tracks: a shipped group of the same
    script on those tracks (a study's track included), else that no reference holds a study's budget, else a group
    across tracks."""
    mine = {family.get(g) for g in groups if name in (g, algorithm_of(g))} | {name.removesuffix(".py")}
    there = sorted(g for g in groups if track_of(g) in tracks and family.get(g) in mine)
    if there:
        return f"on those tracks it has {', '.join(there)}: --reference {family[there[0]]}"
    study = sorted(t for t in tracks if t.endswith("-study"))
    if study:
        return (
            f"a study's runs ({', '.join(study)}) have their own budget, which no reference of {name} holds: "
            "compare them with the library script's runs of the same study, which `benchmark.run study` makes "
            "beside the fork"
        )
    example = f"--reference {name}_{on[0]} --across-tracks"
    return f"name a group and pass --across-tracks to compare across tracks, e.g. {example}"


def runs_for(names: list[str], runs: list[Run], metric: str, data_dir: Path | None = None) -> list[Run]:
    """The shipped runs that `--reference NAME...` asks for, to compare with `runs` on `metric`. A NAME is an
    algorithm (`rloo`: its groups on the tracks of `runs`, or, with no runs, those that log `metric`), a script
    (`grpo_math` or `grpo_math.py`: the groups its runs made, `grpo` and a study's `grpo_math`; a fork's family) or
    one group (`rloo_tiny-tldr`). Their group is renamed `<group> (reference)`, their names `reference/<name>`, so
    that they never merge with the user's runs of the same name. Raises ReferenceError: a NAME that names nothing
    shipped (the message lists what is), or a reference that shares no track or no metric with the runs."""
    shipped = load(data_dir)
    if not shipped:
        raise ReferenceError(
            f"no reference data in {data_dir or DIR} (python -m benchmark.reference build RUNS_DIR writes it)"
        )
    groups = sorted({r.group for r in shipped})
    algorithms = sorted({algorithm_of(g.removesuffix(FULL)) for g in groups})
    family = {r.group: script_of(r) for r in shipped}  # the script that made each group: rloo.py's `rloo-kl0.005`
    tracks = {track_of(r.group) for r in runs}
    chosen: list[str] = []
    for name in names:
        if name in groups:
            picked = [name]
        elif name in algorithms or name.removesuffix(".py") in family.values():
            picked = [g for g in groups if name in (algorithm_of(g.removesuffix(FULL)), f"{family[g]}.py", family[g])]
            on = sorted(track_of(g) for g in picked)
            if runs:
                picked = [g for g in picked if track_of(g) in tracks]
                if not picked:
                    raise ReferenceError(
                        f"--reference {name}: the reference has {name} on {', '.join(on)}; the runs given are on "
                        f"{', '.join(sorted(tracks)) or 'no known track'}: no shared track "
                        f"({no_track_hint(name, on, tracks, groups, family)})"
                    )
        else:
            scripts = sorted(set(filter(None, family.values())))
            raise ReferenceError(
                f"--reference {name} names no shipped algorithm or script; shipped: {', '.join(algorithms)}"
                f"{', by script ' + ', '.join(scripts) if scripts else ''} (or one group: {', '.join(groups[:3])}, "
                "...; python -m benchmark.reference list)"
            )
        for g in picked:
            logged = sorted(
                {k for r in shipped if r.group == g for row in r.rows for k in row if k.startswith("eval/")}
            )
            if metric not in logged:
                if name in groups or runs:
                    raise ReferenceError(
                        f"--reference {name}: its runs {g}__* log no {metric} (they log {', '.join(logged)}): the runs "
                        "and the reference share no metric"
                    )
                continue  # an algorithm asked for without runs: its groups that log the metric
            chosen.append(g)
    if not chosen:
        raise ReferenceError(f"--reference {' '.join(names)}: no shipped run logs {metric}")
    named = [g for g in chosen if g in names]  # a group named in full is drawn whatever its budget
    chosen = [g for g in chosen if g in named or g in same_budget(chosen, shipped, runs)]
    out = []
    for r in shipped:
        if r.group in chosen:
            tag = ", full" if r.group.endswith(FULL) else ""
            r.name, r.group = f"reference/{r.name}", f"{r.group.removesuffix(FULL)} (reference{tag})"
            out.append(r)
    return out


def command_of(run: Run) -> tuple[tuple[str, ...], bool] | None:
    """A run's command as `budget` reads it (a shipped run's recorded one, a run directory's done.json `argv`) and
    whether it is a run of the full budget (`full_only`, `run_budgets`)."""
    if run.reference:
        return tuple(budget(run.argv)), run.group.endswith(FULL)
    if run.done is None:
        return None
    return tuple(budget(run.done.get("argv"))), run_budgets(run.path) == {"full"}  # type: ignore[arg-type]


def same_budget(chosen: list[str], shipped: list[Run], runs: list[Run]) -> list[str]:
    """Of a group shipped at both budgets (`grpo_tiny-math` and `grpo_tiny-math (full)`), the one whose command the
    runs on its track were made with; both, each its own band, when the runs match neither (or none is given)."""
    out = []
    for g in chosen:
        twins = [h for h in chosen if h.removesuffix(FULL) == g.removesuffix(FULL)]
        mine = {command_of(r) for r in runs if track_of(r.group) == track_of(g)} - {None}
        matched = [h for h in twins if mine & {command_of(r) for r in shipped if r.group == h}]
        if len(twins) == 1 or not matched or g in matched:
            out.append(g)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the data of the finished runs of RUNS_DIR")
    b.add_argument("runs_dir", help="a runs directory (e.g. runs/ after `python -m benchmark.run quick`)")
    b.add_argument(
        "--out", default=None, help="where the data goes (default: the shipped data, benchmark/reference_runs)"
    )
    b.add_argument("--fresh", action="store_true", help="drop the data already there instead of adding to it")
    b.add_argument(
        "--replace",
        action="store_true",
        help="let a run replace the record of the same name made by another command or script (refused otherwise)",
    )
    ls = sub.add_parser("list", help="the shipped algorithms, tracks and seeds")
    ls.add_argument("--data", default=None, help="the data directory (default: the shipped data)")
    a = parser.parse_args(argv)
    try:
        if a.command == "build":
            for line in build(Path(a.runs_dir), a.out, a.fresh, a.replace):
                print(line)
            out = Path(a.out or DIR)
            total = sum(p.stat().st_size for p in out.glob("*.jsonl.gz"))
            print(f"wrote {out}: {total / 1024:.1f} KiB in all")
            return 0
        paths = sorted(Path(a.data or DIR).glob("*.jsonl.gz"))
        if not paths:
            raise ReferenceError(f"no reference data in {a.data or DIR}")
        groups = [read_group(path) for path in paths]  # a damaged file is one line, before any of the table
        print(
            "| algorithm | track | seeds | budget | its first run's flags (after the preset and run name) |\n"
            "| --- | --- | --- | --- | --- |"
        )
        for records in groups:
            for full in (False, True):  # the main job's runs, then the full budget's (`full_only`), a row each
                mine = [r for r in records if full_only(r) == full]
                if not mine:
                    continue
                group = group_name(mine[0]["name"])
                seeds = ", ".join(sorted(seeds_of(mine)))
                names = {"quick": "main job", "full": "full"}
                kind = " and ".join(names[b] for b in sorted(budgets_of(mine[0]), reverse=True)) or "its own"
                argv = mine[0].get("argv") or []
                shown = argv[3:] if len(argv) >= 3 and argv[1] == "--run-name" else argv
                print(f"| {algorithm_of(group)} | {track_of(group)} | {seeds} | {kind} | {' '.join(map(str, shown))} |")
        return 0
    except ReferenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
