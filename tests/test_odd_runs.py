"""Issue 59, classes 2 (reference half) and 3: benchmark.compare, benchmark.reference and benchmark.tools.identical
on odd runs and odd data. Each bad input is one `error:` line before any output is written, and nothing good is lost."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmark import compare, frontier, reference, results
from benchmark.tools import identical


def _run(root: Path, name: str, rows: list[dict], argv=None, sha: str | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "done.json").write_text(json.dumps({"argv": argv or ["tiny-math", "--seed", name[-1]]}))
    if sha:
        (run / "provenance.json").write_text(json.dumps({"started": {"script": {"path": "x.py", "sha256": sha}}}))
    return run


def _rows(values: list[float], metric: str = "eval/accuracy", every: int = 64) -> list[dict]:
    return [{"step": i, "episode": every * i, "time": 1.0 + i, metric: v} for i, v in enumerate(values)]


def _last_err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def _error(capsys, call) -> str:
    """The one line a refused command ends in (SystemExit's message or the printed error), checked to be one line."""
    try:
        code = call()
    except SystemExit as e:
        assert isinstance(e.code, str) and "\n" not in e.code, e.code
        return e.code
    assert code == 1
    return _last_err(capsys)


# ---- class 3: two runs' rows in one metrics.jsonl ----


def test_a_metrics_file_whose_episode_counter_goes_back_is_refused_naming_the_row(tmp_path, capsys):
    good = _run(tmp_path, "rloo_tiny-math__1", _rows([0.1, 0.2, 0.3]))
    twice = _run(tmp_path, "rloo_tiny-math__2", _rows([0.1, 0.2, 0.3]) + _rows([0.5, 0.6]))  # appended to one file
    out = tmp_path / "cmp"
    err = _error(capsys, lambda: compare.main([str(good), str(twice), "--metric", "eval/accuracy", "--out", str(out)]))
    assert err == (
        f"error: {twice}/metrics.jsonl line 4: its episode 0 is below the 128 of line 3: the counter goes back, so the "
        "file holds the rows of two runs; keep one run's rows in it (or rerun it)"
    )
    assert not out.with_suffix(".md").exists() and not out.with_suffix(".png").exists()
    # rows without episodes: their step; a counter that is not a number
    steps = _run(tmp_path / "b", "x__1", [{"step": 3, "eval/accuracy": 0.1}, {"step": 1, "eval/accuracy": 0.2}])
    err = _error(capsys, lambda: compare.main([str(steps), "--metric", "eval/accuracy", "--out", str(out)]))
    assert err.startswith(f"error: {steps}/metrics.jsonl line 2: its step 1 is below the 3 of line 1")
    text = _run(tmp_path / "c", "x__1", [{"step": 0, "episode": "64", "eval/accuracy": 0.1}])
    err = _error(capsys, lambda: compare.main([str(text), "--metric", "eval/accuracy", "--out", str(out)]))
    assert err == (
        f'error: {text}/metrics.jsonl line 1: its episode is "64", not a number (a script logs numbers, NaN when it '
        "diverged): its rows cannot be read: restore the file or rerun the run"
    )
    # equal counters are one run's rows (an evaluation and an update at one episode)
    same = _run(tmp_path / "d", "rloo_tiny-math__1", _rows([0.1, 0.2]) + [{"step": 1, "episode": 64, "time": 3.0}])
    assert compare.main([str(same), "--metric", "eval/accuracy", "--out", str(out)]) == 0


def test_the_results_tables_and_the_reference_refuse_such_a_file_too(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    _run(runs, "rloo_tiny-math__1", _rows([0.1, 0.2, 0.3]) + _rows([0.5, 0.6]))
    err = _error(capsys, lambda: results.main(["--runs-dir", str(runs), "--tracks", "tiny-math"]))
    assert err.startswith(f"error: {runs}/rloo_tiny-math__1/metrics.jsonl line 4: its episode 0 is below the 128")
    monkeypatch.setattr(reference, "DIR", tmp_path / "data")
    err = _error(capsys, lambda: reference.main(["build", str(runs)]))
    assert err.startswith(f"error: {runs}/rloo_tiny-math__1/metrics.jsonl line 4: its episode 0 is below the 128")
    assert not (tmp_path / "data").exists()
    frontier_run = _run(tmp_path / "f", "ppo-kl0.1_tiny-tldr-noisy__1", _rows([0.1, 0.2], "eval/gold_reward") * 2)
    err = _error(capsys, lambda: frontier.main([str(frontier_run), "--out", str(tmp_path / "fr")]))
    assert "metrics.jsonl line 3: its episode 0 is below the 64 of line 2" in err


# ---- class 3: compare's flags and runs that cannot be ranked together ----


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_threshold_that_is_not_finite_is_one_line(tmp_path, capsys, value):
    run = _run(tmp_path, "rloo_tiny-math__1", _rows([0.1, 0.2]))
    out = tmp_path / "cmp"
    err = _error(
        capsys, lambda: compare.main([str(run), "--metric", "eval/accuracy", f"--threshold={value}", "--out", str(out)])
    )
    assert err.startswith(f"error: --threshold {float(value)} is not a finite number; give a value of eval/accuracy")
    assert not out.with_suffix(".md").exists()


def test_an_out_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys):
    run = _run(tmp_path, "rloo_tiny-math__1", _rows([0.1, 0.2]))
    (tmp_path / "afile").write_text("mine")
    args = [str(run), "--metric", "eval/accuracy", "--out"]
    err = _error(capsys, lambda: compare.main([*args, str(tmp_path / "afile" / "sub" / "cmp")]))
    assert err == (
        f"error: --out {tmp_path}/afile/sub/cmp: {tmp_path}/afile is a file, not a folder, so OUT.png and OUT.md "
        "cannot be written; pass another --out"
    )
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "cmp.md").mkdir()  # OUT.md taken by a folder
    err = _error(capsys, lambda: compare.main([*args, str(tmp_path / "cmp")]))
    assert err == (
        f"error: --out {tmp_path}/cmp: {tmp_path}/cmp.md is a folder, so OUT.png and OUT.md cannot be written; pass "
        "another --out"
    )
    assert not (tmp_path / "cmp.png").exists()


def test_runs_of_different_tracks_are_not_ranked_together(tmp_path, capsys):
    """eval/accuracy is a reward model's pairwise accuracy on tiny-tldr and a policy's exact answers on tiny-math."""
    math_runs = [_run(tmp_path, f"grpo_tiny-math__{s}", _rows([0.1, 0.4])) for s in (1, 2)]
    rm = _run(tmp_path, "rm_tiny-tldr__1", _rows([0.5, 0.9]))
    out = tmp_path / "cmp"
    args = [*map(str, math_runs), str(rm), "--metric", "eval/accuracy", "--out", str(out)]
    err = _error(capsys, lambda: compare.main(args))
    assert err == (
        "error: the runs are of different tracks (tiny-math: grpo_tiny-math__1, grpo_tiny-math__2; tiny-tldr: "
        "rm_tiny-tldr__1): one ranking of eval/accuracy would mix tasks; compare each track's runs on their own (or "
        "pass --across-tracks)"
    )
    assert not out.with_suffix(".md").exists()
    assert compare.main([*args, "--across-tracks"]) == 0
    # one track, or names that are no track of the benchmark's, are not judged
    assert compare.main([*map(str, math_runs), "--metric", "eval/accuracy", "--out", str(out)]) == 0
    mine = _run(tmp_path / "m", "my_run__1", _rows([0.2, 0.3]))
    assert compare.main([*map(str, math_runs), str(mine), "--metric", "eval/accuracy", "--out", str(out)]) == 0


def test_a_metric_value_that_is_not_a_number_is_refused_not_counted_as_diverged(tmp_path, capsys):
    rows = _rows([0.1, 0.2])
    rows[1]["eval/accuracy"] = "0.2"
    run = _run(tmp_path, "rloo_tiny-math__1", rows)
    err = _error(capsys, lambda: compare.main([str(run), "--metric", "eval/accuracy", "--out", str(tmp_path / "c")]))
    assert err == (
        f'error: {run}/metrics.jsonl line 2: its eval/accuracy is "0.2", not a number (a script logs numbers, NaN '
        "when it diverged): its rows cannot be read: restore the file or rerun the run"
    )
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 0, "eval/accuracy": None}) + "\n")
    err = _error(capsys, lambda: compare.main([str(run), "--metric", "eval/accuracy", "--out", str(tmp_path / "c")]))
    assert "line 1: its eval/accuracy is null, not a number" in err


# ---- class 3: a damaged data file; class 1: build deletes and replaces only its own files ----


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A data directory standing for the shipped one, with rloo on tiny-math (seeds 1, 2), script sha `aaa`."""
    monkeypatch.setattr(reference, "DIR", tmp_path / "data")
    runs = tmp_path / "runs"
    for s in (1, 2):
        _run(runs, f"rloo_tiny-math__{s}", _rows([0.1, 0.2 * s]), sha="aaa")
    assert reference.main(["build", str(runs)]) == 0
    return tmp_path / "data"


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: p.write_bytes(b"not gzip"), "BadGzipFile"),
        (lambda p: p.write_bytes(p.read_bytes()[:30]), "EOFError"),
        (lambda p: p.write_bytes(gzip.compress(b"{not json\n")), "JSONDecodeError"),
        (lambda p: p.write_bytes(gzip.compress(b'{"step": 0}\n')), "line 1 is not a run's record"),
        (lambda p: p.write_bytes(gzip.compress(b"")), "it holds no run"),
    ],
)
def test_a_damaged_data_file_is_one_line_naming_it_and_how_to_restore_it(data, tmp_path, capsys, damage, why):
    path = data / "rloo_tiny-math.jsonl.gz"
    damage(path)
    damaged = path.read_bytes()
    hint = f"restore it with `git checkout -- {path}` (the shipped data)"
    assert reference.main(["list"]) == 1
    err = _last_err(capsys)
    assert err.startswith(f"error: {path} is damaged (") and why in err and err.endswith(hint)
    mine = _run(tmp_path / "mine", "rloo_batchmean_tiny-math__1", _rows([0.1, 0.3]))
    err = _error(
        capsys,
        lambda: compare.main(
            [str(mine), "--metric", "eval/accuracy", "--out", str(tmp_path / "c"), "--reference", "rloo"]
        ),
    )
    assert err.startswith(f"error: {path} is damaged (") and err.endswith(hint)
    err = _error(capsys, lambda: results.main(["--reference", "--out-dir", str(tmp_path / "docs")]))
    assert err.startswith(f"error: {path} is damaged (") and err.endswith(hint)
    # a build that would rewrite it refuses too: the damaged file is left for git to restore, not overwritten
    more = _run(tmp_path / "more", "rloo_tiny-math__3", _rows([0.1, 0.5]), sha="aaa")
    assert reference.main(["build", str(more.parent)]) == 1
    assert _last_err(capsys).endswith(hint) and path.read_bytes() == damaged
    # elsewhere than the shipped data: rebuild it
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.jsonl.gz").write_bytes(b"not gzip")
    assert reference.main(["list", "--data", str(other)]) == 1
    assert _last_err(capsys).endswith(
        f"rebuild it (python -m benchmark.reference build RUNS_DIR --out {other}) or move it away"
    )


def test_build_deletes_or_rewrites_only_files_it_wrote(data, tmp_path, capsys):
    runs = tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dataset = elsewhere / "train.jsonl.gz"  # a user's dataset beside --out: not a group of records
    dataset.write_bytes(gzip.compress(b'{"query": "q", "response": "r"}\n'))
    assert reference.main(["build", str(runs), "--out", str(elsewhere), "--fresh"]) == 1
    err = _last_err(capsys)
    assert err == (
        f"error: {dataset} is damaged (line 1 is not a run's record (an object with a name and its rows)); rebuild it "
        f"(python -m benchmark.reference build RUNS_DIR --out {elsewhere}) or move it away"
    )
    assert dataset.exists() and not (elsewhere / "rloo_tiny-math.jsonl.gz").exists()
    # without --fresh it is neither dropped nor rewritten: not build's business
    assert reference.main(["build", str(runs), "--out", str(elsewhere)]) == 0
    assert dataset.exists() and (elsewhere / "rloo_tiny-math.jsonl.gz").exists()
    (elsewhere / "rloo_tiny-math.jsonl.gz").unlink()
    # records of another group under this group's file name: not build's file
    (elsewhere / "train.jsonl.gz").unlink()
    (data / "rloo_tiny-math.jsonl.gz").rename(elsewhere / "grpo_tiny-math.jsonl.gz")
    before = (elsewhere / "grpo_tiny-math.jsonl.gz").read_bytes()
    assert reference.main(["build", str(runs), "--out", str(elsewhere), "--fresh"]) == 1
    assert _last_err(capsys) == (
        f"error: {elsewhere}/grpo_tiny-math.jsonl.gz holds runs of another group than grpo_tiny-math "
        "(rloo_tiny-math__1, rloo_tiny-math__2): it is not a file that benchmark.reference build wrote, so it is "
        "neither replaced nor deleted; move it away or pass another --out"
    )
    assert (elsewhere / "grpo_tiny-math.jsonl.gz").read_bytes() == before
    # --out a file
    assert reference.main(["build", str(runs), "--out", str(dataset.parent / "grpo_tiny-math.jsonl.gz")]) == 1
    assert _last_err(capsys) == (
        f"error: --out {elsewhere}/grpo_tiny-math.jsonl.gz is a file, not a folder for the data; pass another --out"
    )


# ---- class 2: a record replaced by a run of another budget or another script ----


def test_a_record_is_replaced_only_by_the_same_command_and_script_unless_replace(data, tmp_path, capsys):
    path = data / "rloo_tiny-math.jsonl.gz"
    shipped = path.read_bytes()
    quick = tmp_path / "quick"  # seed 2 again, at another budget
    _run(
        quick,
        "rloo_tiny-math__2",
        _rows([0.1, 0.3]),
        argv=["tiny-math", "--seed", "2", "--total-episodes", "64"],
        sha="aaa",
    )
    assert reference.main(["build", str(quick)]) == 1
    assert _last_err(capsys) == (
        f"error: a run would replace the record of another run of the same name: rloo_tiny-math__2 in {path}: command "
        "`tiny-math` -> `tiny-math --total-episodes 64`; pass --replace to replace it, or build into another --out"
    )
    assert path.read_bytes() == shipped
    # older (or newer) code: another script
    edited = tmp_path / "edited"
    _run(edited, "rloo_tiny-math__1", _rows([0.1, 0.3]), sha="bbb")
    _run(edited, "rloo_tiny-math__2", _rows([0.1, 0.3]), sha="bbb")
    assert reference.main(["build", str(edited), "--fresh"]) == 1
    assert _last_err(capsys) == (
        f"error: a run would replace the record of another run of the same name: rloo_tiny-math__1 in {path}: script "
        "sha256 aaa -> bbb (and 1 more); pass --replace to replace it, or build into another --out"
    )
    assert path.read_bytes() == shipped
    # asked for: replaced, and each replacement said
    assert reference.main(["build", str(quick), "--replace"]) == 0
    out = capsys.readouterr().out
    assert f"replaced rloo_tiny-math__2 in {path}: command `tiny-math` -> `tiny-math --total-episodes 64`" in out
    records = reference.read_group(path)
    assert [r["argv"][-1] for r in records] == ["1", "64"]
    # the same command and script again, and a run of a new name: no question asked
    assert reference.main(["build", str(quick)]) == 0
    _run(tmp_path / "new", "rloo_tiny-math__3", _rows([0.1, 0.3]), sha="bbb")
    assert reference.main(["build", str(tmp_path / "new")]) == 0


# ---- class 3: benchmark.tools.identical ----


def _identical_run(root: Path, config: dict, rows=None) -> Path:
    run = root / "ppo_tiny-tldr__1"
    (run / "model").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or _rows([0.1, 0.2])))
    (run / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.tensor([1.0, 2.0])}, str(run / "model" / "model.safetensors"))
    return run


def test_identical_runs_in_two_output_folders_are_the_same(tmp_path, capsys):
    for side in ("a", "b"):
        root = tmp_path / side
        _identical_run(root, {"seed": 1, "output_dir": str(root), "sft_model_path": f"{root}/sft_tiny-tldr__1/model"})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "same    ppo_tiny-tldr__1" in capsys.readouterr().out
    # a path outside the output folder is still an input that can differ
    for side, sft in (("c", "x/sft"), ("d", "y/sft")):
        _identical_run(tmp_path / side, {"seed": 1, "output_dir": str(tmp_path / side), "sft_model_path": sft})
    assert identical.main([str(tmp_path / "c"), str(tmp_path / "d")]) == 1
    assert "config.json: sft_model_path 'x/sft' != 'y/sft'" in capsys.readouterr().out


def test_identical_on_a_metrics_or_config_file_that_is_not_json_is_one_line(tmp_path, capsys):
    a = _identical_run(tmp_path / "a", {"seed": 1})
    b = _identical_run(tmp_path / "b", {"seed": 1})
    (b / "metrics.jsonl").write_text((b / "metrics.jsonl").read_text() + '{"step": 2, "episo\n{"step": 3}\n')
    err = _error(capsys, lambda: identical.main([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert err.startswith(f"error: {b}/metrics.jsonl line 3 is not a JSON row (")
    (b / "metrics.jsonl").write_text((a / "metrics.jsonl").read_text())
    (b / "config.json").write_text("{")
    err = _error(capsys, lambda: identical.main([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert err.startswith(f"error: {b}/config.json is not JSON (")


def test_a_run_whose_origin_cannot_be_shown_never_replaces_one_that_can(data, tmp_path, capsys):
    """Issue 67 item 2: a run without provenance.json (no script hash; its regime read as native) passed the gate and
    replaced the record of its name, exit 0, nothing said. Now it needs --replace, which says it; a rerun of the same
    command and script with other numbers is replaced and said."""
    path = data / "rloo_tiny-math.jsonl.gz"
    shipped = path.read_bytes()
    lost = tmp_path / "lost"  # a run made under --rounding default whose provenance.json was lost
    _run(lost, "rloo_tiny-math__1", _rows([0.1, 0.9]))
    assert reference.main(["build", str(lost)]) == 1
    assert _last_err(capsys) == (
        f"error: a run would replace the record of another run of the same name: rloo_tiny-math__1 in {path}: origin: "
        "the run has no script sha256 (no provenance.json), the record has aaa; pass --replace to replace it, or "
        "build into another --out"
    )
    assert path.read_bytes() == shipped
    assert reference.main(["build", str(lost), "--replace"]) == 0
    assert f"replaced rloo_tiny-math__1 in {path}: origin: the run has no script sha256" in capsys.readouterr().out
    rerun = tmp_path / "rerun"  # the same command and script, other numbers (another host): replaced, and said
    _run(rerun, "rloo_tiny-math__2", _rows([0.1, 0.35]), sha="aaa")
    assert reference.main(["build", str(rerun)]) == 0
    assert f"replaced rloo_tiny-math__2 (native) in {path}: other rows" in capsys.readouterr().out
    assert reference.main(["build", str(rerun)]) == 0  # the very same run again: nothing replaced
    assert "replaced" not in capsys.readouterr().out


def test_two_builds_into_one_folder_at_once_keep_both_runs(data, tmp_path, monkeypatch):
    """Issue 67 item 2: two builds that read a group before either wrote it each wrote it without the other's run.
    The second now waits for the first (a lock on the data folder); both new seeds are kept."""
    import threading
    import time

    write = reference.write_group

    def slow_write(path, records):  # widen the window between reading a group and writing it back
        time.sleep(0.5)
        write(path, records)

    monkeypatch.setattr(reference, "write_group", slow_write)
    for s in (3, 4):
        _run(tmp_path / f"new{s}", f"rloo_tiny-math__{s}", _rows([0.1, 0.3]), sha="aaa")
    threads = [threading.Thread(target=reference.build, args=(tmp_path / f"new{s}", data)) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = sorted(r["name"] for r in reference.read_group(data / "rloo_tiny-math.jsonl.gz"))
    assert names == [f"rloo_tiny-math__{s}" for s in (1, 2, 3, 4)]
    assert not [p for p in data.iterdir() if p.name.startswith(".")], "no lock file left in the data"
