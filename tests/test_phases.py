"""benchmark.tools.phases: the line timer behind docs/speed.md's profile. Each line is charged its own time, a traced
callee's lines are not charged again to the line that called it, and each line lands in the phase its rules name."""

from __future__ import annotations

import functools
import sys
import time

import pytest

from benchmark.tools import phases


def helper() -> None:
    time.sleep(0.03)  # a traced callee: its time is its own, not its caller's line's
    time.sleep(0.01)


def logged(fn):  # as the scripts' `@one_error_line`: the timer must trace the body, not this wrapper
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)

    return wrapper


@logged
def toy(n: int) -> int:
    time.sleep(0.02)  # before the loop: setup
    x = 0
    for update in range(n):
        time.sleep(0.02)  # sample
        helper()
        x += update
    return x


RULES = {"loop": r"^for update in range", "lines": [(r"sleep\(0\.02\)  # sample", "sampling")]}
HELPER = {"lines": [(r"sleep\(0\.01\)", "optimizer")], "default": "backward"}


@pytest.fixture
def clean():
    phases.TIMES.clear()
    phases.CALLS.clear()
    yield
    sys.settrace(None)


def test_each_line_is_charged_once_to_its_phase(clean):
    timer = phases.LineTimer({toy: RULES, helper: HELPER})
    timer.install()
    toy(3)
    sys.settrace(None)
    t = phases.TIMES
    assert t["setup"] == pytest.approx(0.02, abs=0.015)
    assert t["sampling"] == pytest.approx(0.06, abs=0.02)
    assert t["backward"] == pytest.approx(0.09, abs=0.03)  # the helper's first line, 3 calls
    assert t["optimizer"] == pytest.approx(0.03, abs=0.015)
    assert t[phases.OTHER] < 0.02  # the `helper()` line itself: its callee's 0.12 s are not charged to it
    assert sum(t.values()) == pytest.approx(0.2, abs=0.05)


def test_the_table_gives_seconds_per_step_and_shares():
    ours = {"seconds": {"sampling": 2.0, "backward": 2.0, "setup": 9.0}}
    trl = {"seconds": {"sampling": 4.0, "backward": 4.0, phases.OTHER: 8.0}}
    md = phases.table({"ppo": {"ours": ours, "trl": trl}}, {"ppo": 2})
    assert "| sampling | 1.000 (50%) | 2.000 (25%) | 0.50 |" in md
    assert "| **the loop** | 2.000 | 8.000 | 0.25 |" in md  # setup is left out


def test_the_rules_find_their_lines_in_the_real_loops():
    """Every rule of our PPO and RM loops matches a statement of the script it is for (a renamed call would silently
    move its time to `the rest`)."""
    import ppo_rlhf
    import reward_model

    for fn, rules in ((ppo_rlhf.main, phases.PPO_OURS), (reward_model.main, phases.RM_OURS)):
        found = set(phases.statement_phases(fn, rules).values())
        want = {p for _, p in rules["lines"]}
        assert want <= found, (fn.__module__, want - found)
        assert "setup" in found
        assert phases.OTHER in found  # the loop header matched: its unnamed lines are in the loop, not setup
        assert phases.key(phases.inspect.unwrap(fn).__code__) in phases.LineTimer({fn: rules}).phases


def test_a_loop_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match="loop pattern"):
        phases.statement_phases(toy, {**RULES, "loop": r"^for step in range"})


def test_the_trl_rules_find_their_lines():
    """TRL's side (benchmark extra, not CI's environment): the PPO rules against trl 1.12's PPOTrainer.train where
    that is importable, the RM rules against transformers' epoch loop."""
    pytest.importorskip("trl")
    from transformers import Trainer

    found = set(phases.statement_phases(Trainer._run_epoch, phases.HF_LOOP).values())
    assert {p for _, p in phases.HF_LOOP["lines"]} <= found
    try:
        from trl.experimental.ppo import PPOTrainer
    except ImportError:
        return
    found = set(phases.statement_phases(PPOTrainer.train, phases.PPO_TRL).values())
    assert {p for _, p in phases.PPO_TRL["lines"]} <= found, {p for _, p in phases.PPO_TRL["lines"]} - found
