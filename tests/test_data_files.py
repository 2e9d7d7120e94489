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
