"""Data: prompt templates (format strings and chat templates), row validation, tokenizing and padding; sft.py's
prompt/response rows. Nothing here changes a number: the scripts choose what is rendered and which tokens count."""

from __future__ import annotations

import re
import string

import torch
from datasets import Dataset


def template_fields(template: str, flag: str) -> list[str]:
    """The row fields a format string uses (`{question}` -> question), or a one-line error naming the flag. A template
    takes fields by name only: a format spec (`{query:.5}` cuts the text), a conversion (`{query!r}`), an index
    (`{query[0]}`) or an attribute (`{query.__class__}`) would rewrite the data, and is an error naming the part."""
    try:
        parts = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise SystemExit(f"error: {flag} {template!r} is not a format string: {e}") from None
    if any(name == "" or name.isdigit() for name, _, _ in parts):
        raise SystemExit(
            f"error: {flag} {template!r} has a positional field {{}}; name the row's field, e.g. {{question}}"
        )
    for name, spec, conv in parts:
        field = re.match(r"[^.\[]*", name).group()
        extra = name[len(field) :] and f"{name[len(field) :]!r} (an index or attribute)"
        extra = extra or (conv and f"'!{conv}' (a conversion)") or (spec and f"':{spec}' (a format spec)")
        if extra:
            raise SystemExit(
                f"error: {flag} {template!r}: {{{field}}} has {extra}, which would rewrite the row's text; a "
                f"template takes fields by name only ({{{field}}}; {{{{ and }}}} for literal braces)"
            )
    return [name for name, _, _ in parts]


GOLD_NUMBER = re.compile(r"\$?\s*-?[\d,]*\.?\d+\.?")
"""What may follow a gold answer's `####`: one number as the scripts' graders read it (`1,000`, `$5`, `-2.5`, `7.`)"""


def check_gold_answer(reference: str, where: str, field: str) -> None:
    """A GSM8K reference's final answer: exactly one `####`, followed by exactly one number (`GOLD_NUMBER`) and nothing
    else. The graders take the number at the start of the last marker's text, so `#### 3/4` would grade as 3, `#### 1e3`
    as 1 and `#### 12 apples or 13` as 12, and a second marker would silently win: each is a one-line error naming the
    row (`where`: the file, split and row) and the field, when the data is loaded."""
    markers = reference.count("####")
    if markers > 1:
        raise SystemExit(
            f"error: {where}: {field} holds {markers} `####` final-answer markers; a gold answer is one `#### <number>`"
        )
    after = reference.split("####", 1)[-1].strip()
    if markers == 1 and GOLD_NUMBER.fullmatch(after) is None:
        raise SystemExit(
            f"error: {where}: the gold answer of {field} is `#### {after[:40]}`, not exactly one number; the grader "
            "reads a plain number (`#### 42`, `#### 1,000`, `#### -2.5`), not a fraction, exponent or words"
        )


def whole_field_messages(template: str, row: dict) -> list[dict] | None:
    """The chat messages of a template that is one field alone (`{prompt}`) holding them; None otherwise."""
    match = re.fullmatch(r"\{(\w+)\}", template.strip())
    return row[match.group(1)] if match and chat_messages(row.get(match.group(1))) else None


def chat_messages(value) -> bool:
    """Whether a field holds a chat conversation: a list of {"role", "content"} messages (TRL's conversational
    format)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def chat_prompt_ids(tokenizer, messages: list[dict], where: str, text: bool = False):
    """`messages` in the tokenizer's chat template, ready for the assistant's turn: the token ids (`text`: the rendered
    text too, as `(text, ids)`). A chat template that is not valid Jinja, raises (`raise_exception`), is blocked by
    transformers' sandbox or renders an empty prompt is a one-line error naming the row (`where`), when the prompts are
    prepared, before the models train on them."""
    from jinja2 import TemplateError  # SecurityError (the sandbox), TemplateSyntaxError, raise_exception's error

    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        reason = " ".join(str(e).split())[:160]
        raise SystemExit(
            f"error: {where}: the tokenizer's chat template cannot render the prompt ({type(e).__name__}: {reason}); "
            "fix the template (tokenizer_config.json or chat_template.jinja) or give plain-text prompts"
        ) from None
    if not rendered.strip() or not ids:
        raise SystemExit(
            f"error: {where}: the tokenizer's chat template renders an empty prompt ({rendered!r}); fix the template "
            "(tokenizer_config.json or chat_template.jinja) or give plain-text prompts"
        )
    return (rendered, ids) if text else ids


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding for generation: every prompt ends at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding for training: every sequence starts at column 0."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def end_with_eos(ids: list[int], eos_id: int) -> list[int]:
    """Token ids ending in exactly one EOS. The N+ TL;DR responses already end with the text `<|endoftext|>`, which the
    Pythia tokenizer encodes as its EOS: appending another would teach two EOS and move the reward's position."""
    return ids if ids and ids[-1] == eos_id else [*ids, eos_id]


def conversation_hint(row: dict) -> str:
    """How to pass a conversational row (TRL's formats) to the templates, when it has fields of chat messages."""
    chat = [k for k, v in row.items() if chat_messages(v)]
    if not chat:
        return ""
    if len(chat) == 1:  # language modelling: {"messages": [...]}, the last assistant turn the response
        return (
            f"; for TRL's conversational format pass --prompt-template '{{{chat[0]}}}' --response-template "
            f"'{{{chat[0]}}}' (the last assistant turn is the response)"
        )
    return (
        f"; for TRL's conversational format pass --prompt-template '{{{chat[0]}}}' --response-template '{{{chat[-1]}}}'"
    )


def render_row(template: str, row: dict, index: int, split: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the split, the row, the field and the flag, never a silent `None` or
    `[...]` in the text the model trains on."""
    where = f"row {index} of split '{split}'"
    for name in template_fields(template, flag):
        if name not in row:
            raise SystemExit(
                f"error: {where} has no field '{name}' used by the {what} template ({flag} {template!r}); "
                f"its fields are {sorted(row)}{conversation_hint(row)}"
            )
        value = row[name]
        if value is None:
            raise SystemExit(
                f"error: {where}: field '{name}' of the {what} ({flag} {template!r}) is null; fill it in "
                "or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: {where}: field '{name}' holds chat messages, which a text template cannot hold; "
                f"pass {flag} '{{{name}}}' alone to render them with the tokenizer's chat template"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SystemExit(
                f"error: {where}: field '{name}' of the {what} ({flag} {template!r}) is a "
                f"{type(value).__name__}, not text: {str(value)[:60]!r}"
            )
    try:
        text = template.format(**row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: {where}: {flag} {template!r} cannot be filled in: {e}") from None
    if not text.strip():
        raise SystemExit(f"error: {where} renders an empty {what} ({flag} {template!r})")
    return text


def prompt_and_response(row: dict, index: int, split: str, tokenizer, args) -> tuple[list[int], str]:
    """A row's prompt token ids and response text. Text fields fill `--prompt-template` (wrapped as a user message with
    `--use-chat-template`) and `--response-template`. A template that is one field alone holding chat messages is
    rendered with the tokenizer's chat template: TRL's conversational language-modelling format (`{messages}` for both
    templates: the prompt is every turn before the last, an assistant turn, which is the response) or its
    prompt/completion format (`{prompt}`, the prompt's messages; `{completion}`, the assistant's turn)."""
    where = f"row {index} of split '{split}'"
    same_field = args.prompt_template.strip() == args.response_template.strip()
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render_row(args.prompt_template, row, index, split, "prompt", "--prompt-template")
        if args.use_chat_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif messages[-1]["role"] == "assistant":
        if not same_field:
            raise SystemExit(
                f"error: {where}: the chat messages of --prompt-template {args.prompt_template!r} end "
                "with an assistant turn; give the same field as --response-template to train on that "
                "turn (TRL's `messages` format), or the prompt's messages only (its prompt/completion "
                "format)"
            )
        messages = messages[:-1]
        if not messages:
            raise SystemExit(
                f"error: {where}: the chat messages of --prompt-template {args.prompt_template!r} hold "
                "only the assistant's turn: there is no prompt before it"
            )
    if messages is not None:
        if not tokenizer.chat_template:
            raise SystemExit(
                f"error: the tokenizer of --model-name-or-path {args.model_name_or_path} has no chat "
                f"template, so the chat messages of {where} (or --use-chat-template) cannot be rendered; "
                "give plain-text prompts and responses"
            )
        prompt_ids = chat_prompt_ids(tokenizer, messages, where)
    turns = whole_field_messages(args.response_template, row)
    if turns is None:
        return prompt_ids, render_row(args.response_template, row, index, split, "response", "--response-template")
    if turns[-1]["role"] != "assistant":
        raise SystemExit(
            f"error: {where}: the chat messages of --response-template {args.response_template!r} do not "
            "end with an assistant turn, which is the response to train on"
        )
    if not same_field and any(m["role"] != "assistant" for m in turns):
        raise SystemExit(
            f"error: {where}: the chat messages of --response-template {args.response_template!r} hold "
            f"turns other than the assistant's (roles {[m['role'] for m in turns]}); give the whole "
            "conversation as both templates (TRL's `messages` format) or the prompt's turns elsewhere"
        )
    if not turns[-1]["content"].strip():
        raise SystemExit(
            f"error: {where} renders an empty response (the last assistant turn of "
            f"--response-template {args.response_template!r})"
        )
    return prompt_ids, turns[-1]["content"]


def tokenize_split(ds: Dataset, tokenizer, args, split: str, check=None, positions: int | None = None) -> list[dict]:
    """(SFT) Prompt and response token ids for every row, the response ending in exactly one EOS (`end_with_eos`),
    every field checked now (`prompt_and_response`; with `check(row, response, index, split, args)`, what the evaluation
    needs too). Overlong rows, past the length limits or the model's `positions`, are an error (or dropped with
    `--drop-overlong`): truncating a TL;DR query would silently cut the post."""
    examples, dropped = [], 0
    for i, row in enumerate(ds):
        prompt_ids, response = prompt_and_response(row, i, split, tokenizer, args)
        if check is not None:
            check(row, response, i, split, args)
        response_ids = end_with_eos(tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
        too_long = len(prompt_ids) > args.max_prompt_length or len(response_ids) > args.max_response_length
        no_room = positions is not None and len(prompt_ids) + len(response_ids) > positions
        if too_long or no_room:
            if not args.drop_overlong:
                if too_long:
                    raise SystemExit(
                        f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a "
                        f"{len(response_ids)}-token response (EOS included); the limits are --max-prompt-length "
                        f"{args.max_prompt_length} and --max-response-length {args.max_response_length}. Raise them or "
                        "pass --drop-overlong."
                    )
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a {len(response_ids)}-"
                    f"token response, more than the {positions} positions of --model-name-or-path "
                    f"(max_position_embeddings); lower --max-prompt-length (now {args.max_prompt_length}) to fit them "
                    "and pass --drop-overlong"
                )
            dropped += 1
            continue
        examples.append({"prompt_ids": prompt_ids, "response_ids": response_ids, "row": row, "response": response})
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} rows of '{split}' that exceed the length limits or the model's positions"
        )
    if not examples:
        raise SystemExit(f"error: no usable rows in split '{split}'")
    return examples


def concat_batches(batches: list[dict]) -> dict:
    """One batch of the rows of several (tensors concatenated, lists joined)."""
    return {
        k: torch.cat([b[k] for b in batches]) if torch.is_tensor(batches[0][k]) else [x for b in batches for x in b[k]]
        for k in batches[0]
    }


def select_groups(batch: dict, groups: list[int], G: int) -> dict:
    """The rows of the given groups (G completions each) of a batch."""
    idx = [g * G + j for g in groups for j in range(G)]
    return {k: (v[idx] if torch.is_tensor(v) else [v[i] for i in idx]) for k, v in batch.items()}
