"""sft.py's own bad inputs (tests/bad_inputs.py runs them with the shared ones): prompt / response fields that are
missing, null or mistyped, in the training and in the evaluation data (a null response used to train on the text
`None`, a list on its Python repr); TRL's conversational formats that cannot be rendered; the fields only evaluation
uses (`facts` for `--eval-task tldr`, a final answer for gsm8k / boxed), checked when the evaluation split is loaded and
not at the first evaluation; rows longer than the limits or the model's positions; tokenizers without a distinct pad
token or a chat template; LoRA flags (rank 0, a non-finite alpha, target modules the model lacks). Each ends before
the first step in one `error:` line naming the split, row, field or flag."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

from tests.bad_inputs import BadInput, World, bad_copy, rows_edited

S = ["sft"]
LONG = " ".join(["my roommate ate my dog"] * 866)  # about 6,060 tokens of the tiny tokenizer: more than 512 positions


def every_row(f: Callable[[dict], dict]) -> Callable[[str], str]:
    return lambda text: "".join(json.dumps(f(json.loads(line))) + "\n" for line in text.splitlines() if line.strip())


def rows(split: str, field: str, value) -> Callable[[str, World], list[str]]:
    """Flags of a copy of tiny-tldr/sft with row 0 of `split` given `field` = `value`; with `value` ..., every row
    without `field` (a field missing from one row of a JSON-lines file is read as null: the column is there)."""
    if value is ...:
        edit = every_row(lambda row: {k: v for k, v in row.items() if k != field})
    else:
        edit = rows_edited(lambda row: {**row, field: value})
    return lambda s, w: bad_copy(s, w, edit, split)


def as_messages(row: dict) -> dict:
    """TRL's conversational language-modelling row: the reference summary is the last (assistant) turn."""
    return {
        "messages": [
            {"role": "user", "content": row["query"]},
            {"role": "assistant", "content": row["reference_response"]},
        ],
        "facts": row["facts"],
    }


def as_prompt_completion(row: dict) -> dict:
    """TRL's conversational prompt / completion row."""
    return {
        "prompt": [{"role": "user", "content": row["query"]}],
        "completion": [{"role": "assistant", "content": row["reference_response"]}],
        "facts": row["facts"],
    }


def conversational(edit_row: Callable[[dict], dict], *flags: str) -> Callable[[str, World], list[str]]:
    """Flags of a copy of tiny-tldr/sft whose train and validation rows are rewritten by `edit_row`."""

    def f(s: str, w: World) -> list[str]:
        out = bad_copy(s, w, every_row(edit_row), "train")
        bad_copy(s, w, every_row(edit_row), "validation")
        return [*out, *flags]

    return f


def math_flags(
    edit_row: Callable[[dict], dict] | None = None, split: str = "test"
) -> Callable[[str, World], list[str]]:
    """Flags of the tiny-math preset's data and templates (eval split `test`, `--eval-task gsm8k`) on a copy of
    tiny-math/sft whose row 0 of `split` `edit_row` rewrites."""

    def f(s: str, w: World) -> list[str]:
        src, dst = w.assets / "tiny-math" / "sft", w.tmp / "data" / "math"
        if not dst.exists():
            shutil.copytree(src, dst)
        if edit_row is not None:
            (dst / f"{split}.jsonl").write_text(rows_edited(edit_row)((src / f"{split}.jsonl").read_text()))
        return [
            "--dataset-name-or-path",
            str(dst),
            "--eval-split",
            "test",
            "--prompt-template",
            "Question: {question}\nAnswer:\n",
            "--response-template",
            "{answer}",
            "--eval-task",
            "gsm8k",
            "--max-response-length",
            "80",
        ]

    return f


def model_copy(w: World, name: str, tokenizer_config: dict | None = None, chat_template: bool = True) -> list[str]:
    """Flags of a copy of tiny-neox with its tokenizer_config.json updated (a None value removes the key), or without
    its chat template."""
    dst = w.tmp / name
    shutil.copytree(w.assets / "models" / "tiny-neox", dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(tokenizer_config or {})
    config = {k: v for k, v in config.items() if v is not None}
    if not chat_template:
        (dst / "chat_template.jinja").unlink()
        config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return ["--model-name-or-path", str(dst)]


CASES = [
    # ---- the prompt and response fields, training split ----
    BadInput(
        "sft-response-missing",
        "rows without the response field (it trained on the text `None`)",
        "row 0 of split 'train' has no field 'reference_response' used by the response template "
        "(--response-template '{reference_response}')",
        rows("train", "reference_response", ...),
        S,
    ),
    BadInput(
        "sft-response-null",
        "a row whose response is null (it trained on the text `None`)",
        "row 0 of split 'train': field 'reference_response' of the response (--response-template "
        "'{reference_response}') is null",
        rows("train", "reference_response", None),
        S,
    ),
    BadInput(
        "sft-response-list",
        "a row whose response is a list of strings (it trained on its Python repr)",
        "field 'reference_response' of the response (--response-template '{reference_response}') is a list, not text",
        rows("train", "reference_response", [" my dog", " ate"]),
        S,
    ),
    BadInput(
        "sft-response-empty",
        "a row whose response is blank",
        "row 0 of split 'train' renders an empty response",
        rows("train", "reference_response", "  "),
        S,
    ),
    BadInput(
        "sft-query-missing",
        "rows without the prompt field",
        "row 0 of split 'train' has no field 'query' used by the prompt template (--prompt-template '{query}')",
        rows("train", "query", ...),
        S,
    ),
    BadInput(
        "sft-query-null",
        "a row whose prompt field is null",
        "field 'query' of the prompt (--prompt-template '{query}') is null",
        rows("train", "query", None),
        S,
    ),
    BadInput(
        "sft-query-dict",
        "a row whose prompt field is an object",
        "field 'query' of the prompt (--prompt-template '{query}') is a dict, not text",
        rows("train", "query", {"post": "my dog"}),
        S,
    ),
    BadInput(
        "sft-template-positional",
        "a template with a positional field `{}`",
        "--prompt-template 'Post: {}' has a positional field",
        lambda s, w: ["--prompt-template", "Post: {}"],
        S,
    ),
    # ---- the evaluation split, checked when it is loaded ----
    BadInput(
        "sft-eval-response-null",
        "an evaluation row whose response is null",
        "row 0 of split 'validation': field 'reference_response'",
        rows("validation", "reference_response", None),
        S,
    ),
    BadInput(
        "sft-eval-query-list",
        "an evaluation row whose prompt is a list",
        "row 0 of split 'validation': field 'query' of the prompt (--prompt-template '{query}') is a list",
        rows("validation", "query", ["a post"]),
        S,
    ),
    BadInput(
        "sft-eval-facts-missing",
        "evaluation rows without the `facts` that --eval-task tldr scores (failed at "
        "the first evaluation, after training)",
        "row 0 of split 'validation': --eval-task tldr judges summaries by the row's 'facts'",
        rows("validation", "facts", ...),
        S,
    ),
    BadInput(
        "sft-eval-facts-text",
        "an evaluation row whose `facts` is a string, not a list",
        "--eval-task tldr judges summaries by the row's 'facts' (a list of words",
        rows("validation", "facts", "roommate rent"),
        S,
    ),
    BadInput(
        "sft-eval-no-final-answer",
        "a gsm8k evaluation reference without `#### <number>` (failed at the first evaluation)",
        "row 0 of split 'test': the reference response holds no final answer `#### <number>` for --eval-task gsm8k",
        math_flags(lambda r: {**r, "answer": "Tom has seven apples."}),
        S,
    ),
    BadInput(
        "sft-eval-boxed-mismatch",
        "--eval-task boxed on GSM8K-style references",
        "holds no final answer `\\boxed{...}` for --eval-task boxed",
        lambda s, w: [*math_flags()(s, w), "--eval-task", "boxed"],
        S,
    ),
    # ---- conversational data (TRL's formats) ----
    BadInput(
        "sft-messages-default-templates",
        "TRL's `messages` rows under the preset's text templates",
        "pass --prompt-template '{messages}' --response-template '{messages}'",
        conversational(as_messages),
        S,
    ),
    BadInput(
        "sft-prompt-completion-default-templates",
        "TRL's conversational prompt/completion rows under the preset's text templates",
        "pass --prompt-template '{prompt}' --response-template '{completion}'",
        conversational(as_prompt_completion),
        S,
    ),
    BadInput(
        "sft-messages-in-template",
        "chat messages inside a longer template",
        "holds chat messages, which a text template cannot hold; pass --prompt-template '{prompt}' alone",
        conversational(
            as_prompt_completion, "--prompt-template", "POST: {prompt}", "--response-template", "{completion}"
        ),
        S,
    ),
    BadInput(
        "sft-messages-prompt-ends-with-answer",
        "a conversation ending with the assistant's turn as the prompt, the response from another field",
        "end with an assistant turn; give the same field as --response-template",
        conversational(
            lambda r: {**as_messages(r), "summary": r["reference_response"]},
            "--prompt-template",
            "{messages}",
            "--response-template",
            "{summary}",
        ),
        S,
    ),
    BadInput(
        "sft-messages-no-final-answer-turn",
        "a `messages` conversation that ends with the user's turn",
        "do not end with an assistant turn",
        conversational(
            lambda r: {**as_messages(r), "messages": as_messages(r)["messages"][:1]},
            "--prompt-template",
            "{messages}",
            "--response-template",
            "{messages}",
        ),
        S,
    ),
    BadInput(
        "sft-completion-whole-conversation",
        "TRL's completion field holding the whole conversation",
        "hold turns other than the assistant's",
        conversational(
            lambda r: {**as_prompt_completion(r), "completion": as_messages(r)["messages"]},
            "--prompt-template",
            "{prompt}",
            "--response-template",
            "{completion}",
        ),
        S,
    ),
    BadInput(
        "sft-messages-no-chat-template",
        "conversational rows and a tokenizer without a chat template",
        "has no chat template",
        lambda s, w: [
            *conversational(as_messages, "--prompt-template", "{messages}", "--response-template", "{messages}")(s, w),
            *model_copy(w, "no-template", chat_template=False),
        ],
        S,
    ),
    BadInput(
        "sft-chat-template-flag-without-template",
        "--use-chat-template with a tokenizer without a chat template",
        "has no chat template",
        lambda s, w: ["--use-chat-template", *model_copy(w, "no-template", chat_template=False)],
        S,
    ),
    # ---- lengths ----
    BadInput(
        "sft-prompt-over-limit",
        "a 6,060-token prompt, over --max-prompt-length",
        "--max-prompt-length 96",
        rows("train", "query", LONG),
        S,
    ),
    BadInput(
        "sft-prompt-over-positions",
        "a 6,060-token prompt with --max-prompt-length 8000: past the model's 512 positions",
        "more than the 512 positions of --model-name-or-path (max_position_embeddings)",
        lambda s, w: [*rows("train", "query", LONG)(s, w), "--max-prompt-length", "8000"],
        S,
    ),
    # ---- tokenizers ----
    BadInput(
        "sft-pad-is-eos",
        "a tokenizer whose pad token is its EOS",
        "--add-pad-token",
        lambda s, w: model_copy(w, "pad-eos", {"pad_token": "<|endoftext|>"}),
        S,
    ),
    BadInput(
        "sft-no-pad",
        "a tokenizer without a pad token",
        "has no pad token",
        lambda s, w: model_copy(w, "no-pad", {"pad_token": None}),
        S,
    ),
    # ---- LoRA (--lora-r) ----
    BadInput(
        "sft-lora-r-0",
        "--lora-r 0 (a rank-0 adapter; it trained every weight instead)",
        "--lora-r is 0",
        lambda s, w: ["--lora-r", "0"],
        S,
    ),
    BadInput(
        "sft-lora-alpha-nan",
        "--lora-alpha nan",
        "--lora-alpha is nan",
        lambda s, w: ["--lora-r", "4", "--lora-alpha", "nan"],
        S,
    ),
    BadInput(
        "sft-lora-target-missing",
        "--lora-target-modules naming no module of the model",
        "--lora-target-modules ['no_such_module']: Target modules {'no_such_module'} not found",
        lambda s, w: ["--lora-r", "4", "--lora-target-modules", "no_such_module"],
        S,
    ),
]
