"""Data files: what a `.jsonl` or `.json` file given as a dataset holds, checked before `datasets` reads it, so that a
file in another shape (a JSON array saved as .jsonl, one object of columns, CSV, a key given twice, a truncated line)
is a one-line error naming what it holds and the format to use, not a message from deep inside `datasets` or a
confusing one about a row's fields later. Nothing here changes a number: a file that passes is read by `datasets`."""

from __future__ import annotations

import json
from pathlib import Path

SAVE_AS_JSONL = (
    "save one JSON object per line (JSON Lines, .jsonl), e.g. pandas' DataFrame.to_json(path, orient='records', "
    "lines=True)"
)


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    """`json.loads`' object hook: an object that gives a key twice is refused (JSON readers keep one of the values)."""
    row = dict(pairs)
    if len(row) < len(pairs):
        raise _DuplicateKey(next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])))
    return row


def _is_columns(value) -> bool:
    """One JSON object of columns, {"prompt": [...], "chosen": [...]}: every value a list, all of one length, none a
    conversation (a one-row file of TRL's conversational format has lists of role/content messages)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(v, list) for v in value.values())
        and len({len(v) for v in value.values()}) == 1
        and not any(v and all(isinstance(m, dict) and "role" in m for m in v) for v in value.values())
    )


def _twice(where: str, key: str) -> SystemExit:
    return SystemExit(
        f"error: {where} gives the key {key!r} twice in one object (a JSON reader keeps one of the two values); "
        "give each field once"
    )


def check_json_rows(path: Path, flag: str) -> None:
    """A `.jsonl` / `.json` file holds rows as `datasets` reads them: one JSON object per line (JSON Lines), or, in a
    `.json` file, one JSON array of objects. Anything else is a one-line error that names what the file holds and the
    format to use: a JSON array in a .jsonl file, one object of columns ({"prompt": [...], ...}), one object over
    several lines, CSV text, a key given twice in one object, text that is not UTF-8, a line that is not a JSON object
    (a truncated file's last one). A UTF-8 byte order mark is accepted, as `datasets` skips it."""
    where = f"{path} ({flag})"
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        parquet = path.open("rb").read(4) == b"PAR1"
        raise SystemExit(
            f"error: {where} is not UTF-8 text"
            + (" (it is a parquet file: name it .parquet)" if parquet else "")
            + f"; {SAVE_AS_JSONL}"
        ) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        return  # only blank lines: datasets reads no rows, and load_split says so
    number, first = lines[0]
    try:
        row = json.loads(first, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise _twice(f"{where} line {number}", e.args[0]) from None
    except ValueError:
        row = ...  # not one JSON value on the first line: one value over several lines, CSV, or a truncated line
    whole = row if len(lines) == 1 else ...
    if row is ...:
        try:
            whole = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as e:
            raise _twice(where, e.args[0]) from None
        except ValueError as e:
            if not first.lstrip().startswith(("{", "[")) and ("," in first or "\t" in first):
                raise SystemExit(
                    f"error: {where} line {number} looks like CSV ({first.strip()[:60]!r}), not a JSON object; "
                    f"{SAVE_AS_JSONL}"
                ) from None
            if first.strip() in ("[", "{"):
                raise SystemExit(
                    f"error: {where} is not valid JSON (line {e.lineno}: {e.msg}); is the file complete?"
                ) from None
    span = f"line {number} is a JSON array" if len(lines) == 1 else f"is one JSON array over {len(lines)} lines"
    if isinstance(whole, list):
        if path.suffix == ".json":
            return  # a .json file of one JSON array: datasets reads its objects as rows
        raise SystemExit(f"error: {where} {span}, not one object per line; {SAVE_AS_JSONL}, or name the file .json")
    if _is_columns(whole):
        raise SystemExit(
            f"error: {where} holds one JSON object of columns ({{{next(iter(whole))!r}: [...], ...}}), not rows; "
            f"{SAVE_AS_JSONL}"
        )
    if isinstance(whole, dict) and len(lines) > 1:
        raise SystemExit(
            f"error: {where} is one JSON object over {len(lines)} lines, not one object per line; {SAVE_AS_JSONL}"
        )
    for number, line in lines:  # name the first line that is not a JSON object (a truncated file's last one)
        try:
            value = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as e:
            raise _twice(f"{where} line {number}", e.args[0]) from None
        except ValueError:
            value = None
        if isinstance(value, list):
            raise SystemExit(f"error: {where} line {number} is a JSON array, not one object per line; {SAVE_AS_JSONL}")
        if not isinstance(value, dict):
            raise SystemExit(
                f"error: {where} line {number} is not a JSON object: {line.strip()[:60]!r}; is the file complete?"
            )
        if "\\ud" in line.lower() and _lone_surrogate(value):  # only a \u escape can write one in UTF-8 text
            raise SystemExit(
                f"error: {where} line {number} holds a lone UTF-16 surrogate {_lone_surrogate(value)}, half of a "
                "character (text cut inside a \\uXXXX\\uXXXX pair?), which no tokenizer reads; fix or drop that row"
            )


def _lone_surrogate(value) -> str | None:
    """The first escape of a lone UTF-16 surrogate (a half of a pair, e.g. from text cut between the two) in the
    strings of a parsed JSON value, or None."""
    for text in _strings(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"\\u{ord(text[e.start]):04x}"
    return None


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
