"""Runs survive faults: stopped by SIGTERM / SIGINT or killed outright, a run resumes to the same metrics and weights as
an uninterrupted one; a used run directory is refused; model/ is never half-written."""

from __future__ import annotations

import json
import signal

import pytest

from tests.faults import assert_same_run, check_stopped, metric_rows, run, script_cmd, stop_part_way


def sft_flags(assets, tmp_path, name: str, *extra: str) -> list[str]:
    return [
        "--model-name-or-path",
        str(assets / "models" / "tiny-neox"),
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--max-prompt-length",
        "96",
        "--max-response-length",
        "48",
        "--max-train-samples",
        "96",
        "--per-device-train-batch-size",
        "8",
        "--gradient-accumulation-steps",
        "2",
        "--num-train-epochs",
        "2",
        "--learning-rate",
        "1e-3",
        "--num-eval-examples",
        "4",
        "--eval-every",
        "4",
        "--log-every",
        "1",
        "--eval-task",
        "tldr",
        "--num-threads",
        "1",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *extra,
    ]


def test_sft_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path):
    """12 steps over 2 epochs (6 a epoch, the data order replayed on resume), stopped after step 2 or so."""
    run(script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "full")))
    killed = script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "killed"))
    check_stopped(stop_part_way(killed, tmp_path / "killed", after_step=2), tmp_path / "killed")
    resumed = run([*killed, "--resume"])
    assert "resumed" in resumed.stdout + resumed.stderr and "run finished" in resumed.stdout + resumed.stderr
    assert_same_run(tmp_path / "killed", tmp_path / "full")
    assert not (tmp_path / "killed" / "checkpoint").exists()  # removed at the end: model/ holds the weights
    done = json.loads((tmp_path / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 12 and done["preset"] == "tiny-tldr"


def test_sft_killed_outright_resumes_from_its_last_periodic_checkpoint(assets, tmp_path):
    """SIGKILL (an out-of-memory kill, a lost node) leaves no chance to save: the run resumes from `--save-every`'s last
    checkpoint, and the rows logged after it are dropped."""
    run(script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "full")))
    killed = script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "killed", "--save-every", "3"))
    out = stop_part_way(killed, tmp_path / "killed", after_step=7, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    assert max(r["step"] for r in metric_rows(tmp_path / "killed")) >= 7  # rows past the checkpoint of step 6
    run([*killed, "--resume"])
    assert_same_run(tmp_path / "killed", tmp_path / "full")


def small_sft_args(assets, tmp_path, **kw):
    import sft

    base = dict(
        model_name_or_path=str(assets / "models" / "tiny-neox"),
        max_prompt_length=96,
        max_response_length=48,
        dataset_name_or_path=str(assets / "tiny-tldr" / "sft"),
        max_train_samples=16,
        num_eval_examples=2,
        per_device_train_batch_size=8,
        eval_every=100,
        num_threads=1,
        output_dir=str(tmp_path),
        run_name="r",
    )
    return sft.Args(**{**base, **kw})


def test_a_used_run_directory_is_refused_unless_resume_or_overwrite(assets, tmp_path):
    import sft

    sft.main(small_sft_args(assets, tmp_path))
    run_dir = tmp_path / "r"
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match=r"already holds a run: pass --resume to continue it, --overwrite"):
        sft.main(small_sft_args(assets, tmp_path))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files  # untouched
    with pytest.raises(SystemExit, match="finished its run"):
        sft.main(small_sft_args(assets, tmp_path, resume=True))
    with pytest.raises(SystemExit, match="holds no complete checkpoint"):
        sft.main(small_sft_args(assets, tmp_path, run_name="other", resume=True))
    sft.main(small_sft_args(assets, tmp_path, overwrite=True, learning_rate=1e-4))
    assert json.loads((run_dir / "config.json").read_text())["learning_rate"] == 1e-4
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(lines) == len(files["samples.jsonl"].splitlines())  # replaced, not appended to


def test_a_model_write_killed_part_way_leaves_no_half_written_model(assets, tmp_path, monkeypatch):
    """model/ is written to model.tmp and renamed: a kill during the write leaves the previous model/ (or none), and a
    kill between the two renames of `replace_dir` leaves model.old, which the next run puts back."""
    import sft
    from clean_rlhf_utils import runs

    real_save = runs.save_model  # what Run.finish calls

    def killed_part_way(model, tokenizer, accelerator, path, prefix="", dtype=None):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"half")  # the weights, not yet the tokenizer
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "save_model", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        sft.main(small_sft_args(assets, tmp_path))
    run_dir = tmp_path / "r"
    assert not (run_dir / "model").exists() and not (run_dir / "done.json").exists()

    monkeypatch.setattr(runs, "save_model", real_save)
    sft.main(small_sft_args(assets, tmp_path, overwrite=True))
    before = (run_dir / "model" / "model.safetensors").read_bytes()
    (run_dir / "model").rename(run_dir / "model.old")  # killed between the renames of a later write
    with pytest.raises(SystemExit, match="already holds a run"):
        sft.main(small_sft_args(assets, tmp_path))  # the next run looks at the directory: model.old is put back
    assert (run_dir / "model" / "model.safetensors").read_bytes() == before and not (run_dir / "model.old").exists()


def test_sft_under_two_processes_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path):
    """`accelerate launch` forwards SIGTERM to both processes; whichever gets it, both stop after the same step (the
    flag is or-ed over the processes), each saves its RNG state, and the resumed run equals an uninterrupted one."""
    from tests.faults import REPO
    from tests.launch import launch_cmd

    flags = lambda name: ["tiny-tldr", *sft_flags(assets, tmp_path, name)]  # noqa: E731
    run(launch_cmd(REPO / "sft.py", *flags("full")))
    killed = launch_cmd(REPO / "sft.py", *flags("killed"))
    out = stop_part_way(killed, tmp_path / "killed", after_step=2)
    assert (tmp_path / "killed" / "checkpoint" / "state.json").exists() and not (
        tmp_path / "killed" / "done.json"
    ).exists()
    assert "stopped by SIGTERM after step" in out.stderr, out.stderr[-3000:]
    assert len(json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())["running"]) == 2
    run([*launch_cmd(REPO / "sft.py", *flags("killed")), "--resume"])
    assert_same_run(tmp_path / "killed", tmp_path / "full")
