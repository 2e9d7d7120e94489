"""Every bad-input case (tests/bad_inputs.py and tests/bad_inputs_<script>.py) against every script it applies to: a
one-line `error:` naming the flag, file, row or field, before the first training step, within seconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bad_inputs import REPO, World, all_cases, base_flags, make_reward_model, run_case

PARAMS = [pytest.param(case, script, id=f"{script}-{case.id}") for case in all_cases() for script in case.scripts]


@pytest.fixture(scope="module")
def tiny_rm(assets, tmp_path_factory):
    return make_reward_model(assets, tmp_path_factory.mktemp("rm"))


@pytest.mark.parametrize("case, script", PARAMS)
def test_bad_input_ends_in_one_line_before_training(case, script, assets, tiny_rm, tmp_path):
    message, elapsed = run_case(case, script, World(assets, tmp_path, tiny_rm))
    assert case.expect in message, message
    assert elapsed < 30, f"took {elapsed:.1f} s to fail"


# two scripts as a user runs them (a process each, about 8 s); every script's `__main__` is the same one line and its
# `main` carries `one_error_line` (tests/test_conventions.py), and each case of the suite runs in-process
@pytest.mark.parametrize("script", ["sft", "grpo_math"])
def test_the_command_line_prints_the_line_and_exits_non_zero(script, assets, tiny_rm, tmp_path):
    """As a user sees it: exit code 1, the `error:` line last on stderr, no traceback."""
    cmd = [
        sys.executable,
        str(REPO / f"{script}.py"),
        *base_flags(script, World(assets, tmp_path, tiny_rm)),
        "--learning-rate",
        "nan",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "error: --learning-rate is nan; give a finite number"


def test_the_docs_table_lists_every_case():
    table = (REPO / "docs" / "bad_inputs.md").read_text()
    missing = [case.id for case in all_cases() if f"`{case.id}`" not in table]
    assert not missing, f"regenerate docs/bad_inputs.md with `python -m tests.bad_inputs`: {missing}"


@pytest.mark.parametrize("script", ["sft", "grpo_math"])  # the others: tests/test_conventions.py, as above
def test_a_command_without_a_preset_names_the_presets(script, tmp_path):
    """As a user types it (issue 42 item 6): flags without the preset first are one line naming the presets, not tyro's
    "Unrecognized options --output-dir"."""
    import importlib

    presets = ", ".join(importlib.import_module(script).PRESETS)
    cmd = [sys.executable, str(REPO / f"{script}.py"), "--output-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {script}.py needs a preset first: python {script}.py PRESET [flags]; presets: {presets}"
    )
