"""Bad input specific to rloo.py (run by tests/test_bad_inputs.py with the shared cases of tests/bad_inputs.py): the
prompt and answer fields of the training and evaluation data, prompts that do not fit the model's positions,
conversational data, fields only evaluation uses, tokenizers, SFT and reward models, and RLOO's batch arithmetic. Each
ends in one `error:` line before the first update. `prompt_cases` is shared with tests/bad_inputs_remax.py (the two
scripts read prompts and models alike)."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file

from tests.bad_inputs import BadInput, World, bad_copy, rows_edited


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


def every_row(edit_row, *flags: str):
    """Flags for the tiny-math training and evaluation data with every row rewritten (a dataset in another format)."""

    def edit(text: str) -> str:
        return "".join(json.dumps(edit_row(json.loads(line))) + "\n" for line in text.splitlines() if line.strip())

    return lambda s, w: [*bad_copy(s, w, edit, "test"), *bad_copy(s, w, edit), *flags]


def as_prompt_chat(row: dict) -> dict:  # TRL's conversational prompt / completion format
    return {
        "prompt": [{"role": "user", "content": row["question"]}],
        "completion": [{"role": "assistant", "content": row["answer"]}],
    }


def as_messages(row: dict) -> dict:  # TRL's conversational language-modelling format: the answer is the last turn
    return {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}


def as_preference(row: dict) -> dict:  # TRL's conversational prompt / chosen / rejected format
    return {
        "prompt": [{"role": "user", "content": row["question"]}],
        "chosen": [{"role": "assistant", "content": row["answer"]}],
        "rejected": [{"role": "assistant", "content": "#### 0"}],
    }


def model_copy(
    w: World, tokenizer_config: dict | None = None, chat_template: bool = True, nan: bool = False
) -> list[str]:
    """Flags for a copy of tiny-llama with its tokenizer_config.json updated, without its chat template, or with a NaN
    weight."""
    dst = w.tmp / "tiny-llama"
    shutil.copytree(w.assets / "models" / "tiny-llama", dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(tokenizer_config or {})
    if not chat_template:
        (dst / "chat_template.jinja").unlink()
        config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if nan:
        weights = load_file(dst / "model.safetensors")
        weights["model.norm.weight"][0] = float("nan")
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return ["--sft-model-path", str(dst)]


def reward_model_copy(w: World, config: dict | None = None, swap_tokens: bool = False) -> list[str]:
    """Flags for the world's reward model (reward_model.py's format) with its config updated, or with a tokenizer that
    gives two tokens each other's ids."""
    dst = w.tmp / "rm"
    shutil.copytree(w.rm, dst)
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
    if swap_tokens:
        tok = json.loads((dst / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = [t for t in vocab if t.isalpha()][:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return ["--reward-source", "model", "--reward-model-path", str(dst)]


TEMPLATE = repr("Question: {question}\nAnswer:\n")  # the tiny-math preset's --prompt-template, as messages quote it
LONG = "Tom has 3 apples. " * 866  # 6,077 tokens with the template: past tiny-llama's 512 positions
MEDIUM = "Tom has 3 apples. " * 25  # over the tiny preset's --max-prompt-length 96, within the positions


def prompt_cases(script: str) -> list[BadInput]:
    """The cases rloo.py and remax.py share: how they read prompts, references and models."""
    S = [script]
    return [
        # ---- the question and answer fields, in the training and in the evaluation data ----
        BadInput(
            "question-missing",
            "a training row without its `question` field (the other rows have it)",
            f"row 0 of split 'train': field 'question' of the prompt (--prompt-template {TEMPLATE}) is missing",
            edited("question", ...),
            S,
        ),
        BadInput(
            "question-null",
            "a training row whose `question` is null",
            "row 0 of split 'train': field 'question' of the prompt",
            edited("question", None),
            S,
        ),
        BadInput(
            "question-field-absent",
            "training data without a `question` field at all (another schema)",
            "row 0 of split 'train' has no field 'question' used by the prompt template (--prompt-template",
            every_row(lambda row: {"problem": row["question"], "answer": row["answer"]}),
            S,
        ),
        BadInput(
            "question-list",
            "a training row whose `question` is a list of strings (not text)",
            "field 'question' of the prompt (--prompt-template",
            edited("question", ["Tom has 3 apples.", "How many?"]),
            S,
        ),
        BadInput(
            "question-number-list",
            "a training row whose `question` is a dict",
            "is a dict, not text",
            edited("question", {"text": "Tom has 3 apples."}),
            S,
        ),
        BadInput(
            "answer-missing",
            "a training row without its `answer` (the math reward's gold answer)",
            "row 0 of split 'train': field 'answer' of the reference (--reference-template '{answer}') is missing",
            edited("answer", ...),
            S,
        ),
        BadInput(
            "answer-null",
            "a training row whose `answer` is null",
            "field 'answer' of the reference (--reference-template '{answer}') is missing or null",
            edited("answer", None),
            S,
        ),
        BadInput(
            "answer-no-final",
            "a training answer without the `#### number` final answer",
            "row 0 of split 'train': the reference",
            edited("answer", "3 + 4 = 7"),
            S,
        ),
        BadInput(
            "eval-question-missing",
            "an evaluation row without its `question`",
            "row 0 of split 'test': field 'question' of the prompt",
            edited("question", ..., "test"),
            S,
        ),
        BadInput(
            "eval-question-null",
            "an evaluation row whose `question` is null",
            "row 0 of split 'test': field 'question'",
            edited("question", None, "test"),
            S,
        ),
        BadInput(
            "eval-answer-list",
            "an evaluation row whose `answer` is a list (evaluation grades against it)",
            "row 0 of split 'test': field 'answer' of the reference",
            edited("answer", ["#### 7"], "test"),
            S,
        ),
        BadInput(
            "eval-answer-no-final",
            "an evaluation answer without a final answer (checked before training, not at the first evaluation)",
            "row 0 of split 'test': the reference",
            edited("answer", "seven", "test"),
            S,
        ),
        BadInput(
            "eval-split-missing",
            "an evaluation split that does not exist",
            "no split 'nope'",
            lambda s, w: ["--eval-split", "nope"],
            S,
        ),
        BadInput(
            "eval-tldr-on-math",
            "`--eval-task tldr` on data without the tiny-tldr `facts` (used only by evaluation)",
            "--eval-task tldr judges summaries by the row's 'facts'",
            lambda s, w: ["--eval-task", "tldr"],
            S,
        ),
        BadInput(
            "answer-format-boxed",
            "`--answer-format boxed` on GSM8K answers (`#### 7`)",
            "has no final answer in the boxed format",
            lambda s, w: ["--answer-format", "boxed"],
            S,
        ),
        # ---- templates ----
        BadInput(
            "template-positional",
            "a prompt template with a positional `{}`",
            "has a positional field",
            lambda s, w: ["--prompt-template", "Q: {}"],
            S,
        ),
        BadInput(
            "template-unclosed",
            "a prompt template with an unclosed brace",
            "is not a format string",
            lambda s, w: ["--prompt-template", "Q: {question"],
            S,
        ),
        BadInput(
            "question-blank",
            "a blank `question` under `--prompt-template {question}`",
            "renders an empty prompt",
            lambda s, w: [*edited("question", " ")(s, w), "--prompt-template", "{question}"],
            S,
        ),
        # ---- lengths ----
        BadInput(
            "prompt-over-limit",
            "a prompt over `--max-prompt-length`",
            "row 0 of split 'train' has a 190-token prompt; the limit is --max-prompt-length 96",
            edited("question", MEDIUM),
            S,
        ),
        BadInput(
            "prompt-over-positions",
            "a 6,077-token prompt for tiny-llama's 512 positions, `--max-prompt-length` raised to let it through",
            "row 0 of split 'train' has a 6077-token prompt, and --response-length 12 "
            "more tokens do not fit the 512 positions of --sft-model-path",
            lambda s, w: [*edited("question", LONG)(s, w), "--max-prompt-length", "8000"],
            S,
        ),
        BadInput(
            "response-over-positions",
            "`--response-length` past the model's positions",
            "--response-length 600 leaves no room for a prompt in the 512 positions",
            lambda s, w: ["--response-length", "600"],
            S,
        ),
        BadInput(
            "response-fills-positions",
            "`--response-length` that leaves the prompts too few of the model's positions",
            "row 0 of split 'train' has a 61-token prompt, and --response-length 500 more tokens do "
            "not fit the 512 positions",
            lambda s, w: ["--response-length", "500"],
            S,
        ),
        # ---- conversational data ----
        BadInput(
            "chat-in-text-template",
            "TRL's conversational prompts (a list of role/content messages) under a text template",
            "holds chat messages, which a text template cannot hold; pass --prompt-template '{prompt}' alone",
            every_row(as_prompt_chat, "--prompt-template", "Question: {prompt}"),
            S,
        ),
        BadInput(
            "chat-no-template",
            "conversational prompts for a tokenizer without a chat template",
            "holds chat messages, but the tokenizer of --sft-model-path",
            lambda s, w: [
                *every_row(as_prompt_chat, "--prompt-template", "{prompt}", "--reference-template", "{completion}")(
                    s, w
                ),
                *model_copy(w, chat_template=False),
            ],
            S,
        ),
        BadInput(
            "chat-messages-with-answer",
            "TRL's conversational `messages` (the answer as the last turn) as prompts",
            "end with an assistant turn",
            every_row(as_messages, "--prompt-template", "{messages}"),
            S,
        ),
        BadInput(
            "chat-preference",
            "TRL's conversational prompt / chosen / rejected data with the math templates",
            "has no field 'question' used by the prompt template",
            every_row(as_preference),
            S,
        ),
        BadInput(
            "use-chat-template-without-one",
            "`--use-chat-template` with a tokenizer that has no chat template",
            "error: --use-chat-template: the tokenizer of --sft-model-path",
            lambda s, w: ["--use-chat-template", *model_copy(w, chat_template=False)],
            S,
        ),
        # ---- data too small ----
        BadInput(
            "fewer-prompts-than-a-batch",
            "a training split smaller than one batch of prompts (the endless loader would never yield one)",
            "usable prompts, fewer than one batch",
            lambda s, w: bad_copy(s, w, lambda text: text.splitlines(keepends=True)[0]),
            S,
        ),
        # ---- tokenizer, SFT model, reward model ----
        BadInput(
            "tokenizer-no-pad",
            "a tokenizer without a pad token",
            "has no pad token",
            lambda s, w: model_copy(w, {"pad_token": None}),
            S,
        ),
        BadInput(
            "tokenizer-pad-is-eos",
            "a tokenizer whose pad token is its EOS",
            "uses its EOS",
            lambda s, w: model_copy(w, {"pad_token": "<|endoftext|>"}),
            S,
        ),
        BadInput(
            "sft-not-a-model",
            "an `--sft-model-path` that is a dataset folder",
            "--sft-model-path",
            lambda s, w: ["--sft-model-path", str(w.assets / "tiny-math" / "gsm8k")],
            S,
        ),
        BadInput(
            "sft-nan-weights",
            "an SFT model with a NaN weight (it would die in sampling: torch's 'probability tensor contains inf/nan')",
            "has non-finite weights (model.norm.weight)",
            lambda s, w: model_copy(w, nan=True),
            S,
        ),
        BadInput(
            "reward-model-missing",
            "`--reward-source model` without `--reward-model-path`",
            "--reward-source model needs --reward-model-path",
            lambda s, w: ["--reward-source", "model"],
            S,
        ),
        BadInput(
            "reward-model-not-a-model",
            "a `--reward-model-path` that is a dataset folder",
            "--reward-model-path",
            lambda s, w: ["--reward-source", "model", "--reward-model-path", str(w.assets / "tiny-math" / "gsm8k")],
            S,
        ),
        BadInput(
            "reward-model-process",
            "a process reward model where an outcome one is needed",
            "is a process reward model",
            lambda s, w: reward_model_copy(w, {"reward_type": "process"}),
            S,
        ),
        BadInput(
            "reward-model-other-tokenizer",
            "a reward model whose tokenizer gives the policy's tokens other ids",
            "differs from the policy's",
            lambda s, w: reward_model_copy(w, swap_tokens=True),
            S,
        ),
        BadInput(
            "total-episodes-below-a-batch",
            "`--total-episodes` smaller than one batch",
            "--total-episodes 2",
            lambda s, w: ["--total-episodes", "2"],
            S,
        ),
    ]


def lora_cases(script: str) -> list[BadInput]:
    """The LoRA flags (rloo.py and remax.py alike): a rank or scale that trains nothing, modules the model lacks."""
    S = [script]
    return [
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
            "lora-alpha-nan",
            "`--lora-alpha nan`",
            "--lora-alpha is nan; give a finite number",
            lambda s, w: ["--lora-r", "4", "--lora-alpha", "nan"],
            S,
        ),
        BadInput(
            "lora-target-missing",
            "`--lora-target-modules` naming a module the model does not have",
            "--lora-target-modules ['nope']: Target modules {'nope'} not found",
            lambda s, w: ["--lora-r", "4", "--lora-target-modules", "nope"],
            S,
        ),
    ]


CASES = [
    *prompt_cases("rloo"),
    *lora_cases("rloo"),
    BadInput(
        "rloo-k-not-dividing",
        "`--rloo-k` that does not divide the batch (a prompt's k samples must stay on one process)",
        "--per-device-batch-size 6 is not a multiple of rloo_k (--rloo-k 4)",
        lambda s, w: ["--per-device-batch-size", "6", "--rloo-k", "4"],
        ["rloo"],
    ),
    BadInput(
        "rloo-k-0", "`--rloo-k 0`", "--rloo-k is 0; it must be at least 1", lambda s, w: ["--rloo-k", "0"], ["rloo"]
    ),
    BadInput(
        "mini-batches-not-dividing",
        "`--num-mini-batches` x `--gradient-accumulation-steps` that do not divide the batch",
        "does not split into --num-mini-batches 3",
        lambda s, w: ["--num-mini-batches", "3"],
        ["rloo"],
    ),
    BadInput("cliprange-0", "`--cliprange 0`", "--cliprange is 0.0", lambda s, w: ["--cliprange", "0"], ["rloo"]),
    BadInput(
        "kl-coef-negative", "`--kl-coef -0.05`", "--kl-coef is -0.05", lambda s, w: ["--kl-coef", "-0.05"], ["rloo"]
    ),
    BadInput(
        "rloo-cliprange-one-pass",
        "`--cliprange 0.1` with one pass over one minibatch (plain REINFORCE: the ratio is 1; was: ignored)",
        "error: --cliprange 0.1 acts only with a ratio that can leave 1",
        lambda s, w: ["--cliprange", "0.1"],
        ["rloo"],
    ),
]
