"""Issue 67, class 1: one checked reader of run files (benchmark/runfiles.py) for every tool. The same damage to a
run's metrics.jsonl, done.json, provenance.json or config.json gets the same one `error:` line from compare,
reproduce, results, frontier, reference build and tools/identical, before any output is written: a pipe or a device
is named, never read; bytes that are not UTF-8, a row that is not an object of numbers (a JSON boolean is none), a
counter that goes back, a done.json that is not an object, a finished run without its rows. A torn last row is
dropped and said by each. A run that stops before the span reproduce judges it on is "incomplete, not judged"."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from benchmark import compare, frontier, reference, reproduce, results, runfiles
from benchmark.tools import identical

NAME = "grpo_tiny-math__1"  # a shipped group: reproduce judges it against the library's data
SHIPPED = str(reference.DIR)


def _rows(n: int = 4) -> list[dict]:
    return [
        {"step": i, "episode": 64 * i, "time": 1.0 + i, "eval/accuracy": i / 10, "eval/kl": i / 10} for i in range(n)
    ]


def _run(root: Path, name: str = NAME) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (d / "done.json").write_text(json.dumps({"argv": ["tiny", "--seed", "1"]}))
    (d / "config.json").write_text(json.dumps({"seed": 1}))
    return d


def _metrics_with(line: bytes):
    def damage(d: Path) -> Path:
        raw = (d / "metrics.jsonl").read_bytes().splitlines(keepends=True)
        (d / "metrics.jsonl").write_bytes(b"".join(raw[:2]) + line + b"".join(raw[2:]))
        return d / "metrics.jsonl"

    return damage


def _replace(file: str, how):
    def damage(d: Path) -> Path:
        path = d / file
        if os.path.lexists(path):
            path.unlink()
        how(path)
        return path

    return damage


DAMAGE = {  # what a careless or hostile user leaves in a run directory; none of these is in an earlier test
    "metrics-link-to-dev-zero": _replace("metrics.jsonl", lambda p: p.symlink_to("/dev/zero")),
    "metrics-a-fifo": _replace("metrics.jsonl", os.mkfifo),
    "metrics-a-folder": _replace("metrics.jsonl", lambda p: p.mkdir()),
    "metrics-dangling-link": _replace("metrics.jsonl", lambda p: p.symlink_to(p.parent / "gone.jsonl")),
    "metrics-latin-1-key": _metrics_with(b'{"step": 2, "episode": 128, "caf\xe9": 1.0}\n'),
    "metrics-a-boolean": _metrics_with(b'{"step": 2, "episode": 128, "eval/accuracy": true}\n'),
    "metrics-a-list-row": _metrics_with(b"[2, 128, 0.5]\n"),
    "metrics-a-text-value": _metrics_with(b'{"step": 2, "episode": 128, "eval/accuracy": "0.5"}\n'),
    "metrics-corrupt-middle": _metrics_with(b'{"step": 2, "episode": 12\n'),
    "metrics-two-runs": _metrics_with(b'{"step": 0, "episode": 0, "eval/accuracy": 0.0}\n'),
    "metrics-gone-but-done": _replace("metrics.jsonl", lambda p: None),
    "done-empty": _replace("done.json", lambda p: p.write_text("")),
    "done-a-list": _replace("done.json", lambda p: p.write_text('["tiny"]')),
    "done-a-fifo": _replace("done.json", os.mkfifo),
    "done-not-utf8": _replace("done.json", lambda p: p.write_bytes(b'{"argv": ["caf\xe9"]}')),
    "provenance-torn": _replace("provenance.json", lambda p: p.write_text('{"started": {"host"')),
    "provenance-no-started": _replace("provenance.json", lambda p: p.write_text('{"resumed": []}')),
}
NOT_IDENTICAL = ("done-", "provenance-")  # tools/identical compares rows, arguments and weights alone


def _expected(path: Path) -> str:
    """The line the one reader gives for the damaged file (what every tool must say)."""
    with pytest.raises(SystemExit) as e:
        if path.name == "metrics.jsonl":
            runfiles.read_metrics(path)
        elif path.name == "provenance.json" and path.is_file() and "started" not in path.read_text():
            raise runfiles.RunFileError(f"{path} has no `started` record: {runfiles.WHY['provenance.json']}")
        else:
            runfiles.read_object(path)
    return str(e.value.code)


def _no_hang(seconds: int = 20):
    """A read of a pipe blocks for ever: the test fails in `seconds` instead."""

    def alarm(*_):
        raise TimeoutError("the tool blocked reading a run file")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)


def _tools(tmp_path: Path, runs: Path, monkeypatch) -> dict:
    monkeypatch.setattr(reference, "DIR", tmp_path / "data")
    twin = tmp_path / "twin"
    if not twin.exists():
        _run(twin)
    out = str(tmp_path / "out")
    return {
        "compare": lambda: compare.main([str(runs / NAME), "--metric", "eval/accuracy", "--out", out]),
        "reproduce": lambda: reproduce.main([str(runs), "--data", SHIPPED]),
        "results": lambda: results.main(["--runs-dir", str(runs), "--tracks", "tiny-math", "--out-dir", out]),
        "frontier": lambda: frontier.main([str(runs / NAME), "--metric", "eval/accuracy", "--out", out]),
        "reference-build": lambda: reference.main(["build", str(runs)]),
        "identical": lambda: identical.main([str(twin), str(runs)]),
    }


TOOLS = ("compare", "reproduce", "results", "frontier", "reference-build", "identical")


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_tool_says_the_same_line_for_the_same_damage(tmp_path, monkeypatch, capsys, damage):
    runs = tmp_path / "runs"
    path = DAMAGE[damage](_run(runs))
    want = _expected(path)
    assert want.startswith("error: ") and "\n" not in want and str(path.parent) in want
    for tool, call in _tools(tmp_path, runs, monkeypatch).items():
        if tool == "identical" and damage.startswith(NOT_IDENTICAL):
            continue
        _no_hang()
        try:
            with pytest.raises(SystemExit) as e:
                call()
        finally:
            signal.alarm(0)
        assert str(e.value.code) == want, (tool, e.value.code)
        assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists(), tool  # nothing written


def test_a_damaged_config_json_is_the_readers_line_in_identical(tmp_path, capsys):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    for text in ("", "[1]", "{"):
        (b / "config.json").write_text(text)
        with pytest.raises(SystemExit) as e:
            identical.main([str(a.parent), str(b.parent)])
        assert str(e.value.code) == _expected(b / "config.json")
    (b / "config.json").unlink()
    (b / "config.json").symlink_to("/dev/zero")
    with pytest.raises(SystemExit, match=r"config.json is a character device \(a link to /dev/zero\), not a run's"):
        identical.main([str(a.parent), str(b.parent)])


def test_a_torn_last_row_is_dropped_and_said_by_every_tool(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    d = _run(runs)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "episode": 256, "eval/accu')  # a kill in the middle of a write: no newline after it
    said = f"warning: {d / 'metrics.jsonl'} line 5: its last row is torn (a write cut short: "
    assert len(runfiles.read_metrics(d / "metrics.jsonl").rows) == 4
    for tool, call in _tools(tmp_path, runs, monkeypatch).items():
        try:
            call()
        except SystemExit:
            pass  # reproduce and results may find nothing to judge in one made-up run; the warning comes first
        assert said in capsys.readouterr().err, tool
    # a torn row that is not the last line (a newline after it: no write of ours ends so) is damage
    with open(d / "metrics.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(SystemExit, match=r"line 5 is not a JSON row \("):
        runfiles.read_metrics(d / "metrics.jsonl")


def test_a_finished_run_whose_evaluations_stop_early_is_incomplete_not_ok(tmp_path, capsys):
    """A run with its done.json whose last evaluation is missing (a metrics.jsonl cut at a line, an evaluation that
    was never logged): its final value is an earlier one, so no band judges it. Was: `ok`, its final inside."""
    built, data = tmp_path / "built", tmp_path / "data"
    for i, final in enumerate([0.30, 0.31, 0.32, 0.33], start=1):
        _shipped_run(built, f"grpo_tiny-math__{i}", [0.16, 0.2, 0.25, final])
    data.mkdir()
    reference.build(built, data)
    runs = tmp_path / "runs"
    _shipped_run(runs, "grpo_tiny-math__1", [0.16, 0.21, 0.31])  # the 4th evaluation is gone; 0.31 is in the band
    code = reproduce.main([str(runs), "--data", str(data)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "grpo_tiny-math__1: incomplete, not judged: early: cannot apply (the run has no provenance.json (its "
        "libraries and threads are unknown)); end: incomplete, its evaluations do not span the shipped runs' "
        "(episodes 0-128, the shipped runs' 0-192) (4 distinct shipped runs)"
    )
    assert code == 2 and out[-1] == (
        "reproduces the library: unknown (no check could judge any run; incomplete, not judged: grpo_tiny-math__1)"
    )
    # beside a run that is judged, the verdict still names it
    _shipped_run(runs, "grpo_tiny-math__2", [0.16, 0.2, 0.25, 0.315])
    assert reproduce.main([str(runs), "--data", str(data)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "reproduces the library: yes (1 runs: 0 early checks and 1 end results passed; incomplete, not judged: "
        "grpo_tiny-math__1)"
    )


def _shipped_run(runs: Path, name: str, values: list[float]) -> Path:
    d = runs / name
    d.mkdir(parents=True)
    rows = [{"step": i, "episode": 64 * i, "time": i, "eval/accuracy": v} for i, v in enumerate(values)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text(json.dumps({"argv": ["tiny", "--run-name", name, "--total-steps", "20"]}))
    return d


def test_the_suite_reruns_a_stage_whose_done_json_is_damaged_and_says_how(tmp_path):
    """The suite's decision reads done.json through the same reader: a pipe is not read, and the reason is said."""
    from benchmark import launch

    d = _run(tmp_path)
    shutil.rmtree(d / "metrics.jsonl", ignore_errors=True)
    (d / "done.json").unlink()
    os.mkfifo(d / "done.json")
    _no_hang()
    try:
        decision, why = launch.decide(tmp_path, NAME, ["tiny"], [])
    finally:
        signal.alarm(0)
    assert decision == "rerun" and why.startswith(f"its done.json is damaged ({d / 'done.json'} is a named pipe")
