"""What a run writes to disk and reads back, made safe against storage faults (docs/faults.md, "Storage faults"): the
output directory checked before anything loads, directories replaced by renames, the checkpoint to resume from (the
last complete one), metrics rows read back past a torn last line, and model directories checked for the files a
killed copy or save leaves out. Nothing here changes a number."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils.other import load as accelerate_load
from safetensors import SafetensorError, safe_open

CHECKPOINTS = ("checkpoint", "checkpoint.tmp", "checkpoint.prev")  # the newest first; see `checkpoint_to_resume`


def output_dir_problem(root: Path) -> str | None:
    """The one-line error of an `--output-dir` that is not a directory this process can write (a file of that name, a
    read-only file system), or None; checked before anything loads, where the first write would otherwise end the run
    in a traceback after all the loading."""
    if root.exists() and not root.is_dir():
        return f"error: --output-dir {root} is a file, not a directory; pass a directory for the runs"
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"error: --output-dir {root} cannot be written ({e.strerror or e}); pass a directory this user can write"
    return None


# the longest name the library puts beside a run directory: `.<run_name>.lock` (ownership.lock_file) and
# `.<run_name>.previous` (a finished run that --overwrite keeps until the new one finishes)
SIBLING_SUFFIX = len("..previous")
NAME_MAX = 255 - SIBLING_SUFFIX


def previous_dir(run_dir: Path) -> Path:
    """Where `--overwrite` keeps a finished run until the new one finishes: hidden (a dot name), so that globs of
    runs (`runs/ppo_*`) never count it as another seed."""
    return run_dir.with_name(f".{run_dir.name}.previous")


def overwrite_problem(run_dir: Path) -> str | None:
    """The one-line error of `--overwrite` of `run_dir`, or None: it deletes the directory, and for a finished run the
    `previous_dir` of an earlier `--overwrite` (`set_aside`), so each must be a run of this library
    (`not_a_run_problem`)."""
    problem = not_a_run_problem(run_dir)
    if problem is None and (run_dir / "done.json").is_file():
        problem = not_a_run_problem(previous_dir(run_dir))
    return problem


def set_aside(run_dir: Path) -> Path | None:
    """`--overwrite` of a used run directory, once everything is loaded: a finished run (done.json) is moved to
    `previous_dir` and deleted only when the new run finishes (`Run.finish`), so a new run that fails or is killed
    never costs the finished one (docs/faults.md); returns where it went. An unfinished run is deleted (its
    checkpoints were only a way to finish it). Neither unless it is a run of this library (`overwrite_problem`, checked
    when the run started and again here)."""
    problem = overwrite_problem(run_dir)
    if problem:
        raise SystemExit(problem)
    if not (run_dir / "done.json").exists():
        shutil.rmtree(run_dir)
        return None
    previous = previous_dir(run_dir)
    shutil.rmtree(previous, ignore_errors=True)
    run_dir.rename(previous)
    print(f"note: --overwrite: the finished run is kept in {previous} until this run finishes", file=sys.stderr)
    return previous


def remove_previous(run_dir: Path) -> None:
    """The end of a run: the finished run an `--overwrite` set aside (`set_aside`) is deleted, also when a `--resume`
    finishes the new run; whatever else has that name (not a run of this library) is left alone."""
    if not_a_run_problem(previous_dir(run_dir)) is None:
        shutil.rmtree(previous_dir(run_dir), ignore_errors=True)


def run_name_problem(run_name: str) -> str | None:
    """The one-line error of a `--run-name` that is not one plain directory name, or None: `.` and `..` name the
    output directory and its parent (an `--overwrite` would delete them), a `/` a directory elsewhere, and a name
    too long for the file system fails at the first write, after all the loading."""
    if run_name in ("", ".", "..") or any(c in run_name for c in "/\\\0"):
        return (
            f"error: --run-name {run_name!r} is not a plain directory name; give a name without '/', other than "
            "'.' and '..' (the run goes to --output-dir/NAME)"
        )
    if len(run_name.encode()) > NAME_MAX:
        return f"error: --run-name is {len(run_name.encode())} bytes long; give one of at most {NAME_MAX}"
    return None


def run_dir_problem(run_dir: Path) -> str | None:
    """The one-line error of a run directory the run cannot own, or None: a symbolic link (two names would share one
    directory, and `--overwrite` would delete what it points to or fail), a file, or a directory this process cannot
    write (a read-only mount). Checked before anything loads."""
    flag = f"--run-name {run_dir.name}"
    if run_dir.is_symlink():
        return (
            f"error: {run_dir} ({flag}) is a symbolic link; a run directory is a plain directory inside --output-dir: "
            "remove the link or pass another --run-name"
        )
    if run_dir.exists() and not run_dir.is_dir():
        return f"error: {run_dir} ({flag}) is a file, not a run directory; move it or pass another --run-name"
    if run_dir.is_dir():
        probe = run_dir / f".write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            return f"error: {run_dir} ({flag}) cannot be written ({e.strerror or e}); pass another --run-name"
    return None


# What a run of this library writes at the top of its directory (`runs.Run`, `tracking`: wandb's own folder and id;
# `DONE`: the end marker of an older benchmark.run), files and directories apart. `not_a_run_problem` lets `--overwrite`
# (and a tool that cleans a folder) delete a directory only when it holds nothing else.
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "samples.jsonl",
    "provenance.json",
    "done.json",
    "done.json.tmp",
    "wandb_id",
    "DONE",
)
RUN_DIRS = (*CHECKPOINTS, "model", "model.tmp", "model.old", "wandb")
# the files that only a run writes (with a run's config.json, or a checkpoint: its state.json); model/ and wandb/ alone
# are anyone's
RUN_MARKERS = ("metrics.jsonl", "samples.jsonl", "provenance.json", "done.json", "wandb_id", "DONE")
PROBE = ".write-test-"  # `run_dir_problem`'s probe, left by a process killed while it existed


def _is_run_config(path: Path) -> bool:
    """Whether `path` holds a run's config.json (a JSON object of `Args`, with `run_name`), not a model's."""
    try:
        if path.stat().st_size > 1 << 20:
            return False
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "run_name" in config


def not_a_run_problem(path: Path, action: str = "--overwrite", fix: str = "pass another --run-name") -> str | None:
    """The one-line error of deleting `path` as a run of this library, or None when it may go: absent, empty, or
    recognisably a run (every entry at its top one a run writes, of the kind it writes, `RUN_FILES` and `RUN_DIRS`,
    and at least one that only a run writes: a `RUN_MARKERS` file, a run's config.json or a checkpoint's state.json).
    Anything else (a symbolic link, a file, a directory holding other entries, or only a model/) is named in the line:
    `action` is what would delete it, `fix` what to do instead. `--overwrite` and the tools that clean a folder call
    it before they delete; it reads a few small files and deletes nothing."""
    if path.is_symlink():
        return f"error: {action} would delete {path}, which is a symbolic link (to {os.readlink(path)}); {fix}"
    if not path.exists():
        return None
    if not path.is_dir():
        return f"error: {action} would delete {path}, which is a file, not a run directory; {fix}"
    try:
        entries = sorted(p for p in path.iterdir() if not p.name.startswith(PROBE))
    except OSError as e:
        return f"error: {action} would delete {path}, whose entries cannot be listed ({e.strerror or e}); {fix}"
    foreign, marked = [], False
    for entry in entries:
        name, is_dir = entry.name, entry.is_dir() and not entry.is_symlink()
        if entry.is_symlink():
            foreign.append(f"{name} (a symbolic link)")
        elif name in RUN_FILES and is_dir:
            foreign.append(f"{name}/ (a directory where a run writes a file)")
        elif name in RUN_DIRS and not is_dir:
            foreign.append(f"{name} (a file where a run writes a directory)")
        elif name == "config.json":
            if not _is_run_config(entry):
                foreign.append("config.json (not a run's arguments)")
            marked = True
        elif name in RUN_FILES or name in RUN_DIRS:
            marked = marked or name in RUN_MARKERS or (name in CHECKPOINTS and (entry / "state.json").is_file())
        else:
            foreign.append(name + ("/" if is_dir else ""))
    if foreign:
        more = f", ... ({len(foreign)} in all)" if len(foreign) > 4 else ""
        return (
            f"error: {action} would delete {path}, which is not a run of this library: it holds "
            f"{', '.join(foreign[:4])}{more}; move what is yours out of it (a run holds only "
            f"{', '.join(RUN_FILES[:5])}, checkpoint/, model/, ...), or {fix}"
        )
    if entries and not marked:
        names = ", ".join(p.name + "/" * p.is_dir() for p in entries)
        return (
            f"error: {action} would delete {path}, which holds {names} but none of a run's own files (a run's "
            f"config.json, {', '.join(RUN_MARKERS[:4])}, a checkpoint's state.json); move what is yours out of it, "
            f"or {fix}"
        )
    return None


def resume_dir_problem(run_dir: Path) -> str | None:
    """The one-line error of a run directory `--resume` cannot continue, or None: a run's file or folder it cannot
    read as the run wrote it (a file replaced by a directory or the other way round, a file that cannot be read or
    decoded: `config.json`, `provenance.json`, `done.json` must be JSON objects, `metrics.jsonl` and `samples.jsonl`
    UTF-8 text, whose rows `read_rows` checks), or a finished run (done.json). Checked before anything loads, instead
    of a traceback where the run reads it."""
    for name in (*RUN_FILES, *RUN_DIRS):
        path = run_dir / name
        if not path.exists() and not path.is_symlink():
            continue
        fix = "restore the run's own, or move it away and start over with --overwrite"
        if path.is_symlink() and not path.exists():
            return f"error: --resume: {path} is a symbolic link to nothing; {fix}"
        if name in RUN_DIRS:
            if not path.is_dir():
                return f"error: --resume: {path} is a file where the run writes a directory; {fix}"
            continue
        if path.is_dir():
            return f"error: --resume: {path} is a directory where the run writes a file; {fix}"
        try:
            text = path.read_text(encoding="utf-8")
            if name.endswith(".json") and not isinstance(json.loads(text), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            why = " ".join(str(getattr(e, "strerror", None) or e).split())[:120]
            return f"error: --resume: {path} cannot be read as the run wrote it ({why}); {fix}"
    if (run_dir / "done.json").exists():
        return f"error: --resume: {run_dir} finished its run (done.json); there is nothing to resume"
    return None


def replace_dir(tmp: Path, final: Path, keep_old_as: Path | None = None) -> None:
    """Puts the finished directory `tmp` at `final` by renames, so a kill part way leaves the old `final` (or, between
    the two renames, `final.old`, which `Run` puts back) and never a half-written one. `keep_old_as`: the old `final`
    is kept there instead of deleted (the previous checkpoint)."""
    old = keep_old_as or final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if keep_old_as is None:
        shutil.rmtree(old, ignore_errors=True)


def write_synced(path: Path, text: str) -> None:
    """`path.write_text(text)`, flushed to the disk before it returns: a crash of the machine after it cannot leave the
    file empty."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_state(checkpoint: Path) -> dict | None:
    """The loop state of a checkpoint directory (`state.json`, written last), or None when it is missing, empty or
    torn: a checkpoint whose write did not end."""
    try:
        state = json.loads((checkpoint / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None


def state_digest(checkpoint: Path, state: dict) -> str:
    """The digest that ties a checkpoint's `state.json` to the checkpoint: sha256 over the state's fields (all but
    `digest` itself, keys sorted) and the JSON files written beside it (`custom_state_<i>.json`: the learning-rate
    schedule, whose position follows the step). `Run.checkpoint` records it in `state.json`; `--resume` recomputes it,
    so a state edited by hand (a step, an episode, a row count) no longer describes its checkpoint. It reads no
    weights: cheap for any model size."""
    fields = json.loads(json.dumps({k: v for k, v in state.items() if k != "digest"}))  # as state.json reads back
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for file in sorted(checkpoint.glob("custom_state_*.json")):
        h.update(file.name.encode() + b"\0" + file.read_bytes())
    return h.hexdigest()


def state_problem(checkpoint: Path, state: dict) -> str | None:
    """The one-line error of a checkpoint whose `state.json` does not describe it (edited by hand, or from another
    checkpoint: `state_digest`), or None."""
    try:
        same = state.get("digest") == state_digest(checkpoint, state)
    except OSError as e:
        same, why = False, f"{e.strerror or e}"
    else:
        why = "no digest" if "digest" not in state else "its digest does not match"
    if same:
        return None
    return (
        f"error: --resume: {checkpoint / 'state.json'} does not describe this checkpoint ({why}: edited, or from "
        f"another checkpoint; it claims step {state['step']}); start over with --overwrite"
    )


def checkpoint_file_problem(checkpoint: Path) -> str | None:
    """The one-line error of a checkpoint file that is not whole (a cut or corrupt copy): every safetensors file
    (`safetensors_problem`) and every torch file (`.bin`, `.pt`, `.pkl`: torch.save's zip archive, whose central
    directory, at the end, a cut file lacks) at the top of the checkpoint, checked before anything loads; None."""
    import zipfile

    for file in sorted(checkpoint.iterdir()):
        problem = None
        if file.suffix == ".safetensors":
            problem = safetensors_problem(file)
        elif file.suffix in (".bin", ".pt", ".pkl") and file.is_file():
            try:
                with zipfile.ZipFile(file) as archive:
                    archive.infolist()
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                problem = f"is not a whole torch file ({file.stat().st_size} bytes; {e})"
        if problem:
            return (
                f"error: --resume: {file} {problem}; the checkpoint is damaged (a cut copy?): restore it, or start "
                "over with --overwrite"
            )
    return None


def checkpoint_to_resume(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of a run and what was passed over, newest first: `checkpoint/`; while it is
    missing, `checkpoint.tmp/` when complete (a kill between the two renames that put it in place); then
    `checkpoint.prev/`, the one before (kept for a `checkpoint/` whose `state.json` is empty or torn, as a crash of
    the machine can leave it)."""
    passed = []
    for name in CHECKPOINTS:
        path = run_dir / name
        if name == "checkpoint.tmp" and (run_dir / "checkpoint").exists():
            continue  # a write that a kill interrupted: checkpoint/ is the newest complete one, if any
        if not path.is_dir():
            continue
        if read_state(path) is not None:
            return path, passed
        why = "is a directory" if (path / "state.json").is_dir() else "is missing, empty or torn"
        passed.append(f"{path} (its state.json {why})")
    return None, passed


def read_rows(path: Path) -> list[str]:
    """The lines of a run's `.jsonl` file that hold a JSON object, or a one-line error. A last line that does not
    parse is a row whose write a kill cut short: it is dropped (the checkpoint before it did not count it)."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            if i == len(lines):
                break
            raise SystemExit(f"error: --resume: {path} line {i} is not a JSON row; fix or delete that line") from None
        rows.append(line if line.endswith("\n") else line + "\n")
    return rows


def check_not_pickled(path: str, flag: str) -> None:
    """A local model directory whose weights are only a pickle (`pytorch_model.bin`, sharded or not: torch.save's
    format, no safetensors beside it) is a one-line error naming `flag`; this library loads and saves weights as
    safetensors only. Checked for every model flag before anything loads (`runs.check_args`)."""
    root = Path(path)
    if not root.is_dir() or any(root.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in root.glob("pytorch_model*.bin"))
    if pickles:
        raise SystemExit(
            f"error: {flag} {path} holds its weights only as a pickle ({pickles[0]}), which this library does not "
            "load; save them as safetensors (transformers' default: `save_pretrained(dir)`) and pass that directory"
        )


def check_model_files(path: str, flag: str) -> None:
    """A local model directory holds `config.json` and whole safetensors weights, or a one-line error naming `flag`:
    a copy or a save that was killed leaves a truncated `model.safetensors`, or the weights without `config.json`,
    which transformers reports in a traceback. Hub names and other directories (no weights expected) pass."""
    root = Path(path)
    if not root.is_dir():
        return
    if not (root / "config.json").is_file():
        raise SystemExit(
            f"error: {flag} {path} holds no config.json: it is no model directory, or its save or copy was cut "
            "short; pass a complete model directory (config.json, weights, tokenizer)"
        )
    check_config_json(path, flag)
    check_not_pickled(path, flag)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise SystemExit(f"error: {flag} {path}: {index.name} is not a weight index (truncated?)") from None
    else:
        files = [p.name for p in root.glob("*.safetensors")]
    for name in files:
        problem = safetensors_problem(root / name)
        if problem:
            raise SystemExit(
                f"error: {flag} {path}: {name} {problem} (was its save or copy interrupted?); pass a complete model "
                "directory"
            )


def check_config_json(path: str, flag: str) -> None:
    """A local model directory's `config.json`, when there is one, is JSON, or a one-line error naming it and the JSON
    error (transformers reports it from whichever loads first, the tokenizer included, as a problem of that)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        where = f" (line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise SystemExit(
            f"error: {flag} {path}: config.json is not valid JSON{where}: {reason}; fix or restore config.json"
        ) from None


def check_loading_info(info: dict, path: str, flag: str, what: str, new_head: bool = False) -> None:
    """The weights of `path` fill exactly the model its config builds, or a one-line error naming the first tensors
    that are missing (transformers would give them random values and only print a table), unexpected (weights of
    another architecture) or of another shape. `new_head`: a sequence classifier, whose `score` head may be new and
    which leaves a causal LM's output layer unused. Tied weights (an LM head tied to the embedding) are not missing."""
    missing = [k for k in info.get("missing_keys", ()) if not (new_head and k.split(".")[0] == "score")]
    unexpected = [
        k for k in info.get("unexpected_keys", ()) if not (new_head and k.split(".")[0] in ("lm_head", "embed_out"))
    ]
    mismatched = [f"{k} {tuple(a)} in the file, {tuple(b)} in the model" for k, a, b in info.get("mismatched_keys", ())]
    problems = [
        f"{len(keys)} {kind} ({', '.join(sorted(keys)[:3])}{', ...' if len(keys) > 3 else ''})"
        for kind, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched))
        if keys
    ]
    if problems:
        raise SystemExit(
            f"error: {flag} {path}: its weights do not match the {what} its config.json describes: tensors "
            f"{'; '.join(problems)}; pass the model directory those weights were saved with"
        )


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file (missing, or not whole: safetensors' own header check, which also finds
    a file shorter than its header says), or None. It maps the file and reads no tensor."""
    try:
        with safe_open(file, framework="pt"):
            return None
    except FileNotFoundError:
        return "is missing"
    except Exception as e:  # SafetensorError and OSError: a file cut short or not safetensors at all
        return f"is not a whole safetensors file ({file.stat().st_size} bytes; {e})"


# What a failed write raises on a full or lost file system: OSError from Python's own writes, SafetensorError from
# safetensors (the weights), RuntimeError from torch.save's zip writer (the optimizer: "PytorchStreamWriter failed
# writing file ..."); each ends the run in one line naming the checkpoint to go on from, never a traceback.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_error(e: BaseException) -> str:
    """The cause of a failed write, on one line."""
    return " ".join(str(getattr(e, "strerror", None) or e).split())[:200] or type(e).__name__


def save_state_without_pickles(accelerator: Accelerator, path: Path) -> None:
    """accelerate's `save_state` (weights in safetensors, the optimizer, every process's RNG states), except that the
    objects registered with `register_for_checkpointing` (the learning-rate schedule) are written as JSON,
    `custom_state_<i>.json`: accelerate would pickle them to `custom_checkpoint_<i>.pkl` and load that pickle with
    `weights_only=False`, so a tampered checkpoint could run code on `--resume` (docs/faults.md)."""
    custom, accelerator._custom_objects = accelerator._custom_objects, []
    try:
        accelerator.save_state(str(path))
    finally:
        accelerator._custom_objects = custom
    if accelerator.is_main_process:
        for i, obj in enumerate(custom):
            write_synced(path / f"custom_state_{i}.json", json.dumps(obj.state_dict()) + "\n")


def load_state_safely(accelerator: Accelerator, path: Path) -> None:
    """The inverse of `save_state_without_pickles`: accelerate loads its files with `weights_only=True` (tensors,
    numbers and numpy arrays; a pickle that would call anything else is refused), the registered objects come from
    JSON, and a pickle of a registered object (an older checkpoint, or one planted) is never loaded. A file that does
    not load (damaged, planted, of another model) is a one-line error."""
    pickles = sorted(p.name for p in path.glob("custom_checkpoint_*.pkl"))
    if pickles:
        raise SystemExit(
            f"error: --resume: {path / pickles[0]} is a pickle, which this library does not load (it could run code); "
            "this checkpoint was not written by this version of clean-rlhf: start over with --overwrite"
        )
    custom, accelerator._custom_objects = accelerator._custom_objects, []
    try:
        # accelerate passes over RNG states it cannot load (a resume that is no longer exact, silently): load them first
        rng = path / f"random_states_{accelerator.process_index}.pkl"
        if rng.exists():
            accelerate_load(rng)
        accelerator.load_state(str(path))
        for i, obj in enumerate(custom):
            obj.load_state_dict(json.loads((path / f"custom_state_{i}.json").read_text()))
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: --resume: {path} cannot be loaded ({type(e).__name__}: {reason}); it is damaged or not this "
            "run's: start over with --overwrite"
        ) from None
    finally:
        accelerator._custom_objects = custom
