"""Data files: what a `.jsonl` or `.json` file given as a dataset holds, checked before `datasets` reads it, so that a
file in another shape (a JSON array saved as .jsonl, one object of columns, CSV, a key given twice, a truncated line)
is a one-line error naming what it holds and the format to use, not a message from deep inside `datasets` or a
confusing one about a row's fields later. And what a run reads as a whole (issue 59): one file is one split (read as
two, the run would evaluate on its training rows), and splits that share rows are noted. Nothing here changes a number:
a file that passes is read by `datasets`."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
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
    # JSON Lines ends a line at \n alone: str.splitlines would also cut at U+2028, U+2029 and U+0085, which JSON
    # strings may hold as they are
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
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


# ---- what is not a file: a path that exists but holds no data to read twice ----

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_file(path: str | os.PathLike) -> str | None:
    """What a path is when it exists but is neither a regular file nor a directory (a pipe such as bash's `<(...)`, a
    device such as /dev/null, a socket), in words; None otherwise. Such a path is never opened: a pipe reads once and a
    device never ends."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_not_special(path: Path, flag: str) -> None:
    """A data path that exists but is no regular file or folder (`special_file`) is a one-line error naming what it
    is, before anything opens it."""
    kind = special_file(path)
    if kind is not None:
        raise SystemExit(
            f"error: {path} ({flag}) is {kind}, not a regular file or folder (datasets reads a file more than once); "
            "write the rows to a .jsonl file and pass that"
        )


def check_one_form(folder: Path, split: str, held: list[str], flag: str) -> None:
    """A folder holds each split once: `held` names the forms of `split` found in it (`train.jsonl`, `train.parquet`,
    a save_to_disk dataset); two or more is a one-line error, as which one is read would be a guess."""
    if len(held) > 1:
        raise SystemExit(
            f"error: {folder} ({flag}) holds split '{split}' in {len(held)} forms ({', '.join(held)}): which one is "
            "read would be a guess; keep one of them there (move the others away)"
        )


def check_datasets_cache(what: str) -> None:
    """The cache `datasets` writes every dataset it loads to (HF_DATASETS_CACHE, else HF_HOME/datasets, else
    XDG_CACHE_HOME or HOME's .cache/huggingface/datasets) must be a folder it can write: otherwise `load_dataset` fails
    with an OSError that read as the data file's fault. A one-line error naming the folder and the variable it comes
    from, before `what` is read."""
    import datasets.config

    cache = Path(datasets.config.HF_DATASETS_CACHE)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()
    except OSError as e:
        source = next(
            (f"{v}={os.environ[v]}" for v in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME") if os.environ.get(v)),
            f"HOME={os.environ.get('HOME', '~')}",
        )
        reason = f"{e.strerror or type(e).__name__}" + (f": {e.filename}" if e.filename else "")
        raise SystemExit(
            f"error: the datasets cache {cache} (from {source}) cannot be written ({reason}), so {what} cannot be "
            "loaded; the data is not at fault: point HF_DATASETS_CACHE (or HF_HOME) to a writable folder"
        ) from None


# ---- what one run reads: one file is one split; splits that share rows are noted ----


@dataclass
class _Read:
    key: tuple  # what was read: (the file,) or (the folder or hub name, its configuration, the split)
    split: str
    where: str  # in words, for the messages
    ds: object  # the datasets.Dataset
    hashes: object = None  # its rows' hashes, computed when another split of the same columns is read


_READS: list[_Read] = []


def forget_reads() -> None:
    """A new run starts (`runs.Run`): what earlier runs in this process read is not this run's."""
    _READS.clear()


def record_read(ds, key: tuple, split: str, where: str, file: Path | None = None) -> None:
    """What `loading.load_split` read for `split`. A file read earlier in this run for another split name is refused
    (a file is one split: as two, the run would be evaluated on its own training rows); a split that shares rows with
    one read earlier (the same columns, its rows hashed: no string is compared with another) is a one-line `note:` on
    stderr from the main process, with the count."""
    for read in _READS:
        if file is not None and read.key == key and read.split != split:
            via = read.where if read.where == where else f"{read.where}; {where}"
            real = file.resolve()
            link = f" (a link to {real})" if real != file.parent.resolve() / file.name else ""
            raise SystemExit(
                f"error: {file}{link} is one file, read as split '{read.split}' and as split '{split}' ({via}): "
                f"the run would be evaluated on its own training rows; give each split its own file (a folder of "
                f"{read.split}.jsonl and {split}.jsonl), or, to evaluate on the training rows on purpose, name the "
                "same split for both"
            )
    new = _Read(key, split, where, ds)
    if os.environ.get("RANK", "0") == "0":
        for read in _READS:
            if read.key != key and sorted(read.ds.column_names) == sorted(ds.column_names):
                shared = _shared_rows(new, read)
                if shared:
                    print(
                        f"note: {shared} of the {len(ds)} rows of split '{split}' ({where}) are also rows of split "
                        f"'{read.split}' ({read.where})",
                        file=sys.stderr,
                    )
    _READS.append(new)


def _shared_rows(new: _Read, old: _Read) -> int:
    """How many rows of `new` are also rows of `old` (equal in every column, by a 64-bit hash of each row)."""
    import numpy as np

    for read in (new, old):
        if read.hashes is None:
            read.hashes = row_hashes(read.ds)
    return int(np.isin(new.hashes, old.hashes).sum())


def row_hashes(ds, rows_per_batch: int = 4096):
    """A 64-bit hash of every row of a `datasets.Dataset`, from its Arrow columns in batches (the columns in name order;
    a list's items by position): vectorised, so TL;DR's 117k rows of token lists take seconds, not minutes, and the
    memory of one batch."""
    import numpy as np

    table = ds.with_format("arrow")[:]
    names = sorted(table.column_names)
    out = []
    for batch in table.select(names).to_batches(max_chunksize=rows_per_batch):
        h = np.zeros(batch.num_rows, dtype=np.uint64)
        for column in batch.columns:
            h = _mix(h * np.uint64(1000003) + _array_hashes(column))
        out.append(h)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


def _mix(values):
    from pandas.util import hash_array

    return hash_array(values, categorize=False)


def _array_hashes(array):
    """One uint64 per item of a pyarrow array: lists by their items and positions, structs by their fields, the rest
    by pandas' hash of the value; a null differs from every value."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    nulls = np.asarray(array.is_null().to_numpy(zero_copy_only=False), dtype=np.uint64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.int64)
        flat = pc.list_flatten(array)
        if (pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type)) and flat.null_count == 0:
            items = flat.to_numpy().astype(np.float64 if pa.types.is_floating(flat.type) else np.int64).view(np.uint64)
        else:  # token ids are summed as they are (one multiply each, below); anything else is hashed first
            items = _array_hashes(flat)
        starts = np.cumsum(lengths) - lengths
        positions = np.arange(len(items), dtype=np.int64) - np.repeat(starts, lengths)
        items = items * (_mix(np.arange(int(lengths.max(initial=0)), dtype=np.uint64)) | np.uint64(1))[positions]
        h = np.zeros(len(array), dtype=np.uint64)
        filled = lengths > 0
        if filled.any():
            h[filled] = np.add.reduceat(items, starts[filled])
        h = _mix(h + lengths.astype(np.uint64))
    elif pa.types.is_struct(kind):
        h = np.zeros(len(array), dtype=np.uint64)
        for i in sorted(range(kind.num_fields), key=lambda i: kind.field(i).name):
            h = _mix(h * np.uint64(1000003) + _array_hashes(array.field(i)))
    else:
        try:
            h = _mix(array.to_numpy(zero_copy_only=False))
        except (TypeError, ValueError, pa.ArrowException):  # a type numpy or pandas does not hash: its JSON text
            h = _mix(np.array([json.dumps(v, sort_keys=True, default=str) for v in array.to_pylist()], dtype=object))
    if nulls.any():  # row by row: a null elsewhere in the batch changes no other row's hash
        h[nulls == 1] = _mix(h[nulls == 1] + np.uint64(0x51ED27))
    return h
