"""The suite's live status (benchmark/status.py, issue 43): tqdm progress parsed from a stage's log, the terminal block
(each state, progress and rate, elapsed time, the estimate of what is left), the line-per-event output without ANSI
codes when stdout is a pipe, the periodic progress line, and the paths `benchmark.results` ends with. No training:
the stages are tiny Python files that print tqdm-like progress."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import launch, results, status, suites
from benchmark.status import Progress, StageStatus

REPO = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[")

# what tqdm 4.x writes to a file (captured from tqdm itself): `\r` before each update, `\n` at the end of a bar; the
# first update has no rate yet, later ones carry the postfix the scripts set
TQDM_LOG = (
    "loading model from runs/sft_tiny-tldr__1/model\n"
    "\rppo:   0%|          | 0/32 [00:00<?, ?it/s]"
    "\rppo:   3%|3         | 1/32 [00:02<01:09,  0.45it/s]"
    "\rppo:  38%|###8      | 12/32 [00:10<00:17,  1.15it/s, reward=0.123, kl=0.01]"
)


def test_parse_progress_takes_the_last_complete_tqdm_update():
    assert status.parse_progress(TQDM_LOG) == Progress(12, 32, 1.15, 17.0)
    # a printed line after the bar (an evaluation's metrics) does not hide it
    assert status.parse_progress(TQDM_LOG + "\neval/gold_reward 0.61\n") == Progress(12, 32, 1.15, 17.0)
    # the log read in the middle of tqdm's write: the cut update is ignored, the one before it counts
    assert status.parse_progress(TQDM_LOG + "\rppo:  41%|####      | 13/32 [00:1") == Progress(12, 32, 1.15, 17.0)
    assert status.parse_progress(TQDM_LOG + "\rppo:  41%|####      | 13/32 [00:11<00:16,  1.1") == Progress(
        12, 32, 1.15, 17.0
    )
    # before the first update (a library's bar is not the stage's), or a bar without a rate yet
    assert status.parse_progress("loading model\nwarning: something\n") is None
    start = (  # the start of a real sft.py log
        "Generating train split: 4000 examples [00:00, 49193.12 examples/s]\n"
        "\rLoading weights:   0%|          | 0/52 [00:00<?, ?it/s]"
        "\rLoading weights: 100%|██████████| 52/52 [00:00<00:00, 28861.16it/s]\n"
        "run sft_tiny-tldr__1: 4000 training rows, 375 optimizer steps of 32 sequences\n"
    )
    assert status.parse_progress(start) is None
    assert status.parse_progress(start + "\rsft:  11%|█         | 42/375 [02:04<13:23,  2.41s/it, loss=1.601]") == (
        Progress(42, 375, pytest.approx(1 / 2.41), 803.0)
    )
    assert status.parse_progress("") is None
    assert status.parse_progress("\rgrpo:   0%|          | 0/20 [00:00<?, ?it/s]") == Progress(0, 20, None, None)
    # slow steps: tqdm inverts the rate (s/it); hours in the remaining time
    p = status.parse_progress("\rsft:  10%|#         | 3/30 [00:38<1:02:03, 12.50s/it, loss=1.2]")
    assert (p.n, p.total, p.remaining) == (3, 30, 3723.0) and p.rate == pytest.approx(0.08)
    # no total: `12it [...]`
    assert status.parse_progress("\r12it [00:10,  1.15it/s]") == Progress(12, None, 1.15, None)
    # a resumed run's log: the attempt before the marker does not count
    resumed = TQDM_LOG + "\n\n--- resumed: python ppo_rlhf.py tiny-tldr --resume\nloading checkpoint\n"
    assert status.parse_progress(resumed) is None
    assert status.parse_progress(resumed + "\rppo:  38%|###8      | 12/32 [00:00<?, ?it/s]") == Progress(
        12, 32, None, None
    )


def test_log_tail_shows_a_tqdm_bar_once():
    assert status.log_tail(TQDM_LOG + "\nTraceback (most recent call last):\nValueError: boom\n", 3) == [
        "ppo:  38%|###8      | 12/32 [00:10<00:17,  1.15it/s, reward=0.123, kl=0.01]",
        "Traceback (most recent call last):",
        "ValueError: boom",
    ]


def _fake_states(now: float) -> list[StageStatus]:
    """One stage in each state, as the suite shows them at time `now` (it started at now - 125)."""
    return [
        StageStatus("sft_tiny-tldr__1", status.SKIPPED, "sft.py", headline="eval/gold_reward 0.580"),
        StageStatus(
            "ppo_tiny-tldr__1", status.DONE, "ppo_rlhf.py", now - 120, 100.0, headline="eval/gold_reward 0.700"
        ),
        StageStatus("ppo_tiny-tldr__2", status.RUNNING, "ppo_rlhf.py", now - 10, progress=Progress(12, 32, 0.9, 30.0)),
        StageStatus("rloo_tiny-tldr__1", status.RUNNING, "rloo.py", now - 3),  # no tqdm update yet
        StageStatus(
            "dpo_tiny-tldr__1", status.FAILED, "dpo.py", now - 50, 4.0, log="runs/_suite/dpo.log", note="exit 1"
        ),
        StageStatus("online-dpo_tiny-tldr__1", status.BLOCKED, "dpo.py", note="needs failed dpo_tiny-tldr__1"),
        StageStatus("ppo_tiny-tldr__3", status.WAITING, "ppo_rlhf.py"),
    ]


def _row(lines: list[str], name: str) -> list[str]:
    """The cells of a stage's row (split on runs of 2+ spaces)."""
    return re.split(r"\s{2,}", next(line for line in lines if line.split()[0] == name).strip())


def test_the_terminal_block_shows_each_state_progress_elapsed_and_an_estimate():
    now = 1000.0
    lines = status.render_table("quick suite", _fake_states(now), now, started=now - 125, jobs=2)
    # ppo seed 2 has 30 s left; rloo has no estimate (no update, no finished rloo stage): it is counted, the answer
    # is a lower bound, and ppo seed 3 (100 s, as seed 1 took) goes in its slot, which frees first (at 0 s)
    assert lines[:2] == [
        "quick suite: 1 done, 1 skipped, 2 running, 1 waiting, 1 failed, 1 blocked",
        "elapsed 2m05s, left at least 1m40s (1 stage not estimated yet)",
    ]
    assert len(lines) == 9 and not any(ANSI.search(line) for line in lines)
    assert _row(lines, "ppo_tiny-tldr__2") == [
        "ppo_tiny-tldr__2",
        "running",
        "10s",
        "12/32 updates",
        "0.90 it/s",
        "30s left",
    ]
    assert _row(lines, "rloo_tiny-tldr__1") == ["rloo_tiny-tldr__1", "running", "3s", "starting"]
    assert _row(lines, "ppo_tiny-tldr__1") == ["ppo_tiny-tldr__1", "done", "1m40s", "eval/gold_reward 0.700"]
    assert _row(lines, "sft_tiny-tldr__1") == [
        "sft_tiny-tldr__1",
        "skipped",
        "finished earlier",
        "eval/gold_reward 0.580",
    ]
    assert _row(lines, "dpo_tiny-tldr__1") == [
        "dpo_tiny-tldr__1",
        "failed",
        "exit 1",
        "after 4s",
        "log runs/_suite/dpo.log",
    ]
    assert _row(lines, "online-dpo_tiny-tldr__1") == [
        "online-dpo_tiny-tldr__1",
        "blocked",
        "needs failed dpo_tiny-tldr__1",
    ]
    assert _row(lines, "ppo_tiny-tldr__3") == ["ppo_tiny-tldr__3", "waiting"]
    # a narrow terminal: every line cut, so that none wraps and breaks the redraw
    assert all(len(line) <= 39 for line in status.render_table("quick", _fake_states(now), now, now - 125, 2, 40))
    # a short one (8 lines): the running, failed and blocked stages stay, one row counts the others, and the block
    # leaves the last line for the cursor
    short = status.render_table("quick", _fake_states(now), now, now - 125, 2, height=8)
    assert len(short) == 7 and short[-1] == "  ... and 3 more: 1 done, 1 skipped, 1 waiting"
    assert [line.split()[0] for line in short[2:6]] == [
        "ppo_tiny-tldr__2",
        "rloo_tiny-tldr__1",
        "dpo_tiny-tldr__1",
        "online-dpo_tiny-tldr__1",
    ]


def test_the_estimate_spreads_the_waiting_stages_over_the_jobs():
    now = 1000.0
    states = [
        StageStatus("ppo_t__1", status.DONE, "ppo_rlhf.py", now - 200, 100.0),
        StageStatus("ppo_t__2", status.RUNNING, "ppo_rlhf.py", now - 70, progress=Progress(7, 10, 0.1, 30.0)),
        StageStatus("rloo_t__1", status.RUNNING, "rloo.py", now - 5, progress=Progress(1, 10, 1.0, 10.0)),
        StageStatus("ppo_t__3", status.WAITING, "ppo_rlhf.py"),
        StageStatus("ppo_t__4", status.WAITING, "ppo_rlhf.py"),
    ]
    # slots free at 10 and 30 s; a ppo stage takes 100 s as seed 1 did: seed 3 runs 10-110 s, seed 4 30-130 s
    assert status.estimate_left(states, now, jobs=2) == (130.0, 0)
    assert status.fmt_left(states, now, 2) == "~2m10s"
    one = [st for st in states if st.name != "rloo_t__1"]
    assert status.estimate_left(one, now, jobs=1) == (230.0, 0)  # 30 + 100 + 100, one at a time
    # before any ppo stage finished: seed 2's projection (70 s run + 30 s left) stands for the waiting seeds
    assert status.estimate_left(states[1:], now, jobs=2) == (130.0, 0)
    # nothing finished or measured yet: unknown, not a guess
    fresh = [StageStatus("a__1", status.RUNNING, "sft.py", now), StageStatus("b__1", status.WAITING, "rloo.py")]
    assert status.fmt_left(fresh, now, 2) == "unknown"
    assert status.fmt_left([StageStatus("a__1", status.DONE, "sft.py", now, 5.0)], now, 2) == "0s"
    # a running stage before its first tqdm update: the typical duration of its script less what it has run, 95 s:
    # seed 3 runs 30-130 s, seed 4 95-195 s
    states[2] = StageStatus("rloo_t__1", status.RUNNING, "ppo_rlhf.py", now - 5)
    assert status.estimate_left(states, now, jobs=2) == (195.0, 0)


def test_the_terminal_display_redraws_its_block_in_place(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the terminal's size, as shutil.get_terminal_size reads it first
    monkeypatch.setenv("LINES", "50")
    states = _fake_states(1000.0)
    display = status.Display("quick suite", states, jobs=2, live=True)
    display.event("[run] python ppo_rlhf.py tiny-tldr --run-name ppo_tiny-tldr__2")
    first = capsys.readouterr().out
    assert first.startswith("\r\x1b[J[run] python ppo_rlhf.py") and first.count("\n") == 1 + 2 + len(states)
    monkeypatch.setattr(status, "REDRAW_EVERY", 0.0)
    display.tick()
    # back up over the 9 lines of the block, erase it, draw it again: no event line in between
    again = capsys.readouterr().out
    assert again.startswith("\x1b[9F\x1b[J") and again.count("\n") == 9 and "[run]" not in again


FAKE_STAGE = """
import hashlib, json, pathlib, sys, time
me = pathlib.Path(__file__).resolve()
script = {"path": str(me), "sha256": hashlib.sha256(me.read_bytes()).hexdigest()}  # the record `Run` writes
argv = sys.argv[1:]
name = argv[argv.index("--run-name") + 1]
steps, pause = 4, float(argv[argv.index("--pause") + 1]) if "--pause" in argv else 0.0
run = pathlib.Path("runs", name)
run.mkdir(parents=True, exist_ok=True)
print("loading the model", flush=True)
for n in range(steps):  # as tqdm writes to a file: `\\r` before each update, flushed
    sys.stderr.write(f"\\rfake: {100 * n // steps:3d}%|#   | {n}/{steps} [00:0{n}<00:0{steps - n},  2.00it/s]")
    sys.stderr.flush()
    time.sleep(pause if n == steps - 1 else 0.05)
sys.stderr.write(f"\\rfake: 100%|####| {steps}/{steps} [00:04<00:00,  2.00it/s]\\n")
(run / "metrics.jsonl").write_text(json.dumps({"step": steps, "episode": 8, "eval/gold_reward": 0.7}) + "\\n")
(run / "done.json").write_text(json.dumps({"step": steps, "argv": argv, "script": script}))
"""


def _fake_suite(tmp_path: Path) -> list[suites.Stage]:
    """A passing stage, one that fails after printing progress, one blocked by it, one that needs the first."""
    (tmp_path / "stage.py").write_text(FAKE_STAGE)
    (tmp_path / "bad.py").write_text(
        "import sys\nsys.stderr.write('\\rfake: 1/4 [00:01<00:03, 1.00it/s]')\nsys.exit(3)\n"
    )
    return [
        suites.Stage("a__1", str(tmp_path / "stage.py"), "p"),
        suites.Stage("b__1", str(tmp_path / "bad.py"), "p"),
        suites.Stage("c__1", str(tmp_path / "stage.py"), "p", needs=["b__1"]),
        suites.Stage("d__1", str(tmp_path / "stage.py"), "p", needs=["a__1"]),
    ]


DRIVER = """
import sys
from pathlib import Path
from benchmark import launch, run, suites
sys.path.insert(0, {tests!r})
from test_run_status import _fake_suite
suites.SUITES["fake"] = lambda seeds: _fake_suite(Path({tmp!r}))
status = launch.run_suite("fake", [1], workdir=Path({tmp!r}), jobs={jobs})
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_under_a_pipe_the_suite_prints_one_line_per_event_and_no_ansi(tmp_path, jobs):
    """`python -m benchmark.run ... | tee log` (CI, nohup): the stage events as lines, each once, and the paths."""
    driver = DRIVER.format(tests=str(REPO / "tests"), tmp=str(tmp_path), jobs=jobs)

    def suite() -> str:
        proc = subprocess.run(
            [sys.executable, "-c", driver],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm"},
            stdout=subprocess.PIPE,  # not a terminal: even with TERM set, no block is drawn
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout
        assert not ANSI.search(proc.stdout) and "\r" not in proc.stdout, proc.stdout
        return proc.stdout

    out = suite()
    events, summary = out.split("[end] fake suite in ", 1)
    lines = events.splitlines()
    log = tmp_path / "runs" / "_suite" / "b__1.log"
    # each event is one line (a failure's log lines follow it, indented); with 2 jobs their order is the processes'
    kinds = [line.split()[0] for line in lines if not line.startswith("    ")]
    if jobs == 1:
        assert kinds == ["[run]", "[ok]", "[run]", "[FAILED]", "[skip]", "[run]", "[ok]"], out
    assert sorted(kinds) == sorted(["[run]"] * 3 + ["[ok]"] * 2 + ["[FAILED]", "[skip]"]), out
    assert f"[FAILED] b__1 (exit 3); last lines of {log}:\n    fake: 1/4 [00:01<00:03, 1.00it/s]\n" in out
    assert "[skip] c__1: depends on failed ['b__1']\n" in out
    assert re.search(r"^\[ok\] a__1 in \d+s: eval/gold_reward 0\.700$", out, re.M), out
    assert out.count("--run-name a__1") == 1 and out.count("[ok] d__1") == 1
    assert re.match(r"\d+s: 2 done, 1 failed, 1 blocked\n", summary), summary
    assert out.endswith(f"wrote {tmp_path / 'runs' / 'fake_summary.md'}\nstage logs and records: {log.parent}/\n")
    # again: the finished stages are skipped, one line each
    out = suite()
    assert (
        "[skip] a__1: finished earlier with the same command and script (done.json)\n" in out and "[ok] a__1" not in out
    )


def test_plain_output_has_a_periodic_progress_line_read_from_the_logs(tmp_path, monkeypatch, capsys):
    stages = _fake_suite(tmp_path)[:1]
    stages[0].extra = ["--pause", "2"]  # stays at 3/4 for 2 s
    monkeypatch.setitem(suites.SUITES, "fake", lambda seeds: stages)
    monkeypatch.setattr(status, "PLAIN_PROGRESS_EVERY", 0.4)
    assert launch.run_suite("fake", [1], workdir=tmp_path, live=False) == {"a__1": "ok"}
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("[progress]")]
    assert any(re.search(r"; a__1 \ds  3/4 steps  2\.00 it/s  1s left$", line) for line in progress), out
    assert all(re.match(r"\[progress\] elapsed \d+s, left (~\d+s|unknown); 1 running; a__1 ", p) for p in progress), out
    assert not ANSI.search(out)


def test_results_ends_with_the_paths_it_wrote(tmp_path, capsys):
    from tests.test_compare import _write_rows

    for seed, end in ((1, 0.5), (2, 0.6)):
        rows = [{"step": 0, "episode": 0, "time": 1.0, "eval/accuracy": 0.2}]
        rows.append({"step": 2, "episode": 64, "time": 9.0, "eval/accuracy": end})
        _write_rows(tmp_path, f"grpo_tiny-math__{seed}", rows)
    assert results.main(["--runs-dir", str(tmp_path), "--tracks", "tiny-math"]) == 0
    tail = capsys.readouterr().out.rstrip("\n").splitlines()[-4:]
    assert tail == [
        "wrote:",
        f"  {tmp_path / 'results_tiny-math.md'}",
        f"  {tmp_path / 'results_tiny-math.png'}",
        f"  {tmp_path / 'results_tiny-math_grpo.png'}",
    ]
    assert all(Path(line.strip()).stat().st_size > 0 for line in tail[1:])
    (tmp_path / "empty").mkdir()  # a runs directory without runs (a missing one is an error)
    assert results.main(["--runs-dir", str(tmp_path / "empty"), "--tracks", "tiny-tldr"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote nothing under {tmp_path / 'empty'}"
