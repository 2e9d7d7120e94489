"""The run directory is exactly one plain child of --output-dir, owned by what it resolves to; --overwrite never costs a
finished run before the new one finishes; a checkpoint holds no pickle this library loads unsafely (issue 51 items
1-3; docs/faults.md "The run directory" and "Checkpoints run no code")."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_faults import small_sft_args


@pytest.mark.parametrize("name", [".", "..", "a/b", "../escape", "x" * 300])
def test_a_run_name_that_is_not_one_plain_name_is_refused_before_anything_is_touched(assets, tmp_path, name):
    import sft

    out = tmp_path / "runs"
    (out / "finished").mkdir(parents=True)
    (out / "finished" / "done.json").write_text("{}")
    with pytest.raises(SystemExit, match="error: --run-name .*(not a plain directory name|bytes long)"):
        sft.main(small_sft_args(assets, out, run_name=name, overwrite=True))
    assert (out / "finished" / "done.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_a_symlinked_run_directory_is_refused_and_left_alone(assets, tmp_path):
    import sft

    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(SystemExit, match="is a symbolic link"):
        sft.main(small_sft_args(assets, tmp_path, run_name="link", overwrite=True))
    assert (target / "keep.txt").read_text() == "mine"


def test_a_symlinked_output_directory_shares_the_lock_of_what_it_points_to(assets, tmp_path):
    import sft

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    # another process runs real/r (it holds the lock, as a run does, until its stdin closes)
    hold = "import sys; from pathlib import Path; from clean_rlhf_utils import ownership; "
    hold += (
        f"assert ownership.take_lock(Path({str(real / 'r')!r})) is None; print('held', flush=True); sys.stdin.read()"
    )
    owner = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match="is in use by"):
            sft.main(small_sft_args(assets, tmp_path / "alias", run_name="r"))
    finally:
        owner.communicate("")
    assert not (real / "r").exists()


def test_overwrite_keeps_the_finished_run_until_the_new_one_finishes(assets, tmp_path, monkeypatch):
    import sft
    from clean_rlhf_utils import runs

    sft.main(small_sft_args(assets, tmp_path))
    run_dir, previous = tmp_path / "r", tmp_path / ".r.previous"
    files = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    def broken(self, *a, **k):
        raise RuntimeError("the new run fails part way")

    with monkeypatch.context() as m:
        m.setattr(runs.Run, "log", broken)
        with pytest.raises(RuntimeError, match="part way"):
            sft.main(small_sft_args(assets, tmp_path, overwrite=True, learning_rate=1e-4))
    kept = {p.relative_to(previous): p.read_bytes() for p in previous.rglob("*") if p.is_file()}
    assert kept == files  # the finished run, whole, where the note said
    sft.main(small_sft_args(assets, tmp_path, overwrite=True, learning_rate=1e-4))  # the unfinished one is deleted
    assert json.loads((run_dir / "config.json").read_text())["learning_rate"] == 1e-4
    assert (run_dir / "done.json").exists() and not previous.exists()  # replaced only once the new run finished


class Planted:
    """A pickle that writes a file when it is loaded, as a tampered checkpoint would run any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def stopped_after_first_checkpoint(assets, tmp_path, monkeypatch) -> Path:
    """An SFT run stopped (as by SIGTERM) after its first step: its checkpoint/ as --resume finds it."""
    import sft
    from clean_rlhf_utils import runs

    with monkeypatch.context() as m:
        m.setattr(runs.Run, "stop_requested", lambda self: True)
        with pytest.raises(SystemExit):
            sft.main(small_sft_args(assets, tmp_path, max_train_samples=32))
    checkpoint = tmp_path / "r" / "checkpoint"
    assert (checkpoint / "state.json").exists()
    return checkpoint


def test_the_schedule_is_checkpointed_as_json_and_no_pickle_of_it_is_written(assets, tmp_path, monkeypatch):
    checkpoint = stopped_after_first_checkpoint(assets, tmp_path, monkeypatch)
    assert not list(checkpoint.glob("custom_checkpoint_*.pkl"))
    schedule = json.loads((checkpoint / "custom_state_0.json").read_text())
    assert schedule["last_epoch"] == 1 and "base_lrs" in schedule


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_resume_never_runs_code_planted_in_a_checkpoint(assets, tmp_path, monkeypatch, planted):
    import sft

    checkpoint = stopped_after_first_checkpoint(assets, tmp_path, monkeypatch)
    marker = tmp_path / "code-ran"
    (checkpoint / planted).write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(
        SystemExit, match=r"^error: --resume: .*(is a pickle|cannot be loaded|is not a whole torch file)"
    ) as e:
        sft.main(small_sft_args(assets, tmp_path, max_train_samples=32, resume=True))
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_an_output_dir_given_as_a_quoted_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """Issue 67 item 7: `--output-dir '~/x'` (quoted: no shell expanded it) wrote ./~/x; it is the home folder's x."""
    import sft
    from clean_rlhf_utils.runs import check_args

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = sft.Args(output_dir="~/x")
    check_args(args)
    assert args.output_dir == str(tmp_path / "home" / "x")
    args = sft.Args(output_dir="runs")
    check_args(args)
    assert args.output_dir == "runs"  # a relative path stays as given
