"""benchmark.tools.timeline: the main job's stages on a timeline (issue 70), read from the records the suite writes
as it launches and ends each stage."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark import launch, suites
from benchmark.tools import timeline
from tests.test_run import _fake_suite


def _record(folder: Path, name: str, start: float, end: float, needs=(), threads=1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"argv": [], "needs": dict.fromkeys(needs), "launched": start, "ended": end, "threads": threads, "rc": 0}
    (folder / f"{name}.stage.json").write_text(json.dumps(data))


def test_waits_on_the_need_that_ended_last_and_the_critical_path_follows_it(tmp_path):
    d = tmp_path / "runs" / launch.SUITE_DIR
    _record(d, "sft", 0, 600)
    _record(d, "rm", 600, 700, ["sft"])
    _record(d, "sft_math", 0, 900)
    _record(d, "ppo", 700, 1000, ["sft", "rm"], threads=2)
    _record(d, "grpo", 900, 1100, ["sft_math"])
    (d / "old.stage.json").write_text(json.dumps({"argv": []}))  # an older suite's record: no times
    spans = timeline.read_spans(tmp_path / "runs")
    assert [s.name for s in spans] == ["sft", "sft_math", "rm", "ppo", "grpo"]
    by = {s.name: s for s in spans}
    assert timeline.waits_on(by["ppo"], by).name == "rm"
    assert [s.name for s in timeline.critical_path(spans)] == ["sft_math", "grpo"]
    md = timeline.table(spans)
    assert "| ppo | 11.7 | 5.0 | 10.0 | rm |" in md  # 5 minutes on 2 threads
    assert "Wall-clock 18.3 min, 40.0 CPU-minutes in 5 stages" in md and "**grpo**" in md


def test_the_suite_records_each_stages_launch_and_end(tmp_path, monkeypatch, capsys):
    _fake_suite(tmp_path, monkeypatch)
    launch.run_suite("fake", [1], workdir=tmp_path, jobs=2)
    spans = {s.name: s for s in timeline.read_spans(tmp_path / "runs")}
    assert set(spans) == {s.run_name for s in suites.SUITES["fake"]([1])} - {"c__1"}  # c waited on b, which failed
    assert spans["b__1"].rc != 0 and spans["a__1"].rc == 0 and spans["a__1"].threads == 1
    assert spans["d__1"].needs == ["a__1"] and spans["d__1"].start >= spans["a__1"].end
