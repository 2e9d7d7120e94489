"""Launched by tests/test_invariance.py on two gloo processes: every script's case, its batch split in two halves (rank
0 the first, rank 1 the second; uneven lengths, so uneven counts per rank), each half as two accumulated micro-batches;
the DDP-averaged gradient must equal the one-process gradient of the whole batch. Prints one line per case; exit 1 on
any difference."""

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from invariance import accumulated_grad, all_cases, reference_grad

failed = []
for case in all_cases():
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    )
    half = len(case.items) // 2
    mine = case.items[:half] if accelerator.process_index == 0 else case.items[half:]
    assert len(case.items) % 2 == 0 and len(mine) >= 2, f"{case.name}: needs an even number (>= 4) of items"
    got = accumulated_grad(case, accelerator, mine, (1, len(mine) - 1))
    want = reference_grad(case)
    ok = torch.allclose(got, want, atol=case.atol, rtol=case.rtol)
    if not ok:
        failed.append(case.name)
    if accelerator.is_main_process:
        print(
            f"{case.name}: {'ok' if ok else 'DIFFERS'} (max abs diff {(got - want).abs().max().item():.2e})", flush=True
        )
sys.exit(1 if failed else 0)
