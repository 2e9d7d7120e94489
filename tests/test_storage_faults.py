"""Storage faults end in one line and never lose finished work (docs/faults.md, "Storage faults"): a final save of
model/ that fails (a full disk) leaves the checkpoint of the last step, from which `--resume` writes the model an
uninterrupted run writes; a periodic checkpoint that fails names the one before, which resumes exactly; `--resume`
reads past a torn last row and falls back from a checkpoint whose state.json is empty to the one before. The faults are
made by making the write fail (ENOSPC), in this process."""

from __future__ import annotations

import errno
import json
import signal

import pytest
import torch
import tyro
from accelerate import Accelerator

from clean_rlhf_utils import runs, storage
from tests.faults import assert_same_run
from tests.test_faults import sft_flags
from tests.test_faults_grpo_math import grpo_flags

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


def in_process(module, argv: list[str]):
    """`python <module>.py *argv`, in this process; the signal handlers `Run` installs are put back after."""
    try:
        return module.main(tyro.extras.overridable_config_cli(module.PRESETS, args=argv))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def error_of(module, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        in_process(module, argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def full_disk_at_save(model, tokenizer, accelerator, path, *args):
    """A final save on a full disk: part of the weights written, then ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(b"\0" * 1024)
    raise NO_SPACE


@pytest.fixture(scope="module")
def sft_reference(assets, tmp_path_factory):
    """The uninterrupted sft run (12 steps) the tests compare with."""
    import sft

    out = tmp_path_factory.mktemp("sft-storage")
    in_process(sft, ["tiny-tldr", *sft_flags(assets, out, "full")])
    return out / "full"


def test_a_full_disk_at_the_final_save_leaves_a_checkpoint_that_resume_finishes(
    assets, tmp_path, monkeypatch, sft_reference
):
    """`--save-every 0` (no periodic checkpoint): the final save fails, the run ends in one line naming the checkpoint
    of the last step, the half-written model.tmp is removed, and `--resume` writes model/ bit-identical to the
    uninterrupted run's, with the same rows (none trained twice)."""
    import sft

    flags = ["tiny-tldr", *sft_flags(assets, tmp_path, "disk")]
    monkeypatch.setattr(runs, "save_model", full_disk_at_save)
    message = error_of(sft, flags)
    run_dir = tmp_path / "disk"
    assert message == (
        f"error: writing {run_dir / 'model.tmp'} failed (No space left on device); free space, then continue from "
        f"{run_dir / 'checkpoint'} (after step 12) with the same command and --resume"
    )
    assert not (run_dir / "model").exists() and not (run_dir / "model.tmp").exists()
    assert not (run_dir / "done.json").exists()
    monkeypatch.undo()
    in_process(sft, [*flags, "--resume"])
    assert_same_run(run_dir, sft_reference)
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint")) == []


def test_a_full_disk_at_a_periodic_checkpoint_names_the_one_before_which_resumes_exactly(
    assets, tmp_path, monkeypatch, sft_reference
):
    """`--save-every 4`: the checkpoint after step 8 fails; the run ends in one line naming the one after step 4 (its
    half-written checkpoint.tmp removed), from which `--resume` ends as the uninterrupted run."""
    import sft

    flags = ["tiny-tldr", *sft_flags(assets, tmp_path, "disk", "--save-every", "4")]
    real, calls = Accelerator.save_state, []

    def fails_the_second_time(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:
            raise NO_SPACE
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", fails_the_second_time)
    message = error_of(sft, flags)
    run_dir = tmp_path / "disk"
    assert message == (
        f"error: writing the checkpoint after step 8 failed (No space left on device); free space, then continue "
        f"from {run_dir / 'checkpoint'} (after step 4) with the same command and --resume"
    )
    assert not (run_dir / "checkpoint.tmp").exists()
    monkeypatch.undo()
    in_process(sft, [*flags, "--resume"])
    assert_same_run(run_dir, sft_reference)


def test_resume_reads_past_a_torn_row_and_falls_back_from_an_empty_state_json(
    assets, tmp_path, monkeypatch, sft_reference
):
    """A run with `--save-every 2` stopped after step 5 holds checkpoint/ (step 5) and checkpoint.prev/ (step 4). What a
    crash of the machine can leave: checkpoint/state.json empty, and metrics.jsonl ending in half a row. `--resume`
    says what it passes over, resumes from step 4 and ends as the uninterrupted run; before, both were a
    JSONDecodeError."""
    import sft

    flags = ["tiny-tldr", *sft_flags(assets, tmp_path, "crash", "--save-every", "2")]
    monkeypatch.setattr(runs.Run, "stop_requested", lambda self: bool(self.reached) and self.reached[0] >= 5)
    with pytest.raises(SystemExit) as e:
        in_process(sft, flags)
    assert e.value.code == 128 + signal.SIGTERM
    monkeypatch.undo()
    run_dir = tmp_path / "crash"
    assert storage.read_state(run_dir / "checkpoint")["step"] == 5
    assert storage.read_state(run_dir / "checkpoint.prev")["step"] == 4
    (run_dir / "checkpoint" / "state.json").write_text("")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "episode": 96, "ti')
    in_process(sft, [*flags, "--resume"])
    assert_same_run(run_dir, sft_reference)


def test_resume_without_a_complete_checkpoint_is_one_line(assets, tmp_path):
    import sft

    flags = ["tiny-tldr", *sft_flags(assets, tmp_path, "torn")]
    (tmp_path / "torn" / "checkpoint").mkdir(parents=True)
    (tmp_path / "torn" / "checkpoint" / "state.json").write_text('{"step": 3, "epi')
    (tmp_path / "torn" / "config.json").write_text("{}")
    message = error_of(sft, [*flags, "--resume"])
    assert message.startswith(f"error: --resume: {tmp_path / 'torn'} holds no complete checkpoint (")
    assert "state.json is missing, empty or torn" in message


def test_a_full_disk_at_grpos_final_save_resumes_without_repeating_its_pass_at_k_row(assets, tmp_path, monkeypatch):
    """grpo_math.py logs pass@k after its last step's checkpoint: the resumed run evaluates it again (the same RNG, the
    same row) in place of the first one, so the rows read as one run's, and the weights are the uninterrupted run's."""
    import grpo_math

    in_process(grpo_math, grpo_flags(assets, tmp_path, "full"))
    monkeypatch.setattr(runs, "save_model", full_disk_at_save)
    flags = grpo_flags(assets, tmp_path, "disk")
    assert "after step 8" in error_of(grpo_math, flags)
    monkeypatch.undo()
    in_process(grpo_math, [*flags, "--resume"])
    assert_same_run(tmp_path / "disk", tmp_path / "full")
    rows = [json.loads(line) for line in (tmp_path / "disk" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval/pass@k" in r for r in rows) == 1


def test_storage_helpers(tmp_path):
    """A torn row in the middle is an error naming the line; a checkpoint.tmp whose write ended is used when a kill
    between the renames left no checkpoint/; a truncated safetensors file is named with its size and the cause."""
    rows = tmp_path / "metrics.jsonl"
    rows.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(SystemExit, match=r"line 2 is not a JSON row"):
        storage.read_rows(rows)
    rows.write_text('{"step": 1}\n{"step": 2')
    assert storage.read_rows(rows) == ['{"step": 1}\n']
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "state.json").write_text('{"step": 7}')
    assert storage.checkpoint_to_resume(tmp_path) == (tmp_path / "checkpoint.tmp", [])
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(100)}, tmp_path / "w.safetensors")
    assert storage.safetensors_problem(tmp_path / "w.safetensors") is None
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-10])
    assert storage.safetensors_problem(tmp_path / "w.safetensors") == (
        f"is not a whole safetensors file ({len(data) - 10} bytes; Error while deserializing header: incomplete "
        "metadata, file not fully covered)"
    )
    assert storage.safetensors_problem(tmp_path / "none.safetensors") == "is missing"
