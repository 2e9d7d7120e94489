"""benchmark.run: the suites point at presets that exist, failures are reported and the suite goes on,
dependents of a failed stage are skipped, and a finished stage is not rerun."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmark import run

REPO = Path(__file__).resolve().parent.parent


def _presets(script: Path) -> set[str]:
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PRESETS":
            return {k.value for k in node.value.keys}
    return set()


@pytest.mark.parametrize("suite", sorted(run.SUITES))
def test_every_stage_names_an_existing_script_and_preset(suite):
    stages = run.SUITES[suite]([1, 2, 3])
    names = [st.run_name for st in stages]
    assert len(names) == len(set(names)), "run names are unique"
    for st in stages:
        script = REPO / st.script
        assert script.exists(), f"{st.run_name}: {st.script} is missing"
        assert st.preset in _presets(script), f"{st.run_name}: {st.script} has no preset {st.preset!r}"
        assert set(st.needs) <= set(names[: names.index(st.run_name)]), "a stage only needs earlier stages"


def test_real_suites_print_accelerate_commands(capsys):
    status = run.run_suite("tldr", [1], dry_run=True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(status) and all(v == "dry-run" for v in status.values())
    assert all(line.startswith("accelerate launch --config_file benchmark/accelerate_configs/") for line in out)
    assert any("ppo_rlhf.py tldr-pythia-6.9b" in line and "deepspeed_zero3.yaml" in line for line in out)
    assert not (REPO / "runs" / "ppo_tldr-pythia-1b__1").exists(), "a dry run runs nothing"


def _fake_suite(tmp_path: Path, monkeypatch):
    ok = tmp_path / "ok.py"
    ok.write_text("import sys, pathlib\nname = sys.argv[sys.argv.index('--run-name') + 1]\n"
                  "pathlib.Path('runs', name).mkdir(parents=True, exist_ok=True)\n"
                  "pathlib.Path('runs', name, 'metrics.jsonl').write_text('{\"step\": 0, \"episode\": 0, \"time\": 0, \"eval/x\": 1.5}\\n')\n"
                  "open('calls.txt', 'a').write(name + '\\n')\n")
    (tmp_path / "bad.py").write_text("raise SystemExit('boom')\n")
    stages = [run.Stage("a__1", str(ok), "p"), run.Stage("b__1", str(tmp_path / "bad.py"), "p"),
              run.Stage("c__1", str(ok), "p", needs=["b__1"]), run.Stage("d__1", str(ok), "p", needs=["a__1"])]
    monkeypatch.setitem(run.SUITES, "fake", lambda seeds: stages)


@pytest.mark.parametrize("jobs", [1, 2])
def test_failed_stage_is_reported_dependents_skipped_and_finished_stages_not_rerun(tmp_path, monkeypatch, capsys, jobs):
    _fake_suite(tmp_path, monkeypatch)
    status = run.run_suite("fake", [1], workdir=tmp_path, jobs=jobs)
    assert status == {"a__1": "ok", "b__1": "failed", "c__1": "blocked", "d__1": "ok"}
    out = capsys.readouterr().out
    assert "[FAILED] b__1" in out and "boom" in out
    assert (tmp_path / "runs" / "a__1" / "DONE").exists() and not (tmp_path / "runs" / "b__1" / "DONE").exists()
    assert "eval/x 1.500" in (tmp_path / "runs" / "fake_summary.md").read_text()
    status = run.run_suite("fake", [1], workdir=tmp_path, jobs=jobs)
    assert status["a__1"] == status["d__1"] == "skipped" and status["b__1"] == "failed"
    assert (tmp_path / "calls.txt").read_text().split() == ["a__1", "d__1"], "finished stages ran once"


def test_only_takes_algorithm_track_names_and_quick_appends_the_shorter_budget(capsys):
    status = run.run_suite("tiny", [1], dry_run=True, only=["ppo_tiny-tldr", "grpo_tiny-math"], quick=True)
    # the two stages and what they need, not PPO on tiny-math nor the other GRPO variants
    assert sorted(status) == ["grpo_tiny-math__1", "ppo_tiny-tldr__1", "rm_tiny-tldr__1", "sft_tiny-math__1", "sft_tiny-tldr__1"]
    out = capsys.readouterr().out
    ppo = next(line for line in out.splitlines() if "--run-name ppo_tiny-tldr__1" in line)
    assert ppo.endswith("--seed 1 --total-episodes 512 --eval-every 8")
    assert "--total-steps 20" in out and "sft.py tiny-tldr --run-name sft_tiny-tldr__1\n" in out  # SFT has no quick budget
    run.run_suite("tiny", [1], dry_run=True, only=["ppo"])  # an algorithm name keeps it on both tracks, full budgets
    out = capsys.readouterr().out
    assert "ppo_tiny-math__1" in out and "ppo_tiny-tldr__1" in out and "--total-episodes 512" not in out
