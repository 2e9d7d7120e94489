"""ppo_rlhf.py survives faults: stopped by SIGTERM or killed outright part way, a run resumes to the same metrics and
final policy as an uninterrupted one, bit for bit (float32 on CPU). The tiny-tldr preset with a reward model (random
head, reward_model.py's format), so the value model starts from it, and with the adaptive KL controller, whose
coefficient is loop state the checkpoint must carry (it is logged as objective/kl_coef every update)."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from tests.bad_inputs import make_reward_model
from tests.faults import assert_same_run, check_stopped, metric_rows, run, script_cmd, stop_part_way


def ppo_cmd(world, name: str, *extra: str) -> list[str]:
    """6 updates of 8 responses over 20 prompts (2 batches an epoch: the replay of the data position on resume crosses
    the prompt loader's epochs), evaluated every 2 updates and before the first."""
    assets, rm, data, tmp = world
    return script_cmd(
        "ppo_rlhf",
        "tiny-tldr",
        "--sft-model-path",
        str(assets / "models" / "tiny-neox"),
        "--reward-model-path",
        str(rm),
        "--dataset-name-or-path",
        str(data),
        "--response-length",
        "12",
        "--total-episodes",
        "48",
        "--per-device-batch-size",
        "8",
        "--num-mini-batches",
        "2",
        "--num-ppo-epochs",
        "2",
        "--learning-rate",
        "1e-3",
        "--adaptive-kl",
        "--target-kl",
        "0.1",
        "--kl-horizon",
        "100",
        "--num-eval-examples",
        "4",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--num-threads",
        "1",
        "--output-dir",
        str(tmp),
        "--run-name",
        name,
        *extra,
    )


@pytest.fixture(scope="module")
def world(assets, tmp_path_factory):
    """The reward model, 20 training prompts, and the uninterrupted run every test compares with."""
    tmp = tmp_path_factory.mktemp("ppo_faults")
    rm = make_reward_model(assets, tmp / "rm")
    (tmp / "data").mkdir()
    lines = (assets / "tiny-tldr" / "sft" / "train.jsonl").read_text().splitlines(keepends=True)
    (tmp / "data" / "train.jsonl").write_text("".join(lines[:20]))
    shutil.copy(assets / "tiny-tldr" / "sft" / "validation.jsonl", tmp / "data")
    w = (assets, rm, tmp / "data", tmp)
    run(ppo_cmd(w, "full"))
    return w


def test_ppo_stopped_by_sigterm_resumes_to_the_uninterrupted_run(world):
    """Stopped after update 2 or so: the resumed run skips the evaluation before training (logged already), restores
    the adaptive KL coefficient, replays the prompts the finished updates drew, and ends where the full run ends."""
    tmp = world[3]
    killed = ppo_cmd(world, "killed")
    check_stopped(stop_part_way(killed, tmp / "killed", after_step=2), tmp / "killed")
    state = json.loads((tmp / "killed" / "checkpoint" / "state.json").read_text())
    assert 2 <= state["step"] < 6 and state["kl_coef"] != 0.05  # the controller moved it
    resumed = run([*killed, "--resume"])
    assert "resumed" in resumed.stdout + resumed.stderr and "before training" not in resumed.stdout
    assert_same_run(tmp / "killed", tmp / "full")
    assert [r["step"] for r in metric_rows(tmp / "killed")].count(0) == 1  # one evaluation before training
    assert not (tmp / "killed" / "checkpoint").exists()
    done = json.loads((tmp / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 6 and done["total_episodes"] == 48 and done["preset"] == "tiny-tldr"
    samples = [json.loads(line) for line in (tmp / "killed" / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [2, 4, 6]


def test_ppo_killed_outright_resumes_from_its_last_periodic_checkpoint(world):
    """SIGKILL leaves no chance to save: the run resumes from `--save-every 2`'s checkpoint of update 2 (the kill lands
    at update 3 or later), the rows logged after it are dropped, and it ends as the full run does."""
    tmp = world[3]
    killed = ppo_cmd(world, "sigkill", "--save-every", "2")
    out = stop_part_way(killed, tmp / "sigkill", after_step=3, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    assert (tmp / "sigkill" / "checkpoint" / "state.json").exists()
    run([*killed, "--resume"])
    assert_same_run(tmp / "sigkill", tmp / "full")


def test_a_non_finite_loss_stops_with_one_line_keeping_the_checkpoint_of_the_last_finite_update(
    assets, tmp_path, monkeypatch
):
    """A NaN value loss at update 2 (of a run of one optimizer step an update): `error: non-finite PPO loss at update
    2 ...`, before the optimizer step, and the checkpoint of update 1 (--save-every 1) kept as it was (the weights
    never saw the NaN)."""
    import torch

    import ppo_rlhf as ppo

    calls, value_loss = [], ppo.value_loss

    def nan_at_the_second_update(*a, **kw):
        calls.append(1)
        loss, clipfrac = value_loss(*a, **kw)
        return (loss * float("nan") if len(calls) == 2 else loss), clipfrac

    monkeypatch.setattr(ppo, "value_loss", nan_at_the_second_update)
    args = ppo.Args(
        exp_name="nan",
        run_name="nan",
        output_dir=str(tmp_path),
        num_threads=1,
        sft_model_path=str(assets / "models" / "tiny-llama"),
        reward_model_path=None,
        reward_source="math",
        dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
        eval_split="test",
        prompt_template="Question: {question}\nAnswer:\n",
        reference_template="{answer}",
        max_prompt_length=96,
        response_length=8,
        total_episodes=24,
        per_device_batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        eval_every=100,
        num_eval_examples=2,
        save_every=1,
    )
    try:
        with pytest.raises(
            SystemExit, match=r"^error: non-finite PPO loss at update 2 .*--learning-rate.*after step 1"
        ):
            ppo.main(args)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # `Run` installs its handlers in-process
        signal.signal(signal.SIGINT, signal.default_int_handler)
    state = json.loads((tmp_path / "nan" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 1 and not (tmp_path / "nan" / "done.json").exists()
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "nan" / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
