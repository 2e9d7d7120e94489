"""The shapes a `.jsonl` / `.json` data file may hold (issue 42 item 6; `datafiles.check_json_rows`, run by
`loading.load_split`): what `datasets` reads as rows loads unchanged, a UTF-8 byte order mark included; every other
shape is one `error:` line naming what the file holds and the format to use. The scripts' side of these cases (the same
line from every script, before training) is in tests/bad_inputs.py."""

from __future__ import annotations

import codecs
import json

import pytest

from clean_rlhf_utils.loading import load_split

ROWS = [
    {"prompt": "a post", "chosen": "good", "rejected": "bad"},
    {"prompt": "another post", "chosen": "fine", "rejected": "worse"},
]
JSONL = "".join(json.dumps(r) + "\n" for r in ROWS)


def rows_of(path) -> list[dict]:
    return load_split(str(path), "train").to_list()


def error_of(path) -> str:
    with pytest.raises(SystemExit) as e:
        load_split(str(path), "train")
    message = str(e.value.code)
    assert message.startswith(f"error: {path} (--dataset-name-or-path)") and "\n" not in message, message
    return message


def test_a_byte_order_mark_is_read_as_if_it_were_not_there(tmp_path):
    """Windows editors write a BOM; it was refused: "line 1 is not a JSON object; is the file complete?"."""
    plain, marked, array = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl", tmp_path / "marked.json"
    plain.write_text(JSONL)
    marked.write_bytes(codecs.BOM_UTF8 + JSONL.encode())
    array.write_bytes(codecs.BOM_UTF8 + json.dumps(ROWS, indent=2).encode())
    assert rows_of(plain) == ROWS
    assert rows_of(marked) == ROWS and rows_of(array) == ROWS


def test_the_shapes_datasets_reads_as_rows_still_load(tmp_path):
    """A .json of one array (on one line or pretty-printed), a .json holding JSON Lines, one row of TRL's conversational
    format (every value a list, as a column file's are) and a blank line between rows."""
    files = {
        "array.json": json.dumps(ROWS),
        "pretty.json": json.dumps(ROWS, indent=2),
        "lines.json": JSONL,
        "blank.jsonl": JSONL.replace("\n", "\n\n", 1),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert rows_of(tmp_path / name) == ROWS, name
    chat = {
        "prompt": [{"role": "user", "content": "a post"}],
        "chosen": [{"role": "assistant", "content": "good"}],
        "rejected": [{"role": "assistant", "content": "bad"}],
    }
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    assert rows_of(tmp_path / "chat.jsonl") == [chat]


def test_other_shapes_name_what_the_file_holds_and_the_format_to_use(tmp_path):
    columns = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    cases = {
        # a pretty-printed column file was read by pandas, a one-line one as one row of lists: neither said so
        "columns.json": (json.dumps(columns, indent=2), "holds one JSON object of columns ({'prompt': [...], ...})"),
        "columns.jsonl": (json.dumps(columns), "holds one JSON object of columns"),
        "array.jsonl": (json.dumps(ROWS, indent=2), "is one JSON array over 12 lines, not one object per line"),
        "one.jsonl": (json.dumps(ROWS[0], indent=2), "is one JSON object over 5 lines, not one object per line"),
        "arrays.jsonl": (JSONL + json.dumps(ROWS) + "\n", "line 3 is a JSON array, not one object per line"),
        "cut.json": (json.dumps(ROWS, indent=2)[:-20], "is not valid JSON (line 10: Unterminated string"),
        "twice.jsonl": (
            JSONL + '{"prompt": "a", "chosen": "b", "chosen": "c"}\n',
            "line 3 gives the key 'chosen' twice",
        ),
        "tabs.jsonl": ("prompt\tchosen\trejected\na\tb\tc\n", "line 1 looks like CSV ('prompt\\tchosen\\trejected')"),
        "rows.tsv": ("prompt\tchosen\trejected\na\tb\tc\n", "is a TSV file, which is not read"),
    }
    for name, (text, expect) in cases.items():
        (tmp_path / name).write_text(text)
        message = error_of(tmp_path / name)
        assert expect in message, message
        fixes = ("save one JSON object per line (JSON Lines, .jsonl)", "is the file complete?", "give each field once")
        assert any(fix in message for fix in fixes), message
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert "is not UTF-8 text" in error_of(tmp_path / "latin1.jsonl")
    (tmp_path / "parquet.jsonl").write_bytes(b"PAR1\x15\x04\x15\xff\xfe")
    assert "(it is a parquet file: name it .parquet)" in error_of(tmp_path / "parquet.jsonl")


def test_a_folder_whose_split_is_csv_says_so(tmp_path):
    (tmp_path / "train.csv").write_text("prompt,chosen,rejected\na,b,c\n")
    with pytest.raises(SystemExit) as e:
        load_split(str(tmp_path), "train")
    assert "no split 'train' in" in str(e.value.code) and "train.csv is CSV, which is not read" in str(e.value.code)


# ---- issue 59, class 4: data read as written ----


@pytest.fixture
def new_run():
    """What `runs.Run` does at a run's start: earlier tests' reads are not this run's."""
    from clean_rlhf_utils import datafiles

    datafiles.forget_reads()
    yield
    datafiles.forget_reads()


def error_line(*args, **kwargs) -> str:
    with pytest.raises(SystemExit) as e:
        load_split(*args, **kwargs)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_one_file_is_one_split_a_run_never_reads_it_as_two(tmp_path, new_run):
    """One file given for a dataset served every split: a run trained on it and evaluated on the same rows, no word."""
    from clean_rlhf_utils import datafiles

    data = tmp_path / "pairs.jsonl"
    data.write_text(JSONL)
    assert load_split(str(data), "train").to_list() == ROWS
    assert load_split(str(data), "train", flag="--norm-dataset-name-or-path").to_list() == ROWS  # the same split: ok
    message = error_line(str(data), "validation")
    assert message == (
        f"error: {data} is one file, read as split 'train' and as split 'validation' (--dataset-name-or-path {data}): "
        "the run would be evaluated on its own training rows; give each split its own file (a folder of train.jsonl "
        "and validation.jsonl), or, to evaluate on the training rows on purpose, name the same split for both"
    )
    datafiles.forget_reads()  # a new run in the same process
    assert load_split(str(data), "validation").to_list() == ROWS
    # a folder's test.jsonl that is a link to its train.jsonl, or the folder's train file given again as another flag
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text(JSONL)
    (folder / "test.jsonl").symlink_to(folder / "train.jsonl")
    datafiles.forget_reads()
    load_split(str(folder), "train")
    assert error_line(str(folder), "test").startswith(
        f"error: {folder / 'test.jsonl'} (a link to {folder / 'train.jsonl'}) is one file, read as split 'train' and "
        "as split 'test'"
    )
    datafiles.forget_reads()
    load_split(str(folder), "train")
    message = error_line(str(folder / "train.jsonl"), "test", flag="--eval-dataset-name-or-path")
    assert f"(--dataset-name-or-path {folder}; --eval-dataset-name-or-path {folder / 'train.jsonl'})" in message


def test_splits_that_share_rows_are_noted_with_the_count(tmp_path, new_run, capsys):
    """A validation split holding training rows was read without a word. Rows are compared whole (every column, a
    list item by item and by position), by hash."""
    rows = [{"q": f"post {i}", "ids": [i, i + 1], "meta": {"n": i}} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    held = [
        rows[1],  # a training row
        {"meta": {"n": 3}, "ids": [3, 4], "q": "post 3"},  # the same row, its keys in another order
        {**rows[2], "ids": [3, 2]},  # a training row's items in another order: another row
        {**rows[0], "meta": {"n": 9}},  # another nested value: another row
        rows[5],
    ]
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    (tmp_path / "test.jsonl").write_text(json.dumps(rows[5]) + "\n")

    def notes() -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if "note:" in line]

    load_split(str(tmp_path), "train")
    assert notes() == []
    load_split(str(tmp_path), "validation")
    assert notes() == [
        f"note: 2 of the 5 rows of split 'validation' (--dataset-name-or-path {tmp_path}) are also rows of split "
        f"'train' (--dataset-name-or-path {tmp_path})"
    ]
    load_split(str(tmp_path), "test")  # shares its one row with validation, none with train
    assert notes() == [
        f"note: 1 of the 1 rows of split 'test' (--dataset-name-or-path {tmp_path}) are also rows of split "
        f"'validation' (--dataset-name-or-path {tmp_path})"
    ]


def test_row_hashes_are_those_of_the_rows_alone():
    """The hash of a row is the same in any batch and beside any other rows (nulls included), and tells apart rows that
    differ in one column, one list item or its position, or a null."""
    from datasets import Dataset

    from clean_rlhf_utils.datafiles import row_hashes

    rows = [
        {"a": "x", "t": [1, 2], "m": [{"role": "u", "content": "c"}], "f": 1.5},
        {"a": "x", "t": [2, 1], "m": [{"role": "u", "content": "c"}], "f": 1.5},
        {"a": "x", "t": [1, 2], "m": [{"role": "u", "content": "d"}], "f": 1.5},
        {"a": "x", "t": [], "m": [], "f": 1.5},
        {"a": "x", "t": [1, 2, 0], "m": [{"role": "u", "content": "c"}], "f": 1.5},
        {"a": "x", "t": [1, 2], "m": [{"role": "u", "content": "c"}], "f": 1.25},
        {"a": None, "t": None, "m": None, "f": None},
        {"a": "x", "t": [1, 2], "m": [{"role": "u", "content": "c"}], "f": 1.5},
    ]
    for batch in (1, 3, 8):
        h = row_hashes(Dataset.from_list(rows), rows_per_batch=batch).tolist()
        assert h[0] == h[7] and len(set(h)) == 7, (batch, h)
        assert h == row_hashes(Dataset.from_list(rows), rows_per_batch=2).tolist()


def test_a_folder_holding_a_split_twice_is_refused(tmp_path):
    """train.jsonl beside train.parquet (or train.json, or a save_to_disk dataset): the .jsonl was read, silently."""
    from datasets import Dataset

    (tmp_path / "train.jsonl").write_text(JSONL)
    Dataset.from_list(ROWS[:1]).to_parquet(str(tmp_path / "train.parquet"))
    assert error_line(str(tmp_path), "train") == (
        f"error: {tmp_path} (--dataset-name-or-path) holds split 'train' in 2 forms (train.jsonl, train.parquet): "
        "which one is read would be a guess; keep one of them there (move the others away)"
    )
    saved = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(saved))
    (saved / "train.json").write_text(json.dumps(ROWS))
    assert "holds split 'train' in 2 forms (train.json, a save_to_disk dataset)" in error_line(str(saved), "train")
    (saved / "train.json").unlink()
    assert load_split(str(saved), "train").to_list() == ROWS


def test_json_lines_split_at_newlines_only(tmp_path):
    """U+2028, U+2029 and U+0085 are valid unescaped inside JSON strings, and JSON Lines ends a line at \\n only; they
    were taken for line ends ("line 1 is not a JSON object ...; is the file complete?"). CRLF still reads."""
    rows = [
        {"prompt": "one\u2028two", "chosen": "para\u2029graph", "rejected": "next\u0085line"},
        {"prompt": "plain", "chosen": "a\u2028", "rejected": "\u0085"},
    ]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert "\u2028" in text and "\\u2028" not in text
    (tmp_path / "seps.jsonl").write_text(text, encoding="utf-8")
    assert rows_of(tmp_path / "seps.jsonl") == rows
    (tmp_path / "crlf.jsonl").write_bytes(text.replace("\n", "\r\n").encode())
    assert rows_of(tmp_path / "crlf.jsonl") == rows


def test_a_path_that_is_no_file_or_folder_is_named_as_such(tmp_path):
    """A pipe (bash's `<(zcat data.jsonl.gz)`, a FIFO) or a device was "no such file or directory"."""
    import os

    from clean_rlhf_utils.loading import require_hub

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    assert error_line(str(fifo), "train") == (
        f"error: {fifo} (--dataset-name-or-path) is a named pipe (FIFO), not a regular file or folder (datasets reads "
        "a file more than once); write the rows to a .jsonl file and pass that"
    )
    assert "/dev/null (--prompt-dataset-name-or-path) is a character device" in error_line(
        "/dev/null", "train", flag="--prompt-dataset-name-or-path"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "test.jsonl")
    assert f"error: {folder / 'test.jsonl'} (--dataset-name-or-path) is a named pipe (FIFO)" in error_line(
        str(folder), "test"
    )
    with pytest.raises(SystemExit) as e:
        require_hub(str(fifo), "model", "--model-name-or-path")
    assert str(e.value.code) == f"error: --model-name-or-path {fifo} is a named pipe (FIFO), not a regular file or " + (
        "model folder"
    )


@pytest.mark.parametrize("variable", ["HF_HOME", "HOME", "HF_DATASETS_CACHE"])
def test_an_unusable_cache_is_named_not_the_data(tmp_path, variable):
    """`datasets` writes every file it loads to its cache: a HOME, HF_HOME or HF_DATASETS_CACHE that cannot hold it
    was reported as "<the data file> cannot be read as json: [Errno 20] Not a directory ...; check that the file is
    complete"."""
    import os
    import subprocess
    import sys

    (tmp_path / "train.jsonl").write_text(JSONL)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")}
    env[variable] = str(blocker)
    code = f"from clean_rlhf_utils.loading import load_split; load_split({str(tmp_path)!r}, 'train')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    message = out.stderr.strip().splitlines()[-1]
    cache = {"HF_HOME": blocker / "datasets", "HOME": blocker / ".cache/huggingface/datasets"}.get(variable, blocker)
    assert out.returncode == 1 and message.startswith(
        f"error: the datasets cache {cache} (from {variable}={blocker}) cannot be written ("
    ), out.stderr[-2000:]
    assert message.endswith(
        f"so {tmp_path / 'train.jsonl'} (--dataset-name-or-path) cannot be loaded; the data is not at fault: point "
        "HF_DATASETS_CACHE (or HF_HOME) to a writable folder"
    ), message


def test_each_run_in_a_process_has_its_own_reads(assets, tmp_path):
    """`runs.Run` forgets the reads of earlier runs in the process: a file one run evaluated on may be the next run's
    training file (here the first fails on a row of the file, read as 'test'; the second reads it as 'train' and fails
    on the same row, not with "is one file, read as split 'test' and as split 'train'")."""
    from tests.bad_inputs import BadInput, World, run_case

    rows = (assets / "tiny-math" / "gsm8k" / "test.jsonl").read_text().splitlines()
    bad = tmp_path / "questions.jsonl"
    bad.write_text("".join(line.replace("####", "#### 3 or") + "\n" for line in rows[:16]))
    w = World(assets, tmp_path, None)
    first = BadInput("a", "", "", lambda s, w: ["--eval-dataset-name-or-path", str(bad)], ["grpo_math"])
    second = BadInput("b", "", "", lambda s, w: ["--dataset-name-or-path", str(bad), "--run-name", "bad2"])
    assert "of split 'test'" in run_case(first, "grpo_math", w)[0]
    message = run_case(second, "grpo_math", w)[0]
    assert "of split 'train'" in message and "is one file" not in message, message
