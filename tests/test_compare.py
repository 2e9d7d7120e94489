"""benchmark.compare: aggregation against known values, robustness to bad metrics files, the outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmark import compare, results


def _write_run(root: Path, name: str, values: list[float], extra_lines: list[str] = ()) -> Path:
    run = root / name
    run.mkdir(parents=True)
    lines = [json.dumps({"step": i, "episode": 100 * i, "time": 2.0 * i, "eval/gold_reward": v}) for i, v in enumerate(values)]
    (run / "metrics.jsonl").write_text("\n".join(lines + list(extra_lines)) + "\n")
    return run


def _write_rows(root: Path, name: str, rows: list[dict]) -> None:
    (root / name).mkdir()
    (root / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_known_curves_give_known_mean_and_band():
    x = np.array([0.0, 100.0, 200.0])
    curves = [(x, np.array([0.0, 1.0, 2.0])), (x, np.array([2.0, 3.0, 4.0])), (x, np.array([1.0, 2.0, 3.0]))]
    agg = compare.aggregate_curves(curves, n_points=3)
    np.testing.assert_allclose(agg["x"], x)
    np.testing.assert_allclose(agg["mean"], [1.0, 2.0, 3.0])
    assert (agg["low"] <= agg["mean"]).all() and (agg["mean"] <= agg["high"]).all()
    # the band of the mean of {0, 2, 1} lies within [min, max] and is symmetric here
    assert agg["low"][0] >= 0.0 and agg["high"][0] <= 2.0
    assert agg["mean"][0] - agg["low"][0] == pytest.approx(agg["high"][0] - agg["mean"][0], abs=0.15)
    # curves logged at different x are interpolated onto the common range
    shifted = compare.aggregate_curves([(np.array([0.0, 10.0]), np.array([0.0, 10.0])), (np.array([5.0, 20.0]), np.array([5.0, 20.0]))], 2)
    np.testing.assert_allclose(shifted["x"], [5.0, 10.0])
    np.testing.assert_allclose(shifted["mean"], [5.0, 10.0])


def test_bootstrap_ci_and_iqm_by_hand():
    assert compare.bootstrap_ci(np.array([0.5, 0.5, 0.5])) == (0.5, 0.5)  # no spread, no band
    assert compare.bootstrap_ci(np.array([0.7])) == (0.7, 0.7)
    lo, hi = compare.bootstrap_ci(np.array([0.0, 1.0] * 50))
    assert lo == pytest.approx(0.5 - 1.96 * 0.05, abs=0.03) and hi == pytest.approx(0.5 + 1.96 * 0.05, abs=0.03)
    assert compare.iqm(np.array([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -100.0])) == pytest.approx(3.5)  # drops 2 at each end
    assert compare.iqm(np.array([1.0, 2.0, 9.0])) == pytest.approx(4.0)  # 3 runs: floor(0.75) = 0 dropped


def test_groups_by_algorithm_and_summarises_final_values(tmp_path):
    for seed, final in ((1, 0.6), (2, 0.8), (3, 0.7)):
        _write_run(tmp_path, f"ppo_tiny-tldr__{seed}", [0.5, final])
    _write_run(tmp_path, "rloo_tiny-tldr__1", [0.5, 0.9])
    runs = [compare.read_run(p) for p in sorted(tmp_path.iterdir())]
    table = {t["group"]: t for t in compare.summarize(runs, "eval/gold_reward")}
    assert table["ppo_tiny-tldr"]["seeds"] == 3 and table["ppo_tiny-tldr"]["mean"] == pytest.approx(0.7)
    assert table["rloo_tiny-tldr"]["seeds"] == 1 and table["rloo_tiny-tldr"]["low"] == table["rloo_tiny-tldr"]["high"] == 0.9
    assert "| ppo_tiny-tldr | 3 | 0.700 |" in compare.markdown_table(list(table.values()), "eval/gold_reward")


def test_corrupt_or_missing_metrics_are_reported_and_skipped(tmp_path, capsys):
    good = _write_run(tmp_path, "a__1", [0.1, 0.2], extra_lines=['{"step": 9, "episode": 900, "eval/gold_rew'])
    (tmp_path / "b__1").mkdir()
    run = compare.read_run(good)
    assert len(run.rows) == 2 and len(run.problems) == 1 and "corrupt line" in run.problems[0]
    assert compare.read_run(tmp_path / "b__1").problems == [f"{tmp_path / 'b__1'}: no metrics.jsonl"]
    out = tmp_path / "cmp"
    assert compare.main([str(good), str(tmp_path / "b__1"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "corrupt line" in err and "no metrics.jsonl" in err
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| a | 1 | 0.200 |" in out.with_suffix(".md").read_text()
    assert compare.main([str(tmp_path / "b__1"), "--out", str(out)]) == 1  # nothing to compare is an error


def test_results_table_has_the_start_row_and_per_algorithm_finals(tmp_path):

    def run(name, start, end, eps, lengths=None):
        rows = [{"step": 0, "episode": 0, "time": 1.0, "eval/accuracy": start},
                {"step": 1, "episode": 64, "time": 5.0, "perf/episodes_per_sec": eps, "perf/peak_mem_gb": 1.0},
                {"step": 2, "episode": 128, "time": 9.0, "eval/accuracy": end}]
        if lengths:  # the secondary metric, logged by some scripts only
            rows[0]["eval/completion_length"], rows[2]["eval/completion_length"] = lengths
        _write_rows(tmp_path, name, rows)

    run("grpo_tiny-math__1", 0.3, 0.5, 10.0, (5.0, 30.0))
    run("grpo_tiny-math__2", 0.3, 0.7, 12.0, (5.0, 34.0))
    run("ppo_tiny-math__1", 0.3, 0.4, 5.0)
    run("sft_tiny-math__1", 0.0, 0.3, 99.0)  # not an RL run: left out
    md, runs = results.track_table(tmp_path, "tiny-math")
    lines = md.splitlines()
    assert lines[2] == "| SFT (start) | 3 runs | 0.300 [0.300, 0.300] | 5.000 [5.000, 5.000] | - | - | - |"
    grpo = next(line for line in lines if line.startswith("| grpo |"))
    assert grpo.startswith("| grpo | 2 | 0.600 [")  # mean of 0.5 and 0.7 with its bootstrap band
    assert "| 32.000 [" in grpo  # the secondary metric: mean of 30 and 34
    assert "| 11.000 [" in grpo and "| 9.000 [" in grpo  # episodes/s and seconds are averaged too
    assert "| ppo | 1 | 0.400 | - | 5.000 | 1.000 | 9.000 |" in md  # a metric the run never logged is blank
    assert not any(line.startswith("| sft |") for line in lines) and len(runs) == 3
    assert results.main(["--runs-dir", str(tmp_path), "--tracks", "tiny-math"]) == 0
    assert (tmp_path / "results_tiny-math.png").stat().st_size > 0


def test_prm_table_reports_the_last_values_of_each_reward_setting(tmp_path):
    def run(name, acc, length, eos, steps):
        rows = [{"step": 0, "episode": 0, "time": 1.0, "eval/accuracy": 0.2, "eval/completion_length": 7.0, "eval/eos_rate": 1.0},
                {"step": 1, "episode": 64, "time": 2.0, "objective/num_steps": 2.0},
                {"step": 2, "episode": 128, "time": 3.0, "objective/num_steps": steps},
                {"step": 2, "episode": 128, "time": 4.0, "eval/accuracy": acc, "eval/completion_length": length, "eval/eos_rate": eos}]
        _write_rows(tmp_path, name, rows)

    run("ppo-prm-raw_tiny-math__1", 0.1, 70.0, 0.2, 6.0)
    run("ppo-prm-raw_tiny-math__2", 0.3, 60.0, 0.4, 5.0)
    run("ppo-prm-clip-delta_tiny-math__1", 0.5, 30.0, 1.0, 3.5)
    lines = results.prm_table(tmp_path).splitlines()
    assert len(lines) == 4  # header, rule, and the two settings that have runs (no success-only PPO here)
    assert lines[2].startswith("| ppo-prm-raw | 2 | 0.200 [") and "| 65.000 [" in lines[2] and "| 5.500 [" in lines[2]
    assert lines[3] == "| ppo-prm-clip-delta | 1 | 0.500 | 30.000 | 1.000 | 3.500 |"
    assert results.prm_table(tmp_path / "nothing") == ""
