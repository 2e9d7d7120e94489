"""`--overwrite` deletes only a run of this library, and `--resume` continues only this run's checkpoint from run files
it can read (issue 59, classes 1 and 5; docs/faults.md "The run directory"): a directory holding anything a run does
not write is refused in one line naming it, and left as it was (`storage.not_a_run_problem`, which the tools that clean
a folder call too); a checkpoint records its run's name and seed, and one copied from another run is refused; a run
file replaced by a directory, or unreadable, is one line before anything loads, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from clean_rlhf_utils import runs, storage
from tests.test_faults import small_sft_args


def write_layout(root, layout: dict) -> None:
    """`root` holding `layout`: a relative path to its text or bytes, or None for a directory."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in layout.items():
        path = root / rel
        if text is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


CONFIG = json.dumps({"run_name": "r", "seed": 1, "output_dir": "runs"})
RUN_LAYOUTS = {
    "empty": {},
    "a probe a killed run left": {".write-test-4242": ""},
    "died before its first step": {"config.json": CONFIG, "provenance.json": "{}"},
    "stopped, tracked": {
        "config.json": CONFIG,
        "metrics.jsonl": '{"step": 1}\n',
        "samples.jsonl": "",
        "provenance.json": "{}",
        "checkpoint/state.json": '{"step": 1}',
        "checkpoint.prev/state.json": '{"step": 0}',
        "checkpoint.tmp/model.safetensors": b"half",
        "wandb/offline-run-x/run.wandb": b"",
        "wandb_id": "abcd1234",
    },
    "finished, killed between model/'s renames": {
        "config.json": CONFIG,
        "metrics.jsonl": "",
        "model.old/model.safetensors": b"w",
        "model.tmp": None,
        "done.json": "{}",
        "done.json.tmp": "{",
    },
    "a checkpoint alone": {"checkpoint/state.json": '{"step": 3}'},
    "an older benchmark.run's DONE": {"metrics.jsonl": "", "DONE": ""},
}


@pytest.mark.parametrize("layout", RUN_LAYOUTS, ids=list(RUN_LAYOUTS))
def test_a_directory_that_holds_only_a_runs_output_may_be_deleted(tmp_path, layout):
    write_layout(tmp_path / "r", RUN_LAYOUTS[layout])
    assert storage.not_a_run_problem(tmp_path / "r") is None
    assert storage.not_a_run_problem(tmp_path / "absent") is None


NOT_RUNS = {
    "a home directory": ({".bashrc": "", "projects/a.py": "", "config.json": CONFIG}, "it holds .bashrc, projects/"),
    "a run with the user's notes": ({"config.json": CONFIG, "metrics.jsonl": "", "notes.md": "mine"}, "holds notes.md"),
    "a model directory": (
        {"config.json": '{"model_type": "llama"}', "model.safetensors": b"w", "tokenizer.json": "{}"},
        "it holds config.json (not a run's arguments), model.safetensors, tokenizer.json",
    ),
    "config.json a directory": (
        {"config.json/keep.txt": "mine", "metrics.jsonl": ""},
        "it holds config.json/ (a directory where a run writes a file)",
    ),
    "model a file": ({"config.json": CONFIG, "model": "mine"}, "model (a file where a run writes a directory)"),
    "only a model": ({"model/model.safetensors": b"w"}, "which holds model/ but none of a run's own files"),
    "only wandb": ({"wandb/settings": ""}, "which holds wandb/ but none of a run's own files"),
    "five foreign entries": ({f"f{i}": "" for i in range(5)}, "it holds f0, f1, f2, f3, ... (5 in all)"),
}


@pytest.mark.parametrize("layout", NOT_RUNS, ids=list(NOT_RUNS))
def test_anything_else_is_one_line_naming_what_is_there(tmp_path, layout):
    files, named = NOT_RUNS[layout]
    write_layout(tmp_path / "r", files)
    message = storage.not_a_run_problem(tmp_path / "r")
    assert message.startswith(f"error: --overwrite would delete {tmp_path / 'r'}, which ") and "\n" not in message
    assert named in message and message.endswith("or pass another --run-name"), message


def test_a_link_a_file_and_a_link_inside_are_refused_and_a_tool_names_its_own_action(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    assert "which is a symbolic link (to " in storage.not_a_run_problem(tmp_path / "link")
    (tmp_path / "file").write_text("mine")
    assert "which is a file, not a run directory" in storage.not_a_run_problem(tmp_path / "file")
    write_layout(tmp_path / "r", {"config.json": CONFIG})
    (tmp_path / "r" / "model").symlink_to(tmp_path / "elsewhere")
    message = storage.not_a_run_problem(
        tmp_path / "r", action="benchmark.run --overwrite", fix="pass another --workdir"
    )
    assert message.startswith(f"error: benchmark.run --overwrite would delete {tmp_path / 'r'}, which is not a run")
    assert "it holds model (a symbolic link)" in message and message.endswith("or pass another --workdir")


def test_overwrite_of_a_folder_that_is_no_run_touches_nothing(assets, tmp_path, monkeypatch):
    """A user's folder under the run's name: refused before anything loads, every byte where it was."""
    import sft

    monkeypatch.setattr(runs.Run, "begin", lambda self: pytest.fail("refused only once everything was loaded"))
    write_layout(tmp_path / "r", {"thesis.tex": "mine", "figures/a.png": b"\x89PNG", "metrics.jsonl": "{}\n"})
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        sft.main(small_sft_args(assets, tmp_path, overwrite=True))
    assert str(e.value).startswith(f"error: --overwrite would delete {tmp_path / 'r'}, which is not a run of this ")
    assert "it holds figures/, thesis.tex;" in str(e.value)
    assert snapshot(tmp_path) == before  # no .r.previous, no lock left, nothing written


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory):
    """A finished sft run, tracked offline (wandb/ and wandb_id beside the run's own files)."""
    import sft

    out = tmp_path_factory.mktemp("finished")
    sft.main(small_sft_args(assets, out, track=True, save_model=True))
    return out / "r"


def test_a_real_finished_run_is_a_run_and_a_foreign_previous_beside_it_is_left_alone(assets, finished, tmp_path):
    import sft

    assert {"wandb", "wandb_id", "model", "done.json"} <= {p.name for p in finished.iterdir()}
    assert storage.not_a_run_problem(finished) is None
    # a folder of the user's where a finished run's .previous would go: --overwrite refuses; a run that finishes
    # without --overwrite (the name was free) no longer deletes it
    shutil.copytree(finished, tmp_path / "r")
    write_layout(tmp_path / ".r.previous", {"keep.txt": "mine"})
    with pytest.raises(
        SystemExit, match=r"would delete .*\.r\.previous, which is not a run of this library: it holds k"
    ):
        sft.main(small_sft_args(assets, tmp_path, overwrite=True))
    assert (tmp_path / "r" / "done.json").exists()
    write_layout(tmp_path / ".fresh.previous", {"keep.txt": "mine"})
    sft.main(small_sft_args(assets, tmp_path, run_name="fresh"))
    assert (tmp_path / ".fresh.previous" / "keep.txt").read_text() == "mine"
    assert (tmp_path / ".r.previous" / "keep.txt").read_text() == "mine"


# ---- class 5: whose checkpoint, and run files it can read ----


@pytest.fixture(scope="module")
def stopped(assets, tmp_path_factory):
    """An sft run `src` of seed 2 stopped (as by SIGTERM) after its first step: checkpoint/ as --resume finds it."""
    import sft

    out = tmp_path_factory.mktemp("stopped")
    mp = pytest.MonkeyPatch()
    mp.setattr(runs.Run, "stop_requested", lambda self: True)
    try:
        with pytest.raises(SystemExit):
            sft.main(small_sft_args(assets, out, run_name="src", seed=2, max_train_samples=32))
    finally:
        mp.undo()
    assert (out / "src" / "checkpoint" / "state.json").exists()
    return out / "src"


def resume(assets, out, **kw):
    import sft

    return sft.main(small_sft_args(assets, out, max_train_samples=32, resume=True, **kw))


def test_the_checkpoint_records_whose_it_is(stopped):
    state = storage.read_state(stopped / "checkpoint")
    assert state["run"] == {"run_name": "src", "seed": 2, "exp_name": "sft"}
    assert storage.state_problem(stopped / "checkpoint", state) is None  # under the digest


def test_a_checkpoint_copied_from_another_run_name_is_refused(assets, stopped, tmp_path):
    """The whole run copied to another name (its config.json agrees with the flags): the checkpoint says whose it is."""
    shutil.copytree(stopped, tmp_path / "dst")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        resume(assets, tmp_path, run_name="dst", seed=2)
    assert str(e.value) == (
        f"error: --resume: {tmp_path / 'dst' / 'checkpoint'} was written by another run (--run-name src, --seed 2), "
        "not by this one (--run-name dst, --seed 2): copied here, it would continue that run under this one's name; "
        "resume that run in its own directory, or start this one over with --overwrite"
    )
    assert snapshot(tmp_path) == before


def test_a_checkpoint_copied_from_another_seed_is_refused(assets, stopped, tmp_path):
    """Seed 2's checkpoint in the directory of the same run name whose config.json says seed 1."""
    shutil.copytree(stopped, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "seed": 1}))
    with pytest.raises(SystemExit, match=r"\(--run-name src, --seed 2\), not by this one \(--run-name src, --seed 1\)"):
        resume(assets, tmp_path, run_name="src", seed=1)
    assert not (tmp_path / "src" / "done.json").exists()


def test_a_checkpoint_without_the_record_still_resumes(assets, stopped, tmp_path):
    """Checkpoints written before the record was kept: not refused (their digest covers what they hold)."""
    shutil.copytree(stopped, tmp_path / "src")
    path = tmp_path / "src" / "checkpoint" / "state.json"
    state = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("run", "digest")}
    state["digest"] = storage.state_digest(path.parent, state)
    path.write_text(json.dumps(state))
    resume(assets, tmp_path, run_name="src", seed=2)
    assert json.loads((tmp_path / "src" / "done.json").read_text())["step"] == 4


@pytest.mark.parametrize(
    "name, content, says, flags",
    [
        ("metrics.jsonl", None, "is a directory where the run writes a file", {}),
        ("samples.jsonl", b"\xff\xfe{}", "cannot be read as the run wrote it ('utf-8' codec can't decode", {}),
        ("provenance.json", "[1, 2]", "cannot be read as the run wrote it (not a JSON object)", {}),
        ("provenance.json", '{"started": ', "cannot be read as the run wrote it (Expecting value", {}),
        ("wandb_id", None, "is a directory where the run writes a file", {"track": True}),
        ("checkpoint.prev", "x", "is a file where the run writes a directory", {}),
    ],
    ids=["metrics-dir", "samples-not-utf8", "provenance-list", "provenance-torn", "wandb-id-dir", "prev-a-file"],
)
def test_a_run_file_replaced_or_unreadable_is_one_line_before_anything_loads(
    assets, stopped, tmp_path, name, content, says, flags
):
    shutil.copytree(stopped, tmp_path / "src")
    path = tmp_path / "src" / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    write_layout(tmp_path / "src", {f"{name}/kept.txt" if content is None else name: content or "mine"})
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        resume(assets, tmp_path, run_name="src", seed=2, **flags)
    assert str(e.value).startswith(f"error: --resume: {path} {says}") and "\n" not in str(e.value), str(e.value)
    assert str(e.value).endswith("restore the run's own, or move it away and start over with --overwrite")
    assert snapshot(tmp_path) == before


def test_a_forks_record_names_its_parent_and_wandb_groups_it_with_the_parent(tmp_path, monkeypatch):
    """Issue 58 item 6: a fork's script record holds its parent's name and sha256 and the lines it adds and removes;
    --track puts its runs in the wandb group of its family, tagged with its own name."""
    import hashlib
    import sys
    import types
    from pathlib import Path
    from types import SimpleNamespace

    from clean_rlhf_utils import tracking

    (tmp_path / "rloo.py").write_text("a\nb\nc\n")
    fork = tmp_path / "rloo_x.py"
    fork.write_text('PARENT = "rloo"\na\nx\nc\n')  # + the PARENT line and x, - b
    parent = tracking.fork_parent(fork, tmp_path)
    sha = hashlib.sha256(b"a\nb\nc\n").hexdigest()
    assert parent == {"name": "rloo", "sha256": sha, "added": 2, "removed": 1}
    assert tracking.script_record(fork, tmp_path)["parent"] == parent  # in done.json and provenance.json
    assert tracking.fork_parent(tmp_path / "rloo.py", tmp_path) is None  # a library script has no parent
    (tmp_path / "undeclared.py").write_text("a\nb\n")
    assert tracking.fork_parent(tmp_path / "undeclared.py", tmp_path) is None
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    repo = Path(tracking.__file__).resolve().parent.parent
    args = SimpleNamespace(wandb_project="p", wandb_entity=None, run_name="r")
    monkeypatch.setattr(tracking.dataclasses, "asdict", lambda a: {})
    for script, group in ((repo / "grpo_clip_cov.py", "grpo_math"), (repo / "rloo.py", "rloo")):
        monkeypatch.setattr(tracking, "script_path", lambda a, s=script: s)
        tracking.start_wandb(args, tmp_path)
        assert (seen["group"], seen["tags"]) == (group, [script.stem])
