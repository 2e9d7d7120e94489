"""benchmark.run: the suites point at presets that exist, failures are reported and the suite goes on,
dependents of a failed stage are skipped, a stage whose done.json holds its command is not rerun, one whose
done.json holds another command (a `--quick` budget) is rerun with --overwrite, and one stopped part way is
resumed with --resume."""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from benchmark import launch, run, suites
from benchmark.tools import timeline

REPO = Path(__file__).resolve().parent.parent


def _presets(script: Path) -> set[str]:
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PRESETS":
            return {k.value for k in node.value.keys}
    return set()


@pytest.mark.parametrize("suite", sorted(suites.SUITES))
def test_every_stage_names_an_existing_script_and_preset(suite):
    stages = suites.SUITES[suite]([1, 2, 3])
    names = [st.run_name for st in stages]
    assert len(names) == len(set(names)), "run names are unique"
    for st in stages:
        script = REPO / st.script
        assert script.exists(), f"{st.run_name}: {st.script} is missing"
        assert st.preset in _presets(script), f"{st.run_name}: {st.script} has no preset {st.preset!r}"
        assert set(st.needs) <= set(names[: names.index(st.run_name)]), "a stage only needs earlier stages"


def test_real_suites_print_accelerate_commands(capsys, tmp_path):
    shutil.copytree(REPO / "benchmark" / "accelerate_configs", tmp_path / "benchmark" / "accelerate_configs")
    status = launch.run_suite("tldr", [1], workdir=tmp_path, dry_run=True)  # launched from a checkout: its configs
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(status) and all(v == "dry-run" for v in status.values())
    assert all(line.startswith("accelerate launch --config_file benchmark/accelerate_configs/") for line in out)
    assert any("ppo_rlhf.py tldr-pythia-6.9b" in line and "deepspeed_zero3.yaml" in line for line in out)
    assert not (tmp_path / "runs").exists(), "a dry run runs nothing"


# A stand-in for an algorithm script that keeps their run-directory contract (sft.py's `Run`): it refuses a directory
# that holds a run unless given --resume (which needs a checkpoint and no done.json) or --overwrite (which deletes it),
# and writes done.json with its argv at the end. A run named in $CRASH stops part way: a checkpoint, exit 143 (SIGTERM).
FAKE_SCRIPT = """
import hashlib, json, os, pathlib, shutil, sys
me = pathlib.Path(__file__).resolve()
from clean_rlhf_utils.tracking import script_record
script = script_record(me)  # the record `Run` writes: outside the checkout, the file's name only
argv = sys.argv[1:]
name = argv[argv.index("--run-name") + 1]
run = pathlib.Path("runs", name)
if "--resume" in argv:
    if (run / "done.json").exists() or not (run / "checkpoint" / "state.json").exists():
        raise SystemExit(f"error: --resume: nothing to resume in {run}")
elif run.is_dir() and any(run.iterdir()):
    if "--overwrite" not in argv:
        raise SystemExit(f"error: {run} already holds a run")
    shutil.rmtree(run)
run.mkdir(parents=True, exist_ok=True)
if "--resume" not in argv:
    (run / "provenance.json").write_text(json.dumps({"started": {"script": script}, "resumed": []}))
with open("calls.txt", "a") as f:
    f.write(json.dumps(argv) + "\\n")
with open(run / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 0, "episode": 0, "time": 0, "eval/x": 1.5}) + "\\n")
if name in os.environ.get("CRASH", "").split():
    (run / "checkpoint").mkdir(exist_ok=True)
    (run / "checkpoint" / "state.json").write_text('{"step": 0}')
    raise SystemExit(143)
shutil.rmtree(run / "checkpoint", ignore_errors=True)
done = {"step": 1, "preset": argv[0], "argv": argv, "time": 0.1, "script": script}
(run / "done.json").write_text(json.dumps(done))
"""


def _calls(tmp_path: Path) -> list[list[str]]:
    """The argv of each launch of the fake script, in order (after its preset: run name and flags)."""
    path = tmp_path / "calls.txt"
    return [json.loads(line)[1:] for line in path.read_text().splitlines()] if path.exists() else []


def _fake_suite(tmp_path: Path, monkeypatch):
    ok = tmp_path / "ok.py"
    ok.write_text(FAKE_SCRIPT)
    (tmp_path / "bad.py").write_text("raise SystemExit('boom')\n")
    stages = [
        suites.Stage("a__1", str(ok), "p"),
        suites.Stage("b__1", str(tmp_path / "bad.py"), "p"),
        suites.Stage("c__1", str(ok), "p", needs=["b__1"]),
        suites.Stage("d__1", str(ok), "p", needs=["a__1"]),
        suites.Stage("q__1", str(ok), "p", ["--seed", "1"], quick=["--total-episodes", "8"]),
        suites.Stage("r__1", str(ok), "p", needs=["q__1"]),
    ]
    monkeypatch.setitem(suites.SUITES, "fake", lambda seeds: stages)


@pytest.mark.parametrize("jobs", [1, 2])
def test_failed_stage_is_reported_dependents_skipped_and_finished_stages_not_rerun(tmp_path, monkeypatch, capsys, jobs):
    _fake_suite(tmp_path, monkeypatch)
    status = launch.run_suite("fake", [1], workdir=tmp_path, jobs=jobs)
    assert status == {"a__1": "ok", "b__1": "failed", "c__1": "blocked", "d__1": "ok", "q__1": "ok", "r__1": "ok"}
    out = capsys.readouterr().out
    assert "[FAILED] b__1" in out and "boom" in out
    assert not (tmp_path / "runs" / "a__1" / "DONE").exists(), "the suite leaves the end-of-run marker to the script"
    assert "eval/x 1.500" in (tmp_path / "runs" / "fake_summary.md").read_text()
    spans = {s.name: s for s in timeline.read_spans(tmp_path / "runs")}  # each stage's launch and end, recorded
    assert set(spans) == {"a__1", "b__1", "d__1", "q__1", "r__1"}  # c waited on b, which failed
    assert spans["b__1"].rc != 0 and spans["a__1"].rc == 0 and spans["a__1"].threads == 1
    assert spans["d__1"].needs == ["a__1"] and spans["d__1"].start >= spans["a__1"].end
    status = launch.run_suite("fake", [1], workdir=tmp_path, jobs=jobs)
    assert status["a__1"] == status["d__1"] == status["q__1"] == "skipped" and status["b__1"] == "failed"
    assert "[skip] a__1: finished earlier with the same command and script (done.json)" in capsys.readouterr().out
    assert sorted(c[1] for c in _calls(tmp_path)) == ["a__1", "d__1", "q__1", "r__1"], "finished stages ran once"


def test_a_quick_run_is_rerun_by_the_full_suite_and_what_it_feeds_too(tmp_path, monkeypatch, capsys):
    _fake_suite(tmp_path, monkeypatch)
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"], quick=True)
    assert _calls(tmp_path) == [["--run-name", "q__1", "--seed", "1", "--total-episodes", "8"], ["--run-name", "r__1"]]
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"], dry_run=True) == {
        "q__1": "dry-run",
        "r__1": "dry-run",
    }
    out = capsys.readouterr().out
    assert (
        "# [rerun] q__1: its done.json is from another command, the budget or flags differ: was '--total-episodes 8', "
        "now (none)" in out
    )
    assert out.splitlines()[1].endswith("q__1 --seed 1 --overwrite") and len(_calls(tmp_path)) == 2, (
        "a dry run runs nothing"
    )
    status = launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"])
    assert status == {"q__1": "ok", "r__1": "ok"}
    out = capsys.readouterr().out
    assert "[rerun] q__1: its done.json is from another command" in out
    assert (
        "[rerun] r__1: it needs q__1, run again now" in out
    )  # its done.json holds its command, but an older q__1's model
    assert _calls(tmp_path)[2:] == [
        ["--run-name", "q__1", "--seed", "1", "--overwrite"],
        ["--run-name", "r__1", "--overwrite"],
    ]
    assert json.loads((tmp_path / "runs" / "q__1" / "done.json").read_text())["argv"] == [
        "p",
        "--run-name",
        "q__1",
        "--seed",
        "1",
        "--overwrite",
    ]
    # the full budget is done: a third invocation, with other threads per job, skips both
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"], jobs=2) == {
        "q__1": "skipped",
        "r__1": "skipped",
    }
    assert len(_calls(tmp_path)) == 4


def test_a_stage_stopped_part_way_is_resumed_by_the_same_command_only(tmp_path, monkeypatch, capsys):
    _fake_suite(tmp_path, monkeypatch)
    monkeypatch.setenv("CRASH", "q__1")
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"])["q__1"] == "failed"
    assert (tmp_path / "runs" / "q__1" / "checkpoint").exists() and not (
        tmp_path / "runs" / "q__1" / "done.json"
    ).exists()
    monkeypatch.delenv("CRASH")
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"]) == {"q__1": "ok"}
    assert (
        "[resume] q__1: it stopped part way (a checkpoint, no done.json); same command and script"
        in capsys.readouterr().out
    )
    assert _calls(tmp_path) == [
        ["--run-name", "q__1", "--seed", "1"],
        ["--run-name", "q__1", "--seed", "1", "--resume"],
    ]
    assert "resumed" in (tmp_path / "runs" / "_suite" / "q__1.log").read_text()
    # the suite's files live in runs/_suite/: a glob of run directories takes run directories only (issue 43)
    assert [p.name for p in (tmp_path / "runs").glob("q__*")] == ["q__1"]
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"]) == {"q__1": "skipped"}, (
        "done.json holds the same command"
    )
    # stopped part way under the quick budget: the full suite starts it over rather than continue the quick run
    monkeypatch.setenv("CRASH", "q__1")
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q"], quick=True)
    monkeypatch.delenv("CRASH")
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"]) == {"q__1": "ok"}
    out = capsys.readouterr().out
    assert (
        "[rerun] q__1: it did not finish, and was started by another command: was '--total-episodes 8', now (none)"
        in out
    )
    assert _calls(tmp_path)[-1] == ["--run-name", "q__1", "--seed", "1", "--overwrite"]
    # a checkpoint without the suite's record of the command (run by hand): started over, not resumed blindly
    (tmp_path / "runs" / "q__1" / "done.json").unlink()
    (tmp_path / "runs" / "q__1" / "checkpoint").mkdir()
    (tmp_path / "runs" / "q__1" / "checkpoint" / "state.json").write_text('{"step": 1}')
    launch.stage_record(tmp_path / "runs", "q__1").unlink()
    assert launch.decide(
        tmp_path / "runs", "q__1", ["p", "--run-name", "q__1", "--seed", "1"], (), tmp_path / "ok.py"
    ) == ("rerun", "it did not finish and there is no record of the command that started it")


def test_an_edited_script_or_another_file_of_the_same_name_runs_again(tmp_path, monkeypatch, capsys):
    """Issue 59 class 2: the cache is keyed by the code. A stage whose done.json holds the same command is skipped only
    when the file that would run now is the one that made it, with the same bytes."""
    _fake_suite(tmp_path, monkeypatch)
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"]) == {"q__1": "ok", "r__1": "ok"}
    ok = tmp_path / "ok.py"
    ok.write_text(ok.read_text() + "# a fork edited after its first study\n")
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"]) == {"q__1": "ok", "r__1": "ok"}
    out = capsys.readouterr().out
    assert "[rerun] q__1: ok.py changed since it ran (sha256 " in out
    assert "[rerun] r__1: it needs q__1, run again now" in out
    assert len(_calls(tmp_path)) == 4, "both ran again"
    # another file of the same name elsewhere: not the file that made the run
    other = tmp_path / "elsewhere" / "ok.py"
    other.parent.mkdir()
    other.write_text(ok.read_text())
    stage = suites.Stage("q__1", str(other), "p", ["--seed", "1"])
    action, why = launch.decide(tmp_path / "runs", "q__1", stage.args(), (), stage.file(tmp_path))
    assert (action, why) == ("rerun", f"it was made by {ok}, and this stage runs {other}")
    # a done.json that does not say which script made it (a record of older code) is not taken as this script's
    done = tmp_path / "runs" / "q__1" / "done.json"
    done.write_text(json.dumps({k: v for k, v in json.loads(done.read_text()).items() if k != "script"}))
    assert launch.decide(tmp_path / "runs", "q__1", stage.args(), (), ok)[1] == (
        "its record does not say which script made it (no path and sha256)"
    )


def test_a_stage_built_on_a_model_rebuilt_by_another_invocation_runs_again(tmp_path, monkeypatch, capsys):
    """What a stage reads is part of what produced it: r__1 was built on q__1; q__1 rebuilt by a later invocation
    that did not run r__1 makes r__1 stale for the next one."""
    _fake_suite(tmp_path, monkeypatch)
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"])
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q"], quick=True)  # q__1 alone, at another budget
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"], quick=True) == {
        "q__1": "skipped",
        "r__1": "ok",
    }
    assert "[rerun] r__1: it was built on an earlier q__1, which was run again since" in capsys.readouterr().out
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q", "r"], quick=True) == {
        "q__1": "skipped",
        "r__1": "skipped",
    }


def test_a_run_stopped_part_way_is_not_resumed_with_an_edited_script(tmp_path, monkeypatch, capsys):
    _fake_suite(tmp_path, monkeypatch)
    monkeypatch.setenv("CRASH", "q__1")
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q"])
    monkeypatch.delenv("CRASH")
    ok = tmp_path / "ok.py"
    ok.write_text(ok.read_text() + "x = 1\n")
    capsys.readouterr()
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"]) == {"q__1": "ok"}
    assert "[rerun] q__1: it did not finish, and not with this script: ok.py changed since it ran" in (
        capsys.readouterr().out
    )
    assert _calls(tmp_path)[-1] == ["--run-name", "q__1", "--seed", "1", "--overwrite"]


def test_launch_flags_do_not_count_as_another_command():
    assert launch.same_run_args(["p", "--run-name", "x", "--num-threads", "1", "--resume", "--seed", "2"]) == [
        "p",
        "--run-name",
        "x",
        "--seed",
        "2",
    ]
    assert launch.same_run_args(["p", "--num-threads=4", "--overwrite"]) == ["p"]


def test_only_takes_algorithm_track_names_and_quick_appends_the_shorter_budget(capsys, tmp_path):
    status = launch.run_suite(
        "tiny", [1], workdir=tmp_path, dry_run=True, only=["ppo_tiny-tldr", "grpo_tiny-math"], quick=True
    )
    # the two stages and what they need, not PPO on tiny-math nor the other GRPO variants
    assert sorted(status) == [
        "grpo_tiny-math__1",
        "ppo_tiny-tldr__1",
        "rm_tiny-tldr__1",
        "sft_tiny-math__1",
        "sft_tiny-tldr__1",
    ]
    out = capsys.readouterr().out
    ppo = next(line for line in out.splitlines() if "--run-name ppo_tiny-tldr__1" in line)
    assert ppo.endswith("--seed 1 --total-episodes 512 --eval-every 1")
    assert "--total-steps 20" in out
    assert "sft.py tiny-tldr --run-name sft_tiny-tldr__1 --num-train-epochs 3\n" in out  # the quick SFT: 3 epochs of 6
    assert "--run-name rm_tiny-tldr__1 --sft-model-path runs/sft_tiny-tldr__1/model --max-train-samples 2048\n" in out
    launch.run_suite(
        "tiny", [1], workdir=tmp_path, dry_run=True, only=["ppo"]
    )  # an algorithm name keeps it on both tracks, full budgets
    out = capsys.readouterr().out
    assert "ppo_tiny-math__1" in out and "ppo_tiny-tldr__1" in out and "--total-episodes 512" not in out


def test_the_quick_suite_builds_the_tiny_world_then_runs_its_stages_at_quick_budgets(tmp_path, monkeypatch, capsys):
    """The README's main job on a clean clone: `benchmark.run quick` builds runs/assets before its first stage."""
    built = []
    monkeypatch.setattr(launch, "ensure_assets", lambda path: built.append(path))
    status = launch.run_suite("quick", [1], workdir=tmp_path, launcher=[sys.executable, "-c", "pass"])
    assert built == [tmp_path / "runs" / "assets"]
    frontier = list(suites.MAIN_FRONTIER_STAGES)  # the tiny-tldr-noisy runs only, not tiny-math's of the same name
    assert sorted(name.rsplit("__", 1)[0] for name in status) == sorted(
        [*suites.QUICK_STAGES, *frontier, *suites.CHECK_STAGES]
        + ["sft_tiny-tldr", "rm_tiny-tldr", "sft_tiny-math", "rm_tiny-tldr-noisy"]
    )
    out = capsys.readouterr().out
    assert "--total-episodes 512 --eval-every 1" in out  # PPO's quick budget
    # issue 43: the frontier's runs that rank the algorithms; the long PPO run starts first among the RL runs
    launched = [line.split("--run-name ")[1].split()[0] for line in out.splitlines() if line.startswith("[run] ")]
    assert launched[4] == "ppo-kl0_tiny-tldr-noisy__1" and launched[:4] == [
        "sft_tiny-tldr__1",
        "rm_tiny-tldr__1",
        "sft_tiny-math__1",
        "rm_tiny-tldr-noisy__1",
    ]


def test_real_check_only_entries_with_a_caret_select_by_run_name_prefix():
    from benchmark.tools.real_check import matches, stages
    from tests.test_real_check import ONLY

    assert matches("grpo_gsm8k", "dr-grpo_gsm8k-qwen2.5-0.5b__1")  # a part of the name, as before
    assert not matches("^grpo_gsm8k", "dr-grpo_gsm8k-qwen2.5-0.5b__1")
    assert matches("^grpo_gsm8k", "grpo_gsm8k-qwen2.5-0.5b__1")
    # the CI cells of the real-shape check: exactly the stages its comment names, per engine
    names = [st.run_name for _, st in stages()]
    picked = {e: [n for n in names if any(matches(o, n) for o in only)] for e, only in ONLY.items()}
    want = {"single": 6, "ddp": 2, "zero2": 4, "zero3": 2, "fsdp": 1, "2machines": 2}
    assert {e: len(v) for e, v in picked.items()} == want, picked
    assert "grpo_gsm8k-qwen2.5-0.5b__1" in picked["zero2"] and "dr-grpo_math-qwen2.5-math-1.5b__1" in picked["single"]


def test_a_bad_jobs_count_or_a_misspelt_only_is_an_error_not_a_silent_exit(tmp_path):
    """`--jobs 0` waited forever at full CPU and a misspelt `--only` ran nothing and exited 0 (issue 42)."""
    with pytest.raises(SystemExit, match="^error: --jobs is 0; it must be at least 1"):
        launch.run_suite("quick", [1], tmp_path, dry_run=True, jobs=0)
    with pytest.raises(SystemExit, match="^error: --only pppo names no stage of suite tiny-tldr; its names are"):
        launch.run_suite("tiny-tldr", [1], tmp_path, dry_run=True, only=["ppo", "pppo"])


def test_the_docstring_lists_every_suite():
    listed = {line.split()[0] for line in run.__doc__.split("Suites:")[1].split("\n\n")[0].strip().splitlines()}
    assert set(suites.SUITES) <= listed, sorted(set(suites.SUITES) - listed)


def test_a_second_suite_in_one_runs_directory_prints_its_refusal_only(tmp_path, capsys):
    """Issue 51 item 12: a second `benchmark.run` in the runs directory of one still running relaunched the first one's
    stage into the same `_suite/<stage>.log` and showed that log's lines, the first suite's, as its own failure."""
    import subprocess
    import time

    (tmp_path / "wait.py").write_text(
        "import pathlib, sys, time\nprint('line of the first suite', flush=True)\nend = time.time() + 30\n"
        "while not pathlib.Path(sys.argv[0]).with_name('go').exists() and time.time() < end:\n    time.sleep(0.05)\n"
    )
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from benchmark import launch, run, suites; "
            "launch.run_suite('fake', [1], workdir=Path(sys.argv[1]), live=False, "
            "stages=[suites.Stage('w__1', str(Path(sys.argv[1]) / 'wait.py'), 'p')])",
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    log = tmp_path / "runs" / "_suite" / "w__1.log"
    try:
        deadline = time.time() + 60
        while "line of the first suite" not in (log.read_text() if log.exists() else ""):
            assert time.time() < deadline and first.poll() is None, "the first suite did not start its stage"
            time.sleep(0.05)
        stages = [suites.Stage("w__1", str(tmp_path / "wait.py"), "p")]
        with pytest.raises(SystemExit) as e:
            launch.run_suite("fake", [1], workdir=tmp_path, live=False, stages=stages)
        assert str(e.value.code).startswith(f"error: another suite runs in {tmp_path / 'runs'} (process ")
        assert "\n" not in str(e.value.code)
        assert capsys.readouterr().out == "", "the refused suite prints nothing but its refusal"
        assert log.read_text() == "line of the first suite\n", "the first suite's log is untouched"
    finally:
        (tmp_path / "go").touch()
        assert first.wait(60) == 0


def _main(monkeypatch, capsys, *argv: str) -> str:
    """`python -m benchmark.run ARGV` in-process: the one `error:` line it stops with."""
    monkeypatch.setattr(sys, "argv", ["benchmark.run", *argv])
    with pytest.raises(SystemExit) as e:
        run.main()
    return str(e.value.code)


@pytest.mark.parametrize(
    "seeds, expect",
    [
        (["-1"], "error: --seeds -1: a seed must be in [0, 2147483647] (the scripts' --seed)"),
        (["1", "2147483648"], "error: --seeds 2147483648: a seed must be in [0, 2147483647]"),
        (["1", "2", "1"], "error: --seeds gives 1 more than once; give each seed once"),
    ],
)
@pytest.mark.parametrize("suite", [["quick"], ["study", "--scripts", "rloo.py"]])
def test_bad_seeds_are_refused_when_the_suite_or_study_starts(tmp_path, monkeypatch, capsys, seeds, expect, suite):
    """Issue 59 class 7: not per stage later, after the SFT and reward models were trained."""
    message = _main(monkeypatch, capsys, *suite, "--seeds", *seeds, "--workdir", str(tmp_path), "--dry-run")
    assert message.startswith(expect) and "\n" not in message
    assert not (tmp_path / "runs").exists(), "refused before anything was planned or built"
    with pytest.raises(SystemExit, match="give each seed once"):  # and for a caller of run_suite
        launch.run_suite("quick", [3, 3], workdir=tmp_path, dry_run=True)


@pytest.mark.parametrize("flags, named", [(["--only", "ppo"], "--only"), (["--quick"], "--quick")])
def test_suite_only_flags_given_to_the_study_are_refused(tmp_path, monkeypatch, capsys, flags, named):
    """Issue 59 class 6: the study would silently ignore them."""
    argv = ["study", "--scripts", "rloo.py", *flags, "--workdir", str(tmp_path), "--dry-run"]  # broken: runs nothing
    message = _main(monkeypatch, capsys, *argv)
    assert message.startswith(f"error: {named} acts on the suites, not the study")
    assert not (tmp_path / "runs").exists()


def test_a_missing_or_malformed_accelerate_config_is_one_line_before_any_stage(tmp_path, monkeypatch, capsys):
    """Issue 59 class 8: accelerate would stop each stage with its own traceback; the suite checks the file first
    with accelerate's reader. A real suite's configs are read from the working directory, as its stages are launched."""
    configs = tmp_path / "benchmark" / "accelerate_configs"
    configs.mkdir(parents=True)
    stages = [suites.Stage("s__1", "sft.py", "p", accelerate_config="multi_gpu")]
    monkeypatch.setitem(suites.SUITES, "fake", lambda seeds: stages)
    cases = {
        None: "the accelerate config {} does not exist",
        "distributed_type: [MULTI_GPU\n": "is not one accelerate can read (ParserError: while parsing a flow sequence)",
        "compute_environment: LOCAL_MACHINE\n": "is not one accelerate can read (ValueError: A `distributed_type` must",
    }
    for text, expect in cases.items():
        path = configs / "multi_gpu.yaml"
        path.unlink(missing_ok=True)
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit) as e:
            launch.run_suite("fake", [1], workdir=tmp_path)
        message = str(e.value.code)
        assert message.startswith("error: the accelerate config ") and expect.format(path) in message, message
        assert "git checkout -- benchmark/accelerate_configs" in message and "\n" not in message
        capsys.readouterr()
        launch.run_suite("fake", [1], workdir=tmp_path, dry_run=True)  # a dry run launches nothing: it says so
        assert capsys.readouterr().out.startswith(f"# [warning] {message[len('error: ') :]}\n")
    assert not (tmp_path / "runs").exists(), "nothing launched"
    # the library's own configs load
    for path in sorted((REPO / "benchmark" / "accelerate_configs").glob("*.yaml")):
        assert launch.accelerate_config_problem(path) is None, path


def test_real_check_checks_its_accelerate_configs_first(tmp_path, monkeypatch):
    from benchmark.tools import real_check

    monkeypatch.setattr(real_check, "CONFIGS", tmp_path)  # a checkout whose configs are gone
    monkeypatch.setattr(real_check, "REPO", tmp_path.parent)
    monkeypatch.setattr(real_check, "build_models", lambda *a, **k: pytest.fail("built models before the check"))
    with pytest.raises(SystemExit) as e:
        real_check.run_check(tmp_path / "work", None, ["zero2"], dry_run=True)
    assert str(e.value.code).startswith(f"error: the accelerate config {tmp_path / 'deepspeed_zero2.yaml'} does not")


def test_a_seed_is_the_whole_pipeline_and_seed_1_keeps_its_commands(capsys, tmp_path):
    """Issue 57 item 1: seed s's RL runs start from seed s's SFT policy and reward model, trained with --seed s; seed
    1's commands are the presets' (their model paths are seed 1's), so its finished runs stay valid."""
    stages = {st.run_name: st for st in suites.SUITES["tiny"]([1, 2])}
    assert stages["sft_tiny-math__1"].args() == ["tiny-math", "--run-name", "sft_tiny-math__1"]
    assert stages["sft_tiny-math__2"].args() == ["tiny-math", "--run-name", "sft_tiny-math__2", "--seed", "2"]
    assert stages["rloo_tiny-tldr__1"].args() == ["tiny-tldr", "--run-name", "rloo_tiny-tldr__1", "--seed", "1"]
    assert stages["rloo_tiny-tldr__2"].args()[-4:] == [
        "--sft-model-path",
        "runs/sft_tiny-tldr__2/model",
        "--reward-model-path",
        "runs/rm_tiny-tldr__2/model",
    ]
    assert stages["rloo_tiny-tldr__2"].needs == ["sft_tiny-tldr__2", "rm_tiny-tldr__2"]
    assert stages["grpo_tiny-math__2"].args()[-2:] == ["--model-name-or-path", "runs/sft_tiny-math__2/model"]
    assert "--prm-path runs/prm_tiny-math__2/model" in " ".join(stages["ppo-prm-raw_tiny-math__2"].args())
    assert stages["prm_tiny-math__2"].needs == ["sft_tiny-math__2"]
    assert stages["distill_tiny-math__2"].needs == ["sft_tiny-math__2", "grpo_tiny-math__2"]
    frontier = {st.run_name: st for st in suites.SUITES["frontier"]([3])}
    assert frontier["rm_tiny-tldr-noisy__3"].args()[3:] == [
        "--sft-model-path",
        "runs/sft_tiny-tldr__3/model",
        "--seed",
        "3",
    ]
    assert frontier["dpo-beta0.1_tiny-tldr-noisy__3"].needs == ["sft_tiny-tldr__3", "rm_tiny-tldr-noisy__3"]
    assert frontier["grpo-beta0_tiny-math-kl__3"].needs == ["sft_tiny-math__3"]


def test_a_second_rounding_regime_runs_apart_and_the_cache_knows_the_regime(tmp_path, monkeypatch, capsys):
    """Issue 57 item 2: `--rounding default` runs every stage with ATEN_CPU_CAPABILITY=default in
    WORKDIR/rounding-default; a finished run made under another regime (provenance.json) is not taken as this one's."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    _fake_suite(tmp_path, monkeypatch)
    launch.run_suite("fake", [1], workdir=tmp_path, only=["q"])
    provenance = tmp_path / "runs" / "q__1" / "provenance.json"
    record = json.loads(provenance.read_text())
    record["started"]["host"] = {"numerics_env": {}}  # as a script records it (clean_rlhf_utils.tracking.numerics)
    provenance.write_text(json.dumps(record))
    assert launch.run_suite("fake", [1], workdir=tmp_path, only=["q"]) == {"q__1": "skipped"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    capsys.readouterr()
    action, why = launch.decide(
        tmp_path / "runs", "q__1", ["p", "--run-name", "q__1", "--seed", "1"], (), tmp_path / "ok.py"
    )
    assert (action, why) == (
        "rerun",
        "it ran with ATEN_CPU_CAPABILITY=(unset) and the suite runs with default: another rounding regime",
    )
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(sys, "argv", ["run", "quick", "--seeds", "1", "--rounding", "default", "--dry-run"])
    monkeypatch.setattr(sys, "argv", sys.argv + ["--workdir", str(tmp_path / "w")])
    with pytest.raises(SystemExit):
        run.main()
    out = capsys.readouterr().out
    assert out.startswith(
        f"# rounding default: ATEN_CPU_CAPABILITY=default; runs in {tmp_path / 'w' / 'rounding-default'}/runs"
    )
    assert os.environ.pop("ATEN_CPU_CAPABILITY") == "default", "the stages inherit it"


def test_the_suite_never_deletes_a_directory_that_is_not_a_run(tmp_path, monkeypatch, capsys):
    """Issue 59 class 1: a stage to rerun has its directory deleted (`--overwrite`); one holding what is not a run of
    this library is refused in one line and left as it is, and the suite goes on with the others."""
    _fake_suite(tmp_path, monkeypatch)
    mine = tmp_path / "runs" / "a__1"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("mine")
    status = launch.run_suite("fake", [1], workdir=tmp_path, only=["a", "q"])
    assert status == {"a__1": "failed", "q__1": "ok"}
    out = capsys.readouterr().out
    assert f"[FAILED] a__1: rerunning it (--overwrite) would delete {mine}, which is not a run of this library" in out
    assert (mine / "thesis.tex").read_text() == "mine" and not (mine / "done.json").exists()
    launch.run_suite("fake", [1], workdir=tmp_path, only=["a"], dry_run=True)
    assert "# [refused] a__1: rerunning it (--overwrite) would delete" in capsys.readouterr().out
