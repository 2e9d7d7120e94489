"""Bad input specific to grpo_math.py (run by tests/test_bad_inputs.py with the shared cases of tests/bad_inputs.py):
the question and answer fields of the training and evaluation data, prompts that do not fit the model's positions,
conversational data, answers without a final answer in the `--answer-format`, batch arithmetic, tokenizers and reward
models. Each ends in one `error:` line before the first step."""

from __future__ import annotations

import json
import shutil

from tests.bad_inputs import BadInput, World, bad_copy, pickled_copy, rows_edited

S = ["grpo_math"]


def edited(field: str, value, split: str = "train"):
    """Flags for the tiny-math data with row 0's `field` set to `value` (removed for `...`) in `split`."""

    def edit_row(row: dict) -> dict:
        row = dict(row)
        if value is ...:
            del row[field]
        else:
            row[field] = value
        return row

    return lambda s, w: bad_copy(s, w, rows_edited(edit_row), split)


def every_row(edit_row):
    """Flags for the tiny-math training data with every row rewritten (a whole dataset in another format)."""

    def edit(text: str) -> str:
        return "".join(json.dumps(edit_row(json.loads(line))) + "\n" for line in text.splitlines() if line.strip())

    return lambda s, w: bad_copy(s, w, edit)


def as_chat(row: dict) -> dict:  # TRL's conversational prompt-only format
    return {"question": [{"role": "user", "content": row["question"]}], "answer": row["answer"]}


def as_messages(row: dict) -> dict:  # TRL's conversational language-modelling format: the answer is the last turn
    return {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}


def as_preference(row: dict) -> dict:  # TRL's prompt / chosen / rejected format
    return {"prompt": row["question"], "chosen": row["answer"], "rejected": "#### 0"}


def model_copy(w: World, tokenizer_config: dict | None = None, chat_template: bool = True) -> list[str]:
    """Flags for a copy of tiny-llama with its tokenizer_config.json updated (None values remove the token), or without
    its chat template."""
    dst = w.tmp / "tiny-llama"
    shutil.copytree(w.assets / "models" / "tiny-llama", dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(tokenizer_config or {})
    if not chat_template:
        (dst / "chat_template.jinja").unlink()
        config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return ["--model-name-or-path", str(dst)]


LONG = "Tom has 3 apples. " * 1200  # about 8,000 tokens: past tiny-llama's 512 positions
MEDIUM = "Tom has 3 apples. " * 25  # over the tiny preset's --max-prompt-length 96, within the positions

CASES = [
    # ---- the question and answer fields, in the training and in the evaluation data ----
    BadInput(
        "question-missing",
        "a training row without its `question` field",
        "row 0 of split 'train' has no field 'question'",
        edited("question", ...),
        S,
    ),
    BadInput(
        "question-null",
        "a training row whose `question` is null",
        "has no field 'question' (missing or null)",
        edited("question", None),
        S,
    ),
    BadInput(
        "question-list",
        "a training row whose `question` is a list of strings",
        "field 'question' is a list, not text",
        edited("question", ["Tom has 3 apples.", "How many?"]),
        S,
    ),
    BadInput(
        "question-empty",
        "a training row whose `question` is empty (the template alone is not empty: a blank "
        "question under `--prompt-template {question}`)",
        "renders an empty prompt",
        lambda s, w: [*edited("question", " ")(s, w), "--prompt-template", "{question}"],
        S,
    ),
    BadInput(
        "answer-missing",
        "a training row without its `answer` field",
        "row 0 of split 'train' has no field 'answer'",
        edited("answer", ...),
        S,
    ),
    BadInput(
        "answer-null",
        "a training row whose `answer` is null",
        "has no field 'answer' (missing or null)",
        edited("answer", None),
        S,
    ),
    BadInput(
        "answer-list",
        "a training row whose `answer` is a list",
        "field 'answer' is a list, not text",
        edited("answer", ["3 + 4 = 7", "#### 7"]),
        S,
    ),
    BadInput(
        "answer-no-final",
        "a training answer without `#### <number>`",
        "hold no final answer `#### <number>`",
        edited("answer", "Tom has seven apples."),
        S,
    ),
    BadInput(
        "answer-format-mismatch",
        "`--answer-format boxed` on GSM8K-style answers",
        "(--answer-format boxed)",
        lambda s, w: ["--answer-format", "boxed"],
        S,
    ),
    BadInput(
        "eval-question-null",
        "an evaluation row whose `question` is null (checked before the first step)",
        "row 0 of split 'test' has no field 'question' (missing or null)",
        edited("question", None, "test"),
        S,
    ),
    BadInput(
        "eval-answer-missing",
        "an evaluation row without its `answer` field",
        "row 0 of split 'test' has no field 'answer'",
        edited("answer", ..., "test"),
        S,
    ),
    BadInput(
        "eval-answer-list",
        "an evaluation row whose `answer` is a list",
        "row 0 of split 'test': field 'answer' is a list",
        edited("answer", ["#### 7"], "test"),
        S,
    ),
    BadInput(
        "eval-answer-no-final",
        "an evaluation answer without a final answer",
        "row 0 of split 'test': field(s) ['answer']",
        edited("answer", "seven", "test"),
        S,
    ),
    BadInput(
        "eval-data-missing",
        "an evaluation data path that does not exist",
        "--eval-dataset-name-or-path",
        lambda s, w: ["--eval-dataset-name-or-path", str(w.tmp / "nowhere")],
        S,
    ),
    BadInput(
        "eval-data-is-train-file",
        "--eval-dataset-name-or-path naming the training folder's train.jsonl (was: evaluated on the training rows)",
        "train.jsonl is one file, read as split 'train' and as split 'test' (--dataset-name-or-path",
        lambda s, w: ["--eval-dataset-name-or-path", str(w.assets / "tiny-math" / "gsm8k" / "train.jsonl")],
        S,
    ),
    BadInput(
        "eval-split-missing",
        "an evaluation split the data does not have",
        "no split 'validation'",
        lambda s, w: ["--eval-split", "validation"],
        S,
    ),
    # ---- lengths ----
    BadInput(
        "prompt-over-limit",
        "a 170-token question, over `--max-prompt-length 96`",
        "--max-prompt-length 96",
        edited("question", MEDIUM),
        S,
    ),
    BadInput(
        "prompt-over-positions",
        "an 8,000-token question with `--max-prompt-length 9000`: past the model's 512 positions",
        "which with --max-completion-length 80 needs",
        lambda s, w: [*edited("question", LONG)(s, w), "--max-prompt-length", "9000"],
        S,
    ),
    BadInput(
        "budget-over-positions",
        "`--max-completion-length 600` for a 512-position model: no prompt fits",
        "512 (max_position_embeddings)",
        lambda s, w: ["--max-completion-length", "600"],
        S,
    ),
    # ---- conversational data (TRL's formats) ----
    BadInput(
        "conversation-in-template",
        "conversational questions (TRL prompt-only) inside the preset's template `Question: {question}...`",
        "pass --prompt-template '{question}'",
        every_row(as_chat),
        S,
    ),
    BadInput(
        "conversation-ends-with-answer",
        "TRL `messages` whose last turn is the assistant's answer, as the prompt",
        "ends with an assistant message",
        lambda s, w: [
            *every_row(as_messages)(s, w),
            "--prompt-template",
            "{messages}",
            "--reference-template",
            "{messages}",
        ],
        S,
    ),
    BadInput(
        "conversation-no-chat-template",
        "a conversational question and a tokenizer without a chat template",
        "has no chat template to render it",
        lambda s, w: [
            *every_row(as_chat)(s, w),
            "--prompt-template",
            "{question}",
            *model_copy(w, chat_template=False),
        ],
        S,
    ),
    BadInput(
        "chat-template-flag-without-template",
        "`--use-chat-template` with a tokenizer without a chat template",
        "--use-chat-template",
        lambda s, w: ["--use-chat-template", *model_copy(w, chat_template=False)],
        S,
    ),
    BadInput(
        "preference-data",
        "TRL prompt / chosen / rejected data instead of questions and answers",
        "its fields are ['chosen', 'prompt', 'rejected']",
        every_row(as_preference),
        S,
    ),
    # ---- batch arithmetic and the other flags ----
    BadInput(
        "generations-1",
        "`--num-generations 1`: no group to be relative to",
        "--num-generations is 1",
        lambda s, w: ["--num-generations", "1"],
        S,
    ),
    BadInput(
        "mini-batches-indivisible",
        "16 questions x 8 completions do not split into 3 mini-batches",
        "--num-mini-batches 3",
        lambda s, w: ["--num-mini-batches", "3"],
        S,
    ),
    BadInput(
        "questions-0",
        "`--questions-per-device 0`",
        "--questions-per-device is 0",
        lambda s, w: ["--questions-per-device", "0"],
        S,
    ),
    BadInput(
        "overlong-buffer-too-long",
        "a soft overlong buffer as long as the completion budget",
        "--overlong-buffer 80",
        lambda s, w: ["--overlong-buffer", "80"],
        S,
    ),
    BadInput(
        "warmup-steps-negative",
        "`--warmup-steps -1` (a negative learning rate)",
        "--warmup-steps is -1",
        lambda s, w: ["--warmup-steps", "-1"],
        S,
    ),
    BadInput("pass-k-negative", "`--pass-k -1` (0 skips pass@k)", "--pass-k is -1", lambda s, w: ["--pass-k", "-1"], S),
    BadInput(
        "sampling-rounds-0",
        "`--max-sampling-rounds 0`",
        "--max-sampling-rounds is 0",
        lambda s, w: ["--max-sampling-rounds", "0"],
        S,
    ),
    BadInput(
        "advantage-eps-negative",
        "`--advantage-eps -1` (was: right answers got negative advantages)",
        "--advantage-eps is -1.0; it must be above 0",
        lambda s, w: ["--advantage-eps", "-1"],
        S,
    ),
    BadInput("beta-negative", "a negative `--beta`", "--beta is -0.04", lambda s, w: ["--beta", "-0.04"], S),
    BadInput(
        "epsilon-low-negative",
        "a negative `--epsilon-low`",
        "--epsilon-low is -0.2",
        lambda s, w: ["--epsilon-low", "-0.2"],
        S,
    ),
    BadInput(
        "cispo-dual-clip",
        "`--loss-type cispo --dual-clip 3` (CISPO has no clipped surrogate to bound)",
        "--dual-clip bounds PPO's clipped surrogate; --loss-type cispo has none",
        lambda s, w: ["--loss-type", "cispo", "--dual-clip", "3"],
        S,
    ),
    BadInput(
        "overlong-buffer-negative",
        "a negative `--overlong-buffer`",
        "--overlong-buffer is -4",
        lambda s, w: ["--overlong-buffer", "-4"],
        S,
    ),
    # ---- tokenizers and reward models ----
    BadInput(
        "pad-is-eos",
        "a tokenizer whose pad token is its EOS",
        "--add-pad-token",
        lambda s, w: model_copy(w, {"pad_token": "<|endoftext|>"}),
        S,
    ),
    BadInput(
        "no-pad",
        "a tokenizer without a pad token",
        "has no pad token",
        lambda s, w: model_copy(w, {"pad_token": None}),
        S,
    ),
    BadInput(
        "reward-model-missing",
        "a reward model path that does not exist",
        "--reward-model-path",
        lambda s, w: ["--reward-model-path", str(w.tmp / "nowhere")],
        S,
    ),
    BadInput(
        "prm-is-outcome-model",
        "an outcome reward model given as `--prm-path`",
        "is not a process reward model",
        lambda s, w: ["--prm-path", str(w.rm)],
        S,
    ),
    # ---- LoRA ----
    BadInput(
        "lora-r-0",
        "`--lora-r 0` (a rank of 0 would silently train every weight instead)",
        "--lora-r is 0; a LoRA rank must be at least 1",
        lambda s, w: ["--lora-r", "0"],
        S,
    ),
    BadInput(
        "lora-alpha-0",
        "`--lora-alpha 0` (the adapters would change nothing)",
        "--lora-alpha is 0.0",
        lambda s, w: ["--lora-r", "4", "--lora-alpha", "0"],
        S,
    ),
    BadInput(
        "lora-target-missing",
        "`--lora-target-modules` naming a module the model does not have",
        "--lora-target-modules ['nope']: Target modules {'nope'} not found",
        lambda s, w: ["--lora-r", "4", "--lora-target-modules", "nope"],
        S,
    ),
    # ---- a flag that acts only with another the run lacks (issue 59: Args.NEEDS, clean_rlhf_utils/args.py NEEDS) ----
    BadInput(
        "max-sampling-rounds-without-dynamic",
        "`--max-sampling-rounds 8` without dynamic sampling (`--loss-type grpo`; was: ignored)",
        "error: --max-sampling-rounds 8 acts only with --dynamic-sampling, which this run lacks",
        lambda s, w: ["--max-sampling-rounds", "8"],
        S,
    ),
    BadInput(
        "rm-coef-without-rm",
        "`--rm-coef 0.5` without `--reward-model-path` (was: ignored)",
        "error: --rm-coef 0.5 acts only with --reward-model-path, which this run lacks",
        lambda s, w: ["--rm-coef", "0.5"],
        S,
    ),
    BadInput(
        "correction-cap-without-correction",
        "`--sampler-correction-cap 2 --sampler-correction none` (was: ignored)",
        "error: --sampler-correction-cap 2.0 acts only with --sampler-correction other than none",
        lambda s, w: ["--sampler-correction", "none", "--sampler-correction-cap", "2"],
        S,
    ),
    BadInput(
        "kl-estimator-without-kl-term",
        "`--kl-estimator k2` with `--loss-type dapo` (beta 0: no KL loss term; issue 67, was: ignored)",
        "error: --kl-estimator k2 acts only with a KL loss term (--beta above 0), which this run lacks",
        lambda s, w: ["--loss-type", "dapo", "--kl-estimator", "k2"],
        S,
    ),
    BadInput(
        "log-ratio-clamp-on-policy",
        "`--log-ratio-clamp 10` with `--beta 0 --num-mini-batches 1` (a ratio of exactly 1, no k3; issue 67, was: "
        "ignored)",
        "error: --log-ratio-clamp 10.0 acts only with a ratio that can leave 1 (more than one iteration or minibatch, "
        "or --async) or a KL term (--beta above 0), which this run lacks",
        lambda s, w: ["--beta", "0", "--num-mini-batches", "1", "--log-ratio-clamp", "10"],
        S,
    ),
    BadInput(
        "teacher-pickle-only",
        "a `--teacher-model-path` directory whose weights are only `pytorch_model.bin` (was: loaded from the pickle)",
        "holds its weights only as a pickle (pytorch_model.bin), which this library does not load",
        lambda s, w: [
            "--advantage-estimator",
            "distill",
            "--teacher-model-path",
            pickled_copy(w.assets / "models" / "tiny-llama", w, "pickled-teacher"),
        ],
        S,
    ),
]
