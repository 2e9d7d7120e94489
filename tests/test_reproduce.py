"""benchmark.reproduce (issue 57): a user's runs against the band of the library's shipped runs of the same command;
it must be able to fail (a run of a changed script is outside), and bad input is one `error:` line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmark import reference, reproduce


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
    assert out[0].startswith("grpo_tiny-math__1: ok: eval/accuracy final 0.315 in [0.2") and "curve 0." in out[0]
    assert out[-1] == "reproduces the library: yes (1 runs inside the shipped bands)"
    # a changed script (e.g. a learning rate x10) that collapses: its final and its curve are outside
    _run(runs, "grpo_tiny-math__2", [0.16, 0.05, 0.02, 0.0])
    assert reproduce.main([str(runs), "--data", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "grpo_tiny-math__2: differs: eval/accuracy final 0.000 OUTSIDE [" in out[1] and "curve" in out[1]
    assert out[-1] == "reproduces the library: no, these runs differ: grpo_tiny-math__2"
    # the same final value, reached later: only the curve tells
    (runs / "grpo_tiny-math__2" / "metrics.jsonl").unlink()
    (runs / "grpo_tiny-math__2" / "done.json").unlink()
    (runs / "grpo_tiny-math__2").rmdir()
    _run(runs, "grpo_tiny-math__2", [0.16, 0.16, 0.16, 0.31])
    assert reproduce.main([str(runs), "--data", str(data)]) == 1
    line = capsys.readouterr().out.splitlines()[1]
    assert "final 0.310 in [" in line and "curve 0.1" in line and "OUTSIDE" in line


def test_a_band_needs_three_shipped_runs_of_the_same_command(tmp_path, capsys):
    data = _shipped(tmp_path)
    runs = tmp_path / "runs"
    _run(runs, "grpo_tiny-math__1", [0.16, 0.2, 0.25, 0.31], ["tiny", "--run-name", "x", "--total-steps", "40"])
    assert reproduce.main([str(runs), "--data", str(data)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0] == "grpo_tiny-math__1: not judged: 0 shipped run(s) of its command (6 of another command), fewer than 3"
    )
    assert out[-1] == "reproduces the library: unknown (no run has enough shipped runs of its command)"


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


def test_the_prediction_band_covers_one_more_run_and_has_a_floor():
    low, high = reproduce.prediction_band([0.30, 0.31, 0.32])  # mean 0.31, sd 0.01, t(0.975, 2) 4.303
    assert high - 0.31 == pytest.approx(4.303 * 0.01 * (1 + 1 / 3) ** 0.5) and 0.31 - low == pytest.approx(high - 0.31)
    assert reproduce.prediction_band([1.0, 1.0, 1.0]) == (1.0 - reproduce.TOLERANCE, 1.0 + reproduce.TOLERANCE)


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
        "reproduces the library: yes (1 runs inside the shipped bands)",
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
    assert "(6 shipped runs)" in capsys.readouterr().out
