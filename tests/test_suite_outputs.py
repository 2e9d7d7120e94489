"""Issue 67 item 5: the places a suite or a study writes (the runs folder, `runs/_suite/` with each stage's log and
record, the lock, the summary, the study's tables and figures, each run's directory) are checked before the first
stage: a file where a folder must be, a folder where a file must be, or a name too long for the file system is one
`error:` line, not a traceback after every stage ran. A finished study rerun on a read-only copy prints its report;
an ASCII-only stdout prints any run name."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import launch, study, suites
from tests.test_run import FAKE_SCRIPT, _calls, _fake_suite, _main
from tests.test_study import FAKE

REPO = Path(__file__).resolve().parent.parent


def _models_done(workdir: Path, seeds: list[int]) -> None:
    """The study's SFT and reward models, finished by the scripts as they are now: the study skips them."""
    for st in [*suites.frontier_tldr_stages(seeds), *(suites.sft_stage("tiny-math", s) for s in seeds)]:
        if st.script not in ("sft.py", "reward_model.py"):
            continue
        run_dir = workdir / "runs" / st.run_name
        run_dir.mkdir(parents=True)
        script = {"path": st.script, "sha256": hashlib.sha256((REPO / st.script).read_bytes()).hexdigest()}
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 0, "time": 0}) + "\n")
        (run_dir / "done.json").write_text(json.dumps({"argv": st.args(quick=True), "script": script}))


def _study(workdir: Path, monkeypatch, script: str = "fast.py", **kw) -> dict[str, str]:
    """A study of one stand-in script (tests/test_study.py's FAKE) at seed 1, in-process."""
    monkeypatch.setattr(launch, "ensure_assets", lambda path: None)
    if not (workdir / script).exists():
        (workdir / script).write_text(FAKE)
    return study.run_study([str(workdir / script)], kw.pop("seeds", [1]), workdir, live=False, **kw)


def _refused(capsys, call) -> str:
    """The one `error:` line `call` stops with; nothing printed before it."""
    with pytest.raises(SystemExit) as e:
        call()
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert capsys.readouterr().out == "", "refused before the plan is printed"
    return message


def test_a_study_name_too_long_for_a_file_name_is_refused_before_any_stage(tmp_path, monkeypatch, capsys):
    """--name of 300 letters passes the name's rule; its files (runs/study_<name>_<track>_kl.png) cannot be made."""
    _models_done(tmp_path, [1])
    runs = tmp_path / "runs"
    message = _refused(capsys, lambda: _study(tmp_path, monkeypatch, name="x" * 300))
    assert message == (
        f"error: --name is 300 bytes long: {runs}/study_{'x' * 34}...noisy_kl.png would be a file name of 329 bytes, "
        "more than the 255 its file system takes; give a --name of at most 226 bytes"
    )
    assert not (runs / "fast_tiny-math-study__1").exists(), "no stage ran"
    assert study.check_name_length(study.plan([str(tmp_path / "fast.py")]), "x" * 226, runs) is None  # the limit


def test_a_study_script_whose_name_makes_run_names_too_long_is_refused_before_any_stage(tmp_path, monkeypatch, capsys):
    """A run name takes the script's name: `<script>_tiny-tldr-noisy-study__1` and its record `<run>.stage.json`."""
    _models_done(tmp_path, [1])
    script = "f" * 225 + ".py"
    message = _refused(capsys, lambda: _study(tmp_path, monkeypatch, script, name="short"))
    run_name = f"{'f' * 225}_tiny-tldr-noisy-study__1"
    assert message == (
        f"error: {tmp_path}/runs/_suite/{launch.short(run_name + '.stage.json')} (the record of stage "
        f"{launch.short(run_name)}) would be a file name of 261 bytes, more than the 255 its file system takes; give "
        f"{launch.short(script)} a shorter file name (a study names its runs after its scripts)"
    )
    assert not (tmp_path / "runs" / run_name).exists()


def _file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mine\n")


def _folder(path: Path) -> None:
    path.mkdir(parents=True)


# each place the study writes, taken by what it is not; `runs` is tmp_path/runs
TAKEN = [
    (_folder, "study_fast_summary.md", "is a folder, and the suite writes its summary table there"),
    (_folder, "_suite/fast_tiny-math-study__1.log", "is a folder, and the suite writes the log of stage"),
    (_folder, "_suite/fast_tiny-math-study__1.stage.json", "is a folder, and the suite writes the record of stage"),
    (_folder, "._suite.lock", "is a folder, and the suite writes its lock (one suite at a time) there"),
    (_folder, "study_fast_tiny-math.md", "is a folder, and the suite writes the study's table there"),
    (_folder, "study_fast_tiny-tldr-noisy_kl.png", "is a folder, and the suite writes the study's figure there"),
    (_file, "_suite", "is a file, not a folder, and the suite writes each stage's log and record there"),
    (_file, "fast_tiny-math-study__1", "is a file, not a folder, and the suite writes the run of stage"),
]


@pytest.mark.parametrize("make, where, said", TAKEN, ids=[w for _, w, _ in TAKEN])
def test_a_place_the_study_writes_taken_by_a_file_or_folder_is_one_line_before_any_stage(
    tmp_path, monkeypatch, capsys, make, where, said
):
    _models_done(tmp_path, [1])
    make(tmp_path / "runs" / where)
    message = _refused(capsys, lambda: _study(tmp_path, monkeypatch))
    assert message.startswith(f"error: {tmp_path / 'runs' / where} {said}"), message
    assert message.endswith("; move it or pass another --workdir"), message
    assert not any((tmp_path / "runs").glob("fast_tiny-*-study__1/done.json")), "no stage ran"


def test_a_runs_folder_or_workdir_that_is_a_file_is_one_line_before_any_stage(tmp_path, monkeypatch, capsys):
    _file(tmp_path / "runs")
    message = _refused(capsys, lambda: _study(tmp_path, monkeypatch))
    assert message == (
        f"error: {tmp_path / 'runs'} is a file, not a folder, and the suite writes its runs there; move it or pass "
        "another --workdir"
    )
    _file(tmp_path / "work")
    message = _main(monkeypatch, capsys, "quick", "--seeds", "1", "--workdir", str(tmp_path / "work"))
    assert message == (
        f"error: --workdir {tmp_path / 'work'}: {tmp_path / 'work'} is a file, not a folder; pass a folder (runs go "
        "to WORKDIR/runs)"
    )


def test_a_workdir_with_a_part_too_long_for_a_file_name_is_one_line(tmp_path, monkeypatch, capsys):
    work = tmp_path / ("y" * 300)
    message = _main(monkeypatch, capsys, "quick", "--seeds", "1", "--workdir", str(work))
    assert message == (
        f"error: --workdir {launch.short(str(work))}: its part {'y' * 40}...{'y' * 12} is 300 bytes long, more than "
        "the 255 its file system takes; pass another --workdir"
    )


def test_a_rounding_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """`--rounding default` runs in WORKDIR/rounding-default, which it makes: a file there, or at WORKDIR, stops it."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the regime's variable stays in this test
    _file(tmp_path / "rounding-default")
    message = _main(monkeypatch, capsys, "quick", "--seeds", "1", "--rounding", "default", "--workdir", str(tmp_path))
    assert message == (
        f"error: --rounding default: {tmp_path / 'rounding-default'} is a file, not a folder, and the suite of "
        "--rounding default runs there; move it or pass another --workdir"
    )
    work = tmp_path / "rounding-default"
    message = _main(monkeypatch, capsys, "quick", "--seeds", "1", "--rounding", "default", "--workdir", str(work))
    assert message == (
        f"error: --workdir {work}: {work} is a file, not a folder; pass a folder (runs of --rounding default go to "
        "WORKDIR/rounding-default/runs)"
    )


def test_a_suites_summary_taken_by_a_folder_is_one_line_before_any_stage(tmp_path, monkeypatch, capsys):
    """The plain suite runner too: before, every stage ran and the summary's write was a traceback."""
    _fake_suite(tmp_path, monkeypatch)
    _folder(tmp_path / "runs" / "fake_summary.md")
    message = _refused(capsys, lambda: launch.run_suite("fake", [1], workdir=tmp_path, only=["a"], live=False))
    assert message == (
        f"error: {tmp_path / 'runs' / 'fake_summary.md'} is a folder, and the suite writes its summary table there; "
        "move it or pass another --workdir"
    )
    assert _calls(tmp_path) == [], "no stage ran"


@pytest.fixture
def read_only(tmp_path):
    """A folder, and a function that makes it read-only: a tmpfs remounted `ro` as root (who writes through any
    mode), the folder's mode otherwise."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        yield folder, lambda: [p.chmod(0o555) for p in [folder, *folder.rglob("*")] if p.is_dir()]
        for p in [folder, *folder.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        return
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(folder)], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield folder, lambda: subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_finished_study_rerun_on_a_read_only_copy_prints_its_report_and_says_it_wrote_nothing(
    read_only, monkeypatch, capsys
):
    work, make_read_only = read_only
    _models_done(work, [1])
    _study(work, monkeypatch)
    table = (work / "runs" / "study_fast_tiny-math.md").read_text()
    make_read_only()
    with pytest.raises(OSError) as e:
        (work / "runs" / "probe").write_text("")
    reason = e.value.strerror
    assert reason in ("Read-only file system", "Permission denied")
    capsys.readouterr()
    assert set(_study(work, monkeypatch).values()) == {"skipped"}
    out, err = capsys.readouterr()
    assert table in out and "| fast_tiny-math-study__1 | skipped |" in out, "the report and the summary, printed"
    assert f"wrote:\n  nothing: {work / 'runs'} cannot be written ({reason})" in out
    assert err == (
        f"warning: {work / 'runs'} cannot be written ({reason}): every stage had finished, so nothing ran; the "
        f"summary is printed, not written to {work / 'runs' / 'study_fast_summary.md'}\n"
    )
    # a stage to run there is refused before the plan: its run could not be written
    message = _refused(capsys, lambda: _study(work, monkeypatch, seeds=[1, 2]))
    assert message == (
        f"error: {work / 'runs'} cannot be written ({reason}), and 5 of the suite's 10 stages would run "
        "(sft_tiny-tldr__2, rm_tiny-tldr-noisy__2, sft_tiny-math__2, ...); pass a --workdir you can write"
    )


def test_an_ascii_only_stdout_prints_a_non_ascii_run_name(tmp_path):
    """A study script named `é.py` (a run name may hold any letter: storage.run_name_problem): escaped, no crash."""
    (tmp_path / "é.py").write_text(FAKE)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.run", "study", "--scripts", "é.py", "--seeds", "1", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "ascii"},
    )
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert b"--run-name '\\xe9_tiny-math-study__1'" in proc.stdout


def test_a_stage_prints_a_non_ascii_run_name_to_its_log_whatever_the_suites_stdout_encoding(
    tmp_path, monkeypatch, capsys
):
    """A stage's output goes to its log, a file: PYTHONIOENCODING=ascii, meant for the suite's terminal, is not its."""
    monkeypatch.setenv("PYTHONIOENCODING", "ascii")
    script = tmp_path / "speaks.py"
    script.write_text(FAKE_SCRIPT + "print('run finished:', run)\n")
    stages = [suites.Stage("é__1", str(script), "p")]
    assert launch.run_suite("fake", [1], workdir=tmp_path, live=False, stages=stages) == {"é__1": "ok"}
    assert "run finished: runs/é__1" in (tmp_path / "runs" / "_suite" / "é__1.log").read_text(encoding="utf-8")


def test_a_script_prints_a_non_ascii_run_name_on_an_ascii_only_stdout(tmp_path):
    """A script run alone (not under the suite) on an ASCII-only terminal: its `cli` sets both streams to escape what
    they cannot encode, so `run finished: runs/café__1` is printed as `caf\\xe9`, never a UnicodeEncodeError."""
    code = (
        "import sys\nfrom clean_rlhf_utils.runs import cli\ntry:\n    cli({'a': 1}, ['nope'])\nexcept SystemExit:\n"
        "    pass\nprint('run caf\\u00e9')\nprint('warn caf\\u00e9', file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "run caf\\xe9\n" and proc.stderr == "warn caf\\xe9\n"
