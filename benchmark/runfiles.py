"""The one checked reader of a run's files, for every tool that reads runs (compare, reproduce, results, frontier,
reference build, the study, the suite, tools/identical): `read_metrics` (metrics.jsonl), `read_object` (done.json,
config.json, provenance.json), `read_done_argv`. The same damage gets the same line from each: a `RunFileError`,
whose message each tool prints as its one `error:` line. What is checked, before any value is used:

  the path    a regular file (a link to one is fine); a folder, a named pipe, a device (a link to /dev/zero) or a
              socket is named, never read (a pipe would hang the tool, /dev/zero fill its memory); a file above
              MAX_BYTES is not a run's
  the bytes   UTF-8 (the scripts write ASCII JSON), the line named
  the rows    each line a JSON object whose every value is a number (a JSON boolean is not: `true` would be averaged
              as 1; NaN and Infinity are, a diverged run's); the `episode` counter (`step` in rows without one) never
              goes back: two runs' rows appended to one file are no run's curve
  a torn row  a last line that does not parse and has no newline after it is a row whose write a kill cut short:
              dropped, and said (`Metrics.torn`), as the scripts' own --resume drops it; any other line that does
              not parse is damage
  an object   done.json, config.json and provenance.json each one JSON object, not empty
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 1 << 30
"""the largest file read as a run's (a run logs a few hundred bytes a step: this is millions of steps)"""

WHY = {
    "metrics.jsonl": "its rows cannot be read: restore the file or rerun the run",
    "done.json": "the run's end is unknown: rerun the run (or delete done.json and --resume it)",
    "config.json": "the run's arguments are unknown: rerun the run",
    "provenance.json": "the run's code and host are unknown: rerun the run",
}


class RunFileError(SystemExit):
    """A run's file that cannot be read as one. A SystemExit whose text is the one `error:` line, so that every tool
    ends in the same line for the same damage without a handler of its own; `message` is the text after `error: `."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")
        self.message = message


def _advice(path: Path) -> str:
    return WHY.get(path.name, "rerun the run")


def kind_of(path: Path) -> str:
    """What `path` is when it is not a regular file ("" when it is one; FileNotFoundError when it is not there)."""
    mode = os.stat(path).st_mode  # follows links: a link to a regular file is one
    if stat.S_ISREG(mode):
        return ""
    kind = (
        "a folder"
        if stat.S_ISDIR(mode)
        else "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    if os.path.islink(path):
        kind += f" (a link to {os.path.realpath(path)})"
    return kind


def read_bytes(path: Path) -> bytes:
    """The bytes of a run's file, after its path is checked (`kind_of`, MAX_BYTES)."""
    path = Path(path)
    if os.path.islink(path) and not os.path.exists(path):
        raise RunFileError(f"{path} is a link to {os.readlink(path)}, which is not there: {_advice(path)}")
    try:
        kind = kind_of(path)
        if kind:
            raise RunFileError(f"{path} is {kind}, not a run's file; it was not read: {_advice(path)}")
        if os.stat(path).st_size > MAX_BYTES:
            raise RunFileError(f"{path} holds {os.stat(path).st_size} bytes, more than a run's file ({MAX_BYTES})")
        with open(path, "rb") as f:
            return f.read(MAX_BYTES + 1)
    except RunFileError:
        raise
    except OSError as e:
        raise RunFileError(f"{path} cannot be read ({e.strerror or e}): {_advice(path)}") from None


def _text(path: Path, raw: bytes, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path} line {line}" if line else str(path)
        raise RunFileError(
            f"{where} is not UTF-8 (byte 0x{raw[e.start]:02x} at its offset {e.start}): {_advice(path)}"
        ) from None


def read_object(path: Path) -> dict:
    """A run's JSON object file (done.json, config.json, provenance.json): one object, or a RunFileError."""
    path = Path(path)
    text = _text(path, read_bytes(path))
    if not text.strip():
        raise RunFileError(f"{path} is empty (a write cut short): {_advice(path)}")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RunFileError(f"{path} is not JSON ({e}): {_advice(path)}") from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path} is a JSON {_json_kind(data)}, not an object: {_advice(path)}")
    return data


def read_done_argv(run_dir: Path) -> list | None:
    """The command (`argv`) a finished run's done.json records, None where it records none or has no done.json."""
    if not os.path.lexists(Path(run_dir) / "done.json"):
        return None
    argv = read_object(Path(run_dir) / "done.json").get("argv")
    return argv if isinstance(argv, list) else None


def _json_kind(value) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def is_number(value) -> bool:
    """A number as a script logs it: int or float, NaN and Infinity included (a diverged run), a boolean not."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class Metrics:
    rows: list[dict]
    torn: str = ""
    """"" or the line that says its torn last row was dropped"""


def read_metrics(path: Path) -> Metrics:
    """A run's metrics.jsonl, every row checked (the module's docstring), or a RunFileError naming the line."""
    path = Path(path)
    if not os.path.lexists(path):
        done = " though it finished (its done.json)" if os.path.lexists(path.parent / "done.json") else ""
        raise RunFileError(f"{path.parent} holds no metrics.jsonl{done}: its rows are lost; rerun the run")
    data = read_bytes(path)
    lines = data.split(b"\n")
    rows: list[dict] = []
    torn, counter = "", {}
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        text = _text(path, raw, i)  # the scripts write ASCII: a byte that is not UTF-8 is damage, never a torn row
        try:
            row = json.loads(text)
        except ValueError as e:
            if i == len(lines):  # the last line, with no newline after it: a row whose write a kill cut short
                torn = f"{path} line {i}: its last row is torn (a write cut short: {text[:40]!r}), dropped"
                break
            raise RunFileError(f"{path} line {i} is not a JSON row ({e}): {_advice(path)}") from None
        if not isinstance(row, dict):
            raise RunFileError(f"{path} line {i} is a JSON {_json_kind(row)}, not a row of metrics: {_advice(path)}")
        for k, v in row.items():
            if not is_number(v):
                raise RunFileError(
                    f"{path} line {i}: its {k} is {json.dumps(v)[:40]}, not a number (a script logs numbers, NaN "
                    f"when it diverged): {_advice(path)}"
                )
        if problem := counter_problem(row, i, counter):
            raise RunFileError(f"{path} {problem}")
        rows.append(row)
    return Metrics(rows, torn)


def counter_problem(row: dict, line: int, last: dict) -> str:
    """Why `row` (at `line`) cannot follow the rows before it in one run, or "" (`last`: counter -> (value, line) of
    the rows before, updated here)."""
    key = "episode" if "episode" in row else "step" if "step" in row else None
    if key is None:
        return ""
    value = row[key]
    if not is_number(value) or not math.isfinite(value):
        return f"line {line}: its {key} is {value!r}, not a number"
    if key in last and value < last[key][0]:
        before, at = last[key]
        return (
            f"line {line}: its {key} {value:g} is below the {before:g} of line {at}: the counter goes back, so the "
            "file holds the rows of two runs; keep one run's rows in it (or rerun it)"
        )
    last[key] = (value, line)
    return ""


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory to read: a folder holding a metrics.jsonl or a done.json, whatever they are
    (a link to /dev/zero is found here, and refused when read; a finished run without its rows is named then)."""
    path = Path(path)
    return path.is_dir() and any(os.path.lexists(path / name) for name in ("metrics.jsonl", "done.json"))
