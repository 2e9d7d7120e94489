"""reward_model.py survives faults: stopped by SIGTERM or killed outright part way, a tiny-tldr run resumes to exactly
the metrics and weights of an uninterrupted one (float32 on CPU: the checkpoint restores the weights, AdamW's moments,
the learning-rate schedule and every RNG; the pairs the finished steps drew are replayed from the loader's own
generator, across the epoch boundary), the normalisation after the last step included; a learning rate that blows the
model up ends in one `error:` line and a checkpoint of finite weights. The runs that need no signal run in this process
(the same command line, through tyro), to save the seconds of importing torch and transformers again."""

from __future__ import annotations

import json
import signal

import pytest
import tyro
from safetensors.torch import load_file

import reward_model
from clean_rlhf_utils import runs
from tests.faults import assert_same_run, check_non_finite_stop, check_stopped, metric_rows, script_cmd, stop_part_way


def rm_flags(assets, out, name: str, *extra: str) -> list[str]:
    """8 optimizer steps: 32 pairs in micro-batches of 4, accumulated 2 a step, over 2 epochs (so the resume must replay
    the data order across the epoch boundary and restore the schedule), evaluated every 3 steps, then normalised on 16
    reference responses."""
    return [
        "tiny-tldr",
        "--sft-model-path",
        str(assets / "models" / "tiny-neox"),
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "preference"),
        "--norm-dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--max-train-samples",
        "32",
        "--per-device-train-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--num-train-epochs",
        "2",
        "--num-eval-examples",
        "8",
        "--num-norm-examples",
        "16",
        "--eval-every",
        "3",
        "--log-every",
        "1",
        "--num-threads",
        "1",
        "--output-dir",
        str(out),
        "--run-name",
        name,
        *extra,
    ]


def in_process(argv: list[str]) -> dict:
    """`python reward_model.py <argv>`, run in this process; the signal handlers `Run` installs are put back after."""
    try:
        return reward_model.main(tyro.extras.overridable_config_cli(reward_model.PRESETS, args=argv))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run every test compares with."""
    out = tmp_path_factory.mktemp("rm-faults")
    in_process(rm_flags(assets, out, "full"))
    return out / "full"


def test_reward_model_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path, reference):
    flags = rm_flags(assets, tmp_path, "killed")
    check_stopped(
        stop_part_way(script_cmd("reward_model", *flags), tmp_path / "killed", after_step=2), tmp_path / "killed"
    )
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    assert 2 <= state["step"] < 8 and state["episode"] == 8 * state["step"]
    in_process([*flags, "--resume"])
    assert_same_run(tmp_path / "killed", reference)
    rows = metric_rows(tmp_path / "killed")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [3, 6, 8]
    assert [r["step"] for r in rows if "eval/reward_bias" in r] == [8]  # the normalisation ran after the resume
    model = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert model.keys() == load_file(reference / "model" / "model.safetensors").keys()
    config = json.loads((tmp_path / "killed" / "model" / "config.json").read_text())
    assert config["reward_bias"] == json.loads((reference / "model" / "config.json").read_text())["reward_bias"] != 0
    done = json.loads((tmp_path / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 8 and done["total_episodes"] == 64
    assert not (tmp_path / "killed" / "checkpoint").exists()


def test_reward_model_killed_outright_resumes_from_its_last_periodic_checkpoint(assets, tmp_path, reference):
    """SIGKILL leaves no chance to save: the run resumes from `--save-every 2`'s last checkpoint, and the rows logged
    after it are dropped."""
    flags = rm_flags(assets, tmp_path, "killed", "--save-every", "2")
    out = stop_part_way(script_cmd("reward_model", *flags), tmp_path / "killed", after_step=5, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    assert json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())["step"] in (4, 6)
    in_process([*flags, "--resume"])
    assert_same_run(tmp_path / "killed", reference)


def test_running_sums_not_yet_logged_are_restored(assets, tmp_path, monkeypatch):
    """`--log-every 3`: a stop after step 2 (a SIGTERM seen by the check at the end of step 2, in this process) leaves
    two steps of losses and accuracies not yet logged; the resumed run's row of step 3 averages them with step 3's, as
    the uninterrupted run's does."""
    in_process(rm_flags(assets, tmp_path, "full", "--log-every", "3", "--no-normalize"))
    real, calls = runs.Run.stop_requested, []

    def sigterm_in_step_2(self):
        calls.append(1)
        if len(calls) == 2:
            self.signal = signal.SIGTERM
        return real(self)

    monkeypatch.setattr(runs.Run, "stop_requested", sigterm_in_step_2)
    flags = rm_flags(assets, tmp_path, "stopped", "--log-every", "3", "--no-normalize")
    with pytest.raises(SystemExit) as e:
        in_process(flags)
    assert e.value.code == 128 + signal.SIGTERM
    state = json.loads((tmp_path / "stopped" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and len(state["running"][0]["losses"]) == 4  # 2 steps x 2 micro-batches, not logged
    assert len(state["running"][0]["running"]["train/accuracy"]) == 4
    monkeypatch.setattr(runs.Run, "stop_requested", real)
    in_process([*flags, "--resume"])
    assert_same_run(tmp_path / "stopped", tmp_path / "full")


def test_a_learning_rate_that_blows_up_the_model_ends_in_one_line_keeping_the_last_checkpoint(assets, tmp_path):
    """--learning-rate 1e6: within a few steps the loss or the gradient norm is not finite. The run stops before the
    optimizer writes it into the weights, with one line naming the step, the flag and the last checkpoint (of the step
    before, with --save-every 1), which it leaves as it was: no checkpoint of weights the bad steps moved. Its advice
    works: the same command with a lower learning rate and --overwrite trains to the end."""
    flags = rm_flags(assets, tmp_path, "huge", "--no-pack-pairs", "--save-every", "1")
    with pytest.raises(SystemExit) as e:
        in_process([*flags, "--learning-rate", "1e6"])
    message = str(e.value.code)
    check_non_finite_stop(message, tmp_path / "huge", "1e+06", unit="step")
    in_process([*flags, "--overwrite"])  # the advice: a lower learning rate (the preset's), started over
    assert (tmp_path / "huge" / "done.json").exists()
