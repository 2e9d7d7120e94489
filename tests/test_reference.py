"""benchmark.reference (issue 49 item 4): the library's runs shipped as compact metrics data, read back by
benchmark.results into the same tables as the run directories, and drawn by benchmark.compare under a user's runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark import compare, reference, reproduce, results
from benchmark.study import MORE_TRACKS, STUDY
from benchmark.suites import MAIN_FRONTIER_STAGES, QUICK_STAGES, SUITES


def _run(root: Path, name: str, accuracy: list[float], done: bool = True) -> Path:
    """A tiny-math run: training rows (a kept metric, a dropped loss) between evaluations, a last row without either."""
    run = root / name
    run.mkdir(parents=True)
    rows = []
    for i, acc in enumerate(accuracy):
        rows.append({"step": i, "episode": 64 * i, "time": 1.0 + 2 * i, "eval/accuracy": acc})
        rows.append({"step": i, "episode": 64 * i + 32, "time": 2.0 + 2 * i, "objective/reward": acc, "loss/policy": 3})
    rows.append({"step": len(accuracy), "episode": 64 * len(accuracy), "time": 99.0, "loss/policy": 1})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "samples.jsonl").write_text("{}\n")
    if done:
        # a command no suite runs (`reference.suite_budgets`): these runs are of no budget of the library's
        (run / "done.json").write_text(json.dumps({"argv": ["tiny-math", "--seed", name[-1], "--eval-every", "1"]}))
    return run


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    """rloo and grpo on tiny-math, 3 seeds, built into a data directory that stands for the shipped one."""
    runs = tmp_path / "runs"
    for seed, end in ((1, 0.5), (2, 0.6), (3, 0.55)):
        _run(runs, f"rloo_tiny-math__{seed}", [0.2, 0.4, end])
        _run(runs, f"grpo_tiny-math__{seed}", [0.2, 0.3, end - 0.1])
    _run(runs, "sft_tiny-math__1", [0.2])
    _run(runs, "ppo_tiny-math__1", [0.2, 0.9], done=False)  # not finished: not shipped
    _run(runs, ".rloo_tiny-math__1.previous", [0.2, 0.1])  # a finished run an --overwrite rerun keeps: not a run
    monkeypatch.setattr(reference, "DIR", tmp_path / "data")
    return runs


def test_build_keeps_the_rows_the_tables_read_and_the_same_runs_give_the_same_bytes(
    shipped, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(reference, "EARLY_ROWS", 2)  # the first two training rows whole, for reproduce's early check
    assert reference.main(["build", str(shipped)]) == 0
    out = capsys.readouterr()
    assert "ppo_tiny-math__1 did not finish (no done.json); left out" in out.err
    data = tmp_path / "data"
    assert sorted(p.name for p in data.iterdir()) == [
        "grpo_tiny-math.jsonl.gz",
        "rloo_tiny-math.jsonl.gz",
        "sft_tiny-math.jsonl.gz",
    ]
    (first, *_) = reference.read_group(data / "rloo_tiny-math.jsonl.gz")
    assert first["name"] == "rloo_tiny-math__1" and first["argv"] == ["tiny-math", "--seed", "1", "--eval-every", "1"]
    # the first EARLY_ROWS training rows whole; then evaluations and kept training metrics with step/episode/time, the
    # loss dropped; the last row kept for its time
    assert first["rows"][:2] == [
        {"step": 0, "episode": 0, "time": 1.0, "eval/accuracy": 0.2},
        {"step": 0, "episode": 32, "time": 2.0, "objective/reward": 0.2, "loss/policy": 3},
    ]
    assert first["rows"][3]["loss/policy"] == 3 and first["rows"][5] == {
        "step": 2,
        "episode": 160,
        "time": 6.0,
        "objective/reward": 0.5,
    }
    assert first["rows"][-1] == {"step": 3, "episode": 192, "time": 99.0} and len(first["rows"]) == 7
    before = (data / "rloo_tiny-math.jsonl.gz").read_bytes()
    assert reference.main(["build", str(shipped)]) == 0
    assert (data / "rloo_tiny-math.jsonl.gz").read_bytes() == before
    # more seeds later: a directory of seed 4 adds it beside the three shipped
    _run(tmp_path / "more", "rloo_tiny-math__4", [0.2, 0.7])
    assert reference.main(["build", str(tmp_path / "more")]) == 0
    out = capsys.readouterr()
    assert "rloo_tiny-math.jsonl.gz: 1 run(s)" in out.out and "different commands" not in out.err
    # another budget in the same group is said, not silently pooled as seeds of one experiment
    other = _run(tmp_path / "other", "rloo_tiny-math__5", [0.2, 0.7])
    (other / "done.json").write_text(json.dumps({"argv": ["tiny-math", "--seed", "5", "--total-episodes", "64"]}))
    assert reference.main(["build", str(tmp_path / "other")]) == 0
    assert (
        "warning: rloo_tiny-math now holds runs of different commands (budgets): tiny-math --eval-every 1 | "
        "tiny-math --total-episodes 64" in capsys.readouterr().err
    )
    assert [r["name"][-1] for r in reference.read_group(data / "rloo_tiny-math.jsonl.gz")] == ["1", "2", "3", "4", "5"]
    assert reference.main(["list"]) == 0
    assert "| rloo | tiny-math | 1, 2, 3, 4, 5 | its own |" in capsys.readouterr().out


def test_results_from_the_reference_data_equal_results_from_the_runs(shipped, tmp_path):
    """The README's tables are built from the shipped data: the same table as from the run directories."""
    assert reference.main(["build", str(shipped)]) == 0
    from_runs, _ = results.track_table(shipped, "tiny-math")
    from_data, curves = results.track_table(reference.load(), "tiny-math")
    assert from_data == from_runs and "| rloo | 3 | 0.550 [" in from_data and "| SFT (start) | 1 SFT run |" in from_data
    assert len(curves) == 6
    assert results.main(["--reference", "--out-dir", str(tmp_path / "docs"), "--tracks", "tiny-math"]) == 0
    assert (tmp_path / "docs" / "results_tiny-math.md").read_text() == from_runs
    assert (tmp_path / "docs" / "results_tiny-math.png").stat().st_size > 10_000


def test_compare_draws_a_users_runs_over_the_reference_band(shipped, tmp_path, capsys):
    assert reference.main(["build", str(shipped)]) == 0
    mine = [_run(tmp_path / "mine", f"rloo_batchmean_tiny-math__{s}", [0.2, 0.25, 0.3]) for s in (1, 2, 3)]
    out = tmp_path / "cmp"
    args = [*map(str, mine), "--metric", "eval/accuracy", "--out", str(out)]
    assert compare.main([*args, "--reference", "rloo"]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| rloo_batchmean_tiny-math | 3 | 0.300 |" in md and "| rloo_tiny-math (reference) | 3 | 0.550 |" in md
    assert "AUC: rloo_tiny-math (reference) > rloo_batchmean_tiny-math" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    capsys.readouterr()
    # bad inputs: one error line each
    assert compare.main([*args, "--reference", "rlooo"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: --reference rlooo names no shipped algorithm or script; shipped: grpo, rloo, sft (or one group: "
        "grpo_tiny-math, rloo_tiny-math, sft_tiny-math, ...; python -m benchmark.reference list)"
    )
    assert compare.main([*map(str, mine), "--out", str(out), "--reference", "rloo_tiny-math"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: --reference rloo_tiny-math: its runs rloo_tiny-math__* log no eval/gold_reward (they log "
        "eval/accuracy): the runs and the reference share no metric"
    )
    tldr = _run(tmp_path / "tldr", "rloo_tiny-tldr__1", [0.2, 0.3])
    assert compare.main([str(tldr), "--metric", "eval/accuracy", "--out", str(out), "--reference", "rloo"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "error: --reference rloo: the reference has rloo on tiny-math; the runs given are on tiny-tldr: no shared "
            "track"
        )
    )


def test_a_studys_runs_meet_no_reference_of_another_budget(shipped, tmp_path, capsys):
    """Issue 58 item 5: a study's runs (`<track>-study`, the study's own budget) against the shipped runs of the track:
    the hint does not lead to a silent comparison across budgets (it named `--reference grpo_tiny-math`, which then
    compared 10 study steps with the main job's 20); a group named anyway is refused unless --across-tracks."""
    assert reference.main(["build", str(shipped)]) == 0
    study = [_run(tmp_path / "s", f"grpo_fork_tiny-math-study__{s}", [0.2, 0.3]) for s in (1, 2, 3)]
    args = [*map(str, study), "--metric", "eval/accuracy", "--out", str(tmp_path / "cmp")]
    capsys.readouterr()
    assert compare.main([*args, "--reference", "grpo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the runs given are on tiny-math-study: no shared track (a study's runs (tiny-math-study) have" in err
    assert "--reference grpo_tiny-math" not in err
    with pytest.raises(SystemExit, match="the runs are of different tracks .*tiny-math-study"):
        compare.main([*args, "--reference", "grpo_tiny-math"])
    assert compare.main([*args, "--reference", "grpo_tiny-math", "--across-tracks"]) == 0


def test_a_studys_references_are_found_by_the_script_family_and_the_hint_names_them(shipped, tmp_path, capsys):
    """Issue 58 item 5: shipped groups are named by the run (`grpo`, `ppo-kl0`), a study's by the script
    (`grpo_math`): `--reference grpo_math` (or grpo_math.py) takes every group grpo_math.py made on the runs' tracks,
    and `--reference grpo` for a study's runs names the group of the same script on that track."""
    provenance = {"script": {"path": "grpo_math.py", "sha256": "0" * 64, "git": "tracked"}}
    for seed in (1, 2, 3):
        _run(shipped, f"grpo_math_tiny-math-study__{seed}", [0.2, 0.25, 0.3])
    for run in shipped.glob("grpo*__*"):
        (run / "provenance.json").write_text(json.dumps({"started": provenance}))
    assert reference.main(["build", str(shipped)]) == 0
    fork = [_run(tmp_path / "s", f"grpo_fork_tiny-math-study__{s}", [0.2, 0.3]) for s in (1, 2, 3)]
    args = [*map(str, fork), "--metric", "eval/accuracy", "--out", str(tmp_path / "cmp")]
    capsys.readouterr()
    for name in ("grpo_math", "grpo_math.py"):
        assert compare.main([*args, "--reference", name]) == 0
        assert "| grpo_math_tiny-math-study (reference) | 3 |" in capsys.readouterr().out
    assert compare.main([*args, "--reference", "grpo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("no shared track (on those tracks it has grpo_math_tiny-math-study: --reference grpo_math)")
    picked = reference.runs_for(["grpo_math"], [], "eval/accuracy")  # no runs: every group of the script
    assert sorted({r.group for r in picked}) == ["grpo_math_tiny-math-study (reference)", "grpo_tiny-math (reference)"]


def test_the_second_rounding_regime_ships_under_its_own_name(shipped, tmp_path, monkeypatch):
    """A run of one name under both regimes: two records, two names when read back (one group)."""
    assert reference.main(["build", str(shipped)]) == 0
    path = tmp_path / "data" / "grpo_tiny-math.jsonl.gz"
    records = reference.read_group(path)
    second = {**records[0], "provenance": {"host": {"numerics_env": {"ATEN_CPU_CAPABILITY": "default"}}}}
    reference.write_group(path, [*records, second])
    names = sorted(r.name for r in reference.load() if r.group == "grpo_tiny-math")
    assert names == [*sorted(["grpo_tiny-math__1", "grpo_tiny-math__1 (default)", "grpo_tiny-math__2"]),
                     "grpo_tiny-math__3"]  # fmt: skip


def test_runs_that_share_no_metric_are_one_error_line(tmp_path, capsys):
    run = _run(tmp_path, "rloo_tiny-math__1", [0.2, 0.3])
    assert compare.main([str(run), "--out", str(tmp_path / "cmp")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: no finished run has the metric eval/gold_reward; they all log eval/accuracy: pass one with --metric"
    )
    other = tmp_path / "x_tiny-tldr__1"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 0, "eval/win_rate": 0.5}) + "\n")
    (other / "done.json").write_text("{}")
    assert compare.main([str(run), str(other), "--metric", "eval/score", "--out", str(tmp_path / "cmp")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: no finished run has the metric eval/score; they share no evaluation metric"
    )


def _suite_run(root: Path, name: str, accuracy: list[float], quick: bool) -> Path:
    """A run of the tiny-math suite with the command `benchmark.run` gives it: `--quick` (the main job) or full."""
    seed = int(name.rsplit("__", 1)[1])
    (stage,) = [st for st in SUITES["tiny-math"]([seed]) if st.run_name == name]
    run = _run(root, name, accuracy)
    (run / "done.json").write_text(json.dumps({"argv": [*stage.args(quick), "--num-threads", "1"]}))
    return run


@pytest.fixture
def two_budgets(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """GRPO and RLOO on tiny-math, 3 seeds each, at the main job's budget (from the main job's SFT policy) and at the
    full presets' (from the full budget's SFT policy): the same run names, two folders. RLOO's command is the same at
    both budgets; only its start tells them apart."""
    monkeypatch.setattr(reference, "DIR", tmp_path / "data")
    folders = []
    for quick, end in ((True, 0.3), (False, 0.6)):
        runs = tmp_path / ("main" if quick else "full")
        for seed in (1, 2, 3):
            _suite_run(runs, f"sft_tiny-math__{seed}", [0.1, 0.15 + 0.01 * seed], quick)
            for algo in ("grpo", "rloo"):
                _suite_run(runs, f"{algo}_tiny-math__{seed}", [0.15, 0.2, end + 0.01 * seed], quick)
        folders.append(runs)
    return folders[0], folders[1]


def test_the_full_budget_ships_beside_the_main_job_and_is_never_pooled_with_it(two_budgets, tmp_path, capsys):
    """Issue 57 item 4: the 3-seed full-budget runs share the main job's run names (`grpo_tiny-math__1`): they ship
    beside them without --replace, as their own group (`grpo_tiny-math (full)`), and every reader keeps them apart:
    `list` a row each, `results --reference` one budget (`--budget`), `compare --reference` the band of the budget
    the runs were made at, `reproduce` the band of the same command from the same start."""
    main, full = two_budgets
    assert reference.main(["build", str(main)]) == 0
    assert reference.main(["build", str(full)]) == 0  # not refused: another budget, not a changed run
    out = capsys.readouterr()
    assert "different commands" not in out.err and "grpo_tiny-math.jsonl.gz: 3 run(s)" in out.out
    assert len(reference.read_group(tmp_path / "data" / "rloo_tiny-math.jsonl.gz")) == 6
    assert reference.main(["list"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rloo |")]
    assert [row.split(" | ")[3] for row in rows] == ["main job", "full"]  # one command: its start tells them apart
    groups = {r.group for r in reference.load()}
    assert {"grpo_tiny-math", "grpo_tiny-math (full)", "rloo_tiny-math", "rloo_tiny-math (full)"} <= groups
    assert "rloo_tiny-math__1 (full)" in {r.name for r in reference.load()}
    # results --reference: one budget's table, the same as the table of that budget's folder
    for budget, folder in (("quick", main), ("full", full)):
        assert results.main(["--reference", "--budget", budget, "--out-dir", str(tmp_path / budget)]) == 0
        table = (tmp_path / budget / "results_tiny-math.md").read_text()
        assert table == results.track_table(folder, "tiny-math")[0] and "| sft" not in table
        assert f"| grpo | 3 | {'0.620' if budget == 'full' else '0.320'} [" in table
    capsys.readouterr()
    # compare --reference: the user's runs at one budget meet that budget's band alone
    for folder, band in ((main, "grpo_tiny-math (reference)"), (full, "grpo_tiny-math (reference, full)")):
        mine = [str(p) for p in sorted(folder.glob("grpo_tiny-math__*"))]
        args = [*mine, "--metric", "eval/accuracy", "--out", str(tmp_path / "cmp")]
        assert compare.main([*args, "--reference", "grpo"]) == 0
        table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| grpo_tiny-math (")]
        assert len(table) == 1 and table[0].startswith(f"| {band} | 3 |")
    # a fork's runs match neither budget's command: both bands, each its own
    fork = [_run(tmp_path / "fork", f"grpo_x_tiny-math__{s}", [0.2, 0.3]) for s in (1, 2, 3)]
    assert compare.main([*map(str, fork), "--metric", "eval/accuracy", "--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert compare.main([*map(str, fork), "--metric", "eval/accuracy", "--out", str(tmp_path / "c"),
                         "--reference", "grpo"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    bands = [line.split(" | ")[0] for line in out if line.startswith("| grpo_tiny-math (")]
    assert bands == ["| grpo_tiny-math (reference)", "| grpo_tiny-math (reference, full)"]


def test_reproduce_judges_a_run_against_its_own_budget(two_budgets, tmp_path, capsys):
    """A run of the full suite is judged against the full budget's runs, the main job's against the main job's;
    RLOO's runs, of one command at both budgets, by the SFT policy they started from."""
    main, full = two_budgets
    assert reference.main(["build", str(main)]) == 0 and reference.main(["build", str(full)]) == 0
    capsys.readouterr()
    for folder, band in ((main, "[0.2"), (full, "[0.5")):
        assert reproduce.main([str(folder)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[-1] == "reproduces the library: yes (9 runs: 0 early checks and 9 end results passed)"
        rloo = next(line for line in out if line.startswith("rloo_tiny-math__1"))
        assert f"final {0.31 if folder == main else 0.61:.3f} in {band}" in rloo and "(3 distinct shipped runs)" in rloo
    # the main job's final RLOO values in the full budget's folder: outside its band
    (full / "rloo_tiny-math__2" / "metrics.jsonl").write_text(
        (main / "rloo_tiny-math__2" / "metrics.jsonl").read_text()
    )
    assert reproduce.main([str(full)]) == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict == "reproduces the library: no, these runs differ: rloo_tiny-math__2"


def _seeds_per_regime(records: list[dict], group: str, command: list[str], full: bool = False) -> int:
    """The fewer, over the two rounding regimes, of the shipped runs of `group` made by `command`."""
    have = [
        reference.regime(r)
        for r in records
        if r["name"].rsplit("__", 1)[0] == group
        and reference.full_only(r) == full
        and reference.budget(r.get("argv")) == command
    ]
    return min(have.count("native"), have.count("default"))


def test_the_shipped_data_holds_the_main_job_every_study_and_full_tiny_math_as_they_run_today():
    """What `reproduce` and `compare --reference` judge against is today's commands: every group the README's main job
    makes, every family's study track and tiny-math's full-budget groups have 3 or more seeds under each rounding
    regime, made by the command the suite (or the study) runs now. A changed budget fails here, naming the group whose
    runs to rebuild (benchmark.reference build) before its shipped band says anything of the new command."""
    records = [r for path in sorted(reference.DIR.glob("*.jsonl.gz")) for r in reference.read_group(path)]
    wanted: dict[tuple[str, bool], list[str]] = {}  # (group, full budget) -> its command today
    quick = {st.run_name.rsplit("__", 1)[0]: st for st in SUITES["quick"]([1])}
    main = [*QUICK_STAGES, *MAIN_FRONTIER_STAGES]
    main += sorted({need.rsplit("__", 1)[0] for g in main for need in quick[g].needs})
    for group in main:
        wanted[group, False] = reference.budget(quick[group].args(True))
    full = {st.run_name.rsplit("__", 1)[0]: st for st in SUITES["tiny-math"]([1])}
    for group in ("sft_tiny-math", "grpo_tiny-math", "rloo_tiny-math", "ppo_tiny-math", "remax_tiny-math"):
        wanted[group, True] = reference.budget(full[group].args(False))
    for family, tracks in STUDY.items():
        for t in tracks:
            wanted[f"{family}_{t.track}-study", False] = [t.preset, *t.flags]
    missing = []
    for (group, is_full), command in wanted.items():
        if _seeds_per_regime(records, group, command, is_full) < 3:
            missing.append(f"{group}{reference.FULL if is_full else ''}: `{' '.join(command)}`")
    assert not missing, f"shipped runs of today's commands, 3 seeds under each regime, are missing for: {missing}"


NOT_YET_SHIPPED: set[str] = set()
"""the study tracks (benchmark/study.py's MORE_TRACKS) whose library script's runs no host has yet held under both
regimes: empty since 2026-12-04 (issue 68's last four shipped); a track added later is named here until it ships"""


def test_every_effects_track_ships_its_library_scripts_runs_or_is_listed_as_not_yet_shipped():
    """Issue 68: the references of every new track (benchmark/study.py's MORE_TRACKS), 3 seeds under each regime by
    the command the study runs now, or the group named in NOT_YET_SHIPPED; a listed group that ships fails too, so
    the list says what is still missing."""
    records = [r for path in sorted(reference.DIR.glob("*.jsonl.gz")) for r in reference.read_group(path)]
    shipped, wanted = set(), set()
    for family, tracks in MORE_TRACKS.items():
        for t in tracks:
            group, command = f"{family}_{t.track}-study", [t.preset, *t.flags]
            wanted.add(group)
            if _seeds_per_regime(records, group, command) >= 3:
                shipped.add(group)
    assert NOT_YET_SHIPPED <= wanted, f"not a track's group: {sorted(NOT_YET_SHIPPED - wanted)}"
    assert not shipped & NOT_YET_SHIPPED, f"shipped now, drop from NOT_YET_SHIPPED: {sorted(shipped & NOT_YET_SHIPPED)}"
    missing = wanted - shipped - NOT_YET_SHIPPED
    assert not missing, (
        f"shipped runs of today's commands, 3 seeds under each regime, are missing for: {sorted(missing)}"
    )
