"""The live status of a suite run by `benchmark.run`: what each stage is doing, the elapsed time and what is left.

Pure pieces, each testable on its own:
  * `parse_progress(text)`: the last complete tqdm update in a stage's log (its n/total, rate and remaining time);
  * `estimate_left(stages, now, jobs)`: the seconds the suite still needs, and how many stages have no estimate yet;
  * `render_table(...)`: the block shown (and redrawn) on a terminal, as a list of lines;
  * `progress_line(...)`: the one-line summary printed now and then when stdout is not a terminal.
`Display` does the writing: on a terminal the event lines scroll above a block that is redrawn in place with ANSI
cursor movement (at most about once a second); elsewhere (CI, `nohup`, a pipe) it prints the event lines only, plus a
`[progress]` line every PLAIN_PROGRESS_EVERY seconds, and never an ANSI code.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

WAITING, RUNNING, DONE, SKIPPED, BLOCKED, FAILED = "waiting", "running", "done", "skipped", "blocked", "failed"

# what one tqdm step of each script is, for `12/32 updates`; the other scripts count optimizer steps
UNITS = {"ppo_rlhf.py": "updates", "rloo.py": "updates", "remax.py": "updates"}

# the headline of a finished stage: the first of these in its final metrics, else its first other eval/ number
HEADLINE_METRICS = ["eval/gold_reward", "eval/accuracy", "eval/win_rate"]

REDRAW_EVERY = 1.0  # seconds between redraws of the terminal block: the numbers move no faster than that
PLAIN_PROGRESS_EVERY = 60.0  # seconds between `[progress]` lines when stdout is not a terminal: a log, not a screen
LOG_TAIL_BYTES = 16384  # a tqdm update is ~100 bytes: the last 16 KiB hold the latest one, whatever was printed since

# A complete tqdm update: ` 38%|███▊      | 12/32 [00:10<00:17,  1.15it/s, reward=0.1]`, or without a total
# `12it [00:10,  1.15it/s]`. The rate's unit and the `,` or `]` after it must be there, so that an update cut off by a
# read in the middle of a write (`| 13/32 [00:1`) does not match.
_WITH_TOTAL = re.compile(
    r"(?P<n>\d+)/(?P<total>\d+) \[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:]+|\?), *"
    r"(?P<rate>[\d.]+|\?)(?P<unit>it/s|s/it)[,\]]"
)
_WITHOUT_TOTAL = re.compile(r"(?P<n>\d+)it \[(?P<elapsed>[\d:]+), *(?P<rate>[\d.]+|\?)(?P<unit>it/s|s/it)[,\]]")
# the bars libraries draw while a script starts or evaluates (transformers loading weights, datasets mapping, the hub
# downloading, vLLM generating), by their description: not the stage's progress, which its own bar (`ppo: ...`) shows
LIBRARY_BARS = (
    "Loading",
    "Generating",
    "Map",
    "Filter",
    "Fetching",
    "Downloading",
    "Processed prompts",
    "Adding requests",
)
RESUMED = "\n--- resumed:"  # benchmark.run's marker in a log before a resumed run's output


@dataclass
class Progress:
    """One tqdm update: `n` of `total` steps (None: unknown), steps per second and seconds left (None: not yet)."""

    n: int
    total: int | None
    rate: float | None
    remaining: float | None


@dataclass
class StageStatus:
    """What the display knows of one stage."""

    name: str
    state: str = WAITING
    """waiting, running, done, skipped, blocked or failed"""
    script: str = ""
    """the algorithm script's file name: the unit of its progress and which finished stages predict its duration"""
    started: float | None = None
    """time.time() at launch"""
    seconds: float | None = None
    """how long it ran, once done or failed"""
    progress: Progress | None = None
    headline: str = ""
    """done or skipped: its final headline metric, `eval/gold_reward 0.612`"""
    log: str = ""
    """its log's path (shown when it failed)"""
    note: str = ""
    """failed: `exit 1`; blocked: `needs failed b__1`"""

    @property
    def group(self) -> str:
        """`ppo_tiny-tldr__2` -> `ppo_tiny-tldr`: the other seeds of a stage predict its duration best."""
        return re.sub(r"__\d+$", "", self.name)


def _seconds(clock: str) -> float | None:
    """tqdm's `MM:SS` or `H:MM:SS` in seconds; None for `?`."""
    if not re.fullmatch(r"\d+(:\d+)*", clock):
        return None
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return float(total)


def parse_progress(text: str) -> Progress | None:
    """The last complete tqdm update in `text` (a log's tail), or None when there is none yet. tqdm writes each update
    after a `\\r` and ends a bar with `\\n`; other output (warnings, printed metrics) sits between them. Only the text
    after the last resume marker counts: a resumed run's bar, not the one of the attempt before it; and the bars of
    libraries (LIBRARY_BARS) do not."""
    text = text.rsplit(RESUMED, 1)[-1]
    for segment in reversed(re.split(r"[\r\n]", text)):
        if segment.lstrip().startswith(LIBRARY_BARS):
            continue
        m = _WITH_TOTAL.search(segment) or _WITHOUT_TOTAL.search(segment)
        if m is None:
            continue
        rate = None if m["rate"] == "?" else float(m["rate"])
        if rate is not None and m["unit"] == "s/it":  # tqdm shows a slow rate inverted
            rate = 1 / rate if rate > 0 else None
        total = int(m["total"]) if "total" in m.groupdict() else None
        remaining = _seconds(m["remaining"]) if "remaining" in m.groupdict() else None
        return Progress(int(m["n"]), total, rate, remaining)
    return None


def read_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    """The last `size` bytes of a file as text ("" when it cannot be read): tqdm's latest update is there."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def log_tail(text: str, lines: int = 5) -> list[str]:
    """The last `lines` lines of a log as a terminal shows them: of each line, what follows its last `\\r` (a tqdm bar
    is one line, not each of its updates)."""
    shown = [line.rsplit("\r", 1)[-1] for line in text.rstrip("\r\n").split("\n")]
    return [line for line in shown if line.strip()][-lines:]


def headline(metrics: dict) -> str:
    """The metric a finished stage is shown with: `eval/gold_reward 0.612`; "" when it logged no eval/ number."""
    numbers = {
        k: v
        for k, v in metrics.items()
        if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool) and "confidence" not in k
    }
    key = next((k for k in HEADLINE_METRICS if k in numbers), next(iter(numbers), None))
    return "" if key is None else f"{key} {numbers[key]:.3f}"


def fmt_duration(seconds: float) -> str:
    """`42s`, `5m02s`, `1h05m`."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_rate(rate: float) -> str:
    """`1.15 it/s`, or `12.5 s/it` below one step every two seconds (as tqdm inverts it, but easier to read)."""
    return f"{rate:.2f} it/s" if rate >= 0.5 else f"{1 / rate:.1f} s/it"


def _running_left(st: StageStatus, now: float, durations: list[dict[str, list[float]]]) -> float | None:
    """Seconds left of a running stage: tqdm's remaining time, else a typical duration less the time it has run."""
    if st.progress is not None and st.progress.remaining is not None:
        return st.progress.remaining
    typical = _typical(st, durations)
    if typical is None or st.started is None:
        return None
    return max(0.0, typical - (now - st.started))


def _typical(st: StageStatus, durations: list[dict[str, list[float]]]) -> float | None:
    """A stage's expected duration: the mean over its other seeds, else over the other stages of its script; from
    the first of `durations` (finished stages) that has one, then the next (projections of running ones)."""
    for known in durations:
        for key in (st.group, st.script):
            if known.get(key):
                return sum(known[key]) / len(known[key])
    return None


def estimate_left(stages: list[StageStatus], now: float, jobs: int) -> tuple[float, int]:
    """(seconds until the suite ends, number of running or waiting stages without an estimate).

    How: each running stage's time left is tqdm's remaining time (the training loop only: the last evaluation and the
    save after it are not counted), or, before its first tqdm update, the typical duration below less the time it
    has run. A waiting stage's duration is the mean of the stages of the same group (its other seeds), else of the
    same script, done in this invocation; before any is done, the projected durations (elapsed + tqdm's remaining) of
    the running ones, which leave out their start-up and last evaluation.
    Then the scheduler is simulated: `jobs` slots, each free when its running stage ends, and each waiting stage, in
    the suite's order, starts in the slot that frees first; the answer is when the last slot frees. It ignores that a
    stage waits for the ones it needs and that a failure blocks its dependents. Stages with no estimate take no time
    there and are counted instead, so that the caller can say the answer is a lower bound."""
    finished: dict[str, list[float]] = defaultdict(list)
    projected: dict[str, list[float]] = defaultdict(list)  # known before any stage of its kind ends
    for st in stages:
        if st.state == DONE and st.seconds is not None:
            finished[st.group].append(st.seconds)
            finished[st.script].append(st.seconds)
        elif st.state == RUNNING and st.progress and st.progress.remaining is not None and st.started is not None:
            projected[st.group].append(now - st.started + st.progress.remaining)
            projected[st.script].append(now - st.started + st.progress.remaining)
    durations = [finished, projected]
    unknown = 0
    slots = []
    for st in stages:
        if st.state == RUNNING:
            left = _running_left(st, now, durations)
            unknown += left is None
            slots.append(left or 0.0)
    slots = sorted(slots + [0.0] * max(0, jobs - len(slots)))
    for st in stages:
        if st.state != WAITING:
            continue
        typical = _typical(st, durations)
        if typical is None:
            unknown += 1
            continue
        slots[0] += typical  # the slot that frees first takes the next stage
        slots.sort()
    return (max(slots) if slots else 0.0), unknown


def fmt_left(stages: list[StageStatus], now: float, jobs: int) -> str:
    """`~7m10s`, `at least 7m10s (2 stages not estimated yet)`, `unknown` or `0s` (nothing left)."""
    todo = sum(st.state in (RUNNING, WAITING) for st in stages)
    if todo == 0:
        return "0s"
    left, unknown = estimate_left(stages, now, jobs)
    if unknown == todo:
        return "unknown"
    if unknown:
        return f"at least {fmt_duration(left)} ({unknown} stage{'s' * (unknown > 1)} not estimated yet)"
    return f"~{fmt_duration(left)}"


def describe(st: StageStatus, now: float) -> str:
    """What a stage's row says after its state: time so far, progress and rate; time and headline; or why it failed."""
    if st.state == RUNNING:
        ran = [fmt_duration(now - st.started)] if st.started is not None else []  # in the column of a done one's time
        p = st.progress
        if p is None:
            return "  ".join([*ran, "starting"])
        unit = UNITS.get(st.script, "steps")
        parts = [*ran, f"{p.n}/{p.total} {unit}" if p.total is not None else f"{p.n} {unit}"]
        if p.rate is not None:
            parts.append(fmt_rate(p.rate))
        if p.remaining is not None:
            parts.append(f"{fmt_duration(p.remaining)} left")
        return "  ".join(parts)
    if st.state == DONE:
        return "  ".join(x for x in (fmt_duration(st.seconds or 0.0), st.headline) if x)
    if st.state == SKIPPED:
        return "  ".join(x for x in ("finished earlier", st.headline) if x)
    if st.state == FAILED:
        ran = f"after {fmt_duration(st.seconds)}" if st.seconds is not None else ""
        return "  ".join(x for x in (st.note, ran, f"log {st.log}" if st.log else "") if x)
    return st.note


def counts(stages: list[StageStatus]) -> str:
    """`3 done, 2 running, 3 waiting`: the states present, in the order a stage goes through them."""
    n = {s: sum(st.state == s for st in stages) for s in (DONE, SKIPPED, RUNNING, WAITING, FAILED, BLOCKED)}
    return ", ".join(f"{v} {s}" for s, v in n.items() if v)


def render_table(
    title: str, stages: list[StageStatus], now: float, started: float, jobs: int, width: int = 120, height: int = 50
) -> list[str]:
    """The terminal block: two header lines (the counts of each state; the elapsed time and the estimate of what is
    left) and one row per stage, each cut to `width - 1` columns (a wrapped line would break the cursor movement that
    redraws the block). With more stages than `height - 3` rows, the running, failed and blocked ones are kept, then
    the latest finished and the next waiting ones, and one last row counts the rest."""
    head = [f"{title}: {counts(stages)}", f"elapsed {fmt_duration(now - started)}, left {fmt_left(stages, now, jobs)}"]
    name_width = max([len(st.name) for st in stages] + [4])
    room = max(1, height - 3)  # the header, and the line the cursor rests on below the block
    shown = set(range(len(stages)))
    if len(stages) > room:
        room -= 1  # the row that counts the others
        order = sorted(
            range(len(stages)),
            key=lambda i: (
                {RUNNING: 0, FAILED: 1, BLOCKED: 1, DONE: 2, WAITING: 3, SKIPPED: 4}[stages[i].state],
                # the latest finished (by their end), the next waiting
                -((stages[i].started or 0) + (stages[i].seconds or 0)) if stages[i].state == DONE else i,
            ),
        )
        shown = set(order[:room])
    rows = [
        f"  {st.name:<{name_width}}  {st.state:<8}  {describe(st, now)}".rstrip()
        for i, st in enumerate(stages)
        if i in shown
    ]
    if len(shown) < len(stages):
        rest = [st for i, st in enumerate(stages) if i not in shown]
        rows.append(f"  ... and {len(rest)} more: {counts(rest)}")
    return [line[: max(1, width - 1)] for line in [*head, *rows]]


def progress_line(stages: list[StageStatus], now: float, started: float, jobs: int) -> str:
    """The periodic line of plain output: `[progress] elapsed 5m02s, left ~7m10s; 3 done, 2 running, 3 waiting;
    ppo_tiny-tldr__1 1m02s  12/32 updates  0.90 it/s  22s left, rloo_tiny-tldr__1 3s  starting`."""
    running = ", ".join(f"{st.name} {describe(st, now)}" for st in stages if st.state == RUNNING)
    line = f"[progress] elapsed {fmt_duration(now - started)}, left {fmt_left(stages, now, jobs)}; {counts(stages)}"
    return line + (f"; {running}" if running else "")


def stdout_is_terminal() -> bool:
    """Whether the live block can be drawn: stdout is a terminal that understands cursor movement."""
    return sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb"


class Display:
    """The suite's output. `event(line)` prints a line that stays (a stage started, finished, failed, was skipped);
    `tick()` refreshes what changes by itself: the terminal block, or the periodic `[progress]` line. sys.stdout is
    looked up at each write, so that what replaces it (pytest's capture) gets the output."""

    def __init__(self, title: str, stages: list[StageStatus], jobs: int, live: bool | None = None):
        self.title, self.jobs = title, jobs
        self.stages = {st.name: st for st in stages}
        self.live = stdout_is_terminal() if live is None else live
        self.started = time.time()
        self.drawn = 0  # lines of the block on screen, to move back over when it is redrawn
        self.last_draw = self.last_line = self.started

    def __getitem__(self, name: str) -> StageStatus:
        return self.stages[name]

    def _write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def _clear(self) -> str:
        """ANSI: to the start of the block's first line (`ESC[nF`), then erase to the end of the screen (`ESC[J`)."""
        return (f"\x1b[{self.drawn}F" if self.drawn else "\r") + "\x1b[J"

    def _block(self, now: float) -> list[str]:
        size = shutil.get_terminal_size()
        return render_table(
            self.title, list(self.stages.values()), now, self.started, self.jobs, size.columns, size.lines
        )

    def event(self, *lines: str) -> None:
        """Lines that stay in the output; on a terminal they go above the block, which is drawn again below them."""
        text = "".join(line + "\n" for line in lines)
        if not self.live:
            self._write(text)
            return
        block = self._block(time.time())
        self._write(self._clear() + text + "".join(line + "\n" for line in block))
        self.drawn, self.last_draw = len(block), time.time()

    def refresh(self) -> None:
        """Each running stage's progress from the tail of its log (kept when the tail holds no update now)."""
        for st in self.stages.values():
            if st.state == RUNNING and st.log:
                st.progress = parse_progress(read_tail(Path(st.log))) or st.progress

    def tick(self, now: float | None = None) -> None:
        """Redraw the block (terminal, at most every REDRAW_EVERY s) or print a `[progress]` line (otherwise, every
        PLAIN_PROGRESS_EVERY s)."""
        now = time.time() if now is None else now
        if self.live and now - self.last_draw >= REDRAW_EVERY:
            self.refresh()
            self.event()
        elif not self.live and now - self.last_line >= PLAIN_PROGRESS_EVERY:
            self.refresh()
            self.last_line = now
            self._write(progress_line(list(self.stages.values()), now, self.started, self.jobs) + "\n")

    def close(self) -> None:
        """The end of the suite: the block drawn a last time and left on screen (terminal), or an `[end]` line."""
        now = time.time()
        if self.live:
            self.event()
            self._write("\n")  # a blank line between the block, which stays, and what is printed next
            self.drawn = 0
        else:
            self._write(
                f"[end] {self.title} in {fmt_duration(now - self.started)}: {counts(list(self.stages.values()))}\n"
            )
