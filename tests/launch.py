"""How the tests start a script under several processes: one free port, one `accelerate launch` command."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """`accelerate launch --multi_gpu --num_processes {nproc}` of a script path (accelerate's module mode does not set
    up the process group here): gloo processes on this CPU, DDP on GPUs."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(nproc),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
