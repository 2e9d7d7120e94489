"""Learning tests: the tiny suite end to end (SFT, reward model, then RL for one seed), and that each model
actually learns: the RL runs must beat the SFT policy they start from, as measured by the evaluation each
run makes before its first update and after its last.

These train for minutes on a 2-core CPU, so they carry the `slow` marker; CI runs them too. The suite `learning` runs
the suite `quick` (about half of each preset's RL budget, `benchmark/run.py` QUICK: enough to pass the margins below,
which are well under what the full presets reach over 3 seeds, README) and three runs of the KL frontier's `--quick`
version in one queue, two stages at a time with one thread each (`--jobs 2`). The README's tables come from the full
presets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.curves import read_run
from benchmark.launch import final_metrics
from benchmark.suites import LEARNING_FRONTIER_STAGES, MAIN_FRONTIER_STAGES, QUICK_STAGES
from tests.conftest import run_learning_suite

REPO = Path(__file__).resolve().parent.parent
# minimal improvement over the starting SFT policy (seed 1), in gold reward and in win rate. Over 3 seeds of the
# full presets (README) every algorithm improved by at least +0.33 gold reward and +0.37 win rate; the margins leave
# room for the shorter runs and the nondeterminism of thread scheduling, not for a method that stopped learning.
TLDR_MARGINS = {"ppo": 0.15, "rloo": 0.1, "remax": 0.1, "dpo": 0.1, "online-dpo": 0.1}
# tiny-math, greedy test accuracy (200 problems): the SFT policy mostly answers without working (~0.18); GRPO's
# full preset reaches ~0.45 over 3 seeds (README)
MATH_MARGINS = {"grpo": 0.1}
STAGES = [f"{a}_tiny-tldr" for a in TLDR_MARGINS] + [f"{a}_tiny-math" for a in MATH_MARGINS]
assert sorted(STAGES) == sorted(QUICK_STAGES), "the README's main job (suite `quick`) runs what these tests check"


def start_and_end(run_dir: Path, metric: str) -> tuple[float, float]:
    evals = [row for row in read_run(run_dir).rows if metric in row]
    assert evals and evals[0]["episode"] == 0, f"{run_dir.name} evaluates before its first update"
    assert evals[-1]["episode"] > 0, f"{run_dir.name} evaluates after its last update"
    return evals[0][metric], evals[-1][metric]


@pytest.mark.slow
def test_tiny_tldr_sft_imitates_references_and_rm_learns_gold_preferences(suite_dir):
    sft = final_metrics(suite_dir / "runs" / "sft_tiny-tldr__1")
    # the SFT policy learns to write summaries that end with EOS and cover facts about as well as the references
    assert sft["eval/eos_rate"] == 1.0
    assert sft["eval/gold_reward"] > 0.5
    # and it leaves room for RL: the best possible summary scores 1.0
    assert sft["eval/gold_reward"] < 0.9
    rm = final_metrics(suite_dir / "runs" / "rm_tiny-tldr__1")
    assert rm["eval/accuracy"] >= 0.85, rm
    assert abs(rm["eval/reference_reward_mean"]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(TLDR_MARGINS))
def test_tiny_tldr_rl_beats_the_sft_policy(suite_dir, algo):
    run = suite_dir / "runs" / f"{algo}_tiny-tldr__1"
    gold0, gold1 = start_and_end(run, "eval/gold_reward")
    win0, win1 = start_and_end(run, "eval/win_rate")
    assert gold1 >= gold0 + TLDR_MARGINS[algo], (gold0, gold1)
    assert win1 >= win0 + TLDR_MARGINS[algo], (win0, win1)


@pytest.mark.slow
def test_tiny_math_sft_policy_takes_shortcuts_and_leaves_room(suite_dir):
    sft = final_metrics(suite_dir / "runs" / "sft_tiny-math__1")
    assert sft["eval/eos_rate"] == 1.0
    assert 0.05 <= sft["eval/accuracy"] <= 0.35, sft


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(MATH_MARGINS))
def test_tiny_math_rl_beats_the_sft_policy_by_showing_its_work(suite_dir, algo):
    run = suite_dir / "runs" / f"{algo}_tiny-math__1"
    acc0, acc1 = start_and_end(run, "eval/accuracy")
    assert acc1 >= acc0 + MATH_MARGINS[algo], (acc0, acc1)
    # the way it gets there: answers that write the steps out are longer than the shortcut `#### N`
    len0, len1 = start_and_end(run, "eval/completion_length")
    assert len1 > len0 + 3, (len0, len1)


@pytest.mark.slow
def test_rerunning_the_suite_skips_finished_runs(suite_dir):
    proc = run_learning_suite(suite_dir, timeout=300)
    assert proc.returncode == 0
    assert "[run]" not in proc.stdout and proc.stdout.count("[skip]") >= 13
    done = json.loads((suite_dir / "runs" / "sft_tiny-tldr__1" / "done.json").read_text())
    assert done["argv"][0] == done["preset"] == "tiny-tldr" and done["step"] == done["total_steps"]


# The KL frontier's quick version (issue 22): the noisy reward model, PPO without a KL penalty, RLOO and offline DPO on
# tiny-tldr-noisy (the main job's frontier, issue 43) and one GRPO setting on tiny-math, run by the suite `learning` on
# the quick suite's SFT models
FRONTIER_STAGES = [
    "ppo-kl0_tiny-tldr-noisy",
    "rloo-kl0.005_tiny-tldr-noisy",
    "dpo-beta0.1_tiny-tldr-noisy",
    "grpo-beta0_tiny-math-kl",
]
assert FRONTIER_STAGES == MAIN_FRONTIER_STAGES + LEARNING_FRONTIER_STAGES


@pytest.fixture(scope="module")
def frontier_dir(suite_dir) -> Path:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmark.run", "frontier", "--seeds", "1", "--quick", "--dry-run"]
    proc = subprocess.run(
        [*cmd, "--workdir", str(suite_dir), "--only", *FRONTIER_STAGES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the frontier's own `--quick` command finds every run done: the suite `learning` ran them as the frontier does
    assert proc.stdout.count("# [skip]") == 7 and "--run-name" not in proc.stdout, proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.results", "--runs-dir", str(suite_dir / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return suite_dir / "runs"


@pytest.mark.slow
def test_quick_frontier_imperfect_proxy_kl_from_zero_and_its_tables(frontier_dir):
    # the reward model of 1,000 noisy, length-biased labels is an imperfect proxy of the gold judge
    rm = final_metrics(frontier_dir / "rm_tiny-tldr-noisy__1")
    assert 0.55 < rm["eval/accuracy"] < 0.9, rm
    names = [f"{s}__1" for s in MAIN_FRONTIER_STAGES + LEARNING_FRONTIER_STAGES]
    for name in names:
        kl0, kl1 = start_and_end(frontier_dir / name, "eval/kl")
        assert kl0 == 0.0 and kl1 > 0.0, (name, kl0, kl1)  # the policy is its reference at step 0, then moves away
        evals = [row for row in read_run(frontier_dir / name).rows if "eval/kl" in row]
        assert "tiny-math" in name or len(evals) >= 7, (name, len(evals))  # the main job's: curves (issue 43)
    score0, score1 = start_and_end(frontier_dir / "ppo-kl0_tiny-tldr-noisy__1", "eval/score")
    assert score1 > score0 + 1.0, (score0, score1)  # PPO raises the proxy
    tldr = (frontier_dir / "frontier_tiny-tldr-noisy.md").read_text()
    assert "| ppo | kl0 |" in tldr and "| rloo | kl0.005 |" in tldr and "| dpo | beta0.1 |" in tldr
    assert "a measured gap" in tldr  # one seed: the order at each KL budget, not intervals
    assert "| grpo | beta0 |" in (frontier_dir / "frontier_tiny-math-kl.md").read_text()
    assert (frontier_dir / "frontier_tiny-tldr-noisy.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_main_jobs_frontier_ranks_algorithms_at_a_fixed_kl(frontier_dir):
    """Issue 43: the first figure separates algorithms. RLOO gains gold reward at almost no KL (its samples move the
    greedy summary), PPO's four epochs per batch move it far from its reference at once: within KL 0.25 RLOO is well
    above PPO (one seed: 0.90 against PPO's SFT start, 0.67, on this host's run in docs/frontier.md)."""
    best = {}
    for name in ("ppo-kl0", "rloo-kl0.005"):
        rows = [r for r in read_run(frontier_dir / f"{name}_tiny-tldr-noisy__1").rows if "eval/kl" in r]
        best[name] = max(r["eval/gold_reward"] for r in rows if r["eval/kl"] <= 0.25)
    assert best["rloo-kl0.005"] >= best["ppo-kl0"] + 0.1, best
