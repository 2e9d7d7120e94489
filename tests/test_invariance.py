"""Loss-aggregation invariance for every script (issue 20): one micro-batch = gradient accumulation = two processes.
The cases live in tests/cases_<script>.py; the harness in tests/invariance.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from invariance import accumulated_grad, all_cases, reference_grad

from tests.launch import launch_cmd

TESTS = Path(__file__).resolve().parent
CASES = all_cases()


def _accelerator(steps: int) -> Accelerator:
    return Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=steps, sync_with_dataloader=False)
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_micro_batch_and_accumulation_give_the_reference_gradient(case):
    want = reference_grad(case)
    assert want.abs().sum() > 0, "the reference gradient is zero: the case tests nothing"
    one = accumulated_grad(case, _accelerator(1), case.items, (len(case.items),))
    torch.testing.assert_close(one, want, atol=case.atol, rtol=case.rtol, msg=f"{case.name}: one micro-batch")
    acc = accumulated_grad(case, _accelerator(len(case.micro_splits)), case.items, case.micro_splits)
    torch.testing.assert_close(
        acc, want, atol=case.atol, rtol=case.rtol, msg=f"{case.name}: accumulation {case.micro_splits}"
    )


def test_two_processes_give_the_reference_gradient():
    cmd = launch_cmd(str(TESTS / "invariance_check.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(": ok") == len(CASES), proc.stdout
