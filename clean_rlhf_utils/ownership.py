"""One owner per run directory, and records that stay true across `--resume` (docs/faults.md, "The run directory"):
the lock a run holds for its whole life, the input paths `--overwrite` and `--resume` must not write over, and the
flags `--resume` must not change. `runs.Run` calls them before anything loads; nothing here changes a number."""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from clean_rlhf_utils import storage

HELD: dict[str, tuple[int, int]] = {}  # the locks this process holds: lock file -> (its descriptor, the owner's pid)


def lock_file(run_dir: Path) -> Path:
    """`runs/.<run_name>.lock`: beside the run directory, not in it, so that `--overwrite` deleting and recreating the
    directory never touches the lock that guards it."""
    return run_dir.with_name(f".{run_dir.name}.lock")


def _owner(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _describe(owner: dict | None) -> str:
    if not owner:
        return "another process (starting)"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    return f"process {owner.get('pid')} on {owner.get('host')} (started {started})"


def take_lock(run_dir: Path) -> str | None:
    """Takes the run directory's lock (`flock`, exclusive, without waiting) for the life of this process, or returns
    the one-line error naming the live owner. The lock file records the owner (pid, host, start time); the OS releases
    the flock when its process dies, so a file whose lock can be taken was left by a process that was killed
    (SIGKILL, a lost node): it is taken over, and named on stderr. Released by `release_lock` (at the end of a run,
    and at exit)."""
    path = lock_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    release_lock(run_dir)  # a run of this same process that ended without closing (a caller of `main`, e.g. a test)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            for _ in range(40):  # the owner writes its record just after taking the lock: give it a moment to name it
                if owner:
                    break
                time.sleep(0.05)
                owner = _owner(fd)
            os.close(fd)
            return (
                f"error: {run_dir} is in use by {_describe(owner)}; wait for it to end or stop it (two runs in one "
                "directory would interleave their rows and overwrite each other's model)"
            )
        try:
            here = os.stat(path)
            mine = os.fstat(fd)
            same = (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its owner removed the file between our open and our flock: lock the file that is there now
    stale = _owner(fd)
    if stale:
        print(
            f"note: {path} was left by {_describe(stale)}, which ended without releasing it (killed?); taking it over",
            file=sys.stderr,
            flush=True,
        )
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    HELD[str(path.resolve())] = (fd, os.getpid())
    return None


def release_lock(run_dir: Path) -> None:
    """Lets the run directory's lock go; a no-op when this process does not hold it."""
    _release(lock_file(run_dir))


def _release(path: Path) -> None:
    """Removes the lock file while still holding its lock, then lets the lock go: a process waiting on the old file
    finds it gone and locks the new one."""
    fd, pid = HELD.pop(str(path.resolve()), (None, None))
    if fd is None:
        return
    if pid != os.getpid():  # a forked child (a data-loader worker) that exits: the lock is its parent's
        return
    try:
        if os.path.samestat(os.stat(path), os.fstat(fd)):
            os.unlink(path)
    except OSError:
        pass
    os.close(fd)


@atexit.register
def release_all() -> None:  # a run that ends by an exception or SystemExit: nothing is left behind
    for path in list(HELD):
        _release(Path(path))


def check_inputs_outside(args, run_dir: Path) -> None:
    """`--overwrite` deletes the run directory and `--resume` writes its model/ into it: refused when a path the run
    reads (a model, a dataset: every `*path*` flag that names something on disk) lies inside it; then `--overwrite`
    of anything but a run of this library (`storage.overwrite_problem`, which names what is there)."""
    action = "--overwrite would delete" if args.overwrite else "--resume would write into"
    target = run_dir.resolve()
    for f in dataclasses.fields(args):
        if "path" not in f.name:
            continue
        values = getattr(args, f.name)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if isinstance(value, str) and value and Path(value).exists():
                if Path(value).resolve().is_relative_to(target):
                    flag = "--" + f.name.replace("_", "-")
                    raise SystemExit(
                        f"error: {action} {run_dir}, which {flag} reads ({value}); pick another --run-name"
                    )
    if args.overwrite and (problem := storage.overwrite_problem(run_dir)):
        raise SystemExit(problem)


# flags that cannot change what a resumed run computes or logs: the machine's threads, the run's own flags, where the
# run is mirrored, how often it checkpoints and whether the final model is saved. Every other flag, the budget and the
# logging and evaluation cadence included (an evaluation may sample, and the rows must read as one command's), must
# be the one the run was started with.
RESUME_MAY_CHANGE = (
    "num_threads",
    "resume",
    "overwrite",
    "track",
    "wandb_project",
    "wandb_entity",
    "save_every",
    "save_model",
    "output_dir",
    "run_name",
    "exp_name",
)


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value) or "[]"
    return str(value)


def check_resume_args(args, run_dir: Path) -> None:
    """`--resume` continues the run its config.json describes (the arguments it was started with): a flag that alters
    the run (anything but RESUME_MAY_CHANGE) given another value is a one-line error naming it, so that the restored
    optimizer, schedule, counters and done.json never disagree with config.json."""
    path = run_dir / "config.json"
    try:
        was = json.loads(path.read_text())
    except (OSError, ValueError):
        raise SystemExit(
            f"error: --resume: {path} is missing or unreadable, so the arguments {run_dir} was started with are "
            "unknown; start a new run (--overwrite)"
        ) from None
    now = json.loads(json.dumps(dataclasses.asdict(args)))  # as config.json holds them (tuples become lists)
    changed = [k for k in now if k in was and k not in RESUME_MAY_CHANGE and now[k] != was[k]]
    if not changed:
        return
    flags = ["--" + k.replace("_", "-") for k in changed]
    more = f" (also changed: {', '.join(flags[1:])})" if len(flags) > 1 else ""
    raise SystemExit(
        f"error: --resume with {flags[0]} {_show(now[changed[0]])}, but {run_dir} was started with "
        f"{_show(was[changed[0]])}{more}; resume with the same value or start a new run"
    )


def run_identity(args) -> dict:
    """Whose checkpoint it is: the run's name and seed (and, for the reader, its `--exp-name`), recorded in every
    checkpoint's `state.json` (`Run.checkpoint`, under its digest) and compared on `--resume`
    (`checkpoint_owner_problem`)."""
    return {"run_name": args.run_name, "seed": getattr(args, "seed", None), "exp_name": getattr(args, "exp_name", None)}


def checkpoint_owner_problem(args, checkpoint: Path, state: dict) -> str | None:
    """The one-line error of a checkpoint that another run wrote (copied in from another seed or another run name:
    its weights, optimizer and RNG states would continue that run under this one's name and config.json), or None. A
    checkpoint without the record (written before it was kept) is not refused."""
    theirs, mine = state.get("run"), run_identity(args)
    if not isinstance(theirs, dict):
        return None
    if all(theirs.get(k, mine[k]) == mine[k] for k in ("run_name", "seed")):
        return None
    was = f"--run-name {theirs.get('run_name', mine['run_name'])}, --seed {theirs.get('seed', mine['seed'])}"
    return (
        f"error: --resume: {checkpoint} was written by another run ({was}), not by this one (--run-name "
        f"{mine['run_name']}, --seed {mine['seed']}): copied here, it would continue that run under this one's name; "
        "resume that run in its own directory, or start this one over with --overwrite"
    )
