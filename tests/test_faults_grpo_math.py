"""grpo_math.py survives faults: a run stopped by SIGTERM, or killed outright after a periodic checkpoint, resumes to
the metrics and weights of an uninterrupted run, exactly (float32, CPU, one thread). The resume restores the policy,
AdamW, the warm-up schedule and the sampling RNG, and replays each process's question stream by the number of questions
it drew, which DAPO's dynamic sampling makes vary from step to step."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

from tests.faults import REPO, assert_same_run, check_stopped, metric_rows, run, script_cmd, stop_part_way

# 8 steps of 2 questions x 4 completions (two mini-batches each, so 16 optimizer steps), warm-up over the first 10
# optimizer steps (a stop after step 2 or 3 resumes inside it), evaluation every 3 steps and pass@2 at the end
FLAGS = (
    "--questions-per-device 2 --num-generations 4 --max-completion-length 12 --micro-batch-size 4 "
    "--num-mini-batches 2 --total-steps 8 --eval-every 3 --num-eval-examples 4 --pass-k 2 --log-every 1 "
    "--learning-rate 1e-3 --warmup-steps 10 --num-threads 1"
).split()

# An untrained policy is never right, so every group would be dropped by dynamic sampling and no draw would vary: this
# wrapper runs grpo_math.py with a success reward that is a fixed function of the completion's text (about 1 in 3
# "right"), so some groups are kept, some dropped, and a step draws 2, 4, 6 or 8 questions.
LUCKY = """
import sys, zlib
sys.path.insert(0, {repo!r})
import tyro
import grpo_math
grpo_math.success_reward = lambda text, gold, answer_format: float(zlib.crc32(text.encode()) % 3 == 0)
grpo_math.main(tyro.extras.overridable_config_cli(grpo_math.PRESETS))
"""


def grpo_flags(assets, tmp_path, name: str, *extra: str) -> list[str]:
    return [
        "tiny",
        "--model-name-or-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        *FLAGS,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *extra,
    ]


@pytest.fixture(scope="module")
def tiny_outcome_rm(assets, tmp_path_factory):
    """An outcome reward model on the tiny-llama tokenizer (random head): untrained completions are never right, so it
    gives the groups the reward variance, hence the gradients, that make the weights move."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(assets / "models" / "tiny-llama", num_labels=1)
    rm.config.reward_type, rm.config.reward_bias = "outcome", 0.0
    rm.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-llama").save_pretrained(out)
    return out


def test_grpo_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path, tiny_outcome_rm):
    """GRPO with its KL term (a reference policy) and a reward model, stopped after step 2 or so, mid warm-up."""
    rm = ["--reward-model-path", str(tiny_outcome_rm)]
    run(script_cmd("grpo_math", *grpo_flags(assets, tmp_path, "full", *rm)))
    killed = script_cmd("grpo_math", *grpo_flags(assets, tmp_path, "killed", *rm))
    check_stopped(stop_part_way(killed, tmp_path / "killed", after_step=2), tmp_path / "killed")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    assert 2 <= state["step"] < 8 and state["drawn"] == [2 * state["step"]]
    resumed = run([*killed, "--resume"])
    assert "resumed" in resumed.stdout + resumed.stderr and "run finished" in resumed.stdout + resumed.stderr
    assert_same_run(tmp_path / "killed", tmp_path / "full")
    assert [r["step"] for r in metric_rows(tmp_path / "killed") if "eval/accuracy" in r] == [0, 3, 6, 8]
    assert not (tmp_path / "killed" / "checkpoint").exists()
    done = json.loads((tmp_path / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 8 and done["episode"] == 8 * 8 and done["preset"] == "tiny"


def test_dapo_killed_outright_resumes_from_its_periodic_checkpoint_with_the_questions_drawn(assets, tmp_path):
    """DAPO with dynamic sampling, SIGKILLed after step 5 (no chance to save): it resumes from `--save-every 2`'s last
    checkpoint, whose state holds how many questions the stream gave, more than 2 a step (dropped groups are
    resampled): replaying 2 a step would feed the resumed run other questions."""
    (tmp_path / "lucky_grpo.py").write_text(LUCKY.format(repo=str(REPO)))

    def cmd(name: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            str(tmp_path / "lucky_grpo.py"),
            *grpo_flags(assets, tmp_path, name, "--loss-type", "dapo", *extra),
        ]

    run(cmd("full"))
    killed = cmd("killed", "--save-every", "2")
    out = stop_part_way(killed, tmp_path / "killed", after_step=5, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    assert state["step"] in (4, 6) and state["drawn"][0] > 2 * state["step"]
    run([*killed, "--resume"])
    assert_same_run(tmp_path / "killed", tmp_path / "full")
    rows = [r for r in metric_rows(tmp_path / "full") if "objective/groups_dropped" in r]
    assert any(r["objective/groups_dropped"] > 0 for r in rows) and any(r["perf/sampling_rounds"] > 1 for r in rows)
