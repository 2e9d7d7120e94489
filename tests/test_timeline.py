"""benchmark.tools.timeline: the main job's stages on a timeline (issue 70), read from the records the suite writes
as it launches and ends each stage (that the suite writes them: tests/test_run.py's failed-stage test)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark import launch
from benchmark.tools import timeline


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
