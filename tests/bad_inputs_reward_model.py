"""reward_model.py's own bad inputs (tests/bad_inputs.py runs them with the shared ones): preference pairs with a
missing, null or mistyped prompt / chosen / rejected / margin field, in the training and in the evaluation data; pairs
whose chosen and rejected are the same everywhere; process (PRM) data whose labels do not match its steps; a bad
normalisation dataset (path or schema), caught before training and not after it; TRL's conversational formats it cannot
take; rows longer than `--max-length` or the model's positions; SFT model directories without a usable tokenizer (a
save killed part way) or weights, and tokenizers without a distinct pad token. Each ends before the first step in one
`error:` line naming the row, field, file or flag."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

from tests.bad_inputs import BadInput, World, bad_copy, rows_edited

S = ["reward_model"]
LONG = " ".join(["my roommate ate my dog"] * 866)  # about 6,060 tokens of the tiny tokenizer: more than 512 positions


def every_row(f: Callable[[dict], dict]) -> Callable[[str], str]:
    return lambda text: "".join(json.dumps(f(json.loads(line))) + "\n" for line in text.splitlines() if line.strip())


def edit(field: str, value) -> Callable[[str], str]:
    """Row 0 with `field` set to `value`; with `value` ..., every row without `field` (a field missing from one row of
    a JSON-lines file is read as null: the column is there)."""
    if value is ...:
        return every_row(lambda row: {k: v for k, v in row.items() if k != field})
    return rows_edited(lambda row: {**row, field: value})


def pairs(split: str, field: str, value) -> Callable[[str, World], list[str]]:
    """Flags of a copy of the preference pairs with row 0 of `split` edited."""
    return lambda s, w: bad_copy(s, w, edit(field, value), split)


def copy_of(w: World, rel: str, name: str, split: str, change: Callable[[str], str]) -> str:
    """A copy of the assets' `rel` data with `split`.jsonl rewritten by `change`."""
    src, dst = w.assets / rel, w.tmp / "data" / name
    if not dst.exists():
        shutil.copytree(src, dst)
    (dst / f"{split}.jsonl").write_text(change((src / f"{split}.jsonl").read_text()))
    return str(dst)


def norm(change: Callable[[str], str]) -> Callable[[str, World], list[str]]:
    """Flags of a copy of the normalisation data (tiny-tldr/sft, split train) rewritten by `change`."""
    return lambda s, w: ["--norm-dataset-name-or-path", copy_of(w, "tiny-tldr/sft", "norm", "train", change)]


PRM = [
    "--objective",
    "process",
    "--prompt-template",
    "Question: {prompt}\nAnswer:\n",
    "--eval-split",
    "test",
    "--no-normalize",
    "--max-length",
    "192",
]


def prm(change: Callable[[str], str], split: str = "train") -> Callable[[str, World], list[str]]:
    """Flags of a process-RM run on a copy of tiny-math/prm (TRL's stepwise supervision) rewritten by `change`."""
    return lambda s, w: [*PRM, "--dataset-name-or-path", copy_of(w, "tiny-math/prm", "prm", split, change)]


def implicit_prompt(row: dict) -> dict:
    """TRL's conversational preference row with the prompt inside each response (its implicit-prompt format)."""
    user = {"role": "user", "content": row["query"]}
    return {
        "chosen": [user, {"role": "assistant", "content": row["chosen"]}],
        "rejected": [user, {"role": "assistant", "content": row["rejected"]}],
    }


def explicit_prompt(row: dict) -> dict:
    """TRL's conversational prompt / chosen / rejected row, which reward_model.py renders with the chat template."""
    return {
        "prompt": [{"role": "user", "content": row["query"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }


def model_copy(
    w: World, name: str, keep: Callable[[str], bool] = lambda f: True, tokenizer_config: dict | None = None
) -> list[str]:
    """Flags of a copy of tiny-neox holding only the files `keep` keeps, its tokenizer_config.json updated with
    `tokenizer_config` (a None value removes the key; written even where it was not kept)."""
    src, dst = w.assets / "models" / "tiny-neox", w.tmp / name
    dst.mkdir()
    for f in src.iterdir():
        if keep(f.name):
            shutil.copy(f, dst / f.name)
    if tokenizer_config is not None:
        config = json.loads((src / "tokenizer_config.json").read_text())
        config.update(tokenizer_config)
        config = {k: v for k, v in config.items() if v is not None}
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return ["--sft-model-path", str(dst)]


WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")

CASES = [
    # ---- the preference pairs, training split ----
    BadInput(
        "rm-chosen-missing",
        "pairs without a `chosen` field",
        "row 0 of split 'train' has no field 'chosen' (--chosen-field)",
        pairs("train", "chosen", ...),
        S,
    ),
    BadInput(
        "rm-chosen-null",
        "a pair whose `chosen` is null",
        "field 'chosen' (--chosen-field) is null",
        pairs("train", "chosen", None),
        S,
    ),
    BadInput(
        "rm-rejected-null",
        "a pair whose `rejected` is null (it trained on the text `None`)",
        "field 'rejected' (--rejected-field) is null",
        pairs("train", "rejected", None),
        S,
    ),
    BadInput(
        "rm-rejected-list",
        "a pair whose `rejected` is a list of strings",
        "field 'rejected' (--rejected-field) is a list, not text",
        pairs("train", "rejected", ["a summary", "another"]),
        S,
    ),
    BadInput(
        "rm-chosen-empty",
        "a pair whose `chosen` is blank",
        "field 'chosen' (--chosen-field) is empty",
        pairs("train", "chosen", "  "),
        S,
    ),
    BadInput(
        "rm-query-missing",
        "pairs without the prompt field of --prompt-template",
        "has no field 'query' used by the prompt template (--prompt-template '{query}')",
        pairs("train", "query", ...),
        S,
    ),
    BadInput(
        "rm-query-null",
        "a pair whose prompt field is null",
        "field 'query' of the prompt (--prompt-template '{query}') is missing or null",
        pairs("train", "query", None),
        S,
    ),
    BadInput(
        "rm-query-list",
        "a pair whose prompt field is a list of strings",
        "field 'query' of the prompt (--prompt-template '{query}') is a list, not text",
        pairs("train", "query", ["a post", "another"]),
        S,
    ),
    BadInput(
        "rm-same-responses",
        "pairs whose chosen and rejected are the same text everywhere",
        "no preference to learn",
        lambda s, w: bad_copy(s, w, every_row(lambda r: {**r, "rejected": r["chosen"]})),
        S,
    ),
    BadInput(
        "rm-margin-not-a-number",
        "a `--margin-field` holding text",
        "the margin (--margin-field id) must be a finite number",
        lambda s, w: ["--margin-field", "id"],
        S,
    ),
    BadInput(
        "rm-margin-missing",
        "a `--margin-field` the rows do not have",
        "got no such field",
        lambda s, w: ["--margin-field", "margin"],
        S,
    ),
    # ---- the evaluation split, checked when it is loaded ----
    BadInput(
        "rm-eval-chosen-null",
        "an evaluation pair whose `chosen` is null",
        "row 0 of split 'validation': field 'chosen' (--chosen-field) is null",
        pairs("validation", "chosen", None),
        S,
    ),
    BadInput(
        "rm-eval-query-list",
        "an evaluation pair whose prompt is a list",
        "row 0 of split 'validation': field 'query'",
        pairs("validation", "query", ["a post"]),
        S,
    ),
    BadInput(
        "rm-eval-split-missing",
        "an evaluation split the data does not have",
        "no split 'test'",
        lambda s, w: ["--eval-split", "test"],
        S,
    ),
    # ---- the normalisation data: read before training, not after it ----
    BadInput(
        "rm-norm-data-missing",
        "a normalisation data path that does not exist",
        "--norm-dataset-name-or-path",
        lambda s, w: ["--norm-dataset-name-or-path", str(w.tmp / "nowhere")],
        S,
    ),
    BadInput(
        "rm-norm-data-is-preference",
        "preference pairs given as the normalisation data (no reference response)",
        "has no field 'reference_response' used by the reference response template (--norm-response-template",
        lambda s, w: [
            "--norm-dataset-name-or-path",
            str(w.assets / "tiny-tldr" / "preference"),
            "--norm-split",
            "validation",
        ],
        S,
    ),
    BadInput(
        "rm-norm-reference-null",
        "a normalisation row whose reference response is null",
        "of --norm-dataset-name-or-path",
        norm(rows_edited(lambda r: {**r, "reference_response": None})),
        S,
    ),
    BadInput(
        "rm-norm-query-missing",
        "normalisation rows without the prompt field",
        "of --norm-dataset-name-or-path ",
        norm(every_row(lambda r: {k: v for k, v in r.items() if k != "query"})),
        S,
    ),
    BadInput(
        "rm-norm-overlong",
        "a normalisation prompt longer than --max-length",
        "--max-length 160",
        norm(rows_edited(lambda r: {**r, "query": LONG})),
        S,
    ),
    # ---- process reward model data (TRL stepwise supervision) ----
    BadInput(
        "prm-labels-fewer",
        "a solution with fewer labels than steps",
        "5 steps but 4 labels",
        prm(rows_edited(lambda r: {**r, "labels": r["labels"][:-1]})),
        S,
    ),
    BadInput(
        "prm-label-not-boolean",
        "a step label that is a score, not a boolean",
        "label 0 of field 'labels' (--labels-field) is 0.5, not a boolean",
        prm(rows_edited(lambda r: {**r, "labels": [0.5] * len(r["labels"])})),
        S,
    ),
    BadInput(
        "prm-completions-text",
        "`completions` a single string, not a list of steps",
        "field 'completions' (--steps-field) must be a non-empty list of step texts",
        prm(every_row(lambda r: {**r, "completions": "\n".join(r["completions"])})),
        S,
    ),
    BadInput(
        "prm-labels-missing",
        "solutions without `labels`",
        "has no field 'labels' (--labels-field)",
        prm(every_row(lambda r: {k: v for k, v in r.items() if k != "labels"})),
        S,
    ),
    BadInput(
        "prm-step-null",
        "a null step",
        "step 1 of field 'completions' (--steps-field) is None",
        prm(rows_edited(lambda r: {**r, "completions": [r["completions"][0], None, *r["completions"][2:]]})),
        S,
    ),
    BadInput(
        "prm-eval-labels-mismatch",
        "an evaluation solution with more labels than steps",
        "row 0 of split 'test' has",
        prm(rows_edited(lambda r: {**r, "labels": [*r["labels"], True]}), "test"),
        S,
    ),
    BadInput(
        "prm-preference-data",
        "preference pairs given to `--objective process`",
        "has no field 'prompt' used by the prompt template",
        lambda s, w: [
            *PRM,
            "--dataset-name-or-path",
            str(w.assets / "tiny-tldr" / "preference"),
            "--eval-split",
            "validation",
        ],
        S,
    ),
    # ---- conversational data (TRL's formats) ----
    BadInput(
        "rm-conversation-implicit-prompt",
        "TRL's implicit-prompt conversational pairs (the prompt inside chosen and rejected)",
        "TRL's implicit-prompt format; give the prompt's messages in their own field",
        lambda s, w: bad_copy(s, w, every_row(implicit_prompt)),
        S,
    ),
    BadInput(
        "rm-conversation-in-template",
        "conversational prompts inside a longer --prompt-template",
        "holds chat messages, which a text template cannot hold; pass --prompt-template '{prompt}' alone",
        lambda s, w: [*bad_copy(s, w, every_row(explicit_prompt)), "--prompt-template", "POST: {prompt}"],
        S,
    ),
    BadInput(
        "rm-conversation-default-template",
        "TRL's conversational prompt/chosen/rejected under the preset's --prompt-template '{query}'",
        "for TRL's conversational format pass --prompt-template '{prompt}'",
        lambda s, w: bad_copy(s, w, every_row(explicit_prompt)),
        S,
    ),
    BadInput(
        "rm-conversation-ends-with-assistant",
        "conversational prompts that end with the assistant's answer",
        "end with an assistant turn",
        lambda s, w: [
            *bad_copy(
                s,
                w,
                every_row(
                    lambda r: {
                        **explicit_prompt(r),
                        "prompt": [
                            {"role": "user", "content": r["query"]},
                            {"role": "assistant", "content": r["chosen"]},
                        ],
                    }
                ),
            ),
            "--prompt-template",
            "{prompt}",
        ],
        S,
    ),
    BadInput(
        "rm-conversation-no-chat-template",
        "conversational prompts and a tokenizer without a chat template",
        "has no chat template",
        lambda s, w: [
            *bad_copy(s, w, every_row(explicit_prompt)),
            "--prompt-template",
            "{prompt}",
            *model_copy(w, "no-template", lambda f: f != "chat_template.jinja"),
        ],
        S,
    ),
    # ---- lengths ----
    BadInput(
        "rm-prompt-over-limit",
        "a 6,060-token prompt, over --max-length",
        "row 0 of split 'train' is 6",
        pairs("train", "query", LONG),
        S,
    ),
    BadInput(
        "rm-prompt-over-positions",
        "a 6,060-token prompt with --max-length 8000: past the model's 512 positions",
        "more than the 512 positions of --sft-model-path (max_position_embeddings)",
        lambda s, w: [*pairs("train", "query", LONG)(s, w), "--max-length", "8000"],
        S,
    ),
    # ---- the SFT model and its tokenizer ----
    BadInput(
        "rm-model-without-tokenizer",
        "an SFT model/ directory whose save was killed after the weights (no "
        "tokenizer files: transformers would build a 2-token tokenizer)",
        "holds no tokenizer",
        lambda s, w: model_copy(w, "half", lambda f: f in WEIGHTS),
        S,
    ),
    BadInput(
        "rm-model-partial-tokenizer",
        "an SFT model/ directory with tokenizer_config.json but not the vocabulary",
        "tokens for a model embedding of 600 rows: its tokenizer files are incomplete",
        lambda s, w: model_copy(
            w, "partial", lambda f: f in WEIGHTS, {"tokenizer_class": "GPTNeoXTokenizer", "backend": None}
        ),
        S,
    ),
    BadInput(
        "rm-model-without-weights",
        "an SFT model directory with its tokenizer but no weights",
        "cannot be loaded as the reward model",
        lambda s, w: model_copy(w, "no-weights", lambda f: f != "model.safetensors"),
        S,
    ),
    BadInput(
        "rm-pad-is-eos",
        "a tokenizer whose pad token is its EOS",
        "--add-pad-token",
        lambda s, w: model_copy(w, "pad-eos", tokenizer_config={"pad_token": "<|endoftext|>"}),
        S,
    ),
    BadInput(
        "rm-no-pad",
        "a tokenizer without a pad token",
        "has no pad token",
        lambda s, w: model_copy(w, "no-pad", tokenizer_config={"pad_token": None}),
        S,
    ),
    BadInput(
        "rm-chat-template-flag-without-template",
        "`--use-chat-template` with a tokenizer without a chat template",
        "--use-chat-template",
        lambda s, w: ["--use-chat-template", *model_copy(w, "no-template", lambda f: f != "chat_template.jinja")],
        S,
    ),
    BadInput(
        "center-rewards-coef-negative",
        "a negative `--center-rewards-coef` (was: a training loss of -164)",
        "--center-rewards-coef is -0.01",
        lambda s, w: ["--center-rewards-coef", "-0.01"],
        S,
    ),
    # ---- a flag that acts only with another the run lacks (issue 59: Args.NEEDS, clean_rlhf_utils/args.py NEEDS) ----
    BadInput(
        "rm-step-separator-outcome",
        "`--step-separator` (a process reward model's) with `--objective outcome` (was: ignored)",
        "error: --step-separator '\\n\\n' acts only with --objective process, which this run lacks",
        lambda s, w: ["--step-separator", "\n\n"],
        S,
    ),
    BadInput(
        "rm-center-coef-process",
        "`--center-rewards-coef 0.01` with `--objective process` (was: ignored)",
        "error: --center-rewards-coef 0.01 acts only with --objective outcome, which this run lacks",
        lambda s, w: ["--objective", "process", "--no-normalize", "--center-rewards-coef", "0.01"],
        S,
    ),
]
