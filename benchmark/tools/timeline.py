"""A suite's stages on a timeline: when each ran, which stage it waited on, its CPU-minutes, and the critical path.

    python -m benchmark.tools.timeline [RUNS_DIR]          # default runs/: the last suite run there (`benchmark.run`)

Read from the suite's records (RUNS_DIR/_suite/<run>.stage.json: launch and end times, threads, the stages it
needs), so it describes a suite as it ran, not as planned. A stage "waits on" the stage it needs that ended last;
the critical path runs back from the stage that ended last through what each waited on: shortening a stage off that
path does not end the suite sooner. CPU-minutes are wall-clock minutes times the threads the suite gave the stage (one
process at a time with one thread each on a 2-core CPU with --jobs 2). Stages whose records hold no times (launched by
an older suite) are left out, and so are records older than the suite's last launch by more than --window hours (an
earlier invocation's).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmark import runfiles
from benchmark.launch import SUITE_DIR


@dataclass
class Span:
    name: str
    start: float
    end: float
    threads: int
    needs: list[str]
    rc: int | None

    @property
    def minutes(self) -> float:
        return (self.end - self.start) / 60


def read_spans(runs_dir: Path, window_hours: float = 12.0) -> list[Span]:
    spans = []
    for path in sorted((runs_dir / SUITE_DIR).glob("*.stage.json")):
        try:
            r = runfiles.read_object(path)  # the one checked reader of run and stage files
        except runfiles.RunFileError:
            continue
        if "launched" not in r or "ended" not in r:
            continue
        name = path.name[: -len(".stage.json")]
        needs = list(r.get("needs") or {})
        spans.append(Span(name, r["launched"], r["ended"], r.get("threads") or 1, needs, r.get("rc")))
    if spans:
        last = max(s.start for s in spans)
        spans = [s for s in spans if s.start >= last - window_hours * 3600]
    return sorted(spans, key=lambda s: (s.start, s.name))


def waits_on(span: Span, by_name: dict[str, Span]) -> Span | None:
    """The stage it needs that ended last (None: it needs none of these)."""
    ended = [by_name[n] for n in span.needs if n in by_name]
    return max(ended, key=lambda s: s.end) if ended else None


def critical_path(spans: list[Span]) -> list[Span]:
    by_name = {s.name: s for s in spans}
    path, s = [], max(spans, key=lambda s: s.end)
    while s is not None:
        path.append(s)
        s = waits_on(s, by_name)
    return path[::-1]


def table(spans: list[Span], width: int = 40) -> str:
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    scale = width / max(t1 - t0, 1e-9)
    by_name = {s.name: s for s in spans}
    on_path = {s.name for s in critical_path(spans)}
    lines = [
        "| stage | starts (min) | minutes | CPU-minutes | waits on | timeline |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in spans:
        w = waits_on(s, by_name)
        bar = " " * int((s.start - t0) * scale) + "#" * max(1, round((s.end - s.start) * scale))
        name = f"**{s.name}**" if s.name in on_path else s.name
        lines.append(
            f"| {name} | {(s.start - t0) / 60:.1f} | {s.minutes:.1f} | {s.minutes * s.threads:.1f} | "
            f"{w.name if w else '-'} | `{bar:<{width}}` |"
        )
    cpu = sum(s.minutes * s.threads for s in spans)
    path = critical_path(spans)
    lines += [
        "",
        f"Wall-clock {(t1 - t0) / 60:.1f} min, {cpu:.1f} CPU-minutes in {len(spans)} stages. Critical path (in bold): "
        + " -> ".join(f"{s.name} ({s.minutes:.1f})" for s in path)
        + f", {sum(s.minutes for s in path):.1f} min of stages.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", nargs="?", default="runs")
    parser.add_argument("--window", type=float, default=12.0, help="hours before the last launch that count")
    a = parser.parse_args(argv)
    spans = read_spans(Path(a.runs_dir), a.window)
    if not spans:
        raise SystemExit(
            f"error: {a.runs_dir}/{SUITE_DIR} holds no stage with its launch and end times: run a suite "
            "(`python -m benchmark.run main`) first"
        )
    print(table(spans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
