"""dpo.py's own bad inputs (tests/bad_inputs.py runs them with the shared ones): preference pairs with a missing, null
or mistyped prompt / chosen / rejected field, in the training and in the evaluation data; pairs whose chosen and
rejected are the same everywhere; TRL's conversational formats it cannot take; evaluation prompts without the reference
or facts evaluation needs; prompts longer than the model's positions; online DPO without a judge; bad tokenizers,
DPO and LoRA flags. Each ends before the first step in one `error:` line naming the row, field or flag."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

from tests.bad_inputs import BadInput, World, bad_copy, rows_edited

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


def prompts(w: World, split: str, row_edit: Callable[[str], str]) -> list[str]:
    """A copy of the prompt data (tiny-tldr/sft: online training and evaluation prompts) with `split` rewritten."""
    src, dst = w.assets / "tiny-tldr" / "sft", w.tmp / "data" / "prompts"
    if not dst.exists():
        shutil.copytree(src, dst)
    (dst / f"{split}.jsonl").write_text(row_edit((src / f"{split}.jsonl").read_text()))
    return ["--prompt-dataset-name-or-path", str(dst)]


def conversational(row: dict) -> dict:
    """TRL's conversational preference row with the prompt inside each response (its implicit-prompt format)."""
    user = {"role": "user", "content": row["query"]}
    return {
        "chosen": [user, {"role": "assistant", "content": row["chosen"]}],
        "rejected": [user, {"role": "assistant", "content": row["rejected"]}],
    }


def tokenizer_edited(w: World, name: str, change: Callable) -> list[str]:
    """A copy of the tiny model whose tokenizer `change` edits (in place) before it is saved."""
    from transformers import AutoTokenizer

    dst = w.tmp / name
    shutil.copytree(w.assets / "models" / "tiny-neox", dst)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    change(tokenizer)
    for old in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json"):
        (dst / old).unlink(missing_ok=True)  # written again from `tokenizer`, without what `change` removed
    tokenizer.save_pretrained(dst)
    return ["--sft-model-path", str(dst)]


ONLINE = ["--mode", "online", "--total-episodes", "64", "--response-length", "8"]


def explicit_prompts(w: World) -> list[str]:
    """TRL's explicit-prompt preference rows ({"prompt", "chosen", "rejected"}), and no prompt data where the flag
    points (a preset's default path, not built here)."""
    dst = w.tmp / "data" / "explicit"
    dst.mkdir(parents=True)
    for split in ("train", "validation"):
        lines = (w.assets / "tiny-tldr" / "preference" / f"{split}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        keep = [{"prompt": r["query"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows]
        (dst / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    missing = w.tmp / "runs" / "assets" / "tiny-tldr" / "sft"
    return [
        "--dataset-name-or-path",
        str(dst),
        "--prompt-template",
        "{prompt}",
        "--prompt-dataset-name-or-path",
        str(missing),
    ]


CASES = [
    BadInput(
        "dpo-explicit-prompts-no-prompt-data",
        "explicit-prompt pairs (prompt, chosen, rejected) and no prompt data at --prompt-dataset-name-or-path",
        "offline DPO reads only its evaluation prompts from it (or pass --num-eval-examples 0): preference data whose "
        "rows hold the prompt serves (--prompt-dataset-name-or-path",
        lambda s, w: explicit_prompts(w),
        ["dpo"],
    ),
    # ---- the preference pairs, training split ----
    BadInput(
        "dpo-chosen-missing",
        "pairs without a `chosen` field",
        "row 0 of split 'train' has no field 'chosen' (--chosen-field)",
        pairs("train", "chosen", ...),
        ["dpo"],
    ),
    BadInput(
        "dpo-rejected-null",
        "a pair whose `rejected` is null",
        "field 'rejected' (--rejected-field) is missing or null",
        pairs("train", "rejected", None),
        ["dpo"],
    ),
    BadInput(
        "dpo-chosen-list",
        "a pair whose `chosen` is a list of strings",
        "field 'chosen' (--chosen-field) is a list, not text",
        pairs("train", "chosen", ["a summary", "another"]),
        ["dpo"],
    ),
    BadInput(
        "dpo-chosen-empty",
        "a pair whose `chosen` is blank",
        "field 'chosen' (--chosen-field) is empty",
        pairs("train", "chosen", "  "),
        ["dpo"],
    ),
    BadInput(
        "dpo-query-missing",
        "pairs without the prompt field of --prompt-template",
        "has no field 'query' used by the prompt template (--prompt-template",
        pairs("train", "query", ...),
        ["dpo"],
    ),
    BadInput(
        "dpo-query-null",
        "a pair whose prompt field is null",
        "field 'query' of the prompt (--prompt-template",
        pairs("train", "query", None),
        ["dpo"],
    ),
    BadInput(
        "dpo-query-list",
        "a pair whose prompt field is a list of strings",
        "field 'query' of the prompt (--prompt-template '{query}') is a list",
        pairs("train", "query", ["a", "post"]),
        ["dpo"],
    ),
    BadInput(
        "dpo-chosen-is-rejected",
        "every pair's chosen response equals its rejected one (no preference)",
        "every pair of split 'train' has the same chosen and rejected response",
        lambda s, w: bad_copy(s, w, every_row(lambda r: {**r, "rejected": r["chosen"]})),
        ["dpo"],
    ),
    BadInput(
        "dpo-same-field",
        "--rejected-field naming the chosen field",
        "--rejected-field 'chosen'",
        lambda s, w: ["--rejected-field", "chosen"],
        ["dpo"],
    ),
    BadInput(
        "dpo-pair-longer-than-positions",
        "a 6,000-token prompt for a 512-position model (with a --max-prompt-length that lets it through)",
        "row 0 of split 'train' has a",
        lambda s, w: [*bad_copy(s, w, edit("query", LONG)), "--max-prompt-length", "100000"],
        ["dpo"],
    ),
    # ---- TRL's conversational formats ----
    BadInput(
        "dpo-trl-implicit-prompt",
        "TRL's conversational preference rows, the prompt inside chosen and rejected",
        "TRL's implicit-prompt format; give the prompt's messages in their own field",
        lambda s, w: bad_copy(s, w, every_row(conversational)),
        ["dpo"],
    ),
    BadInput(
        "dpo-messages-in-text-template",
        "a prompt field of chat messages inside a longer --prompt-template",
        "holds chat messages, which a text template cannot hold; pass --prompt-template '{query}' alone",
        lambda s, w: [
            *pairs("train", "query", [{"role": "user", "content": "hi"}])(s, w),
            "--prompt-template",
            "Post: {query}",
        ],
        ["dpo"],
    ),
    BadInput(
        "dpo-prompt-ends-with-answer",
        "conversational prompt messages ending with an assistant turn",
        "end with an assistant turn",
        pairs("train", "query", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]),
        ["dpo"],
    ),
    BadInput(
        "dpo-no-chat-template",
        "conversational prompts and a tokenizer without a chat template",
        "has no chat template",
        lambda s, w: [
            *pairs("train", "query", [{"role": "user", "content": "hi"}])(s, w),
            *tokenizer_edited(w, "no-template", lambda t: setattr(t, "chat_template", None)),
        ],
        ["dpo"],
    ),
    # ---- the evaluation data: pairs, and prompts with what evaluation needs ----
    BadInput(
        "dpo-eval-chosen-null",
        "a validation pair whose `chosen` is null",
        "row 0 of split 'validation': field 'chosen' (--chosen-field) is missing or null",
        pairs("validation", "chosen", None),
        ["dpo"],
    ),
    BadInput(
        "dpo-eval-query-list",
        "a validation pair whose prompt is a list",
        "row 0 of split 'validation': field 'query'",
        pairs("validation", "query", ["a", "b"]),
        ["dpo"],
    ),
    BadInput(
        "dpo-eval-reference-null",
        "an evaluation prompt whose reference response is null (--eval-task tldr)",
        "field 'reference_response' of the reference",
        lambda s, w: prompts(w, "validation", edit("reference_response", None)),
        ["dpo"],
    ),
    BadInput(
        "dpo-eval-facts-missing",
        "evaluation prompts without the facts the gold judge needs",
        "--eval-task tldr judges summaries by the row's 'facts'",
        lambda s, w: prompts(w, "validation", edit("facts", ...)),
        ["dpo"],
    ),
    BadInput(
        "dpo-eval-prompt-longer-than-positions",
        "a 6,000-token evaluation prompt for a 512-position model",
        "--response-length 32 more tokens do not fit the 512 positions",
        lambda s, w: [*prompts(w, "validation", edit("query", LONG)), "--max-prompt-length", "100000"],
        ["dpo"],
    ),
    # ---- online DPO ----
    BadInput(
        "dpo-online-without-reward-model",
        "online DPO judged by a reward model, but none given",
        "pass --reward-model-path",
        lambda s, w: [*ONLINE, "--judge", "rm"],
        ["dpo"],
    ),
    BadInput(
        "dpo-online-gold-without-facts",
        "online DPO judged by the gold judge on prompts without facts",
        "--judge gold judges summaries by the row's 'facts'",
        lambda s, w: [*ONLINE, "--judge", "gold", "--eval-task", "none", *prompts(w, "train", edit("facts", None))],
        ["dpo"],
    ),
    BadInput(
        "dpo-online-too-few-prompts",
        "fewer training prompts than one online step samples",
        "fewer than one step's 32",
        lambda s, w: [*ONLINE, "--reward-model-path", str(w.rm), "--max-train-samples", "8"],
        ["dpo"],
    ),
    # ---- the model's tokenizer and DPO's flags ----
    BadInput(
        "dpo-pad-is-eos",
        "a tokenizer whose pad token is its EOS",
        "as pad, so EOS would be masked out",
        lambda s, w: tokenizer_edited(w, "pad-eos", lambda t: setattr(t, "pad_token", t.eos_token)),
        ["dpo"],
    ),
    BadInput(
        "dpo-no-pad",
        "a tokenizer without a pad token",
        "has no pad token",
        lambda s, w: tokenizer_edited(w, "no-pad", lambda t: setattr(t, "pad_token", None)),
        ["dpo"],
    ),
    # ---- flags that do not apply to the mode or loss chosen (issue 51 item 8: they were ignored and recorded) ----
    BadInput(
        "dpo-label-smoothing-ipo",
        "`--label-smoothing 0.1 --loss-type ipo` (was: ignored, recorded as used)",
        "error: --label-smoothing 0.1 acts only with --loss-type sigmoid (conservative DPO), which this run lacks",
        lambda s, w: ["--loss-type", "ipo", "--label-smoothing", "0.1"],
        ["dpo"],
    ),
    BadInput(
        "dpo-offline-async",
        "`--async` in offline DPO (was: ignored, recorded as used)",
        "error: --async acts only with --mode online, which this run lacks",
        lambda s, w: ["--async"],
        ["dpo"],
    ),
    BadInput(
        "dpo-offline-judge",
        "`--judge gold` in offline DPO (was: ignored, recorded as used)",
        "error: --judge gold acts only with --mode online, which this run lacks",
        lambda s, w: ["--judge", "gold"],
        ["dpo"],
    ),
    BadInput("dpo-beta-0", "--beta 0 (IPO divides by it)", "--beta", lambda s, w: ["--beta", "0"], ["dpo"]),
    BadInput(
        "dpo-label-smoothing-half",
        "--label-smoothing 0.5 (a coin flip: no preference left)",
        "--label-smoothing",
        lambda s, w: ["--label-smoothing", "0.5"],
        ["dpo"],
    ),
    BadInput(
        "dpo-eval-pairs-negative",
        "--num-eval-pairs -1",
        "--num-eval-pairs",
        lambda s, w: ["--num-eval-pairs", "-1"],
        ["dpo"],
    ),
    # ---- LoRA (--lora-r) ----
    BadInput(
        "dpo-lora-r-0",
        "--lora-r 0 (a rank-0 adapter; it trained every weight instead)",
        "--lora-r is 0",
        lambda s, w: ["--lora-r", "0"],
        ["dpo"],
    ),
    BadInput(
        "dpo-lora-alpha-nan",
        "--lora-alpha nan",
        "--lora-alpha is nan",
        lambda s, w: ["--lora-r", "4", "--lora-alpha", "nan"],
        ["dpo"],
    ),
    BadInput(
        "dpo-lora-target-missing",
        "--lora-target-modules naming no module of the model",
        "--lora-target-modules ['no_such_module']: Target modules {'no_such_module'} not found",
        lambda s, w: ["--lora-r", "4", "--lora-target-modules", "no_such_module"],
        ["dpo"],
    ),
    # ---- a flag that acts only with another the run lacks (issue 59: Args.NEEDS, clean_rlhf_utils/args.py NEEDS) ----
    BadInput(
        "dpo-ipo-average-sigmoid",
        "`--no-ipo-average` with `--loss-type sigmoid` (was: ignored, recorded as used)",
        "error: --no-ipo-average acts only with --loss-type ipo, which this run lacks",
        lambda s, w: ["--no-ipo-average"],
        ["dpo"],
    ),
    BadInput(
        "dpo-offline-temperature",
        "`--temperature 0.9` in offline DPO, which samples nothing (was: ignored, recorded as used)",
        "error: --temperature 0.9 acts only with --mode online, which this run lacks",
        lambda s, w: ["--temperature", "0.9"],
        ["dpo"],
    ),
    BadInput(
        "dpo-online-no-precompute",
        "`--no-precompute-ref-logprobs` in online DPO, whose pairs are new each step (was: ignored)",
        "error: --no-precompute-ref-logprobs acts only with --mode offline, which this run lacks",
        lambda s, w: [*ONLINE, "--judge", "gold", "--no-precompute-ref-logprobs"],
        ["dpo"],
    ),
]
