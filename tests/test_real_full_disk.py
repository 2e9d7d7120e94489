"""A real full disk (issue 51 item 4): the run directory on a small tmpfs, so the writes fail the way a full disk makes
them fail (safetensors' SafetensorError for the weights, torch.save's zip-writer RuntimeError for the optimizer, OSError
for Python's own writes), not an injected OSError (tests/test_storage_faults.py). The run ends in one line naming the
checkpoint to go on from, and once the file system has room again (a tmpfs remounted larger, as a user frees space),
`--resume` finishes with the metrics and weights of an uninterrupted run. Needs root for `mount` (CI is root)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.faults import REPO, assert_same_run, env, run, script_cmd
from tests.test_faults import sft_flags

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs at tmp_path/fs; resize(mb) remounts it at another size; unmounted at the end."""
    mount = tmp_path / "fs"
    mount.mkdir()

    def resize(mb: int, first: bool = False) -> None:
        opts = f"size={mb}m" if first else f"remount,size={mb}m"
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)], check=True)

    try:
        resize(40, first=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield mount, resize
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def failing(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env())
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = re.findall(r"error: [^\r\n]*", out.stderr)  # tqdm's bar may precede it on its line
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def sft_on(out: Path, tmp_path: Path, assets: Path, *extra: str) -> list[str]:
    flags = sft_flags(assets, tmp_path, "r", "--num-train-epochs", "1", *extra)
    i = flags.index("--output-dir")
    flags[i + 1] = str(out)
    return script_cmd("sft", "tiny-tldr", *flags)


def test_a_full_disk_at_a_periodic_checkpoint_ends_in_one_line_and_resumes_exactly(assets, tmp_path, small_fs):
    """40 MiB: the checkpoint of step 2 (weights 8 MB, optimizer 16 MB) fits, the one of step 4 does not."""
    fs, resize = small_fs
    run(sft_on(tmp_path / "ref", tmp_path, assets))
    cmd = sft_on(fs, tmp_path, assets, "--save-every", "2")
    error = failing(cmd)
    assert "writing the checkpoint after step 4 failed" in error and "--resume" in error, error
    assert "checkpoint (after step 2)" in error, error
    assert not (fs / "r" / "checkpoint.tmp").exists()  # the half-written one is removed: its space is given back
    resize(200)
    run([*cmd, "--resume"])
    assert_same_run(fs / "r", tmp_path / "ref" / "r")


def test_a_full_disk_at_the_final_save_keeps_the_last_checkpoint_and_resume_writes_the_model(
    assets, tmp_path, small_fs
):
    """30 MiB: the last step's checkpoint (24 MB) fits, model/ beside it does not."""
    fs, resize = small_fs
    resize(30)
    run(sft_on(tmp_path / "ref", tmp_path, assets))
    cmd = sft_on(fs, tmp_path, assets)
    error = failing(cmd)
    assert "model.tmp failed" in error and "checkpoint (after step 6)" in error, error
    resize(200)
    run([*cmd, "--resume"])
    assert_same_run(fs / "r", tmp_path / "ref" / "r")


def test_no_room_for_the_last_checkpoint_still_writes_the_smaller_model(assets, tmp_path, small_fs):
    """12 MiB: the last step's checkpoint does not fit, model/ (8 MB) does: the run finishes."""
    fs, resize = small_fs
    resize(12)
    run(sft_on(tmp_path / "ref", tmp_path, assets))
    out = run(sft_on(fs, tmp_path, assets))
    assert "writing model/ all the same" in out.stdout + out.stderr
    assert_same_run(fs / "r", tmp_path / "ref" / "r")
