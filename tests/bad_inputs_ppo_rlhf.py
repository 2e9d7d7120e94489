"""Bad input specific to ppo_rlhf.py (run by tests/test_bad_inputs.py with the shared cases of tests/bad_inputs.py): the
fields of the training and evaluation prompts (the evaluation's own, such as tiny-tldr's `facts`, included), prompts
that do not fit the model's positions, conversational data, the reward model, process reward model and value model
paths, tokenizers, batch arithmetic and PPO's own flags. The base run is the tiny-math preset (verifiable reward) on
tiny-llama; each case ends in one `error:` line before the first update."""

from __future__ import annotations

import json
import shutil

from tests.bad_inputs import BadInput, World, bad_copy, rows_edited

S = ["ppo_rlhf"]


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


def every_row(edit_row, split: str = "train"):
    """Flags for the tiny-math data with every row of `split` rewritten (a whole dataset in another format)."""

    def edit(text: str) -> str:
        return "".join(json.dumps(edit_row(json.loads(line))) + "\n" for line in text.splitlines() if line.strip())

    return lambda s, w: bad_copy(s, w, edit, split)


def as_chat(row: dict) -> dict:  # TRL's conversational prompt-only format, in the question field
    return {"question": [{"role": "user", "content": row["question"]}], "answer": row["answer"]}


def as_messages(row: dict) -> dict:  # TRL's conversational language-modelling format: the answer is the last turn
    return {"messages": [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}


def as_preference(row: dict) -> dict:  # TRL's prompt / chosen / rejected format
    return {"prompt": row["question"], "chosen": row["answer"], "rejected": "#### 0"}


def model_copy(w: World, tokenizer_config: dict | None = None, chat_template: bool = True) -> list[str]:
    """Flags for a copy of tiny-llama as the SFT model, its tokenizer_config.json updated (None values remove the
    token), or without its chat template."""
    dst = w.tmp / "tiny-llama"
    shutil.copytree(w.assets / "models" / "tiny-llama", dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(tokenizer_config or {})
    if not chat_template:
        (dst / "chat_template.jinja").unlink()
        config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return ["--sft-model-path", str(dst)]


def rm_copy(w: World, config: dict | None = None, swap_tokens: bool = False) -> str:
    """A copy of the world's reward model with its config.json updated, or with two tokens' ids swapped in its
    tokenizer (the same vocabulary, other ids: it would score the policy's ids as other tokens)."""
    dst = w.tmp / "rm"
    shutil.copytree(w.rm, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    if swap_tokens:
        tok = json.loads((dst / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab["x"], vocab["y"] = vocab["y"], vocab["x"]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return str(dst)


LONG = "Tom has 3 apples. " * 400  # about 2,800 tokens: past tiny-llama's 512 positions
MEDIUM = "Tom has 3 apples. " * 25  # over the tiny preset's --max-prompt-length 96, within the positions
PROCESS = {"reward_type": "process", "step_separator": "\n"}
MODEL = ["--reward-source", "model"]  # the learned reward model instead of the preset's verifiable reward

CASES = [
    # ---- the prompt and answer fields, in the training and in the evaluation data ----
    BadInput(
        "question-missing",
        "a training row without its `question` field (the prompt template's)",
        "row 0 of split 'train' has no field 'question'",
        edited("question", ...),
        S,
    ),
    BadInput(
        "question-null",
        "a training row whose `question` is null",
        "has no field 'question' (it is null)",
        edited("question", None),
        S,
    ),
    BadInput(
        "question-list",
        "a training row whose `question` is a list of strings",
        "is a list, not text",
        edited("question", ["Tom has 3 apples.", "How many?"]),
        S,
    ),
    BadInput(
        "question-empty",
        "a training row whose `question` is blank, under `--prompt-template {question}`",
        "renders an empty prompt",
        lambda s, w: [*edited("question", " ")(s, w), "--prompt-template", "{question}"],
        S,
    ),
    BadInput(
        "answer-null",
        "a training row whose `answer` (the verifiable reward's gold) is null",
        "row 0 of split 'train' has no field 'answer' (it is null)",
        edited("answer", None),
        S,
    ),
    BadInput(
        "answer-no-final",
        "a training answer without `#### <number>` (no gold for the reward)",
        "has no final answer in the gsm8k format",
        edited("answer", "Tom has seven apples."),
        S,
    ),
    BadInput(
        "eval-question-null",
        "an evaluation row whose `question` is null (checked before the first update)",
        "row 0 of split 'test' has no field 'question' (it is null)",
        edited("question", None, "test"),
        S,
    ),
    BadInput(
        "eval-answer-missing",
        "an evaluation row without the `answer` its accuracy is judged by",
        "row 0 of split 'test' has no field 'answer'",
        edited("answer", ..., "test"),
        S,
    ),
    BadInput(
        "eval-answer-list",
        "an evaluation row whose `answer` is a list",
        "row 0 of split 'test': field 'answer'",
        edited("answer", ["#### 7"], "test"),
        S,
    ),
    BadInput(
        "eval-facts-missing",
        "`--eval-task tldr` on data without tiny-tldr's `facts` (used by evaluation only)",
        "--eval-task tldr",
        lambda s, w: ["--eval-task", "tldr"],
        S,
    ),
    BadInput(
        "eval-split-missing",
        "an evaluation split the data does not have",
        "no split 'validation'",
        lambda s, w: ["--eval-split", "validation"],
        S,
    ),
    BadInput(
        "preference-data",
        "TRL prompt / chosen / rejected data instead of prompts with answers",
        "its fields are ['chosen', 'prompt', 'rejected']",
        every_row(as_preference),
        S,
    ),
    BadInput(
        "too-few-prompts",
        "4 training prompts for a batch of 8 (the prompt loader would never yield)",
        "fewer than one batch of --per-device-batch-size 8",
        lambda s, w: bad_copy(s, w, lambda text: "".join(text.splitlines(keepends=True)[:4])),
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
        "a 2,800-token question with `--max-prompt-length 4000`: past the model's 512 positions",
        "do not fit the 512 positions of --sft-model-path",
        lambda s, w: [*edited("question", LONG)(s, w), "--max-prompt-length", "4000"],
        S,
    ),
    BadInput(
        "response-over-positions",
        "`--response-length 600` for a 512-position model: no prompt fits",
        "--response-length 600",
        lambda s, w: ["--response-length", "600"],
        S,
    ),
    # ---- conversational data (TRL's formats) ----
    BadInput(
        "conversation-in-template",
        "conversational questions (TRL prompt-only) inside the preset's template `Question: {question}...`",
        "pass --prompt-template '{question}' alone",
        every_row(as_chat),
        S,
    ),
    BadInput(
        "conversation-ends-with-answer",
        "TRL `messages` whose last turn is the assistant's answer, as the prompt",
        "end with an assistant turn",
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
        "conversational questions and a tokenizer without a chat template",
        "has no chat template",
        lambda s, w: [
            *every_row(as_chat)(s, w),
            "--prompt-template",
            "{question}",
            *model_copy(w, chat_template=False),
        ],
        S,
    ),
    # ---- tokenizers ----
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
    # ---- reward model, process reward model, value model ----
    BadInput(
        "reward-model-none",
        "`--reward-source model` without `--reward-model-path`",
        "needs --reward-model-path",
        lambda s, w: MODEL,
        S,
    ),
    BadInput(
        "reward-model-missing",
        "a reward model path that does not exist",
        "--reward-model-path",
        lambda s, w: [*MODEL, "--reward-model-path", str(w.tmp / "nowhere")],
        S,
    ),
    BadInput(
        "reward-model-is-causal-lm",
        "the SFT model (a causal LM, no score head) given as the reward model",
        "is not a reward model: it is a LlamaForCausalLM",
        lambda s, w: [*MODEL, "--reward-model-path", str(w.assets / "models" / "tiny-llama")],
        S,
    ),
    BadInput(
        "reward-model-is-process",
        "a process reward model given as the outcome reward model",
        "its config.reward_type is 'process'",
        lambda s, w: [*MODEL, "--reward-model-path", rm_copy(w, PROCESS)],
        S,
    ),
    BadInput(
        "reward-model-other-tokenizer",
        "a reward model whose tokenizer gives the policy's tokens other ids",
        "differs from the policy's",
        lambda s, w: [*MODEL, "--reward-model-path", rm_copy(w, swap_tokens=True)],
        S,
    ),
    BadInput(
        "prm-is-outcome-model",
        "an outcome reward model given as `--prm-path`",
        "is not a process reward model",
        lambda s, w: ["--prm-path", str(w.rm)],
        S,
    ),
    BadInput(
        "prm-is-causal-lm",
        "a causal LM given as `--prm-path`",
        "holds no score head",
        lambda s, w: ["--prm-path", str(w.assets / "models" / "tiny-llama")],
        S,
    ),
    BadInput(
        "prm-no-separator",
        "a process reward model without `config.step_separator`",
        "step_separator",
        lambda s, w: ["--prm-path", rm_copy(w, {"reward_type": "process"})],
        S,
    ),
    BadInput(
        "prm-refine-without-prm",
        "`--prm-refine clip_delta` without a process reward model",
        "error: --prm-refine clip_delta acts only with --prm-path (a process reward model), which this run lacks",
        lambda s, w: ["--prm-refine", "clip_delta"],
        S,
    ),
    BadInput(
        "value-model-missing",
        "a value model path that does not exist",
        "--value-model-path",
        lambda s, w: ["--value-model-path", str(w.tmp / "nowhere")],
        S,
    ),
    # ---- batch arithmetic and PPO's flags ----
    BadInput(
        "mini-batches-indivisible",
        "8 responses do not split into 3 minibatches",
        "--num-mini-batches 3",
        lambda s, w: ["--num-mini-batches", "3"],
        S,
    ),
    BadInput(
        "episodes-below-a-batch",
        "`--total-episodes 4`, less than one batch of 8",
        "--total-episodes 4",
        lambda s, w: ["--total-episodes", "4"],
        S,
    ),
    BadInput("ppo-epochs-0", "`--num-ppo-epochs 0`", "--num-ppo-epochs", lambda s, w: ["--num-ppo-epochs", "0"], S),
    BadInput(
        "cliprange-0",
        "`--cliprange 0` (every ratio clipped: no policy gradient)",
        "--cliprange is 0",
        lambda s, w: ["--cliprange", "0"],
        S,
    ),
    BadInput("lam-over-1", "`--lam 1.5`", "--lam is 1.5", lambda s, w: ["--lam", "1.5"], S),
    BadInput("kl-coef-negative", "`--kl-coef -0.05`", "--kl-coef is -0.05", lambda s, w: ["--kl-coef", "-0.05"], S),
    BadInput("vf-coef-negative", "a negative `--vf-coef`", "--vf-coef is -0.1", lambda s, w: ["--vf-coef", "-0.1"], S),
    BadInput(
        "adaptive-kl-target-0",
        "`--adaptive-kl --target-kl 0` (divides by the target)",
        "--target-kl",
        lambda s, w: ["--adaptive-kl", "--target-kl", "0"],
        S,
    ),
    # ---- LoRA (on the policy) ----
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
    # ---- a flag that acts only with another the run lacks (issue 59: Args.NEEDS, clean_rlhf_utils/args.py NEEDS) ----
    BadInput(
        "target-kl-without-adaptive-kl",
        "`--target-kl 3` without `--adaptive-kl` (was: ignored, recorded as used)",
        "error: --target-kl 3.0 acts only with --adaptive-kl, which this run lacks",
        lambda s, w: ["--target-kl", "3"],
        S,
    ),
    BadInput(
        "adaptive-kl-without-kl",
        "`--adaptive-kl --kl-coef 0`: nothing to adapt (was: the coefficient stayed 0)",
        "error: --adaptive-kl acts only with --kl-coef above 0 (the coefficient it adapts), which this run lacks",
        lambda s, w: ["--adaptive-kl", "--kl-coef", "0"],
        S,
    ),
    BadInput(
        "cliprange-value-one-pass",
        "`--cliprange-value 0.1` with one epoch over one minibatch, where the values never move (was: ignored)",
        "error: --cliprange-value 0.1 acts only with values that can leave the rollout's",
        lambda s, w: ["--num-ppo-epochs", "1", "--num-mini-batches", "1", "--cliprange-value", "0.1"],
        S,
    ),
    BadInput(
        "prm-clip-eta-delta",
        "`--prm-clip-eta 0.3` with `--prm-refine delta`, which has no threshold (was: ignored)",
        "error: --prm-clip-eta 0.3 acts only with --prm-path and --prm-refine clip or clip_delta",
        lambda s, w: ["--prm-path", str(w.rm), "--prm-refine", "delta", "--prm-clip-eta", "0.3"],
        S,
    ),
]
