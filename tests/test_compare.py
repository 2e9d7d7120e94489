"""benchmark.compare: aggregation against known values, robustness to bad metrics files, runs that did not finish
their budget left out, intervals from fewer than 3 seeds shown as the seeds' values, the outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmark import compare, curves, results

REPO = Path(__file__).resolve().parent.parent


def _write_run(
    root: Path, name: str, values: list[float], extra_lines: list[str] = (), done: bool = True, every: int = 100
) -> Path:
    """A run directory: `eval/gold_reward` = values[i] at episode every * i; `done`: it completed its budget."""
    run = root / name
    run.mkdir(parents=True)
    lines = [
        json.dumps({"step": i, "episode": every * i, "time": 2.0 * i, "eval/gold_reward": v})
        for i, v in enumerate(values)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines + list(extra_lines)) + "\n")
    if done:
        (run / "done.json").write_text(json.dumps({"step": len(values) - 1, "argv": ["tiny-tldr"]}))
    return run


def _write_rows(root: Path, name: str, rows: list[dict], done: bool = True) -> None:
    (root / name).mkdir()
    (root / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if done:
        (root / name / "done.json").write_text(json.dumps({"step": rows[-1]["step"]}))


def _means(md: str) -> dict[str, float]:
    """algorithm -> mean final value, from compare's markdown table (its rows: the lines under it are notes)."""
    rows = [line for line in md.splitlines()[2:] if line.startswith("|")]
    return {cells[0]: float(cells[2]) for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}


def test_known_curves_give_known_mean_and_band():
    x = np.array([0.0, 100.0, 200.0])
    three = [(x, np.array([0.0, 1.0, 2.0])), (x, np.array([2.0, 3.0, 4.0])), (x, np.array([1.0, 2.0, 3.0]))]
    agg = curves.aggregate_curves(three, n_points=3)
    np.testing.assert_allclose(agg["x"], x)
    np.testing.assert_allclose(agg["mean"], [1.0, 2.0, 3.0])
    assert (agg["low"] <= agg["mean"]).all() and (agg["mean"] <= agg["high"]).all()
    # the band of the mean of {0, 2, 1} lies within [min, max] and is symmetric here
    assert agg["low"][0] >= 0.0 and agg["high"][0] <= 2.0
    assert agg["mean"][0] - agg["low"][0] == pytest.approx(agg["high"][0] - agg["mean"][0], abs=0.15)
    # curves logged at different x are interpolated onto the common range
    shifted = curves.aggregate_curves(
        [(np.array([0.0, 10.0]), np.array([0.0, 10.0])), (np.array([5.0, 20.0]), np.array([5.0, 20.0]))], 2
    )
    np.testing.assert_allclose(shifted["x"], [5.0, 10.0])
    np.testing.assert_allclose(shifted["mean"], [5.0, 10.0])


def test_bootstrap_ci_and_iqm_by_hand():
    assert curves.bootstrap_ci(np.array([0.5, 0.5, 0.5])) == (0.5, 0.5)  # no spread, no band
    assert curves.bootstrap_ci(np.array([0.7])) == (0.7, 0.7)
    lo, hi = curves.bootstrap_ci(np.array([0.0, 1.0] * 50))
    assert lo == pytest.approx(0.5 - 1.96 * 0.05, abs=0.03) and hi == pytest.approx(0.5 + 1.96 * 0.05, abs=0.03)
    assert curves.iqm(np.array([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -100.0])) == pytest.approx(
        3.5
    )  # drops 2 at each end
    assert curves.iqm(np.array([1.0, 2.0, 9.0])) == pytest.approx(4.0)  # 3 runs: floor(0.75) = 0 dropped


def test_groups_by_algorithm_and_summarises_final_values(tmp_path):
    for seed, final in ((1, 0.6), (2, 0.8), (3, 0.7)):
        _write_run(tmp_path, f"ppo_tiny-tldr__{seed}", [0.5, final])
    _write_run(tmp_path, "rloo_tiny-tldr__1", [0.5, 0.9])
    runs = [curves.read_run(p) for p in sorted(tmp_path.iterdir())]
    table = {t["group"]: t for t in curves.summarize(runs, "eval/gold_reward")}
    assert table["ppo_tiny-tldr"]["seeds"] == 3 and table["ppo_tiny-tldr"]["mean"] == pytest.approx(0.7)
    assert (
        table["rloo_tiny-tldr"]["seeds"] == 1
        and table["rloo_tiny-tldr"]["low"] == table["rloo_tiny-tldr"]["high"] == 0.9
    )
    assert "| ppo_tiny-tldr | 3 | 0.700 |" in curves.markdown_table(list(table.values()), "eval/gold_reward")


def test_a_torn_last_row_or_missing_metrics_are_reported_and_a_corrupt_row_refused(tmp_path, capsys):
    """A last row a kill cut short (no newline after it) is dropped and said; a row before it that does not parse is
    damage: one `error:` line (benchmark/runfiles.py, the same in every tool)."""
    good = _write_run(tmp_path, "a__1", [0.1, 0.2])
    with open(good / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "episode": 900, "eval/gold_rew')
    (tmp_path / "b__1").mkdir()
    run = curves.read_run(good)
    assert len(run.rows) == 2 and len(run.problems) == 1 and "its last row is torn" in run.problems[0]
    assert curves.read_run(tmp_path / "b__1").problems == [f"{tmp_path / 'b__1'}: no metrics.jsonl"]
    out = tmp_path / "cmp"
    assert compare.main([str(good), str(tmp_path / "b__1"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "its last row is torn" in err and "no metrics.jsonl" in err
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| a | 1 | 0.200 |" in out.with_suffix(".md").read_text()
    assert compare.main([str(tmp_path / "b__1"), "--out", str(out)]) == 1  # nothing to compare is an error
    bad = _write_run(tmp_path, "c__1", [0.1, 0.2], extra_lines=['{"step": 9, "episo', '{"step": 10}'])
    with pytest.raises(SystemExit, match=r"c__1/metrics.jsonl line 3 is not a JSON row \(Unterminated string"):
        compare.main([str(bad), "--out", str(out)])


def test_results_table_has_the_start_row_and_per_algorithm_finals(tmp_path, capsys):

    def run(name, start, end, eps, lengths=None):
        rows = [
            {"step": 0, "episode": 0, "time": 1.0, "eval/accuracy": start},
            {"step": 1, "episode": 64, "time": 5.0, "perf/episodes_per_sec": eps, "perf/peak_mem_gb": 1.0},
            {"step": 2, "episode": 128, "time": 9.0, "eval/accuracy": end},
        ]
        if lengths:  # the secondary metric, logged by some scripts only
            rows[0]["eval/completion_length"], rows[2]["eval/completion_length"] = lengths
        _write_rows(tmp_path, name, rows)

    run("grpo_tiny-math__1", 0.3, 0.5, 10.0, (5.0, 30.0))
    run("grpo_tiny-math__2", 0.3, 0.7, 12.0, (5.0, 34.0))
    run("ppo_tiny-math__1", 0.3, 0.4, 5.0)
    run("sft_tiny-math__1", 0.0, 0.3, 99.0)  # not an RL run: left out
    run("grpo-fixed-start_tiny-math__1", 0.125, 0.375, 9.0)  # a check run from the shipped start: left out
    run("grpo_tiny-math__3", 0.3, 0.0, 1.0)
    (tmp_path / "grpo_tiny-math__3" / "done.json").unlink()  # stopped part way: left out
    md, runs = results.track_table(tmp_path, "tiny-math")
    assert "warning: grpo_tiny-math__3 did not finish its budget (no done.json); left out" in capsys.readouterr().err
    lines = md.splitlines()
    # the start row counts the SFT models evaluated, and one value when the RL runs' first evaluations agree
    assert lines[2] == "| SFT (start) | 1 SFT run | 0.300 | 5.000 | - | - | - |"
    grpo = next(line for line in lines if line.startswith("| grpo |"))
    assert grpo.startswith("| grpo | 2 | 0.600 (0.500, 0.700: 2 seeds) |")  # 2 seeds: the values, not a 95% CI
    assert "| 32.000 (30.000, 34.000: 2 seeds) |" in grpo  # the secondary metric: mean of 30 and 34
    assert "| 11.000 (" in grpo and "| 9.000 (" in grpo  # episodes/s and seconds are averaged too
    assert "| ppo | 1 | 0.400 | - | 5.000 | 1.000 | 9.000 |" in md  # a metric the run never logged is blank
    assert not any(line.startswith(("| sft |", "| grpo-fixed-start |")) for line in lines) and len(runs) == 3
    assert results.main(["--runs-dir", str(tmp_path), "--tracks", "tiny-math"]) == 0
    assert (tmp_path / "results_tiny-math.png").stat().st_size > 0


def test_results_table_counts_a_non_finite_final_as_a_diverged_seed(tmp_path, capsys):
    """As benchmark.compare (issue 42 item 5): a NaN final is neither shown nor replaced by an earlier value."""

    def run(name, values):
        rows = [{"step": i, "episode": 64 * i, "time": 1.0 + i, "eval/accuracy": v} for i, v in enumerate(values)]
        _write_rows(tmp_path, name, rows)

    run("grpo_tiny-math__1", [0.3, 0.5])
    run("grpo_tiny-math__2", [0.3, 0.7])
    run("grpo_tiny-math__3", [0.3, 0.9, float("nan")])
    run("ppo_tiny-math__1", [0.3, float("inf")])
    md, runs = results.track_table(tmp_path, "tiny-math")
    err = capsys.readouterr().err
    assert "warning: grpo_tiny-math__3: its final eval/accuracy is not finite (diverged)" in err
    assert "warning: ppo_tiny-math__1: its final eval/accuracy is not finite (diverged)" in err
    assert "| grpo | 3 (1 diverged) | 0.600 (0.500, 0.700: 2 seeds) |" in md
    assert "| ppo | 1 (1 diverged) | diverged | - | - | - | - |" in md
    assert "nan" not in md and "inf" not in md
    assert sorted(r.name for r in runs) == ["grpo_tiny-math__1", "grpo_tiny-math__2"], "diverged runs: no curve"
    assert results.main(["--runs-dir", str(tmp_path), "--tracks", "tiny-math"]) == 0


def test_prm_table_reports_the_last_values_of_each_reward_setting(tmp_path):
    def run(name, acc, length, eos, steps):
        rows = [
            {
                "step": 0,
                "episode": 0,
                "time": 1.0,
                "eval/accuracy": 0.2,
                "eval/completion_length": 7.0,
                "eval/eos_rate": 1.0,
            },
            {"step": 1, "episode": 64, "time": 2.0, "objective/num_steps": 2.0},
            {"step": 2, "episode": 128, "time": 3.0, "objective/num_steps": steps},
            {
                "step": 2,
                "episode": 128,
                "time": 4.0,
                "eval/accuracy": acc,
                "eval/completion_length": length,
                "eval/eos_rate": eos,
            },
        ]
        _write_rows(tmp_path, name, rows)

    run("ppo-prm-raw_tiny-math__1", 0.1, 70.0, 0.2, 6.0)
    run("ppo-prm-raw_tiny-math__2", 0.3, 60.0, 0.4, 5.0)
    run("ppo-prm-clip-delta_tiny-math__1", 0.5, 30.0, 1.0, 3.5)
    lines = results.prm_table(tmp_path).splitlines()
    assert len(lines) == 4  # header, rule, and the two settings that have runs (no success-only PPO here)
    assert (
        lines[2].startswith("| ppo-prm-raw | 2 | 0.200 (0.100, 0.300: 2 seeds) |")
        and "| 65.000 (" in lines[2]
        and "| 5.500 (" in lines[2]
    )
    assert lines[3] == "| ppo-prm-clip-delta | 1 | 0.500 | 30.000 | 1.000 | 3.500 |"
    assert results.prm_table(tmp_path / "nothing") == ""


def test_a_run_that_did_not_finish_its_budget_is_left_out_of_table_and_curves(tmp_path, monkeypatch, capsys):
    # PPO is the better algorithm: its two finished seeds end at 0.8, RLOO's three at 0.6. PPO's third seed crashed
    # early, at 0.1 after 100 episodes: averaged in, it would put PPO (0.567) below RLOO.
    ppo = [_write_run(tmp_path, f"ppo_tiny-tldr__{s}", [0.3, 0.5, 0.7, 0.8], every=100) for s in (1, 2)]
    ppo.append(_write_run(tmp_path, "ppo_tiny-tldr__3", [0.3, 0.1], done=False))
    rloo = [_write_run(tmp_path, f"rloo_tiny-tldr__{s}", [0.3, 0.4, 0.5, 0.55, 0.6], every=80) for s in (1, 2, 3)]
    with_crash = _means(
        curves.markdown_table(curves.summarize([curves.read_run(p) for p in ppo + rloo], "eval/gold_reward"), "")
    )
    assert with_crash["ppo_tiny-tldr"] < with_crash["rloo_tiny-tldr"], "the case this test is about"

    drawn = {}

    def spy(runs, metric, out_png, *args):
        for x in ("episode", "time"):
            drawn[x] = curves.group_curves(runs, metric, x)
        return plot(runs, metric, out_png, *args)

    plot = curves.plot
    monkeypatch.setattr(compare, "plot", spy)
    out = tmp_path / "cmp"
    (tmp_path / "ppo_tiny-tldr__1.log").write_text("the suite's log, which runs/ppo_tiny-tldr__* takes too\n")
    assert compare.main([str(p) for p in ppo + rloo] + [str(tmp_path / "ppo_tiny-tldr__1.log"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: ppo_tiny-tldr__3 did not finish its budget (no done.json); left out" in err
    assert "ppo_tiny-tldr__1.log is a file, not a run directory; skipped" in err and "__1.log did not" not in err
    md = out.with_suffix(".md").read_text()
    means = _means(md)
    assert means == {"ppo_tiny-tldr": pytest.approx(0.8), "rloo_tiny-tldr": pytest.approx(0.6)}
    assert (
        "| ppo_tiny-tldr | 2 | 0.800 | 0.800, 0.800 (2 seeds) |" in md
        and "| rloo_tiny-tldr | 3 | 0.600 | [0.600, 0.600] |" in md
    )
    # the curves: PPO from its 2 finished runs, over all of their episodes (the crashed run stopped at 100)
    agg = drawn["episode"]["ppo_tiny-tldr"]
    assert agg["seeds"] == 2 and agg["x"][0] == 0 and agg["x"][-1] == 300 and agg["mean"][-1] == pytest.approx(0.8)
    assert curves.curve_label("ppo_tiny-tldr", agg) == "ppo_tiny-tldr (band: min-max of 2 seeds)"
    assert drawn["episode"]["rloo_tiny-tldr"]["x"][-1] == 320 and drawn["time"]["ppo_tiny-tldr"]["x"][-1] == 6.0
    assert (
        curves.curve_label("rloo_tiny-tldr", drawn["episode"]["rloo_tiny-tldr"])
        == "rloo_tiny-tldr (band: 95% bootstrap interval over 3 seeds)"
    )
    # an old suite's DONE marker does not make a run finished, and says why
    (ppo[2] / "DONE").write_text("{}")
    curves.finished_runs([curves.read_run(ppo[2])])
    assert "its DONE is from an older benchmark.run" in capsys.readouterr().err
    # nothing finished: an error, not an empty table
    assert compare.main([str(ppo[2]), "--out", str(out)]) == 1


def test_one_or_two_seeds_show_the_values_not_a_95_ci(tmp_path):
    _write_run(tmp_path, "ppo_tiny-tldr__1", [0.3, 0.41])
    _write_run(tmp_path, "ppo_tiny-tldr__2", [0.3, 0.52])
    _write_run(tmp_path, "dpo_tiny-tldr__1", [0.3, 0.47])
    out = tmp_path / "cmp"
    assert compare.main([str(p) for p in sorted(tmp_path.glob("*__*"))] + ["--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "95% CI" not in md and "| seed values |" in md.splitlines()[0]
    assert "| ppo_tiny-tldr | 2 | 0.465 | 0.410, 0.520 (2 seeds) |" in md
    assert "| dpo_tiny-tldr | 1 | 0.470 | 0.470 |" in md
    runs = [curves.read_run(p) for p in sorted(tmp_path.glob("*__*"))]
    grouped = curves.group_curves(runs, "eval/gold_reward", "episode")
    two, one = grouped["ppo_tiny-tldr"], grouped["dpo_tiny-tldr"]
    assert two["band"] == "min-max" and two["low"][-1] == pytest.approx(0.41) and two["high"][-1] == pytest.approx(0.52)
    assert one["band"] is None and curves.curve_label("dpo_tiny-tldr", one) == "dpo_tiny-tldr (1 seed)"
    assert out.with_suffix(".png").stat().st_size > 1000
    # with 3 seeds in one group and fewer in another, each cell says what it is
    _write_run(tmp_path, "ppo_tiny-tldr__3", [0.3, 0.6])
    table = curves.summarize([curves.read_run(p) for p in sorted(tmp_path.glob("*__*"))], "eval/gold_reward")
    md = curves.markdown_table(table, "eval/gold_reward")
    assert "| 95% CI (values below 3 seeds) |" in md.splitlines()[0]
    assert "| dpo_tiny-tldr | 1 | 0.470 | 0.470 |" in md and "| ppo_tiny-tldr | 3 | 0.510 | [0." in md


def test_runs_that_differ_in_code_libraries_or_host_are_named_in_a_warning(tmp_path, capsys):
    """Issue 43: results from two commits, two torch versions or two CPUs are not one experiment; compare says so (on
    stderr and under the table). Runs that agree get no warning."""

    def record(run: Path, commit: str, torch: str, cpu: str) -> None:
        started = {
            "git": {"commit": commit, "dirty": False},
            "versions": {"torch": torch, "transformers": "5.24.0"},
            "host": {"cpu": cpu, "cores": 2, "gpus": [], "python": "3.11.7"},
        }
        (run / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))

    same = [_write_run(tmp_path, f"ppo_tiny-tldr__{s}", [0.1, 0.5]) for s in (1, 2)]
    for run in same:
        record(run, "aaa", "2.13.0", "AMD EPYC")
    out = tmp_path / "cmp"
    assert compare.main([str(p) for p in same] + ["--out", str(out)]) == 0
    assert "differ" not in capsys.readouterr().err and "warning" not in out.with_suffix(".md").read_text()
    other = _write_run(tmp_path, "rloo_tiny-tldr__1", [0.2, 0.4])
    record(other, "bbb", "2.12.0", "AMD EPYC")
    assert compare.main([str(p) for p in [*same, other]] + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: the runs differ in git commit (aaa: 2 run(s); bbb: 1 run(s))" in err
    assert "warning: the runs differ in torch (2.12.0: 1 run(s); 2.13.0: 2 run(s))" in err and "CPU" not in err
    assert "> warning: the runs differ in git commit" in out.with_suffix(".md").read_text()


def _host_provenance(env: dict) -> dict:
    """provenance.json's `started` as a script run under `env` would record it."""
    code = "import json; from clean_rlhf_utils.tracking import provenance; print(json.dumps(provenance()))"
    env = {**{k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}, **env}  # native unless given
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_provenance_tells_two_rounding_regimes_and_two_cpus_apart(tmp_path, capsys):
    """Issue 57: the CPU model name alone ("AMD EPYC") hid that two hosts rounded differently. A run records the CPU's
    vector flags, torch's CPU capability, its BLAS and threads; ATEN_CPU_CAPABILITY=default (the second regime on one
    machine) is recorded as such, and compare warns when runs mix regimes. Runs without the record are left out."""
    native, forced = _host_provenance({}), _host_provenance({"ATEN_CPU_CAPABILITY": "default"})
    assert forced["host"]["cpu_capability"] == "DEFAULT" != native["host"]["cpu_capability"]
    assert forced["host"]["numerics_env"]["ATEN_CPU_CAPABILITY"] == "default"
    assert "ATEN_CPU_CAPABILITY" not in native["host"]["numerics_env"]
    assert native["host"]["blas"] and native["host"]["threads"] >= 1 and isinstance(native["host"]["cpu_flags"], list)
    runs = []
    for seed, started in enumerate([native, native, forced], start=1):
        run = _write_run(tmp_path, f"ppo_tiny-tldr__{seed}", [0.1, 0.5])
        (run / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))
        runs.append(curves.read_run(run))
    lines = curves.provenance_differences(runs)
    capability = native["host"]["cpu_capability"]
    regimes = "; ".join(sorted(["DEFAULT: 1 run(s)", f"{capability}: 2 run(s)"]))
    assert f"the runs differ in torch CPU capability (rounding regime) ({regimes})" in lines, lines
    assert not [line for line in lines if "CPU vector flags" in line], "one CPU: the same flags"
    # an AVX-512 host against an AVX2 one (the flags as /proc/cpuinfo gives them), and an older run without the record
    avx2 = json.loads(json.dumps(native))
    avx2["host"].update(cpu_flags=["avx", "avx2", "fma"], cpu_capability="AVX2")
    avx512 = json.loads(json.dumps(native))
    avx512["host"].update(cpu_flags=["avx", "avx2", "avx512f", "fma"], cpu_capability="AVX512")
    old = json.loads(json.dumps(native))
    for key in ("cpu_flags", "cpu_capability", "blas", "threads", "numerics_env"):
        del old["host"][key]
    for run, started in zip(runs, [avx2, avx512, old]):
        (run.path / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))
    lines = curves.provenance_differences([curves.read_run(r.path) for r in runs])
    assert "the runs differ in CPU vector flags (avx avx2 avx512f fma: 1 run(s); avx avx2 fma: 1 run(s))" in lines
    assert "the runs differ in torch CPU capability (rounding regime) (AVX2: 1 run(s); AVX512: 1 run(s))" in lines
    assert not [line for line in lines if "BLAS" in line or "threads" in line], "the older run is left out"


def test_a_curve_runs_through_its_evaluations_and_the_figure_has_its_training_panels(tmp_path):
    """Issue 43: markers stand where the runs evaluated (the grid is their evaluation points, not an even grid), and
    the results figure adds the per-update training metrics under the evaluations."""
    one = [(np.array([0.0, 64.0, 192.0, 512.0]), np.array([0.6, 0.7, 0.9, 1.0]))]
    agg = curves.aggregate_curves(one)
    np.testing.assert_allclose(agg["x"], [0, 64, 192, 512])
    np.testing.assert_allclose(agg["mean"], [0.6, 0.7, 0.9, 1.0])
    # seeds evaluated at the same episodes: the same points, the mean of each
    two = curves.aggregate_curves(one + [(one[0][0], one[0][1] - 0.2)])
    np.testing.assert_allclose(two["x"], [0, 64, 192, 512]) and np.testing.assert_allclose(two["mean"][-1], 0.9)
    rows = [{"step": 0, "episode": 0, "time": 0.0, "eval/gold_reward": 0.6}]
    rows += [
        {"step": i, "episode": 64 * i, "time": i, "objective/reward": i / 10, "objective/kl": i / 5} for i in (1, 2, 3)
    ]
    rows += [{"step": 3, "episode": 192, "time": 3.5, "eval/gold_reward": 0.9}]
    _write_rows(tmp_path, "ppo_tiny-tldr__1", rows)
    run = curves.read_run(tmp_path / "ppo_tiny-tldr__1")
    train = curves.group_curves([run], "objective/reward", "episode")["ppo_tiny-tldr"]
    np.testing.assert_allclose(train["x"], [64, 128, 192])  # a point per update
    out = tmp_path / "fig.png"
    curves.plot([run], "eval/gold_reward", out, "tiny-tldr: gold reward", ("objective/reward", "objective/kl"))
    assert out.stat().st_size > 10_000


def test_a_seed_whose_final_value_is_nan_is_reported_as_diverged_never_with_an_earlier_value(tmp_path, capsys):
    """Issue 42 item 5: PPO's seed 3 ends at NaN after 0.9: its final value is not 0.9. It counts as a diverged seed
    (named in a warning, under the table and in the seeds column), the mean is over the two others; a group whose every
    seed ends at NaN (here every value is NaN) stays in the table as "diverged", with a warning."""
    nan = float("nan")
    _write_run(tmp_path, "ppo_tiny-tldr__1", [0.3, 0.5])
    _write_run(tmp_path, "ppo_tiny-tldr__2", [0.3, 0.7])
    _write_run(tmp_path, "ppo_tiny-tldr__3", [0.3, 0.9, nan])
    _write_run(tmp_path, "rloo_tiny-tldr__1", [nan, nan])
    _write_run(tmp_path, "rloo_tiny-tldr__2", [0.2, nan])
    assert "NaN" in (tmp_path / "ppo_tiny-tldr__3" / "metrics.jsonl").read_text()  # what json.dumps writes for it
    out = tmp_path / "cmp"
    assert compare.main([str(p) for p in sorted(tmp_path.glob("*__*"))] + ["--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| ppo_tiny-tldr | 3 (1 diverged) | 0.600 | 0.500, 0.700 (2 seeds) |" in md and "0.900" not in md
    assert "| rloo_tiny-tldr | 2 (2 diverged) | diverged | - | - |" in md
    assert "> warning: ppo_tiny-tldr__3: its final eval/gold_reward is not finite" in md
    err = capsys.readouterr().err
    assert "warning: ppo_tiny-tldr__3: its final eval/gold_reward is not finite (diverged)" in err
    assert "warning: every seed of rloo_tiny-tldr diverged" in err
    runs = [curves.read_run(p) for p in sorted(tmp_path.iterdir()) if p.is_dir()]
    assert runs[2].name == "ppo_tiny-tldr__3" and np.isnan(runs[2].final("eval/gold_reward"))  # NaN, not 0.9
    table = {t["group"]: t for t in curves.summarize(runs, "eval/gold_reward")}
    ppo = table["ppo_tiny-tldr"]
    assert ppo["seeds"] == 3 and ppo["diverged"] == ["ppo_tiny-tldr__3"] and ppo["mean"] == pytest.approx(0.6)
    assert table["rloo_tiny-tldr"]["seeds"] == 2 and table["rloo_tiny-tldr"]["values"] == []


def test_the_same_run_given_twice_counts_once(tmp_path, capsys):
    """Issue 42 item 5: runs/ppo__1 and ./runs/../runs/ppo__1 are one run, not two seeds."""
    one = _write_run(tmp_path / "runs", "ppo_tiny-tldr__1", [0.3, 0.5])
    _write_run(tmp_path / "runs", "ppo_tiny-tldr__2", [0.3, 0.7])
    again = tmp_path / "runs" / ".." / "runs" / "ppo_tiny-tldr__1"
    out = tmp_path / "cmp"
    assert compare.main([str(one), str(tmp_path / "runs" / "ppo_tiny-tldr__2"), str(again), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {again} is the run directory {one} given again" in err and "counted once" in err
    assert "| ppo_tiny-tldr | 2 | 0.600 |" in out.with_suffix(".md").read_text()


def test_runs_of_the_same_name_in_two_folders_are_kept_apart(tmp_path, capsys):
    """Issue 42 item 5: runs/a/ppo__1 and runs/b/ppo__1 are two experiments (say two learning rates), not two seeds of
    one: each folder's group is its own row, and the warning names both paths."""
    a = [_write_run(tmp_path / "a", f"ppo_tiny-tldr__{s}", [0.3, v]) for s, v in ((1, 0.5), (2, 0.7))]
    b = _write_run(tmp_path / "b", "ppo_tiny-tldr__1", [0.3, 0.1])
    out = tmp_path / "cmp"
    assert compare.main([str(p) for p in [*a, b]] + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"two run directories are named ppo_tiny-tldr__1 ({a[0]} and {b})" in err
    md = out.with_suffix(".md").read_text()
    assert f"| ppo_tiny-tldr ({tmp_path / 'a'}) | 2 | 0.600 |" in md
    assert f"| ppo_tiny-tldr ({tmp_path / 'b'}) | 1 | 0.100 |" in md


def test_a_missing_path_or_a_folder_without_metrics_is_named_not_called_unfinished(tmp_path, capsys):
    """Issue 42 item 5: a misspelt path does not exist and an empty folder holds no metrics.jsonl; neither is a run
    that "did not finish its budget"."""
    good = _write_run(tmp_path / "runs", "ppo_tiny-tldr__1", [0.3, 0.5])
    (tmp_path / "empty").mkdir()
    out = tmp_path / "cmp"
    args = [str(good), str(tmp_path / "runs" / "ppo_tiny-tldr__9"), str(tmp_path / "empty"), str(tmp_path / "runs")]
    assert compare.main([*args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'runs' / 'ppo_tiny-tldr__9'} does not exist; skipped" in err
    assert f"warning: {tmp_path / 'empty'} holds no metrics.jsonl, so it is not a run directory; skipped" in err
    assert f"(it holds 1 run directories: pass them, {tmp_path / 'runs'}/*)" in err
    assert "did not finish" not in err
    assert "| ppo_tiny-tldr | 1 | 0.500 |" in out.with_suffix(".md").read_text()


def test_area_under_the_curve_and_episodes_to_reach_by_hand():
    """Issue 49 item 5: the AUC is the trapezoid area over the span divided by its length (the mean value over it)."""
    x, y = np.array([0.0, 100.0, 200.0, 400.0]), np.array([0.0, 0.5, 1.0, 1.0])
    assert curves.area_under_curve(x, y, 0, 400) == pytest.approx((25 + 75 + 200) / 400)  # 0.75
    assert curves.area_under_curve(x, y, 0, 200) == pytest.approx(100 / 200)
    # a span inside the curve: interpolated at its ends, y(50) = 0.25 and y(300) = 1.0
    assert curves.area_under_curve(x, y, 50, 300) == pytest.approx((0.375 * 50 + 0.75 * 100 + 1.0 * 100) / 250)
    assert curves.area_under_curve(x, y, 100, 100) == 0.5
    assert curves.episodes_to_reach(x, y, 0.9, 400) == 200  # the first evaluation at or above it
    assert curves.episodes_to_reach(x, y, 0.9, 100) is None  # not within the span
    assert curves.common_span([], "eval/gold_reward") is None


def _three_groups(root: Path) -> list[Path]:
    """fast and its copy learn by episode 100, slow by 300; all end at 1.0, so final values cannot rank them."""
    curves = {
        "fast_tiny-tldr": [[0.5, 1.0, 1.0, 1.0, 1.0], [0.5, 0.9, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0, 1.0]],
        "copy_tiny-tldr": [[0.5, 1.0, 1.0, 1.0, 1.0], [0.5, 0.9, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0, 1.0]],
        "slow_tiny-tldr": [[0.5, 0.6, 0.7, 1.0, 1.0], [0.5, 0.6, 0.8, 1.0, 1.0], [0.5, 0.5, 0.7, 1.0, 1.0]],
    }
    return [
        _write_run(root, f"{group}__{seed}", values)
        for group, seeds in curves.items()
        for seed, values in enumerate(seeds, start=1)
    ]


def test_the_table_ranks_by_sample_efficiency_and_says_what_separates(tmp_path):
    """Issue 49 item 5: next to the final value, the AUC and the episodes to a threshold with their intervals, and
    which groups separate (non-overlapping 95% intervals over 3 seeds) and which do not. Here the final values tie at
    1.0: only sample efficiency tells fast from slow, and nothing tells fast from its copy."""
    out = tmp_path / "cmp"
    assert compare.main([str(p) for p in _three_groups(tmp_path / "runs")] + ["--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    runs = [curves.read_run(p) for p in sorted((tmp_path / "runs").iterdir())]
    table = {t["group"]: t for t in curves.summarize(runs, "eval/gold_reward")}
    # by hand: trapezoids of 100 episodes over 0-400, e.g. fast seed 2: (0.7 + 0.95 + 1 + 1) / 4
    assert table["fast_tiny-tldr"]["auc"] == pytest.approx([0.9375, 0.9125, 0.9375])
    assert table["slow_tiny-tldr"]["auc"] == pytest.approx([0.7625, 0.7875, 0.7375])
    # threshold: 90% of the way from the start (0.5) to the best group's peak (1.0)
    assert table["fast_tiny-tldr"]["threshold"] == pytest.approx(0.95) and table["fast_tiny-tldr"]["span"] == (0, 400)
    assert table["fast_tiny-tldr"]["reach"] == [100, 200, 100] and table["slow_tiny-tldr"]["reach"] == [300] * 3
    assert "| AUC | episodes to 0.950 |" in md.splitlines()[0]
    assert "| fast_tiny-tldr | 3 | 1.000 | [1.000, 1.000] | 1.000 | 0.929 [0.912, 0.938] | 133 [100, 200] |" in md
    assert "| slow_tiny-tldr | 3 | 1.000 | [1.000, 1.000] | 1.000 | 0.762 [" in md and "| 300 [300, 300] |" in md
    assert "Ranking by AUC (mean over seeds): copy_tiny-tldr 0.929 = fast_tiny-tldr 0.929 > slow_tiny-tldr" in md
    separated = next(line for line in md.splitlines() if line.startswith("Separated"))
    assert "AUC: fast_tiny-tldr > slow_tiny-tldr" in separated and "AUC: copy_tiny-tldr > slow_tiny-tldr" in separated
    assert "episodes to threshold: fast_tiny-tldr > slow_tiny-tldr" in separated  # fewer episodes ranks first
    assert "final" not in separated and "copy_tiny-tldr > fast" not in separated
    apart = next(line for line in md.splitlines() if line.startswith("Not separated"))
    assert "final eval/gold_reward: copy_tiny-tldr ~ fast_tiny-tldr" in apart and "AUC: copy_tiny-tldr ~ fast" in apart
    assert "final eval/gold_reward: fast_tiny-tldr ~ slow_tiny-tldr" in apart


def test_fewer_than_3_seeds_are_not_tested_and_a_seed_that_never_reaches_is_counted(tmp_path):
    _write_run(tmp_path, "a_tiny-tldr__1", [0.5, 1.0, 1.0])
    _write_run(tmp_path, "a_tiny-tldr__2", [0.5, 0.6, 0.7])
    _write_run(tmp_path, "b_tiny-tldr__1", [0.5, 0.5, 0.5])
    runs = [curves.read_run(p) for p in sorted(tmp_path.iterdir())]
    table = curves.summarize(runs, "eval/gold_reward", threshold=0.9)
    md = curves.markdown_table(table, "eval/gold_reward")
    assert "| 1 of 2 seeds reached it (mean 100) |" in md and "| 0 of 1 seeds reached it |" in md
    assert "Separated (non-overlapping 95% intervals over 3 or more seeds): none." in md
    assert "Not tested (fewer than 3 seeds, so no 95% interval): a_tiny-tldr (2 seeds), b_tiny-tldr (1 seed)." in md


def test_the_bootstrap_is_determined_by_its_seed():
    values = np.array([0.1, 0.4, 0.35, 0.9, 0.6])
    assert curves.bootstrap_ci(values) == curves.bootstrap_ci(values, seed=0) == curves.bootstrap_ci(values.copy())
    assert curves.bootstrap_ci(values, seed=1) != curves.bootstrap_ci(values, seed=0)
    lo, hi = curves.bootstrap_ci(values)
    assert values.min() < lo < values.mean() < hi < values.max()
    # the table's intervals too: two runs of the comparison print the same numbers
    table = [{"group": "a", "values": [0.1, 0.4, 0.35], "auc": [], "reach": []}]
    table.append({"group": "b", "values": [0.9, 0.6, 0.7], "auc": [], "reach": []})
    assert curves.separation_lines(table, "m") == curves.separation_lines(table, "m")


def test_one_colour_per_group_in_every_figure_of_a_command(tmp_path, monkeypatch):
    """Issue 49 item 5: results draws several figures; an algorithm keeps its colour in each, and groups by its full
    name (rloo and rloo_batchmean are two algorithms, not one `rloo`)."""
    for track, metric in (("tiny-tldr", "eval/gold_reward"), ("tiny-math", "eval/accuracy")):
        for algo, end in (("rloo", 0.9), ("rloo_batchmean", 0.8), ("ppo", 0.7)):
            rows = [{"step": i, "episode": 64 * i, "time": 1.0 + i, metric: v} for i, v in enumerate([0.3, end])]
            _write_rows(tmp_path, f"{algo}_{track}__1", rows)
    drawn = []
    monkeypatch.setattr(
        results, "plot", lambda runs, m, png, title, train, colours, key: drawn.append((runs, colours, key))
    )
    assert results.main(["--runs-dir", str(tmp_path)]) == 0
    md = (tmp_path / "results_tiny-tldr.md").read_text()
    assert "| rloo | 1 | 0.900 |" in md and "| rloo_batchmean | 1 | 0.800 |" in md
    colour = {}
    for runs, colours, key in drawn:
        for r in runs:
            assert colour.setdefault(key(r.group), colours[key(r.group)]) == colours[key(r.group)]
    assert len(drawn) == 2 and drawn[0][1] is drawn[1][1]
    assert len(set(colour.values())) == 3 == len(colour)  # rloo, rloo_batchmean, ppo: three colours, each everywhere
    assert curves.algorithm_of("rloo_batchmean_tiny-tldr") == "rloo_batchmean"
    assert curves.algorithm_of("ppo_tiny-tldr (runs/my_dir)") == "ppo (runs/my_dir)"


def test_results_of_a_runs_dir_that_does_not_exist_is_one_error_line(tmp_path, capsys):
    """Issue 51 item 12: a misspelt --runs-dir tabulated nothing and exited 0."""
    with pytest.raises(SystemExit) as e:
        results.main(["--runs-dir", str(tmp_path / "nowhere")])
    assert (
        e.value.code
        == f"error: --runs-dir {tmp_path / 'nowhere'} does not exist; pass the directory that holds the runs"
    )
    assert not (tmp_path / "nowhere").exists(), "nothing is written there"


def test_warnings_name_only_what_changes_a_number_and_a_dotted_out_keeps_its_name(tmp_path, capsys):
    """Issue 58 item 7: a fork compared with the library's runs warned "uncommitted changes (False / True)" and the
    versions of deepspeed / trl, which no training of these runs used; `--out runs/rloo.lr1e-5` wrote rloo.png."""

    def record(run: Path, dirty: bool, trl: str, torch: str = "2.13.0") -> None:
        started = {
            "git": {"commit": "aaa", "dirty": dirty},
            "versions": {"torch": torch, "transformers": "5.24.0", "trl": trl, "deepspeed": trl},
            "host": {"cpu": "AMD EPYC", "cores": 2, "gpus": [], "python": "3.11.7"},
        }
        (run / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))

    a, b = _write_run(tmp_path, "ppo_tiny-tldr__1", [0.1, 0.5]), _write_run(tmp_path, "fork_tiny-tldr__1", [0.1, 0.5])
    record(a, False, "1.16")
    record(b, True, "1.17")
    out = tmp_path / "cmp" / "rloo.lr1e-5"
    assert compare.main([str(a), str(b), "--out", str(out)]) == 0
    assert "differ" not in capsys.readouterr().err
    assert (tmp_path / "cmp" / "rloo.lr1e-5.md").exists() and (tmp_path / "cmp" / "rloo.lr1e-5.png").exists()
    record(b, True, "1.17", torch="2.12.0")
    assert compare.main([str(a), str(b), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "the runs differ in torch (2.12.0: 1 run(s); 2.13.0: 1 run(s))" in err and "trl" not in err
    assert curves.outputs(Path("x/y.md")) == (Path("x/y.png"), Path("x/y.md"))
    # the wall-clock panel says when its seconds come from two machines
    runs = [curves.read_run(a), curves.read_run(b)]
    assert curves.hosts_of(runs) == 1
    started = json.loads((b / "provenance.json").read_text())
    started["started"]["host"]["cpu"] = "Intel Xeon"
    (b / "provenance.json").write_text(json.dumps(started))
    assert curves.hosts_of([curves.read_run(a), curves.read_run(b)]) == 2


def test_an_exact_tie_prints_as_a_tie():
    table = [
        {"group": g, "values": [0.5, 0.6, 0.7], "auc": auc, "reach": [None]}
        for g, auc in (("a", [0.4, 0.5, 0.6]), ("b", [0.4, 0.5, 0.6]), ("c", [0.1, 0.2, 0.3]))
    ]
    assert (
        curves.separation_lines(table, "eval/x")[0] == "Ranking by AUC (mean over seeds): a 0.500 = b 0.500 > c 0.200."
    )


def test_no_threshold_is_printed_when_no_group_rises_above_its_start(tmp_path):
    """Issue 58 item 4: PPO's study on tiny-math, where no run learns, reported "episodes to 0.175: 0 [0, 0]"."""
    runs = []
    for g in ("ppo", "ppo_fork"):
        for seed in (1, 2, 3):
            runs.append(
                curves.read_run(_write_run(tmp_path, f"{g}_tiny-math__{seed}", [0.175, 0.16, 0.15 + seed / 100]))
            )
    table = curves.summarize(runs, "eval/gold_reward")
    assert all(t["threshold"] is None and t["reach"] == [] and len(t["auc"]) == 3 for t in table)
    md = curves.markdown_table(table, "eval/gold_reward")
    assert "episodes to" not in md.splitlines()[0] and "| AUC |" in md.splitlines()[0]
    assert "No group rises above the runs' mean start, so there is no threshold to reach" in md
    assert not [line for line in md.splitlines() if "episodes to threshold" in line and ">" in line]


def test_the_table_states_the_smallest_difference_its_seeds_can_separate():
    """Issue 57 item 5: "not separated" reads as "no difference larger than X" with X from the observed spread."""
    table = [
        {"group": "a", "values": [0.5, 0.6, 0.7], "auc": [0.40, 0.42, 0.44], "reach": [None]},
        {"group": "b", "values": [0.55, 0.6, 0.65], "auc": [0.41, 0.42, 0.43], "reach": [None]},
        {"group": "c", "values": [0.6], "auc": [0.4], "reach": [None]},  # one seed: no interval, left out
    ]
    widths = {
        k: [np.subtract(*curves.bootstrap_ci(np.array(t[k]))[::-1]) for t in table[:2]] for k in ("values", "auc")
    }
    line = curves.separation_lines(table, "eval/x")[3]
    assert line == (
        "Smallest difference these seeds can separate (half the sum of two groups' 95% interval widths, the widest "
        f"pair): final eval/x {sum(widths['values']) / 2:.3f}, AUC {sum(widths['auc']) / 2:.3f}."
    )
    assert sum(widths["values"]) / 2 > 0.1 > sum(widths["auc"]) / 2


def test_results_refuses_an_unknown_track_and_an_out_dir_that_is_a_file(tmp_path, capsys):
    """Issue 67 item 5: `--tracks` with an unknown name was a KeyError traceback, `--out-dir` naming a file a
    FileExistsError one after the tables were read; each is now one error line before any table is drawn."""
    with pytest.raises(SystemExit):
        results.main(["--reference", "--tracks", "tiny-nope"])
    assert "argument --tracks: invalid choice: 'tiny-nope'" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=r"^error: --out-dir .*afile is a file, not a folder for the tables"):
        results.main(["--reference", "--out-dir", str(tmp_path / "afile")])
