"""benchmark.study (issue 49 item 6): `python -m benchmark.run study --scripts A.py B.py` finds each script's family,
runs it on its family's tracks, then ranks the scripts with intervals. The plumbing is tested here with stand-in
scripts of the library's shape whose curves are known; the real study is a benchmark measurement (docs)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import launch, study, suites

REPO = Path(__file__).resolve().parent.parent

# A stand-in for an RL script of the library's shape: PRESETS, a PARENT line, and a run that writes a learning curve
# (the rate of learning is SPEED: 0.1 per evaluation for a script whose name starts with "fast", else 0.05; a little
# seed noise) and its done.json
FAKE = """
import hashlib, json, pathlib, sys
PARENT = "rloo"
PRESETS = {"tiny-tldr-noisy": None, "tiny-math": None}
SPEED = float(pathlib.Path(__file__).stem.startswith('fast')) * 0.05 + 0.05
argv = sys.argv[1:]
name, seed = argv[argv.index("--run-name") + 1], int(argv[argv.index("--seed") + 1])
run = pathlib.Path("runs", name)
run.mkdir(parents=True)
metric = "eval/accuracy" if "tiny-math" in name else "eval/gold_reward"
rows = [
    {"step": i, "episode": 64 * i, "time": i, metric: min(1.0, 0.2 + SPEED * i + 0.01 * seed)} for i in range(9)
]
if "tiny-tldr-noisy" in name:  # evaluated with --eval-kl, as its preset is: KL grows by 0.1 an evaluation
    rows = [{**r, "eval/kl": 0.1 * r["step"], "eval/score": r["step"]} for r in rows]
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
me = pathlib.Path(__file__).resolve()
script = {"path": str(me), "sha256": hashlib.sha256(me.read_bytes()).hexdigest()}  # the record `Run` writes
(run / "done.json").write_text(json.dumps({"argv": argv, "script": script}))
"""


def _models_done(workdir: Path, seeds: list[int] = (1, 2, 3)) -> None:
    """The SFT and reward models the tracks need, finished with the quick suite's command by the script as it is now
    (done.json's `script`): skipped by the study."""
    for st in [*suites.frontier_tldr_stages(list(seeds)), *(suites.sft_stage("tiny-math", s) for s in seeds)]:
        if st.script not in ("sft.py", "reward_model.py"):
            continue
        script = {"path": st.script, "sha256": hashlib.sha256((REPO / st.script).read_bytes()).hexdigest()}
        (workdir / "runs" / st.run_name).mkdir(parents=True)
        done = {"argv": st.args(quick=True), "script": script}
        (workdir / "runs" / st.run_name / "done.json").write_text(json.dumps(done))
        (workdir / "runs" / st.run_name / "metrics.jsonl").write_text('{"step": 0, "episode": 0, "time": 1.0}\n')


def test_a_study_ranks_a_faster_variant_above_and_a_copy_level_with_its_script(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "ensure_assets", lambda path: None)
    _models_done(tmp_path)
    for name in ("fast.py", "slow.py", "fast_copy.py"):
        (tmp_path / name).write_text(FAKE)
    scripts = [str(tmp_path / n) for n in ("fast.py", "slow.py", "fast_copy.py")]
    status = study.run_study(scripts, [1, 2, 3], tmp_path, jobs=2, live=False)
    out = capsys.readouterr().out
    assert "# fast.py: family rloo (its PARENT line); tracks tiny-tldr-noisy, tiny-math" in out
    assert sum(v == "ok" for v in status.values()) == 18 and sum(v == "skipped" for v in status.values()) == 9
    assert (tmp_path / "runs" / "fast_copy_tiny-math-study__3" / "done.json").exists()
    md = (tmp_path / "runs" / "study_fast-vs-slow-vs-fast_copy_tiny-math.md").read_text()
    assert "| slow_tiny-math-study | 3 | 0.620 | [0.610, 0.630] |" in md
    separated = next(line for line in md.splitlines() if line.startswith("Separated"))
    assert "AUC: fast_tiny-math-study > slow_tiny-math-study" in separated
    assert "AUC: fast_copy_tiny-math-study > slow_tiny-math-study" in separated
    apart = next(line for line in md.splitlines() if line.startswith("Not separated"))
    assert "AUC: fast_copy_tiny-math-study ~ fast_tiny-math-study" in apart  # a script and its copy: not separated
    assert "Ranking by AUC (mean over seeds): fast_copy_tiny-math-study" in md and md in out
    assert (tmp_path / "runs" / "study_fast-vs-slow-vs-fast_copy_tiny-tldr-noisy.png").stat().st_size > 10_000
    # on tiny-tldr-noisy, also what each script buys per unit of KL (benchmark.frontier), a row per script
    kl = (tmp_path / "runs" / "study_fast-vs-slow-vs-fast_copy_tiny-tldr-noisy_kl.md").read_text()
    assert (
        "| slow | - | 0.320 [0.310, 0.330] (3) | 0.470 [0.460, 0.480] (3) |" in kl and "KL <= 0.25: fast > slow" in kl
    )
    # the same command again runs nothing: every stage finished with the same command
    status = study.run_study(scripts, [1, 2, 3], tmp_path, jobs=2, live=False)
    assert set(status.values()) == {"skipped"}


def test_the_family_of_a_fork_is_read_from_its_content(tmp_path):
    """rloo.py and remax.py have the same presets: a copy of either with one line changed is of its own family."""
    for lib in ("rloo", "remax", "grpo_math"):
        text = (REPO / f"{lib}.py").read_text()
        fork = tmp_path / f"my_{lib}.py"
        fork.write_text(text.replace("def main(", "def main(  # a fork\n    ", 1))
        family, how = study.family_of(fork)
        assert family == lib and how.startswith("its content: 99.") and f"of its lines are {lib}.py's" in how
    declared = tmp_path / "declared.py"
    declared.write_text('PARENT = "remax.py"\nPRESETS = {"tiny-math": None}\n')
    assert study.family_of(declared) == ("remax", "its PARENT line")


@pytest.mark.parametrize(
    "name, text, error",
    [
        ("notes.txt", "", "notes.txt is not a Python script (.py): the study runs scripts of the library's shape"),
        ("broken.py", "def (:\n", "broken.py does not parse as Python (line 1: invalid syntax)"),
        ("plain.py", "print(1)\n", "plain.py has no module-level PRESETS dict: not a script of the library's shape"),
        ("odd.py", 'PRESETS = {"my-track": None}\n', "odd.py: none of its presets (my-track) is a library script's"),
        ("unknown.py", 'PARENT = "ppo2"\nPRESETS = {"x": 1}\n', "unknown.py: PARENT = 'ppo2' names no library script"),
        ("sftish.py", 'PARENT = "sft"\nPRESETS = {"x": 1}\n', "sftish.py is of family sft, which the study does not"),
        ("nomath.py", 'PARENT = "rloo"\nPRESETS = {"tiny-tldr-noisy": 1}\n', "nomath.py has no preset tiny-math"),
    ],
)
def test_a_study_script_not_of_the_librarys_shape_is_one_error_line(tmp_path, name, text, error):
    (tmp_path / name).write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.run", "study", "--scripts", name, "--dry-run", "--workdir", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {error}") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_study_dry_run_names_each_run_after_its_script_on_its_familys_tracks(tmp_path, capsys):
    fork = tmp_path / "rloo_batchmean.py"
    fork.write_text((REPO / "rloo.py").read_text().replace("baseline", "baseline ", 1))
    status = study.run_study([str(fork), str(REPO / "rloo.py")], [1, 2], tmp_path, dry_run=True)
    assert sorted(n for n in status if "study" in n) == sorted(
        f"{s}_{t}-study__{seed}"
        for s in ("rloo", "rloo_batchmean")
        for t in ("tiny-tldr-noisy", "tiny-math")
        for seed in (1, 2)
    )
    lines = capsys.readouterr().out.splitlines()
    assert any(
        f"{fork} tiny-math --run-name rloo_batchmean_tiny-math-study__2 --seed 2 --total-episodes" in x for x in lines
    )
    assert not any("tiny-tldr " in x and "study" in x for x in lines)  # not the saturated tiny-tldr
    assert not (tmp_path / "runs").exists(), "a dry run runs nothing"


def test_a_study_from_a_folder_of_forks_names_the_librarys_script_by_its_file_name(tmp_path, monkeypatch):
    """Issue 58 item 6: from ~/experiments, `--scripts rloo_x.py rloo.py` studies the fork there against the library's
    rloo.py (not a file of that folder); a file of that name in the folder is the one studied."""
    (tmp_path / "rloo_x.py").write_text((REPO / "rloo.py").read_text().replace("baseline", "baseline ", 1))
    monkeypatch.chdir(tmp_path)
    found = study.plan(["rloo_x.py", "rloo.py"]).scripts
    assert [(path, family) for path, family, _ in found] == [
        (tmp_path / "rloo_x.py", "rloo"),
        (REPO / "rloo.py", "rloo"),
    ]
    (tmp_path / "rloo.py").write_text((REPO / "rloo.py").read_text())
    assert study.plan(["rloo_x.py", "rloo.py"]).scripts[1][0] == tmp_path / "rloo.py"


@pytest.mark.parametrize("family", sorted(study.STUDY))
def test_every_study_flag_is_a_field_of_its_familys_script_and_every_preset_exists(family):
    """A misspelt budget flag would fail every study run of the family after its models were built."""
    import dataclasses
    import importlib

    module = importlib.import_module(family)
    fields = {f.name for f in dataclasses.fields(module.Args)}
    for t in [*study.STUDY[family], *study.MORE_TRACKS.get(family, [])]:
        assert t.preset in module.PRESETS, (family, t.preset)
        flags = [f for f in [*t.flags, *(flag for flag, _ in t.model_flags)] if f.startswith("--")]
        assert {f[2:].replace("-", "_") for f in flags} <= fields, (family, t.track, flags)
        models = {st.run_name for st in study.model_stages(2)}
        assert set(t.needs(2)) <= models, (family, t.track)


def _model_paths(module, stage) -> set[str]:
    """The run directories a stage's command reads models from: its preset's `runs/<name>/model` paths, overridden by
    the stage's own flags."""
    import dataclasses

    args = module.PRESETS[stage.preset][1]
    paths = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    flags = stage.args()
    for i, flag in enumerate(flags[:-1]):
        if flag.startswith("--"):
            paths[flag[2:].replace("-", "_")] = flags[i + 1]
    return {v.split("/")[1] for v in paths.values() if isinstance(v, str) and v.startswith("runs/") and "/model" in v}


@pytest.mark.parametrize("shared_starts", [False, True])
@pytest.mark.parametrize(
    "family, tracks",
    [(f, None) for f in sorted(study.STUDY)]
    + [(f, [t.track]) for f in study.MORE_TRACKS for t in study.MORE_TRACKS[f]],
)
def test_each_familys_study_plans_every_model_its_runs_read(family, tracks, shared_starts):
    """Issue 58 item 1: on a fresh clone the DPO study's runs failed after the SFT stage, reading a noisy reward model
    no stage built. Every model a study run reads (its preset's paths and its flags) is a stage of the plan that it
    waits for; with per-seed starts, seed 2 reads seed 2's models."""
    import importlib

    module = importlib.import_module(family)
    todo = study.stages(study.plan([str(REPO / f"{family}.py")], tracks), [1, 2], shared_starts)
    names = {st.run_name for st in todo}
    for st in todo:
        if "-study__" not in st.run_name:
            continue
        read = _model_paths(module, st)
        assert read and read <= names and read <= set(st.needs), (st.run_name, read, st.needs)
        seed = st.run_name.rsplit("__", 1)[1]
        assert all(r.endswith("__1" if shared_starts else f"__{seed}") for r in read), (st.run_name, read)


def test_the_studys_table_says_whose_starts_its_interval_covers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "ensure_assets", lambda path: None)
    _models_done(tmp_path, seeds=[1])
    (tmp_path / "fast.py").write_text(FAKE)
    study.run_study([str(tmp_path / "fast.py")], [1, 2], tmp_path, live=False, shared_starts=True)
    assert "(--shared-starts, paired)" in (tmp_path / "runs" / "study_fast_tiny-math.md").read_text()
    assert not (tmp_path / "runs" / "sft_tiny-math__2").exists(), "paired: seed 2 starts from seed 1's models"
    capsys.readouterr()
    status = study.run_study([str(tmp_path / "fast.py")], [1, 2], tmp_path, dry_run=True)
    out = capsys.readouterr().out
    assert "# Starts: each seed from its own SFT policy and reward model (the whole pipeline)" in out
    assert status["sft_tiny-math__2"] == status["rm_tiny-tldr-noisy__2"] == "dry-run"
    assert "--seed 2 --num-train-epochs 6" in out  # seed 2's own SFT policy, at the quick suite's budget


def test_two_studies_keep_both_outputs_and_the_end_lists_them(tmp_path, monkeypatch, capsys):
    """Issue 58 item 3: `runs/study_<track>.md` was named by track only; a second study overwrote the first's."""
    monkeypatch.setattr(launch, "ensure_assets", lambda path: None)
    _models_done(tmp_path, seeds=[1])
    for n in ("fast.py", "slow.py", "fast_copy.py"):
        (tmp_path / n).write_text(FAKE)
    study.run_study([str(tmp_path / "fast.py"), str(tmp_path / "slow.py")], [1], tmp_path, live=False)
    study.run_study([str(tmp_path / "fast_copy.py")], [1], tmp_path, live=False, name="copy.only")
    runs = tmp_path / "runs"
    assert "slow_tiny-math-study" in (runs / "study_fast-vs-slow_tiny-math.md").read_text()
    assert "slow" not in (runs / "study_copy.only_tiny-math.md").read_text()
    assert "slow_tiny-math-study__1" in (runs / "study_fast-vs-slow_summary.md").read_text()  # each its status table
    assert "slow" not in (runs / "study_copy.only_summary.md").read_text()
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        f"studies in {runs}:\n  copy.only: tiny-math, tiny-tldr-noisy\n  fast-vs-slow: tiny-math, tiny-tldr-noisy"
    )
    with pytest.raises(SystemExit, match=r"error: --name '\.\./x': a study's name is letters, digits"):
        study.run_study([str(tmp_path / "fast.py")], [1], tmp_path, dry_run=True, name="../x")


def test_the_plan_says_what_it_builds_first_and_roughly_how_long(tmp_path, capsys):
    """Issue 58 item 2: on a fresh clone the study trains SFT and reward models first, unannounced."""
    study.run_study([str(REPO / "dpo.py")], [1, 2], tmp_path, dry_run=True, jobs=2)
    out = capsys.readouterr().out.splitlines()
    assert "# builds first: sft_tiny-tldr__1, rm_tiny-tldr-noisy__1, sft_tiny-tldr__2, rm_tiny-tldr-noisy__2" in out
    minutes = (2 * (study.SECONDS["sft_tiny-tldr"] + study.SECONDS["rm_tiny-tldr-noisy"]) + 2 * 115) / 60 / 2
    assert f"# then 2 study runs; roughly {minutes:.0f} min with --jobs 2 on a 2-core CPU" in "\n".join(out)
    _models_done(tmp_path, seeds=[1, 2])
    study.run_study([str(REPO / "dpo.py")], [1, 2], tmp_path, dry_run=True, jobs=2)
    assert "# builds first: nothing (every model it reads is built)" in capsys.readouterr().out


def test_tracks_picks_a_familys_tracks_and_names_them_when_one_is_unknown(tmp_path, capsys):
    """`--tracks` (issue 68): a study on the longer tracks of MORE_TRACKS only, or on one of a family's study tracks;
    a track the family has not is one error line that lists the ones it has."""
    p = study.plan([str(REPO / "grpo_math.py"), str(REPO / "rloo.py")], ["tiny-math"])
    assert [t.track for t in p.by_family["rloo"]] == ["tiny-math"] and list(p.tracks) == ["tiny-math"]
    assert [t.track for t in p.by_family["grpo_math"]] == ["tiny-math"]
    p = study.plan([str(REPO / "grpo_math.py")], ["tiny-math-long"])
    names = {st.run_name for st in study.stages(p, [1])}
    assert names == {"sft_tiny-math__1", "grpo_math_tiny-math-long-study__1"}
    (st,) = [st for st in study.stages(p, [1]) if "-study__" in st.run_name]
    assert st.extra[st.extra.index("--total-steps") + 1] == "40"
    with pytest.raises(study.StudyError, match="family rloo has the tracks tiny-tldr-noisy, tiny-math$"):
        study.plan([str(REPO / "rloo.py")], ["tiny-math-long"])
    cmd = [sys.executable, "-m", "benchmark.run", "study", "--scripts", "dpo.py", "--tracks", "nope", "--dry-run"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: --tracks nope: family dpo has the tracks tiny-tldr-noisy, tiny-tldr-long, tiny-tldr-online-long"
    ]
    proc = subprocess.run(
        [*cmd[:3], "quick", "--tracks", "tiny-math", "--dry-run"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "--tracks acts on the study" in proc.stderr
