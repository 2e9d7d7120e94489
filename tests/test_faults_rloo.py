"""rloo.py survives faults: stopped by SIGTERM or killed outright part way, a tiny-math run resumes to exactly the
metrics and weights of an uninterrupted one (float32 on CPU: the checkpoint restores the weights, AdamW's moments and
every RNG, and the prompts the finished updates drew are replayed from the loader's own generator); a policy that
blows up ends in one `error:` line and a checkpoint, not in torch's "probability tensor contains either inf, nan or
element < 0". The runs that need no signal run in this process (the same command line, through tyro), to save the
seconds of importing torch and transformers again."""

from __future__ import annotations

import json
import signal

import pytest
import tyro

import rloo
from clean_rlhf_utils import generation, prompts
from tests.faults import assert_same_run, check_non_finite_stop, check_stopped, metric_rows, script_cmd, stop_part_way


def rloo_flags(assets, out, name: str, *extra: str) -> list[str]:
    """8 updates of 2 prompts x k = 4 responses, two PPO epochs of two minibatches each (so the checkpoint must also
    restore the RNG of the minibatch shuffle and AdamW's moments), evaluated every 3 updates."""
    return [
        "tiny-math",
        "--sft-model-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        "--response-length",
        "12",
        "--total-episodes",
        "64",
        "--per-device-batch-size",
        "8",
        "--rloo-k",
        "4",
        "--num-ppo-epochs",
        "2",
        "--num-mini-batches",
        "2",
        "--learning-rate",
        "1e-3",
        "--num-eval-examples",
        "4",
        "--per-device-eval-batch-size",
        "4",
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
    """`python rloo.py <argv>`, run in this process; the signal handlers `Run` installs are put back after."""
    try:
        return rloo.main(tyro.extras.overridable_config_cli(rloo.PRESETS, args=argv))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def error_line(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        in_process(argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run every test compares with."""
    out = tmp_path_factory.mktemp("rloo-faults")
    in_process(rloo_flags(assets, out, "full"))
    return out / "full"


def test_rloo_stopped_by_sigterm_resumes_to_the_uninterrupted_run(assets, tmp_path, reference):
    flags = rloo_flags(assets, tmp_path, "killed")
    check_stopped(stop_part_way(script_cmd("rloo", *flags), tmp_path / "killed", after_step=2), tmp_path / "killed")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())
    assert 2 <= state["step"] < 8 and state["episode"] == 8 * state["step"]
    in_process([*flags, "--resume"])
    assert_same_run(tmp_path / "killed", reference)
    evals = [r["step"] for r in metric_rows(tmp_path / "killed") if "eval/accuracy" in r]
    assert evals == [0, 3, 6, 8]  # the step-0 evaluation is not run again on resume
    done = json.loads((tmp_path / "killed" / "done.json").read_text())
    assert done["step"] == done["total_steps"] == 8 and done["total_episodes"] == 64
    assert not (tmp_path / "killed" / "checkpoint").exists()


def test_rloo_killed_outright_resumes_from_its_last_periodic_checkpoint(assets, tmp_path, reference):
    """SIGKILL leaves no chance to save: the run resumes from `--save-every 2`'s last checkpoint, and the metrics and
    samples logged after it are dropped."""
    flags = rloo_flags(assets, tmp_path, "killed", "--save-every", "2")
    out = stop_part_way(script_cmd("rloo", *flags), tmp_path / "killed", after_step=5, sig=signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    assert json.loads((tmp_path / "killed" / "checkpoint" / "state.json").read_text())["step"] == 4
    in_process([*flags, "--resume"])
    assert_same_run(tmp_path / "killed", reference)
    samples = [
        [json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()]
        for d in (tmp_path / "killed", reference)
    ]
    assert samples[0] == samples[1]


def test_rloo_learning_rate_that_blows_up_the_policy_ends_in_one_line_keeping_the_last_checkpoint(assets, tmp_path):
    """--learning-rate 300: at update 2 the gradient norm is NaN. The run stops before the optimizer writes it
    into the weights (the next update's sampling would die in torch.multinomial), with one line naming the last
    checkpoint (--save-every 1: of the update before), which it leaves as it was. Its advice works: a lower learning
    rate (the preset's) and --overwrite train to the end."""
    flags = rloo_flags(assets, tmp_path, "huge", "--save-every", "1")
    message = error_line([*flags, "--learning-rate", "300"])
    check_non_finite_stop(message, tmp_path / "huge", "300")
    in_process([*flags, "--overwrite"])
    assert (tmp_path / "huge" / "done.json").exists()


def test_rloo_logits_that_turn_non_finite_end_in_one_line_not_in_a_torch_error(assets, tmp_path, monkeypatch):
    """Weights whose update was finite but whose logits are not (met by sampling at update 3 here): one line naming the
    update that moved them and the learning rate (the checkpoint of step 2 kept: --save-every 1), not
    torch.multinomial's RuntimeError."""
    real, calls = generation.sample_responses, []

    def blows_up_at_update_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "sample_responses", blows_up_at_update_3)
    message = error_line(rloo_flags(assets, tmp_path, "nan", "--save-every", "1"))
    assert message.startswith(
        "error: the policy's logits are not finite at update 3 (sampling met inf or nan): "
        "update 2 moved the weights too far; lower --learning-rate (now 0.001)"
    ), message
    assert json.loads((tmp_path / "nan" / "checkpoint" / "state.json").read_text())["step"] == 2


@pytest.mark.parametrize("script", ["rloo", "remax"])
def test_conversational_prompts_are_rendered_with_the_chat_template(assets, script):
    """TRL's conversational prompt / completion rows ({"prompt": [messages], "completion": [messages]}) under
    `--prompt-template {prompt} --reference-template {completion}`: the prompt is the tokenizer's chat template of the
    messages (as `--use-chat-template` renders a plain-text prompt), the reference the assistant's text. The formats
    that cannot be rendered are bad inputs (tests/bad_inputs_rloo.py)."""
    import importlib

    from datasets import Dataset
    from transformers import AutoTokenizer

    module = importlib.import_module(script)
    model = str(assets / "models" / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    question, answer = "Tom has 3 apples. He finds 2 more. How many apples does Tom have?", "3 + 2 = 5.\n#### 5"
    chat = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": question}], "completion": [{"role": "assistant", "content": answer}]}]
    )
    plain = Dataset.from_list([{"question": question, "answer": answer}])
    common = {"sft_model_path": model, "reward_source": "math", "reward_model_path": None, "eval_task": "gsm8k"}
    chat_args = module.Args(prompt_template="{prompt}", reference_template="{completion}", **common)
    plain_args = module.Args(
        prompt_template="{question}", reference_template="{answer}", use_chat_template=True, **common
    )
    pieces = (module.extract_answer,)  # the script's gold answer parser
    got = prompts.prepare_prompts(chat, tokenizer, chat_args, "train", 512, True, *pieces)
    want = prompts.prepare_prompts(plain, tokenizer, plain_args, "train", 512, True, *pieces)
    assert got == want and got[0]["gold"] == "5" and got[0]["reference"] == answer
    assert tokenizer.decode(got[0]["prompt_ids"]).rstrip().endswith("<|assistant|>")  # ready for the answer
