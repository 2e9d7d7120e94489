"""dpo.py survives faults: stopped by SIGTERM part way, a run resumed with `--resume` reaches the metrics and weights of
an uninterrupted run EXACTLY (float32, CPU) in each mode: offline DPO with cached reference logprobs (computed again on
resume), online DPO labelled by a reward model, sampling synchronously or in a generator thread (`--async`, whose
checkpoint holds the batch already sampled for the next step). A non-finite loss stops with a checkpoint and one line.
TRL's conversational prompt/chosen/rejected rows are rendered with the chat template (the bad ones: bad_inputs_dpo.py).

The stopped run is a subprocess, as a user runs it; the uninterrupted and the resumed runs call `dpo.main` in this
process with the same command line (`--resume` added), which saves two interpreter start-ups a test."""

from __future__ import annotations

import json
import signal

import pytest
import tyro

from tests.bad_inputs import make_reward_model
from tests.faults import assert_same_run, check_stopped, script_cmd, stop_part_way


@pytest.fixture(scope="module")
def tiny_rm(assets, tmp_path_factory):
    return make_reward_model(assets, tmp_path_factory.mktemp("rm"))


def dpo_flags(assets, tmp_path, *extra: str) -> list[str]:
    return [
        "--sft-model-path",
        str(assets / "models" / "tiny-neox"),
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "preference"),
        "--prompt-dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--per-device-train-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--learning-rate",
        "1e-3",
        "--response-length",
        "12",
        "--num-eval-examples",
        "4",
        "--num-eval-pairs",
        "8",
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--num-threads",
        "1",
        "--output-dir",
        str(tmp_path),
        *extra,
    ]


# offline: 28 pairs = 7 micro-batches of 4 an epoch, 2 epochs = 6 steps of 2; step 4 draws across the epoch's end
OFFLINE = ["tiny-tldr", "--max-train-samples", "28", "--num-train-epochs", "2"]


def online(rm) -> list[str]:
    """6 steps of 8 prompts out of 40 (5 a pass: the 6th step starts a new shuffle), two samples each, RM labels."""
    return [
        "tiny-tldr-online",
        "--reward-model-path",
        str(rm),
        "--judge",
        "rm",
        "--max-train-samples",
        "40",
        "--total-episodes",
        "48",
        "--no-non-eos-penalty",
    ]


def in_process(argv: list[str]) -> None:
    """`python dpo.py *argv`, in this process."""
    import dpo

    try:
        dpo.main(tyro.extras.overridable_config_cli(dpo.PRESETS, args=argv))
    finally:  # `Run` installs its handlers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stopped_and_resumed(argv, tmp_path, after_step: int = 2) -> None:
    """The uninterrupted run `full`; the same command as `killed`, stopped by SIGTERM once step `after_step` is
    logged, then resumed; both end alike (metrics, final weights, evaluation samples)."""
    in_process([*argv, "--run-name", "full"])
    killed = [*argv, "--run-name", "killed"]
    check_stopped(stop_part_way(script_cmd("dpo", *killed), tmp_path / "killed", after_step), tmp_path / "killed")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    assert after_step <= state["step"] < 6
    in_process([*killed, "--resume"])
    assert_same_run(tmp_path / "killed", tmp_path / "full")
    samples = [(tmp_path / name / "samples.jsonl").read_text() for name in ("killed", "full")]
    assert samples[0] == samples[1] and samples[0]
    assert not (tmp_path / "killed" / "checkpoint").exists()
    done = json.loads((tmp_path / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 6


def test_offline_dpo_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path):
    """The data order is replayed (4 of 6 steps across two epochs), the reference logprobs cached again."""
    stopped_and_resumed([*OFFLINE, *dpo_flags(assets, tmp_path)], tmp_path)


def test_online_dpo_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tiny_rm, tmp_path):
    """Synchronous sampling: each step samples its batch at its start, so a checkpoint holds no batch; the RNG state
    restored by `--resume` samples the next one as the uninterrupted run does."""
    stopped_and_resumed([*online(tiny_rm), *dpo_flags(assets, tmp_path)], tmp_path)


def test_async_online_dpo_checkpointed_and_stopped_resumes_to_the_uninterrupted_run(assets, tiny_rm, tmp_path):
    """`--async`: the checkpoint of step 2 (`--save-every 2`, the run goes on) and that of the stop wait for the batch
    the generator thread is sampling with the weights of the step before, and hold it; the resumed run trains on it
    and samples the next with its restored RNG. One learner and one generator thread (`--num-threads 2`)."""
    argv = [*online(tiny_rm), "--async", *dpo_flags(assets, tmp_path, "--num-threads", "2", "--save-every", "2")]
    stopped_and_resumed(argv, tmp_path, after_step=3)
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/policy_lag"] for r in rows if "train/loss" in r] == [0, 1, 1, 1, 1, 1]


def test_a_non_finite_loss_stops_in_one_line_keeping_the_last_checkpoint(assets, tmp_path):
    """Learning rate 1e30: Adam moves every weight by about 1e30 at step 1, so the loss of step 2 is not finite. The
    run ends in one line before the weights take the non-finite gradient, leaving the last checkpoint (of step 1,
    --save-every 1) as it was and advising a new run (`--resume` would repeat the steps)."""
    argv = [
        *OFFLINE,
        *dpo_flags(
            assets,
            tmp_path,
            "--learning-rate",
            "1e30",
            "--num-eval-examples",
            "0",
            "--num-eval-pairs",
            "0",
            "--run-name",
            "nan",
            "--save-every",
            "1",
        ),
    ]
    with pytest.raises(
        SystemExit,
        match=r"^error: non-finite (DPO loss|gradient norm) at step 2: lower --learning.*"
        r"then start over with --overwrite .*the last checkpoint, after step 1, stays in",
    ):
        in_process(argv)
    state = json.loads((tmp_path / "nan" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 1 and state["drawn"] == 2 and not (tmp_path / "nan" / "done.json").exists()


def test_trl_conversational_pairs_are_rendered_with_the_chat_template(assets):
    """TRL's conversational preference format, {"prompt": [user turn], "chosen": [assistant turn], "rejected":
    [assistant turn]}, with --prompt-template '{prompt}': the prompt is the chat template's rendering up to the
    assistant's turn, each response the assistant's text and one EOS, as plain-text pairs with --use-chat-template."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    import dpo

    tokenizer = AutoTokenizer.from_pretrained(assets / "models" / "tiny-neox")
    user = [{"role": "system", "content": "Summarize."}, {"role": "user", "content": "my dog ate my exam"}]
    rows = [
        {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": " dog ate exam"}],
            "rejected": [{"role": "assistant", "content": " so basically a dog"}],
        }
    ]
    args = dpo.Args(prompt_template="{prompt}")
    (pair,) = dpo.tokenize_pairs(Dataset.from_list(rows), tokenizer, args, "train", 512)
    assert pair["prompt_ids"] == list(
        tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert tokenizer.decode(pair["prompt_ids"]).endswith("<|assistant|>\n")
    eos = tokenizer.eos_token_id
    assert pair["chosen"] == tokenizer(" dog ate exam", add_special_tokens=False)["input_ids"] + [eos]
    assert pair["rejected"] == tokenizer(" so basically a dog", add_special_tokens=False)["input_ids"] + [eos]
    text = dpo.Args(prompt_template="{prompt}", use_chat_template=True)  # the same prompt given as text
    (plain,) = dpo.tokenize_pairs(
        Dataset.from_list(
            [{"prompt": "my dog ate my exam", "chosen": " dog ate exam", "rejected": " so basically a dog"}]
        ),
        tokenizer,
        text,
        "train",
    )
    assert plain["chosen"] == pair["chosen"] and tokenizer.decode(plain["prompt_ids"]).endswith("<|assistant|>\n")
