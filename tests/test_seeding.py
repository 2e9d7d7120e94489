"""Per-process random streams (issue 41, item 9): with every process seeded alike, two processes sampled the same
completions for the same prompt. `engines.seed_per_process` seeds each with seed + rank * 100003 after `prepare`, as the
N+ code does; every script that samples calls it right after its `accelerator.prepare`."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import launch_cmd

REPO = Path(__file__).resolve().parent.parent

DRIVER = """
import json, sys, torch
from accelerate.utils import gather_object, set_seed
from clean_rlhf_utils.engines import make_accelerator, seed_per_process
accelerator = make_accelerator(1, sync_with_dataloader=True)
set_seed(7)
shared = torch.rand(3).tolist()  # drawn before: the same on every process (fresh heads, LoRA)
seed_per_process(accelerator, 7)
probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
sampled = torch.multinomial(probs.expand(16, 4), 1).squeeze(1).tolist()  # 16 completions of one token, one prompt
everyone = gather_object([{"shared": shared, "sampled": sampled}])
if accelerator.is_main_process:
    open(sys.argv[1], "w").write(json.dumps(everyone))
accelerator.end_training()  # the gloo group closed before exit: without it a rank aborted at exit now and then
"""


def test_two_processes_sample_differently_and_a_rerun_repeats(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = []
    for name in ("first.json", "again.json"):
        proc = subprocess.run(launch_cmd(driver, str(tmp_path / name)), env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs.append(json.loads((tmp_path / name).read_text()))
    first, again = runs
    assert first == again  # a rerun repeats every process's draws
    assert first[0]["shared"] == first[1]["shared"]  # before `seed_per_process`: one stream
    assert first[0]["sampled"] != first[1]["sampled"]  # after: each process its own


@pytest.mark.parametrize("script", ["ppo_rlhf", "rloo", "remax", "dpo", "grpo_math"])
def test_every_sampling_script_seeds_each_process_right_after_prepare(script):
    tree = ast.parse((REPO / f"{script}.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    prepared = [i for i, n in enumerate(main.body) if "accelerator.prepare(" in ast.unparse(n)]
    seeded = [i for i, n in enumerate(main.body) if "seed_per_process(accelerator, args.seed)" in ast.unparse(n)]
    assert prepared and seeded == [prepared[0] + 1], f"{script}: seed_per_process right after the first prepare"
    assert "set_seed(args.seed)" in " ".join(ast.unparse(n) for n in main.body[: prepared[0]])  # one stream before
