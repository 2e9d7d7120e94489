"""Beyond one machine (issue 41 item 12): the sampling loops launched as two machines of one process each, the way a
two-node job starts (`accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip <node 0>`, one launcher
per node, docs/gpus.md), simulated on this host with two launchers and gloo.

What a second node must get right, checked against one machine with two processes (the DDP cell every other test
uses): the same data order and the same numbers (identical metrics rows and bit-identical weights: any difference in
what a process reads, samples or reduces would show), nothing written by the second node but its RNG state in the
checkpoints (it runs in another working directory, as on a machine without the first one's disk: only the global main
process writes the run directory, metrics and `model/`), and a run stopped part way resumes exactly when both nodes
restart with `--resume`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bad_inputs import World, base_flags
from tests.faults import REPO, assert_same_run, env, metric_rows
from tests.launch import free_port, launch_cmd

pytestmark = pytest.mark.slow  # two launches per family, run one heavy job at a time (docs/tests.md)

# the two training loops that sample: GRPO's here, rloo's (ppo_rlhf / remax share its plumbing) in the resume test;
# SFT and the reward model run as two machines in the real-shape check (tests/test_real_check.py, `2machines`)
FAMILIES = ["grpo_math"]  # rloo: the resume test below compares two machines with one
# a few steps: the tiny preset's 40 steps of 16 x 8 completions took 11 minutes, twice over, of CI's 40 (docs/tests.md)
SHORT = {"grpo_math": ["--total-steps", "3", "--pass-k", "2"]}


def node_cmd(script: str, rank: int, port: int, *flags: str) -> list[str]:
    """Node `rank` of two, one process each, node 0 at 127.0.0.1:port."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / f"{script}.py"),
        *flags,
    ]


def two_nodes(script: str, flags0: list[str], flags1: list[str], cwd1: Path, stop_after: int | None = None):
    """Starts both nodes (node 1 in `cwd1`); with `stop_after`, sends SIGTERM to node 0's launcher once its run has
    logged that step. Returns both CompletedProcess-like (returncode, output) pairs."""
    port = free_port()
    procs = [
        subprocess.Popen(
            node_cmd(script, rank, port, *flags),
            cwd=cwd,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, (flags, cwd) in enumerate([(flags0, REPO), (flags1, cwd1)])
    ]
    if stop_after is not None:
        run_dir = Path(flags0[flags0.index("--output-dir") + 1]) / flags0[flags0.index("--run-name") + 1]
        start = time.time()
        while not any(r["step"] >= stop_after for r in metric_rows(run_dir)):
            assert procs[0].poll() is None, procs[0].communicate()[0][-3000:]
            assert time.time() - start < 600
            time.sleep(0.02)
        procs[0].send_signal(signal.SIGTERM)
    return [(p.wait(timeout=600), p.communicate()[0]) for p in procs]


def with_output(flags: list[str], output_dir: str, run_name: str) -> list[str]:
    out = list(flags)
    out[out.index("--output-dir") + 1] = output_dir
    out[out.index("--run-name") + 1] = run_name
    return out


@pytest.mark.parametrize("script", FAMILIES)
def test_two_machines_train_what_one_machine_trains_and_only_node_0_writes(assets, tmp_path, script):
    w = World(assets=assets, tmp=tmp_path, rm=tmp_path)
    flags = [*base_flags(script, w), *SHORT[script]]
    one = with_output(flags, str(tmp_path / "one"), "run")
    proc = subprocess.run(launch_cmd(REPO / f"{script}.py", *one), cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    node1 = tmp_path / "node1"
    node1.mkdir()
    # node 1 is given a relative output directory in a working directory of its own: what it writes lands there
    (rc0, out0), (rc1, out1) = two_nodes(
        script, with_output(flags, str(tmp_path / "two"), "run"), with_output(flags, "runs", "run"), node1
    )
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    # but its own RNG state in the checkpoint after the last step (accelerate's save_state: each process writes its
    # own; on the shared disk a job of several machines needs, it lands in node 0's checkpoint, removed at the end)
    written = sorted(str(p.relative_to(node1)) for p in node1.rglob("*") if p.is_file())
    assert written == ["runs/run/checkpoint.tmp/random_states_1.pkl"], f"node 1 wrote {written[:5]}"
    assert_same_run(tmp_path / "two" / "run", tmp_path / "one" / "run")  # same data, same numbers, exactly


def test_two_machines_stopped_part_way_resume_exactly(assets, tmp_path):
    """SIGTERM to node 0's launcher: both nodes stop after the same step (the stop is agreed over the processes),
    node 0 writes the checkpoint to the shared run directory, both restart with --resume, and the run ends as an
    uninterrupted one does."""
    w = World(assets=assets, tmp=tmp_path, rm=tmp_path)
    flags = [*base_flags("rloo", w), "--total-episodes", "64"]
    full = with_output(flags, str(tmp_path / "runs"), "full")
    proc = subprocess.run(launch_cmd(REPO / "rloo.py", *full), cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = with_output(flags, str(tmp_path / "runs"), "stopped")  # the shared disk of a real two-node job
    (rc0, out0), (rc1, out1) = two_nodes("rloo", stopped, stopped, REPO, stop_after=2)
    assert rc0 != 0 and not (tmp_path / "runs" / "stopped" / "done.json").exists(), out0[-3000:]
    assert (tmp_path / "runs" / "stopped" / "checkpoint" / "state.json").exists(), out0[-3000:] + out1[-3000:]
    (rc0, out0), (rc1, out1) = two_nodes("rloo", [*stopped, "--resume"], [*stopped, "--resume"], REPO)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert_same_run(tmp_path / "runs" / "stopped", tmp_path / "runs" / "full")
