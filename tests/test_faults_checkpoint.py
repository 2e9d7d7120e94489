"""A checkpoint is trusted only as written (issue 51 items 5 and 9; docs/faults.md, "A checkpoint is checked before
it loads"): `--resume` refuses, in one line before anything loads, a `state.json` edited by hand (it claimed step 999
of a 12-step run: nothing more trained, and done.json said step 999) or copied from another checkpoint, a learning-rate
schedule edited beside it, and a weights or optimizer file cut short (a traceback before). An untouched checkpoint
still resumes exactly (tests/test_storage_faults.py)."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from clean_rlhf_utils import runs, storage
from tests.test_faults import sft_flags
from tests.test_storage_faults import error_of, in_process


@pytest.fixture(scope="module")
def stopped(assets, tmp_path_factory):
    """An sft run with `--save-every 2` stopped after step 5: checkpoint/ (step 5) and checkpoint.prev/ (step 4)."""
    import sft

    out = tmp_path_factory.mktemp("trust")
    flags = ["tiny-tldr", *sft_flags(assets, out, "stopped", "--save-every", "2")]
    mp = pytest.MonkeyPatch()
    mp.setattr(runs.Run, "stop_requested", lambda self: bool(self.reached) and self.reached[0] >= 5)
    try:
        with pytest.raises(SystemExit) as e:
            in_process(sft, flags)
    finally:
        mp.undo()
    assert e.value.code == 128 + signal.SIGTERM
    return out / "stopped"


def resume_copy(stopped, tmp_path, assets, edit) -> str:
    """`--resume` of a copy of the stopped run after `edit(run_dir)`: its one error line (nothing trained)."""
    import sft

    run_dir = tmp_path / "stopped"
    shutil.copytree(stopped, run_dir)
    edit(run_dir)
    rows = (run_dir / "metrics.jsonl").read_text()
    message = error_of(sft, ["tiny-tldr", *sft_flags(assets, tmp_path, "stopped", "--save-every", "2"), "--resume"])
    assert (run_dir / "metrics.jsonl").read_text() == rows and not (run_dir / "done.json").exists()
    return message


def edit_json(path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))) + "\n")


def test_the_checkpoint_records_a_digest_of_its_state(stopped):
    state = storage.read_state(stopped / "checkpoint")
    assert state["step"] == 5 and state["digest"] == storage.state_digest(stopped / "checkpoint", state)
    assert storage.state_problem(stopped / "checkpoint", state) is None


@pytest.mark.parametrize(
    "what, edit",
    [
        ("step-999", lambda s: {**s, "step": 999}),
        ("episode", lambda s: {**s, "episode": s["episode"] + 8}),
        ("rows", lambda s: {**s, "rows": {**s["rows"], "metrics.jsonl": 1}}),
        ("no-digest", lambda s: {k: v for k, v in s.items() if k != "digest"}),
    ],
)
def test_an_edited_state_json_is_one_line_before_loading(stopped, tmp_path, assets, what, edit):
    message = resume_copy(stopped, tmp_path, assets, lambda d: edit_json(d / "checkpoint" / "state.json", edit))
    assert message.startswith(
        f"error: --resume: {tmp_path / 'stopped' / 'checkpoint' / 'state.json'} does not describe this checkpoint ("
    ), message
    assert message.endswith("start over with --overwrite")


def test_a_state_json_of_another_checkpoint_or_an_edited_schedule_is_refused(stopped, tmp_path, assets):
    """checkpoint.prev's state.json (step 4, a digest of its own) beside checkpoint/'s files; then the schedule's
    position (`last_epoch`) edited."""

    def swap(d):
        shutil.copy(d / "checkpoint.prev" / "state.json", d / "checkpoint" / "state.json")

    assert "does not describe this checkpoint" in resume_copy(stopped, tmp_path, assets, swap)
    shutil.rmtree(tmp_path / "stopped")
    edit = lambda d: edit_json(d / "checkpoint" / "custom_state_0.json", lambda s: {**s, "last_epoch": 999})  # noqa: E731
    assert "does not describe this checkpoint" in resume_copy(stopped, tmp_path, assets, edit)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_a_cut_checkpoint_file_is_one_line_before_loading(stopped, tmp_path, assets, name):
    def cut(d):
        data = (d / "checkpoint" / name).read_bytes()
        (d / "checkpoint" / name).write_bytes(data[: len(data) // 2])

    message = resume_copy(stopped, tmp_path, assets, cut)
    assert message.startswith(f"error: --resume: {tmp_path / 'stopped' / 'checkpoint' / name} is not a whole "), message
    assert "the checkpoint is damaged" in message
