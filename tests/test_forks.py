"""Issue 49: a copied script is its own variant. Its runs are named after its file, its provenance.json and done.json
say which file ran (path, sha256, tracked / modified / untracked), `benchmark.compare` warns when one label groups
runs of different scripts, and the library's own scripts keep the run names their presets always had."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clean_rlhf_utils.runs import cli, name_run
from clean_rlhf_utils.tracking import provenance, script_record

REPO = Path(__file__).resolve().parent.parent

# every preset's run name as the presets spelled them (the presets' model paths, benchmark/run.py and the docs use them)
LIBRARY_NAMES = {
    "sft": "tldr-pythia-1b sft_tldr_pythia-1b, tldr-pythia-2.8b sft_tldr_pythia-2.8b, "
    "tldr-pythia-6.9b sft_tldr_pythia-6.9b, tiny-tldr sft_tiny-tldr, tiny-math sft_tiny-math",
    "reward_model": "tldr-pythia-1b rm_tldr_pythia-1b, tldr-pythia-2.8b rm_tldr_pythia-2.8b, "
    "tldr-pythia-6.9b rm_tldr_pythia-6.9b, tiny-tldr rm_tiny-tldr, tiny-tldr-noisy rm_tiny-tldr-noisy, "
    "tiny-math-prm prm_tiny-math",
    **{
        script: f"tldr-pythia-1b {label}_tldr_pythia-1b, tldr-pythia-2.8b {label}_tldr_pythia-2.8b, "
        f"tldr-pythia-6.9b {label}_tldr_pythia-6.9b, gsm8k-qwen2.5-0.5b {label}_gsm8k_qwen2.5-0.5b, "
        f"tiny-tldr {label}_tiny-tldr, tiny-tldr-noisy {label}_tiny-tldr-noisy, tiny-math {label}_tiny-math"
        for script, label in (("ppo_rlhf", "ppo"), ("rloo", "rloo"), ("remax", "remax"))
    },
    "grpo_math": "gsm8k-qwen2.5-0.5b grpo_gsm8k_qwen2.5-0.5b, math-qwen2.5-math-1.5b grpo_math_qwen2.5-math-1.5b, "
    "tiny grpo_tiny",
    "dpo": "tldr-pythia-1b dpo_tldr_pythia-1b, tldr-pythia-2.8b dpo_tldr_pythia-2.8b, "
    "tldr-pythia-6.9b dpo_tldr_pythia-6.9b, tldr-pythia-1b-online online_dpo_tldr_pythia-1b, "
    "tiny-tldr dpo_tiny-tldr, tiny-tldr-noisy dpo_tiny-tldr-noisy, tiny-tldr-noisy-online online_dpo_tiny-tldr-noisy, "
    "tiny-tldr-online online_dpo_tiny-tldr",
}


def load_copy(script: str, path: Path, edit=lambda text: text):
    """The library's `script` saved (edited) as `path`, imported under its own name as `python path` would run it."""
    path.write_text(edit((REPO / f"{script}.py").read_text()))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(LIBRARY_NAMES))
def test_the_library_keeps_its_run_names(script):
    module = importlib.import_module(script)
    expected = dict(pair.split(" ") for pair in LIBRARY_NAMES[script].split(", "))
    assert {preset: cli(module.PRESETS, args=[preset]).exp_name for preset in module.PRESETS} == expected
    args = cli(module.PRESETS, args=[next(iter(expected)), "--seed", "3"])
    name_run(args)
    assert args.run_name == f"{expected[next(iter(expected))]}__3"


@pytest.mark.parametrize(
    "script, copy, preset",
    [("rloo", "rloo_batchmean", "tiny-tldr"), ("grpo_math", "grpo_mine", "tiny"), ("dpo", "dpo_x", "tiny-tldr-online")],
)
def test_a_copy_is_named_after_its_file(tmp_path, script, copy, preset):
    module = load_copy(script, tmp_path / f"{copy}.py")
    try:
        args = cli(module.PRESETS, args=[preset, "--seed", "2"])
        name_run(args)
        assert (args.exp_name, args.run_name) == (f"{copy}_{preset}", f"{copy}_{preset}__2")
        args = cli(module.PRESETS, args=[preset, "--exp-name", "mine"])  # the flags still name it
        name_run(args)
        assert args.run_name == "mine__1"
        args = cli(module.PRESETS, args=[preset, "--run-name", "here"])
        name_run(args)
        assert args.run_name == "here"
    finally:
        sys.modules.pop(copy, None)


def _git(repo: Path, *command: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    subprocess.run(
        ["git", *command], cwd=repo, check=True, capture_output=True, env={**env, "GIT_COMMITTER_EMAIL": "t@t"}
    )


def test_the_record_says_whether_git_knows_the_script(tmp_path):
    import hashlib

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "algo.py").write_text("x = 1\n")
    _git(repo, "add", "algo.py")
    _git(repo, "commit", "-qm", "algo")
    (repo / "fork.py").write_text("x = 2\n")
    (tmp_path / "outside.py").write_text("x = 3\n")
    assert script_record(repo / "algo.py", repo) == {
        "path": "algo.py",
        "sha256": hashlib.sha256(b"x = 1\n").hexdigest(),
        "git": "tracked",
    }
    assert script_record(repo / "fork.py", repo)["git"] == "untracked"
    assert script_record(tmp_path / "outside.py", repo)["git"] == "untracked"
    (repo / "algo.py").write_text("x = 4\n")
    assert script_record(repo / "algo.py", repo)["git"] == "modified"
    assert script_record(repo / "algo.py", tmp_path / "nowhere")["git"] is None  # no git checkout: unknown
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode == 0:
        made = provenance(tmp_path / "outside.py")  # the library's checkout, a script git does not know
        assert made["script"]["git"] == "untracked" and made["git"]["dirty"] is True


def test_a_fork_outside_the_checkout_runs_from_its_folder_and_records_no_folder(tmp_path):
    """Issue 58 item 6: a fork in ~/experiments runs from there (the library an installed package), and its records
    name its file, not the folders of the user's machine; its parent is found in the library."""
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    fork = experiments / "rloo_x.py"
    fork.write_text((REPO / "rloo.py").read_text().replace("\nimport ", '\nPARENT = "rloo"\nimport ', 1))
    record = script_record(fork)
    assert (record["path"], record["outside"], record["git"]) == ("rloo_x.py", True, "untracked")
    assert record["parent"]["name"] == "rloo" and record["parent"]["added"] == 1
    assert str(tmp_path) not in json.dumps(provenance(fork)), "a folder of this machine in the record"
    assert "outside" not in script_record(REPO / "rloo.py")
    out = subprocess.run([sys.executable, "rloo_x.py", "--help"], cwd=experiments, capture_output=True, text=True)
    assert out.returncode == 0 and "tiny-tldr" in out.stdout, out.stderr[-2000:]


def test_the_conventions_check_a_fork_outside_the_checkout_when_asked(tmp_path):
    """CLEAN_RLHF_FORKS=~/experiments gives a fork kept there the convention checks of tests/test_conventions.py."""
    fork = tmp_path / "rloo_x.py"
    text = (REPO / "rloo.py").read_text().replace("\nimport ", '\nPARENT = "rloo"\nimport ', 1)
    checks = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "test_conventions.py")]
    env = {**os.environ, "CLEAN_RLHF_FORKS": str(tmp_path)}
    for source, code in ((text, 0), (text.replace("\nimport ", "\nimport benchmark\nimport ", 1), 1)):
        fork.write_text(source)
        out = subprocess.run(
            [sys.executable, *checks, "-k", "stands_alone and rloo_x"], env=env, capture_output=True, text=True
        )
        assert out.returncode == code and ("1 passed" if code == 0 else "1 failed") in out.stdout, out.stdout[-2000:]
    env["CLEAN_RLHF_FORKS"] = str(tmp_path / "nothing_here")
    out = subprocess.run(
        [sys.executable, *checks, "-k", "outside_the_checkout"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 1 and "which are not there" in out.stdout, out.stdout[-2000:]


def test_a_copys_run_is_its_own_and_says_what_ran(assets, tmp_path):
    """The acceptance run of issue 49: a copy with one algorithmic line changed (RLOO's leave-one-out baseline becomes
    the batch mean), run from its preset: runs/<copy>_<preset>__1, and its record names the copy."""
    line = "baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)"
    copy = tmp_path / "rloo_batchmean.py"
    text = (REPO / "rloo.py").read_text()
    assert line in text
    copy.write_text(text.replace(line, "baseline = grouped.mean(1, keepdim=True)"))
    flags = ["--sft-model-path", str(assets / "models" / "tiny-llama"), "--dataset-name-or-path"]
    flags += [str(assets / "tiny-math" / "gsm8k"), "--response-length", "8", "--total-episodes", "8"]
    flags += ["--per-device-batch-size", "8", "--rloo-k", "4", "--num-eval-examples", "4", "--num-threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(copy), "tiny-math", *flags, "--per-device-eval-batch-size", "4", "--no-save-model"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "rloo_batchmean_tiny-math__1"
    import hashlib

    mine = {"path": copy.name, "sha256": hashlib.sha256(copy.read_bytes()).hexdigest(), "git": "untracked"}
    mine["outside"] = True  # a copy outside the checkout: its file name, no folder of this machine
    record = json.loads((run / "provenance.json").read_text())["started"]
    assert record["script"] == mine and record["git"]["dirty"] in (True, None)  # None: the library is no checkout
    assert json.loads((run / "done.json").read_text())["script"] == mine
    assert json.loads((run / "config.json").read_text())["exp_name"] == "rloo_batchmean_tiny-math"


def test_compare_warns_when_one_label_groups_different_scripts(tmp_path, capsys):
    from benchmark import compare, curves

    for seed, sha in ((1, "a" * 64), (2, "b" * 64), (3, "a" * 64)):
        run = tmp_path / f"mine_tiny-tldr__{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "episode": 8, "eval/gold_reward": 0.5}) + "\n")
        (run / "done.json").write_text("{}")
        script = {"path": "mine.py", "sha256": sha, "git": "untracked"}
        (run / "provenance.json").write_text(json.dumps({"started": {"script": script}}))
    runs = [curves.read_run(p) for p in sorted(tmp_path.glob("mine_*"))]
    assert curves.mixed_scripts(runs) == [
        "mine_tiny-tldr groups runs of different scripts (sha256 aaaaaaaaaaaa: mine_tiny-tldr__1, mine_tiny-tldr__3; "
        "bbbbbbbbbbbb: mine_tiny-tldr__2)"
    ]
    assert curves.mixed_scripts([runs[0], runs[2]]) == []
    assert compare.main([str(p) for p in sorted(tmp_path.glob("mine_*"))] + ["--out", str(tmp_path / "c")]) == 0
    assert "warning: mine_tiny-tldr groups runs of different scripts" in capsys.readouterr().err


# ---- issue 69: a declared fork is its parent plus its recorded variant (benchmark/tools/fork_check.py) ----


def _declared_forks() -> list[Path]:
    from benchmark.tools.fork_check import parent_of

    return [p for p in sorted(REPO.glob("*.py")) if parent_of(p)]


def test_every_declared_fork_of_the_library_is_its_parent_and_its_variant(capsys):
    from benchmark.tools import fork_check

    # the forks that keep a record (a user's copy in the checkout without one is left alone)
    forks = [p for p in _declared_forks() if p.with_name(p.stem + fork_check.SUFFIX).is_file()]
    assert "grpo_clip_cov.py" in [p.name for p in forks]
    for fork in forks:
        assert fork_check.main([str(fork)]) == 0, capsys.readouterr().out
        assert "and its recorded variant" in capsys.readouterr().out


def test_a_parent_fixed_alone_fails_the_fork_until_the_fork_follows(tmp_path, capsys):
    """Editing grpo_math.py alone (a line of k3_kl, a function the fork shares) fails with the line to carry over."""
    from benchmark.tools import fork_check

    for name in ("grpo_math.py", "grpo_clip_cov.py", "grpo_clip_cov.variant.diff"):
        (tmp_path / name).write_text((REPO / name).read_text())
    old, new = "    return torch.exp(delta) - delta - 1\n", "    return torch.exp(delta) - delta - 1.0\n"
    parent, fork = tmp_path / "grpo_math.py", tmp_path / "grpo_clip_cov.py"
    assert parent.read_text().count(old) == 1 and fork.read_text().count(old) == 1
    parent.write_text(parent.read_text().replace(old, new))
    assert fork_check.main([str(fork), "--parent", str(parent)]) == 1
    out = capsys.readouterr().out
    line = parent.read_text().splitlines().index(new.rstrip("\n")) + 1
    assert f"grpo_math.py line {line}: return torch.exp(delta) - delta - 1.0 -- grpo_clip_cov.py has: return " in out
    assert "carry the parent's lines over" in out and "1 differences from grpo_math.py outside its variant" in out
    fork.write_text(fork.read_text().replace(old, new))  # the fork follows
    assert fork_check.main([str(fork), "--parent", str(parent)]) == 0


def test_a_users_fork_outside_the_checkout_records_its_variant_and_is_checked(tmp_path, capsys):
    from benchmark.tools import fork_check

    fork = tmp_path / "elsewhere" / "rloo_batchmean.py"
    fork.parent.mkdir()
    text = (REPO / "rloo.py").read_text().replace("\nimport ", '\nPARENT = "rloo"\nimport ', 1)
    fork.write_text(text.replace("leave-one-out", "batch-mean", 1))
    with pytest.raises(SystemExit, match=r"^error: .*rloo_batchmean.variant.diff does not exist: record the variant"):
        fork_check.main([str(fork)])
    assert fork_check.main([str(fork), "--write"]) == 0
    assert fork_check.main([str(fork)]) == 0
    assert "2 differences from rloo.py" in capsys.readouterr().out  # the PARENT line and the changed one
    parent = tmp_path / "rloo.py"  # the library's rloo.py after a pull that changed one line
    parent.write_text((REPO / "rloo.py").read_text().replace("import torch\n", "import torch  # pulled\n", 1))
    assert fork_check.main([str(fork), "--parent", str(parent)]) == 1
    assert "rloo.py line " in capsys.readouterr().out
    (tmp_path / "plain.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match=r"^error: .*plain.py declares no parent: add a module-level line PARENT ="):
        fork_check.main([str(tmp_path / "plain.py")])


def test_a_script_edited_while_it_runs_is_recorded_as_the_bytes_that_ran_and_runs_again(tmp_path):
    """Issue 67 item 3: done.json's record was taken when the run ended, so a script edited during its run was recorded
    as the edited file and the next study skipped it. The records now name the bytes the process imported, and the
    suite's cache reruns such a run, saying why."""
    import hashlib

    from benchmark import launch

    script = tmp_path / "edits_itself.py"
    script.write_text(
        "import json, sys\nfrom pathlib import Path\nfrom clean_rlhf_utils.tracking import script_record\n"
        "me = Path(__file__)\nme.write_text(me.read_text() + '# edited while running\\n')\n"
        "print(json.dumps(script_record(me)))\n"
    )
    ran = hashlib.sha256(script.read_bytes()).hexdigest()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    now = hashlib.sha256(script.read_bytes()).hexdigest()
    assert record["sha256"] == ran and record["edited_while_running"] == now != ran
    why = launch.script_change(record, script, launched=str(script))
    assert why == f"edits_itself.py was edited while it ran (sha256 {ran[:12]} ran, {now[:12]} now)"
    # a file the process did not run is recorded as it is, with nothing to say
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    assert "edited_while_running" not in script_record(other)


# ---- issue 67 item 7: a fork that runs names its parent, the library script it was copied from ----


def _with_parent(script: str, parent: str) -> str:
    return (REPO / f"{script}.py").read_text().replace("\nimport ", f'\nPARENT = "{parent}"\nimport ', 1)


def test_a_forks_parent_line_must_name_the_library_script_it_was_copied_from(tmp_path):
    """A PARENT naming no script of the checkout, or another script than the one the fork was copied from (which it
    shares CLOSER_BY more of its lines with), was recorded as given; now one `error:` line (the study refuses the
    first as well). A right one, `"rloo.py"` (the study's reading), no PARENT line and the library's own pass."""
    from clean_rlhf_utils.tracking import check_parent

    scripts = "sft, reward_model, ppo_rlhf, rloo, remax, grpo_math, dpo"
    nowhere = f"names no script of this checkout (one of {scripts}): name the script it was copied from"
    cases = {  # the shares move as the scripts change: their digits are left out
        "rlooo": f"PARENT = 'rlooo' {nowhere}",
        "": f"PARENT = '' {nowhere}",
        "remax": "PARENT = 'remax', but it shares #% of its lines with remax.py and 100% with rloo.py: name the script "
        "it was copied from (PARENT = 'rloo'?)",
        "grpo_math": "PARENT = 'grpo_math', but it shares #% of its lines with grpo_math.py and 100% with rloo.py: "
        "name the script it was copied from (PARENT = 'rloo'?)",
    }
    fork = tmp_path / "rloo_x.py"
    for parent, message in cases.items():
        fork.write_text(_with_parent("rloo", parent))
        with pytest.raises(SystemExit) as e:
            check_parent(fork)
        assert re.sub(r"\b\d\d?%", "#%", str(e.value.code)) == f"error: rloo_x.py: {message}"
    for parent in ("rloo", "rloo.py"):
        fork.write_text(_with_parent("rloo", parent))
        check_parent(fork)
    fork.write_text((REPO / "rloo.py").read_text())  # a copy without the line: no parent to check
    check_parent(fork)
    for script in (REPO / "grpo_clip_cov.py", REPO / "rloo.py"):
        check_parent(script)


def test_a_fork_naming_no_script_ends_in_one_line_before_anything_loads(tmp_path, monkeypatch):
    """Run directly (`python rloo_x.py tiny-math`), the PARENT line is checked with the flags, before a model loads."""
    module = load_copy("rloo", tmp_path / "rloo_x.py", lambda text: _with_parent("rloo", "rlo"))
    try:
        monkeypatch.setattr(module.engines, "make_accelerator", lambda *a, **k: pytest.fail("the run went on"))
        args = cli(module.PRESETS, args=["tiny-math", "--output-dir", str(tmp_path / "runs")])
        with pytest.raises(SystemExit, match=r"^error: rloo_x.py: PARENT = 'rlo' names no script of this checkout \("):
            module.main(args)
        assert not (tmp_path / "runs").exists()
    finally:
        sys.modules.pop("rloo_x", None)
