"""Issue 58 item 8: the benchmark package shows the user's loop. Every `python -m benchmark...` command the README and
the docs give answers `--help` from any folder without writing anything; the user's loop (benchmark/*.py) imports no
maintainers' tool (benchmark/tools/), and no two modules of the package import each other, even lazily."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[str]:
    """The modules the pages run with `python -m benchmark.X`, and every module of the package that has a `__main__`."""
    named = {m for page in PAGES for m in re.findall(r"python -m (benchmark(?:\.\w+)+)(?!\w|\.<)", page.read_text())}
    for path in (REPO / "benchmark").rglob("*.py"):
        if '__name__ == "__main__"' in path.read_text():
            named.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    return sorted(named)


def test_the_pages_name_the_moved_tools_by_their_new_place():
    """A page that still says `python -m benchmark.speed` would send a reader to a module that is not there."""
    stale = [m for m in documented_commands() if not (REPO / Path(*m.split("."))).with_suffix(".py").is_file()]
    assert not stale, f"documented commands with no module: {stale}"


@pytest.mark.parametrize("module", documented_commands())
def test_each_documented_command_answers_help_from_any_folder(module, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "usage" in out.stdout.lower(), f"{module} --help: {out.stderr[-2000:]}"
    assert not list(tmp_path.iterdir()), f"{module} --help wrote {list(tmp_path.iterdir())}"


def _imports(path: Path) -> set[str]:
    """The benchmark modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmark"):
            if node.module == "benchmark" or node.module == "benchmark.tools":
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("benchmark.")}
    return found


MODULES = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in (REPO / "benchmark").rglob("*.py")}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_no_two_modules_of_the_benchmark_package_import_each_other():
    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for name in sorted(GRAPH) if (c := cycle_from(name))]
    assert not cycles, f"import cycles in benchmark/: {cycles[0]}"


def test_the_users_loop_imports_no_maintainers_tool():
    loop = [name for name in GRAPH if not name.startswith("benchmark.tools")]
    uses = {name: sorted(m for m in GRAPH[name] if m.startswith("benchmark.tools")) for name in loop}
    assert not any(uses.values()), f"the user's loop imports a tool: { {k: v for k, v in uses.items() if v} }"
