"""benchmark.reproduce (issue 57): a user's runs against the band of the library's shipped runs of the same command;
it must be able to fail (a run of a changed script is outside), and bad input is one `error:` line."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmark import reference, reproduce
from benchmark.suites import CHECK_STAGES, MAIN_FRONTIER_STAGES, QUICK_STAGES, SUITES


def _run(runs: Path, name: str, values: list[float], argv: list[str] | None = None) -> Path:
    d = runs / name
    d.mkdir(parents=True)
    rows = [{"step": i, "episode": 64 * i, "time": i, "eval/accuracy": v} for i, v in enumerate(values)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seed = name.rsplit("__", 1)[1]
    argv = argv or ["tiny", "--run-name", name, "--seed", seed, "--total-steps", "20"]
    (d / "done.json").write_text(json.dumps({"argv": argv}))
    return d


def _shipped(tmp_path: Path) -> Path:
    """Reference data of grpo_tiny-math: 6 runs (3 seeds, two regimes) ending at 0.30-0.33, built as the library's."""
    built = tmp_path / "built"
    finals = [0.30, 0.31, 0.32, 0.33, 0.31, 0.32]
    for i, final in enumerate(finals, start=1):
        _run(built, f"grpo_tiny-math__{i}", [0.16, 0.2, 0.25, final])
    data = tmp_path / "data"
    data.mkdir()
    reference.build(built, data)
    return data


def test_a_run_inside_the_band_reproduces_and_a_changed_one_differs(tmp_path, capsys):
    data = _shipped(tmp_path)
    runs = tmp_path / "runs"
    _run(runs, "grpo_tiny-math__1", [0.16, 0.21, 0.26, 0.315])
    assert reproduce.main([str(runs), "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grpo_tiny-math__1: ok: early: cannot apply (the run has no provenance.json")
    assert (
        "eval/accuracy final 0.315 in [0.2" in out[0] and "curve 0." in out[0] and "(4 distinct shipped runs)" in out[0]
    )
    assert out[-1] == "reproduces the library: yes (1 runs: 0 early checks and 1 end results passed)"
    # a changed script (e.g. a learning rate x10) that collapses: its final and its curve are outside
    _run(runs, "grpo_tiny-math__2", [0.16, 0.05, 0.02, 0.0])
    assert reproduce.main([str(runs), "--data", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("grpo_tiny-math__2: differs: ") and "eval/accuracy final 0.000 OUTSIDE [" in out[1]
    assert "curve 0.0" in out[1] and "gain -0.160 BELOW" in out[1]
    assert out[-1] == "reproduces the library: no, these runs differ: grpo_tiny-math__2"
    # the same final value, reached later: only the curve tells
    (runs / "grpo_tiny-math__2" / "metrics.jsonl").unlink()
    (runs / "grpo_tiny-math__2" / "done.json").unlink()
    (runs / "grpo_tiny-math__2").rmdir()
    _run(runs, "grpo_tiny-math__2", [0.16, 0.14, 0.14, 0.31])
    assert reproduce.main([str(runs), "--data", str(data)]) == 1
    line = capsys.readouterr().out.splitlines()[1]
    assert "final 0.310 in [" in line and "curve 0.17" in line and "OUTSIDE" in line and "gain +0.150 >=" in line


def test_a_band_needs_three_shipped_runs_of_the_same_command(tmp_path, capsys):
    data = _shipped(tmp_path)
    runs = tmp_path / "runs"
    _run(runs, "grpo_tiny-math__1", [0.16, 0.2, 0.25, 0.31], ["tiny", "--run-name", "x", "--total-steps", "40"])
    assert reproduce.main([str(runs), "--data", str(data)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0] == "grpo_tiny-math__1: not judged: 0 shipped seed(s) of its command (6 of another command), fewer than 3"
    )
    assert out[-1] == "reproduces the library: unknown (no check could judge any run)"


def test_each_seeds_own_start_is_the_same_command():
    """The suites point seed s > 1 at its own SFT policy and reward model (`suites.starts`); seed 1 names none (the
    presets' paths) and a reward model names its seed's SFT policy: one command (seen on the shipped main job: every RL
    group matched 2 of its 6 runs before). A seed pointed at another seed's start is another experiment."""
    own = ["tiny-tldr", "--run-name", "rloo_tiny-tldr__2", "--seed", "2", "--total-episodes", "1024"]
    own += ["--sft-model-path", "runs/sft_tiny-tldr__2/model", "--reward-model-path", "runs/rm_tiny-tldr__2/model"]
    first = ["tiny-tldr", "--run-name", "rloo_tiny-tldr__1", "--seed", "1", "--total-episodes", "1024"]
    assert reference.budget(own) == reference.budget(first) == ["tiny-tldr", "--total-episodes", "1024"]
    shared = [*first[:2], "rloo_tiny-tldr__2", "--seed", "2", "--sft-model-path", "runs/sft_tiny-tldr__1/model"]
    assert reference.budget(shared) != reference.budget(first)
    rm = [["tiny-tldr", "--run-name", f"rm_tiny-tldr__{s}", "--sft-model-path", f"runs/sft_tiny-tldr__{s}/model"]
          for s in (1, 3)]  # fmt: skip
    assert reference.budget(rm[0]) == reference.budget(rm[1]) == ["tiny-tldr"]
    # a track's own models of the seed (a teacher, a process reward model), which seed 1 names too: one command
    distill = [["tiny", "--run-name", f"grpo_math_tiny-math-distill-study__{s}", "--seed", str(s)] for s in (1, 2)]
    distill[1] += ["--model-name-or-path", "runs/sft_tiny-math__2/model"]
    for s, argv in zip((1, 2), distill):
        argv += ["--advantage-estimator", "distill", "--teacher-model-path", f"runs/teacher_tiny-math__{s}/model"]
    assert reference.budget(distill[0]) == reference.budget(distill[1]) == ["tiny", "--advantage-estimator", "distill"]
    other = [*distill[1][:-1], "runs/teacher_tiny-math__1/model"]  # seed 2 taught by seed 1's teacher: another one
    assert reference.budget(other) != reference.budget(distill[1])


def test_the_prediction_band_covers_one_more_run_and_has_a_floor():
    low, high = reproduce.prediction_band([0.30, 0.35, 0.40])  # mean 0.35, sd 0.05, t(0.975, 2) 4.303
    assert high - 0.35 == pytest.approx(4.303 * 0.05 * (1 + 1 / 3) ** 0.5) and 0.35 - low == pytest.approx(high - 0.35)
    assert reproduce.prediction_band([1.0, 1.0, 1.0]) == (1.0 - reproduce.TOLERANCE, 1.0 + reproduce.TOLERANCE)
    # two regimes of each of two seeds: n and the degrees of freedom are the seeds'
    low, high = reproduce.prediction_band([0.30, 0.31, 0.40, 0.41], seeds=2)
    sd = float(np.std([0.30, 0.31, 0.40, 0.41], ddof=1))
    assert high - 0.355 == pytest.approx(12.706 * sd * 1.5**0.5)
    assert reproduce.lower_bound([0.30, 0.35, 0.40]) == pytest.approx(0.35 - 2.920 * 0.05 * (1 + 1 / 3) ** 0.5)


@pytest.mark.parametrize("case", ["no-folder", "no-finished-run", "no-shipped-group", "damaged"])
def test_bad_input_is_one_error_line(tmp_path, case):
    data = _shipped(tmp_path)
    runs = tmp_path / "runs"
    if case == "no-finished-run":
        (runs / "x__1").mkdir(parents=True)
    if case == "no-shipped-group":
        _run(runs, "mine_tiny-math__1", [0.1, 0.2])
    if case == "damaged":
        _run(runs, "grpo_tiny-math__1", [0.1, 0.2])
        (data / "grpo_tiny-math.jsonl.gz").write_bytes(gzip.compress(b"{not json")[:-4])
    with pytest.raises(SystemExit) as e:
        reproduce.main([str(runs), "--data", str(data)])
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    expect = {
        "no-folder": f"{runs} is not a folder of runs",
        "no-finished-run": f"{runs} holds no finished run",
        "no-shipped-group": f"no run of {runs} is of a shipped group (shipped: grpo_tiny-math",
        "damaged": f"{data / 'grpo_tiny-math.jsonl.gz'} is damaged (",
    }[case]
    assert expect in message, message


def test_the_main_job_ends_with_the_verdict(tmp_path, monkeypatch, capsys):
    """`python -m benchmark.run quick` prints reproduce's lines and verdict after its summary (its exit code is the
    suite's)."""
    import sys

    from benchmark import run

    data = _shipped(tmp_path)
    monkeypatch.setattr(reference, "DIR", data)
    _run(tmp_path / "runs", "grpo_tiny-math__1", [0.16, 0.21, 0.26, 0.315])
    monkeypatch.setattr(run, "run_suite", lambda *a, **k: {"grpo_tiny-math__1": "skipped"})
    monkeypatch.setattr(sys, "argv", ["run", "quick", "--seeds", "1", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        run.main()
    assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == [
        "# python -m benchmark.reproduce",
        out[-2],
        "reproduces the library: yes (1 runs: 0 early checks and 1 end results passed)",
    ] and out[-2].startswith("grpo_tiny-math__1: ok:")


def test_the_two_rounding_regimes_ship_side_by_side_and_make_one_band(tmp_path, capsys):
    """Issue 57 item 4: seed 1 under the machine's kernels and seed 1 under `--rounding default` have one run name;
    the reference keeps both (keyed by name and regime), lists both, and reproduce pools them into one band."""
    data = tmp_path / "data"
    for regime, finals in (("native", [0.30, 0.31, 0.32]), ("default", [0.33, 0.34, 0.35])):
        built = tmp_path / regime
        for seed, final in enumerate(finals, start=1):
            run = _run(built, f"grpo_tiny-math__{seed}", [0.16, 0.2, 0.25, final])
            env = {} if regime == "native" else {"ATEN_CPU_CAPABILITY": "default"}
            started = {"host": {"numerics_env": env}, "git": {"commit": "c"}}
            (run / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))
        reference.build(built, data)
    records = reference.read_group(data / "grpo_tiny-math.jsonl.gz")
    assert sorted(reference.key(r) for r in records) == sorted(
        (f"grpo_tiny-math__{s}", g, False) for s in (1, 2, 3) for g in ("native", "default")
    )
    assert reference.main(["list", "--data", str(data)]) == 0
    assert "| grpo | tiny-math | 1, 1 (default), 2, 2 (default), 3, 3 (default) |" in capsys.readouterr().out
    runs = tmp_path / "runs"
    _run(runs, "grpo_tiny-math__1", [0.16, 0.21, 0.26, 0.345])
    assert reproduce.main([str(runs), "--data", str(data)]) == 0
    assert "(6 distinct shipped runs)" in capsys.readouterr().out


# ---- issue 66: the early check, distinct runs, bands that can tell, the gain, each seed left out ----

VERSIONS = {"torch": "2.13.0+cpu", "transformers": "5.24.0"}
SEEDS_LOSS = {1: 0.50, 2: 0.60, 3: 0.70}  # each seed's loss at update 1


def _early_run(
    root: Path,
    name: str,
    regime: str = "native",
    change: dict | None = None,
    threads: int = 1,
    versions: dict | None = None,
    gpus: list | None = None,
    done: bool = True,
    updates: int = 5,
    blas: str = "mkl",
    accuracy: list[float] = (0.15, 0.3, 0.45),
) -> Path:
    """A GRPO run of the main job's command: 5 training rows (a loss, a KL, the learning rate, a speed), each seed
    its own numbers, the two regimes 1e-7 apart until update 4, where they part; evaluations from 0.15 up.
    `change`: {(update, key): value}, a script that computes something else there."""
    d = root / name
    d.mkdir(parents=True)
    seed = int(name.rsplit("__", 1)[1])
    gap = 0.0 if regime == "native" else 1e-7
    rows = []
    for u in range(1, updates + 1):
        part = 0.5 if u >= 4 and regime != "native" else gap
        row = {"step": u, "episode": 64 * u, "time": 3.0 * u, "loss/policy": SEEDS_LOSS[seed] / u + part}
        row |= {"objective/kl": 0.01 * (u - 1) * seed + part, "lr": 1e-6 * u, "perf/episodes_per_sec": 10 + u + gap}
        row["loss/mean"] = (1 if regime == "native" else -1) * 1e-6 * seed  # 0 but for rounding: its sign too
        for (at, key), value in (change or {}).items():
            if at == u:
                row[key] = value
        rows.append(row)
        if u <= len(accuracy):
            rows.append(
                {"step": u, "episode": 64 * u, "time": 3.0 * u, "eval/accuracy": accuracy[u - 1] + (seed - 1) % 3 / 100}
            )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["tiny", "--run-name", name, "--seed", str(seed), "--total-steps", "20"]
    env = {} if regime == "native" else {"ATEN_CPU_CAPABILITY": "default"}
    host = {"threads": threads, "gpus": gpus or [], "numerics_env": env, "blas": blas}
    started = {"versions": versions or VERSIONS, "host": host, "argv": argv}
    (d / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))
    if done:
        (d / "done.json").write_text(json.dumps({"argv": argv}))
    return d


def _early_shipped(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    for regime in ("native", "default"):
        for seed in (1, 2, 3):
            _early_run(tmp_path / regime, f"grpo_tiny-math__{seed}", regime)
        reference.build(tmp_path / regime, data)
    return data


def _line(runs: Path, data: Path, capsys) -> tuple[int, list[str]]:
    code = reproduce.main([str(runs), "--data", str(data)])
    return code, capsys.readouterr().out.splitlines()


def test_the_early_check_passes_an_honest_run_and_names_the_first_update_and_statistic_that_differs(tmp_path, capsys):
    """The window is the updates where every seed's two regimes agree (3: they part at update 4); within it a run of
    the same seed passes whatever its speed, and a change far below the end result's resolution differs, named."""
    data = _early_shipped(tmp_path)
    runs = tmp_path / "runs"
    _early_run(runs, "grpo_tiny-math__2", "native")
    code, out = _line(runs, data, capsys)
    assert code == 0 and out[0].startswith("grpo_tiny-math__2: ok: early: 3 updates within tolerance; eval/accuracy")
    assert out[-1] == "reproduces the library: yes (1 runs: 1 early checks and 1 end results passed)"
    # the second regime's numbers (1e-7 off) pass; a loss 1e-4 off at update 2 does not, though its end result does
    _early_run(runs, "grpo_tiny-math__3", "default", change={(2, "loss/policy"): 0.35 + 1e-4})
    code, out = _line(runs, data, capsys)
    assert code == 1 and out[1].startswith(
        "grpo_tiny-math__3: differs: early: differs at update 2 (step 2): loss/policy 0.3501 vs 0.35 / 0.35 "
        "[tolerance 5.5e-06]; eval/accuracy final 0.470 in ["
    ), out[1]
    assert out[-1] == "reproduces the library: no, these runs differ: grpo_tiny-math__3"
    # a statistic the run no longer logs, and another count of episodes per update
    for change, said in (
        ({(1, "objective/kl"): None}, "differs at update 1 (step 1): it logs no objective/kl"),
        ({(3, "episode"): 180}, "differs at update 3 (step 3): its episode 180 vs 192"),
        ({(3, "lr"): 3e-6 * 3}, "differs at update 3 (step 3): lr 9e-06 vs 3e-06 / 3e-06"),
    ):
        shutil.rmtree(runs / "grpo_tiny-math__3")
        _early_run(runs, "grpo_tiny-math__3", change=change)
        if None in change.values():
            path = runs / "grpo_tiny-math__3" / "metrics.jsonl"
            path.write_text(path.read_text().replace('"objective/kl": null, ', ""))
        code, out = _line(runs, data, capsys)
        assert code == 1 and said in out[1], out[1]
    # after the window (update 4, where the regimes part) nothing is compared
    shutil.rmtree(runs / "grpo_tiny-math__3")
    _early_run(runs, "grpo_tiny-math__3", change={(4, "loss/policy"): 9.0})
    assert _line(runs, data, capsys)[0] == 0


@pytest.mark.parametrize(
    "case, said",
    [
        ("torch", "early: cannot apply (torch 2.12.0 here, 2.13.0+cpu in the references)"),
        ("threads", "early: cannot apply (4 threads here; the tolerance is checked at 1, 2 (--num-threads))"),
        ("gpu", "early: cannot apply (the run was made on a GPU; the references on a CPU)"),
        ("blas", "early: cannot apply (matrix products by open here, by mkl in the references)"),
        ("seed", "early: cannot apply (the reference holds no run of seed 7)"),
        ("no-provenance", "early: cannot apply (the run has no provenance.json"),
    ],
)
def test_the_early_check_says_what_it_cannot_check(tmp_path, capsys, case, said):
    """Another torch, another BLAS, another thread count, a GPU, a seed the reference lacks: the early check says why
    it cannot apply (never a false "differs"), and the end result alone judges."""
    data = _early_shipped(tmp_path)
    runs = tmp_path / "runs"
    name = "grpo_tiny-math__7" if case == "seed" else "grpo_tiny-math__1"
    SEEDS_LOSS[7] = 0.9
    kwargs = {
        "torch": {"versions": {**VERSIONS, "torch": "2.12.0"}},
        "threads": {"threads": 4},
        "gpu": {"gpus": ["NVIDIA H200"]},
        "blas": {"blas": "open"},  # OpenBLAS (torch's aarch64 wheels): its own rounding, not measured
    }.get(case, {})
    run = _early_run(runs, name, change={(1, "loss/policy"): 5.0}, **kwargs)  # would differ, if it were checked
    if case == "no-provenance":
        (run / "provenance.json").unlink()
    code, out = _line(runs, data, capsys)
    assert code == 0 and said in out[0] and "eval/accuracy final" in out[0], out[0]
    assert out[-1] == "reproduces the library: yes (1 runs: 0 early checks and 1 end results passed)"


def test_a_check_run_is_judged_by_its_first_updates_alone(tmp_path, capsys):
    """GRPO from the shipped start (suites.CHECK_STAGES): its early check decides; its end result (16 problems, steps
    of 1/16) is not judged, so where the early check cannot apply it says it cannot tell, never "differs"."""
    name = "grpo-fixed-start_tiny-math"
    assert name in CHECK_STAGES
    data = tmp_path / "data"
    for regime in ("native", "default"):
        for seed in (1, 2, 3):
            _early_run(tmp_path / regime, f"{name}__{seed}", regime)
        reference.build(tmp_path / regime, data)
    runs = tmp_path / "runs"
    _early_run(runs, f"{name}__1", accuracy=(0.15, 0.9, 0.95))  # far above the band: not judged
    code, out = _line(runs, data, capsys)
    assert code == 0 and out[0] == (
        f"{name}__1: ok: early: 3 updates within tolerance; end: a check run, judged by its first updates alone "
        "(6 distinct shipped runs)"
    ), out[0]
    shutil.rmtree(runs / f"{name}__1")
    _early_run(runs, f"{name}__1", change={(2, "loss/policy"): 0.3})
    assert _line(runs, data, capsys)[0] == 1
    shutil.rmtree(runs / f"{name}__1")
    _early_run(runs, f"{name}__1", versions={**VERSIONS, "torch": "2.12.0"}, accuracy=(0.15, 0.9, 0.95))
    code, out = _line(runs, data, capsys)
    assert code == 2 and out[0].startswith(f"{name}__1: cannot tell: early: cannot apply (torch 2.12.0"), out[0]
    assert reproduce.check_references(data) == ([], 0)  # nor is it left out of its own band


def test_an_unfinished_run_gets_the_early_check_alone(tmp_path, capsys):
    """A run stopped after two updates (no done.json): its command from provenance.json, its two updates checked,
    its end result not judged, and it is incomplete, not "ok"; a planted change in them still differs."""
    data = _early_shipped(tmp_path)
    runs = tmp_path / "runs"
    _early_run(runs, "grpo_tiny-math__1", done=False, updates=2)
    code, out = _line(runs, data, capsys)
    assert code == 2 and out[0] == (  # it stopped before the window it is judged on: never "ok" (issue 67)
        "grpo_tiny-math__1: incomplete, not judged: early: incomplete, 2 of 3 updates logged and within tolerance "
        "(unfinished); end: unfinished (no done.json), not judged (6 distinct shipped runs)"
    )
    assert out[-1] == "reproduces the library: unknown (no check could judge any run; incomplete, not judged: " + (
        "grpo_tiny-math__1)"
    )
    shutil.rmtree(runs / "grpo_tiny-math__1")
    _early_run(runs, "grpo_tiny-math__1", done=False, updates=2, change={(2, "objective/kl"): 0.02})
    code, out = _line(runs, data, capsys)
    assert code == 1 and "early: differs at update 2 (step 2): objective/kl 0.02 vs 0.0100001 / 0.01" in out[0]


def test_the_window_ends_where_the_regimes_part_and_needs_two_regimes(tmp_path):
    records = [
        {"name": f"x__{s}", "rows": [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]}
        for s in (1, 2)
        for r in (_early_run(tmp_path / "n", f"x__{s}"), _early_run(tmp_path / "d", f"x__{s}", "default"))
    ]
    window, why = reproduce.early_tolerances(records)
    assert len(window) == 3 and not why
    # the tolerance: MARGIN x the regimes' largest gap at that update, plus the floor
    assert window[0]["loss/policy"] == pytest.approx(10 * 1e-7 + 1e-5 * 0.6 + 1e-6)
    assert "perf/episodes_per_sec" not in window[0] and "time" not in window[0]
    # a statistic 0 but for rounding parts at the first update: held to 10 x its gap, it does not end the window
    assert window[2]["loss/mean"] == pytest.approx(10 * 4e-6 + 1e-5 * 2e-6 + 1e-6)
    assert reproduce.early_tolerances([r for r in records if r["name"] == "x__1"][:1]) == (
        [],
        "no seed is shipped under two rounding regimes, so no tolerance is measured",
    )


def test_identical_runs_of_two_regimes_count_once(tmp_path, capsys):
    """Two regimes that gave one curve are one run: the band is drawn from the distinct runs (n = 3, not 6)."""
    data = tmp_path / "data"
    for regime in ("native", "default"):
        for seed, final in ((1, 0.30), (2, 0.32), (3, 0.34)):
            run = _run(tmp_path / regime, f"grpo_tiny-math__{seed}", [0.16, 0.2, 0.25, final])
            env = {} if regime == "native" else {"ATEN_CPU_CAPABILITY": "default"}
            started = {"host": {"numerics_env": env}, "git": {"commit": "c"}}
            (run / "provenance.json").write_text(json.dumps({"started": started, "resumed": []}))
        reference.build(tmp_path / regime, data)
    assert len(reference.read_group(data / "grpo_tiny-math.jsonl.gz")) == 6
    runs = tmp_path / "runs"
    _run(runs, "grpo_tiny-math__1", [0.16, 0.21, 0.26, 0.32])
    code, out = _line(runs, data, capsys)
    band = reproduce.prediction_band([0.30, 0.32, 0.34])  # t(0.975, 2), not t(0.975, 5) of six
    assert code == 0 and f"final 0.320 in [{band[0]:.3f}, {band[1]:.3f}]" in out[0] and "(3 distinct" in out[0]


def test_a_band_that_holds_the_start_cannot_tell_and_the_peak_and_gain_judge(tmp_path, capsys):
    """PPO without a KL penalty: it passes its gold peak, then falls anywhere; its final band holds its start and
    covers [0, 1] (`cannot tell`, never `ok`), while its peak still judges. A run that never learns is caught by the
    peak and by its gain; a group that does not learn judges no gain."""
    shape = {1: [0.67, 0.9, 0.96, 0.2], 2: [0.67, 0.92, 0.95, 0.9], 3: [0.67, 0.88, 0.97, 0.5]}
    for seed, values in shape.items():
        _run(tmp_path / "built", f"ppo-kl0_tiny-tldr-noisy__{seed}", values, ["x", "--run-name", "r", "--seed", "1"])
    data = tmp_path / "data"
    reference.build(tmp_path / "built", data)
    runs = tmp_path / "runs"
    _run(runs, "ppo-kl0_tiny-tldr-noisy__1", [0.67, 0.91, 0.96, 0.4], ["x", "--run-name", "r", "--seed", "1"])
    code, out = _line(runs, data, capsys)
    assert code == 0 and "final 0.400: cannot tell (band [" in out[0] and "holds the start)" in out[0]
    assert "peak 0.960 in [" in out[0] and "gain -0.270: cannot tell" in out[0]
    shutil.rmtree(runs / "ppo-kl0_tiny-tldr-noisy__1")
    _run(runs, "ppo-kl0_tiny-tldr-noisy__1", [0.67, 0.68, 0.66, 0.67], ["x", "--run-name", "r", "--seed", "1"])
    code, out = _line(runs, data, capsys)
    assert code == 1 and "peak 0.680 OUTSIDE [" in out[0] and "rise +0.010 BELOW +0." in out[0]
    # only cannot-tell checks: the run is `cannot tell`, and the verdict unknown
    wide = {1: [0.1, 0.1, 0.0], 2: [0.1, 0.9, 1.0], 3: [0.1, 0.5, 0.3]}
    for seed, values in wide.items():
        _run(tmp_path / "wide", f"y_tiny-math__{seed}", values, ["x", "--run-name", "r", "--seed", "1"])
    reference.build(tmp_path / "wide", data)
    _run(tmp_path / "mine", "y_tiny-math__1", [0.1, 0.4, 0.5], ["x", "--run-name", "r", "--seed", "1"])
    code, out = _line(tmp_path / "mine", data, capsys)
    assert code == 2 and out[0].startswith("y_tiny-math__1: cannot tell: ") and "curve" in out[0]
    assert out[-1] == "reproduces the library: unknown (no check could judge any run)"


def test_each_shipped_seed_falls_inside_the_band_of_the_others(tmp_path, capsys):
    """`--check-references`: every distinct shipped run judged by its group's other seeds; an outlier is named."""
    data = _shipped(tmp_path)
    assert reproduce.main(["--check-references", "--data", str(data)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 of 4 shipped runs inside their others' bands"
    _run(tmp_path / "odd", "grpo_tiny-math__7", [0.16, 0.9, 0.95, 0.99])
    reference.build(tmp_path / "odd", data)
    assert reproduce.main(["--check-references", "--data", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grpo_tiny-math__7 (native): eval/accuracy final 0.990 OUTSIDE [") and out[-1] == (
        "4 of 5 shipped runs inside their others' bands"
    )


# Main-job groups whose end result cannot tell over 3 seeds: their early check alone judges them (issue 66 item 1)
END_BLIND = {
    # 384 pairs of offline DPO at beta 0.1, the frontier's low-KL point: 3 seeds end 0.83-1.00 from 0.67, too spread
    # for a band clear of the start with t(0.975, 2) = 4.3
    "dpo-beta0.1_tiny-tldr-noisy"
}


def test_the_shipped_main_job_judges_every_rl_group_by_something_that_excludes_its_start():
    """Issue 66 item 1: in the shipped references every group of the README's main job has an early window of at
    least 3 updates, and every RL group but END_BLIND an end check that can tell (a band clear of its start, or a
    gain or rise bound above 0): GRPO is judged by its gain, PPO without a KL penalty by its rise to the gold peak."""
    shipped = reproduce.shipped_groups(None)
    quick = {st.run_name.rsplit("__", 1)[0]: st for st in SUITES["quick"]([1])}
    main = [*QUICK_STAGES, *MAIN_FRONTIER_STAGES]
    blind, short = [], []
    for group in [*main, *sorted({need.rsplit("__", 1)[0] for g in main for need in quick[g].needs})]:
        same = [r for r in shipped[group] if reference.budget(r["argv"]) == reference.budget(quick[group].args(True))]
        runs = reproduce.distinct(same)
        window, why = reproduce.early_tolerances(same)
        if len(window) < 3:
            short.append(f"{group}: early window {len(window)} ({why})")
        if group in main:
            state, texts, _ = reproduce.end_checks(runs[0]["rows"], runs)
            if not any(" in [" in t or " >= " in t for t in texts):
                blind.append(group)
    assert not short, short
    assert sorted(blind) == sorted(END_BLIND), blind


def test_a_missing_data_folder_a_workdir_and_a_closed_pipe_each_say_so(tmp_path, capsys, monkeypatch):
    """Issue 67 item 5/7: `--data` naming a missing or empty folder blames the data, not the runs; the main job's
    working directory (its runs in runs/) gets a hint; `reproduce | head -1` ends without a traceback."""
    data = _early_shipped(tmp_path)
    work = tmp_path / "work"
    _early_run(work / "runs", "grpo_tiny-math__1")
    for missing, said in (
        (tmp_path / "nowhere", "is not a folder"),
        (tmp_path / "work", r"holds no reference data \(\*.jsonl.gz\)"),
    ):
        with pytest.raises(SystemExit, match=f"^error: --data {missing} {said}; leave --data out"):
            reproduce.main([str(work / "runs"), "--data", str(missing)])
    with pytest.raises(SystemExit, match=rf"its runs are in {work}/runs \(python -m benchmark.reproduce {work}/runs\)"):
        reproduce.main([str(work), "--data", str(data)])

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert reproduce.main([str(work / "runs"), "--data", str(data)]) == 0
