"""A run directory has one owner, and its records stay true across `--resume` (issue 42, items 1 and 2): two runs of one
directory never run together, a killed owner's lock does not block the next run, SIGTERM to the suite runner stops its
stages with it, `--overwrite` never deletes the run's own input, and `--resume` refuses a flag that alters the run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.faults import REPO, env, metric_rows, run, script_cmd, stop_part_way
from tests.test_faults import sft_flags, small_sft_args


def test_two_runs_of_one_directory_started_together_one_runs_the_other_is_refused(assets, tmp_path):
    cmd = script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "r"))
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env())
        for _ in range(2)
    ]
    outs = [(p, *p.communicate(timeout=600)) for p in procs]
    assert sorted(p.returncode for p, _, _ in outs) == [0, 1], [err[-2000:] for _, _, err in outs]
    (winner, _, _), (_, _, refused) = sorted(outs, key=lambda o: o[0].returncode)
    assert refused.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'r'} is in use by process {winner.pid} on {os.uname().nodename} (started "
        + refused.split("(started ", 1)[1].split(")", 1)[0]
        + "); wait for it to end or stop it (two runs in one directory would interleave their rows and overwrite "
        "each other's model)"
    )
    assert "Traceback" not in refused
    steps = [r["step"] for r in metric_rows(tmp_path / "r") if "train/loss" in r]
    assert steps == list(range(1, 13)), "one run's rows, each step once"
    assert json.loads((tmp_path / "r" / "done.json").read_text())["step"] == 12
    assert not (tmp_path / ".r.lock").exists(), "released at the end"


def test_the_lock_of_a_killed_owner_does_not_block_the_next_run_and_is_named(assets, tmp_path):
    cmd = script_cmd("sft", "tiny-tldr", *sft_flags(assets, tmp_path, "r"))
    out = stop_part_way(cmd, tmp_path / "r", after_step=1, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    owner = json.loads((tmp_path / ".r.lock").read_text())  # SIGKILL: no chance to remove it
    with pytest.raises(ProcessLookupError):
        os.kill(owner["pid"], 0)
    again = run([*cmd, "--overwrite"])
    assert f"note: {tmp_path / '.r.lock'} was left by process {owner['pid']} on {owner['host']}" in again.stderr
    assert "taking it over" in again.stderr
    assert json.loads((tmp_path / "r" / "done.json").read_text())["step"] == 12
    assert not (tmp_path / ".r.lock").exists()


# A stage that checkpoints on SIGTERM, slowly (a real script finishes its step first), then exits as the scripts do.
SLOW_STAGE = """
import os, pathlib, signal, sys, time
argv = sys.argv[1:]
name = argv[argv.index("--run-name") + 1]
def stop(signum, frame):
    time.sleep(1.0)
    pathlib.Path(f"{name}.checkpointed").write_text(signal.Signals(signum).name)
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(f"{name}.pid.tmp").write_text(str(os.getpid()))
os.replace(f"{name}.pid.tmp", f"{name}.pid")  # once the handler is in place, and whole
time.sleep(120)
"""

SUITE_DRIVER = """
import sys
from pathlib import Path
from benchmark import launch, run, suites
tmp = Path({tmp!r})
suites.SUITES["fake"] = lambda seeds: [suites.Stage("a__1", str(tmp / "stage.py"), "p"),
                                    suites.Stage("b__1", str(tmp / "stage.py"), "p")]
sys.argv = ["benchmark.run", "fake", "--workdir", str(tmp), "--plain"]
run.main()
"""


def start_suite(driver: str, tmp_path) -> subprocess.Popen:
    """The suite runner of `driver` (its fake stages in `tmp_path`), started in its own process, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", driver.format(tmp=str(tmp_path))],
        cwd=REPO,
        env={**env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigterm_to_the_suite_runner_stops_its_running_stage_and_waits_for_it(tmp_path):
    (tmp_path / "stage.py").write_text(SLOW_STAGE)
    driver = start_suite(SUITE_DRIVER, tmp_path)
    pid_file, start = tmp_path / "a__1.pid", time.time()
    while not pid_file.exists():
        assert driver.poll() is None and time.time() - start < 60, driver.communicate()[0]
        time.sleep(0.05)
    child = int(pid_file.read_text())
    driver.send_signal(signal.SIGTERM)
    out = driver.communicate(timeout=60)[0]
    assert driver.returncode == 128 + signal.SIGTERM, out
    assert (tmp_path / "a__1.checkpointed").read_text() == "SIGTERM", "the stage got SIGTERM and was waited for"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # not left training on its own
    assert not (tmp_path / "b__1.pid").exists(), "no stage starts once the suite is stopped"
    assert "[stopped] a__1 (exit 143)" in out and "stopped by SIGTERM" in out


def test_overwrite_refuses_a_directory_that_an_input_path_points_into(assets, tmp_path):
    import sft

    sft.main(small_sft_args(assets, tmp_path))
    model = tmp_path / "r" / "model"
    before = (model / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as e:
        sft.main(small_sft_args(assets, tmp_path, model_name_or_path=str(model), overwrite=True))
    assert str(e.value) == (
        f"error: --overwrite would delete {tmp_path / 'r'}, which --model-name-or-path reads ({model}); pick another "
        "--run-name"
    )
    assert (model / "model.safetensors").read_bytes() == before and (tmp_path / "r" / "done.json").exists()
    with pytest.raises(SystemExit, match=r"--overwrite would delete .*, which --dataset-name-or-path reads"):
        data = tmp_path / "r" / "data"
        (data / "sft").mkdir(parents=True)
        for f in (assets / "tiny-tldr" / "sft").iterdir():
            (data / "sft" / f.name).write_bytes(f.read_bytes())
        sft.main(small_sft_args(assets, tmp_path, dataset_name_or_path=str(data / "sft"), overwrite=True))
    sft.main(small_sft_args(assets, tmp_path, run_name="r2", model_name_or_path=str(model)))  # another name is fine


def test_resume_refuses_a_changed_flag_that_alters_the_run_and_done_json_states_what_was_trained(
    assets, tmp_path, monkeypatch
):
    import sft
    from clean_rlhf_utils import runs

    args = dict(max_train_samples=16, num_train_epochs=2, learning_rate=3e-4, log_every=1)  # 2 steps an epoch
    calls = itertools.count(1)
    monkeypatch.setattr(runs.Run, "stop_requested", lambda self: next(calls) >= 2)  # SIGTERM during step 2
    with pytest.raises(SystemExit) as e:
        sft.main(small_sft_args(assets, tmp_path, **args))
    assert e.value.code == 128 + signal.SIGTERM
    monkeypatch.undo()
    run_dir = tmp_path / "r"
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    for flag, value, was in (
        ("learning_rate", 1e-3, "0.0003"),
        ("seed", 2, "1"),
        ("per_device_train_batch_size", 4, "8"),
        ("num_train_epochs", 3, "2"),  # the budget
        ("max_train_samples", 8, "16"),  # the data, and with it the budget
        ("eval_every", 1, "100"),  # the evaluation cadence: rows at other steps than config.json says
    ):
        with pytest.raises(SystemExit) as e:
            sft.main(small_sft_args(assets, tmp_path, **{**args, flag: value}, resume=True))
        name = "--" + flag.replace("_", "-")
        assert str(e.value) == (
            f"error: --resume with {name} {value}, but {run_dir} was started with {was}; resume with the same value "
            "or start a new run"
        )
    with pytest.raises(SystemExit, match=r" \(also changed: --(learning-rate|seed)\); resume"):
        sft.main(small_sft_args(assets, tmp_path, **{**args, "learning_rate": 1e-3, "seed": 2}, resume=True))
    assert json.loads((run_dir / "config.json").read_text())["learning_rate"] == 3e-4, "config.json untouched"

    sft.main(
        small_sft_args(assets, tmp_path, **args, num_threads=2, save_every=1, resume=True)
    )  # cannot change a number
    done, rows = json.loads((run_dir / "done.json").read_text()), metric_rows(run_dir)
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4] and [r["episode"] for r in trained] == [8, 16, 24, 32]
    assert (done["step"], done["episode"]) == (4, 32) == (rows[-1]["step"], rows[-1]["episode"])
    assert (done["total_steps"], done["total_episodes"]) == (4, 32)


def test_resume_treats_the_rl_budget_and_batch_as_altering_and_the_threads_as_not(tmp_path):
    from clean_rlhf_utils.ownership import check_resume_args

    @dataclasses.dataclass
    class Args:
        total_episodes: int = 256
        per_device_batch_size: int = 64
        num_threads: int | None = None
        resume: bool = True

    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(Args(resume=False))))
    check_resume_args(Args(num_threads=4), tmp_path)
    with pytest.raises(SystemExit, match=r"^error: --resume with --total-episodes 192, but .* started with 256;"):
        check_resume_args(Args(total_episodes=192), tmp_path)
    with pytest.raises(SystemExit, match=r"^error: --resume with --per-device-batch-size 32, but .* with 64;"):
        check_resume_args(Args(per_device_batch_size=32), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(SystemExit, match=r"config.json is missing or unreadable"):
        check_resume_args(Args(), tmp_path)


def test_a_held_lock_refuses_another_process_and_is_gone_once_released(tmp_path):
    from clean_rlhf_utils import ownership

    run_dir = tmp_path / "x"
    assert ownership.take_lock(run_dir) is None
    code = "from pathlib import Path; from clean_rlhf_utils import ownership; print(ownership.take_lock(Path(%r)))"
    code %= str(run_dir)
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env={**env(), "PYTHONPATH": str(REPO)}
    )
    assert other.stdout.startswith(f"error: {run_dir} is in use by process {os.getpid()}"), other.stderr
    assert ownership.take_lock(run_dir) is None, "a run of this process that did not close is not a second owner"
    ownership.release_lock(run_dir)
    # this lock, not every lock of the process: in-process bad-input cases of the same xdist worker end by SystemExit
    # while their run holds its lock, which a real run's exit releases
    assert (
        not ownership.lock_file(run_dir).exists() and str(ownership.lock_file(run_dir).resolve()) not in ownership.HELD
    )


STOPPING_STAGE = """
import json, os, pathlib, signal, sys, time
argv = sys.argv[1:]
name = argv[argv.index("--run-name") + 1]
run = pathlib.Path("runs") / name
run.mkdir(parents=True, exist_ok=True)
def stop(signum, frame):
    if name.startswith("full"):  # its checkpoint fails on a full disk: an error line, no checkpoint
        print("error: the checkpoint of step 3 could not be written (No space left on device)", flush=True)
    else:
        (run / "checkpoint").mkdir()
        (run / "checkpoint" / "state.json").write_text(json.dumps({"step": 3}))
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(f"{name}.pid.tmp").write_text(str(os.getpid()))
os.replace(f"{name}.pid.tmp", f"{name}.pid")
time.sleep(120)
"""

STOPPING_DRIVER = """
import sys
from pathlib import Path
from benchmark import launch, run, suites
tmp = Path({tmp!r})
suites.SUITES["fake"] = lambda seeds: [suites.Stage("a__1", str(tmp / "stage.py"), "p"),
                                    suites.Stage("full__1", str(tmp / "stage.py"), "p")]
sys.argv = ["benchmark.run", "fake", "--workdir", str(tmp), "--plain", "--jobs", "2"]
run.main()
"""


def test_a_stopped_stage_is_called_resumable_only_with_a_complete_checkpoint(tmp_path):
    """Issue 67 item 4: every stage stopped by a signal was reported "the same command resumes it", also one whose
    checkpoint failed on a full disk (its error line only in runs/_suite/<run>.log). Now: resumable from its
    checkpoint (and step) when one is complete, else "starts it over", with the stage's error line."""
    (tmp_path / "stage.py").write_text(STOPPING_STAGE)
    driver = start_suite(STOPPING_DRIVER, tmp_path)
    start = time.time()
    while not ((tmp_path / "a__1.pid").exists() and (tmp_path / "full__1.pid").exists()):
        assert driver.poll() is None and time.time() - start < 60, driver.communicate()[0]
        time.sleep(0.05)
    driver.send_signal(signal.SIGTERM)
    out = driver.communicate(timeout=60)[0]
    assert "[stopped] a__1 (exit 143); the same command resumes it from checkpoint/ (step 3)" in out, out
    assert "[stopped] full__1 (exit 143); it left no complete checkpoint: the same command starts it over" in out
    assert "    error: the checkpoint of step 3 could not be written (No space left on device)" in out
