"""Is a fork still its parent plus its variant? `python -m benchmark.tools.fork_check FORK.py [--write]`.

A declared fork (a module-level `PARENT = "grpo_math"` line: CleanRL's way, the whole file copied) is its parent
script with the variant's lines changed, and nothing else. What a copy costs is drift: a later fix to the parent that
the fork does not receive makes the fork another algorithm than it says it is. So each fork keeps its variant as a
record, `<fork>.variant.diff` beside it: the differences from the parent (each a run of the parent's lines and the
fork's lines that replace them, without line numbers or context). This command compares the fork's differences from
its parent today with that record and exits 1, naming each difference the record does not hold ("the parent's
line N ... is not in the fork: carry it over"), or each recorded one that is gone. `--write` records the fork's
differences as its variant (after a deliberate change to the variant: read the diff it prints first).

The parent is the library's script of that name (this checkout's), or `--parent PATH`. A fork outside the checkout
gets the same check: `python -m benchmark.tools.fork_check ~/my_grpo.py --write` once, then the check after each
pull. tests/test_forks.py runs it on the library's forks (`grpo_clip_cov.py`, `grpo_kl_cov.py`).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUFFIX = ".variant.diff"


class ForkError(Exception):
    """Input that cannot be checked; its message is the `error:` line."""


def parent_of(fork: Path) -> str | None:
    """The fork's `PARENT = "name"` (a module-level string), or None."""
    try:
        tree = ast.parse(fork.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise ForkError(f"{fork} does not parse as Python ({e})") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PARENT"]:
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return None


def trimmed(lines: list[str]) -> list[str]:
    """`lines` without blank lines at either end: where an inserted function's blank lines fall is the matcher's
    choice, and moves when the parent changes elsewhere."""
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def hunks(parent: list[str], fork: list[str]) -> list[tuple[int, list[str], list[str]]]:
    """The differences: (the parent's first line number, its lines, the fork's lines in their place), blank lines at
    their ends aside (a difference in blank lines alone is none)."""
    matcher = difflib.SequenceMatcher(None, parent, fork, autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        old, new = trimmed(parent[i1:i2]), trimmed(fork[j1:j2])
        if tag != "equal" and (old or new):
            out.append((i1 + 1, old, new))
    return out


def render(diff: list[tuple[int, list[str], list[str]]]) -> str:
    """The record: one `@@` line per difference, then its parent lines (`-`) and fork lines (`+`)."""
    out = []
    for _, old, new in diff:
        out += ["@@", *(f"-{line}" for line in old), *(f"+{line}" for line in new)]
    return "\n".join(out) + "\n"


def parse(text: str) -> list[tuple[list[str], list[str]]]:
    recorded: list[tuple[list[str], list[str]]] = []
    for line in text.splitlines():
        if line == "@@":
            recorded.append(([], []))
        elif recorded and line[:1] in "-+":
            recorded[-1][0 if line[0] == "-" else 1].append(line[1:])
        elif line:
            raise ForkError(f"the record has a line that is not @@, -... or +...: {line[:60]!r}")
    return recorded


def check(fork: Path, parent: Path, record: Path) -> list[str]:
    """The problems: each difference of `fork` from `parent` that `record` does not hold, each recorded one gone."""
    if not record.is_file():
        raise ForkError(f"{record} does not exist: record the variant first (--write)")
    diff = hunks(parent.read_text().splitlines(), fork.read_text().splitlines())
    recorded = parse(record.read_text())
    problems = []
    for at, old, new in diff:
        if (old, new) in recorded:
            recorded.remove((old, new))
            continue
        said = f"{parent.name} line {at}: " + (" / ".join(s.strip() for s in old[:3]) or "(nothing)")[:100]
        theirs = (" / ".join(s.strip() for s in new[:3]) or "(nothing)")[:100]
        problems.append(
            f"{said} -- {fork.name} has: {theirs}. Not in the variant: carry the parent's lines over, or record "
            "them as the variant (--write)"
        )
    for old, new in recorded:
        problems.append(
            f"the recorded difference {(' / '.join(s.strip() for s in old[:2]) or '(nothing)')[:80]} -> "
            f"{(' / '.join(s.strip() for s in new[:2]) or '(nothing)')[:80]} is gone: record the variant again"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fork", help='the fork\'s script (with a module-level PARENT = "<library script>" line)')
    parser.add_argument("--parent", default=None, help="the parent's file (default: the library's script of PARENT)")
    parser.add_argument("--record", default=None, help=f"the variant's record (default: the fork's name + {SUFFIX})")
    parser.add_argument("--write", action="store_true", help="record the fork's differences as its variant")
    a = parser.parse_args(argv)
    fork = Path(a.fork)
    try:
        if not fork.is_file():
            raise ForkError(f"{fork} does not exist")
        name = parent_of(fork)
        if a.parent is None and name is None:
            raise ForkError(
                f'{fork} declares no parent: add a module-level line PARENT = "grpo_math", or pass --parent'
            )
        parent = Path(a.parent) if a.parent else REPO / f"{Path(name).stem}.py"
        if not parent.is_file():
            raise ForkError(f"the parent {parent} does not exist (--parent)")
        record = Path(a.record) if a.record else fork.with_name(fork.stem + SUFFIX)
        if a.write:
            diff = hunks(parent.read_text().splitlines(), fork.read_text().splitlines())
            record.write_text(render(diff))
            print(f"wrote {record}: {len(diff)} differences from {parent.name}")
            return 0
        problems = check(fork, parent, record)
    except ForkError as e:
        raise SystemExit(f"error: {e}") from None
    for p in problems:
        print(p)
    print(
        f"{fork.name}: "
        + (
            f"{len(problems)} differences from {parent.name} outside its variant"
            if problems
            else f"{parent.name} and its recorded variant ({record.name}), nothing else"
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
