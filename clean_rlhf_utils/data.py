"""Data: prompt templates (format strings and chat templates), row validation, tokenizing and padding; sft.py's
prompt/response rows. Nothing here changes a number: the scripts choose what is rendered and which tokens count."""

from __future__ import annotations

import re
import string

import torch
from datasets import Dataset


def template_fields(template: str, flag: str) -> list[str]:
    """The row fields a format string uses (`{question}` -> question), or a one-line error naming the flag."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise SystemExit(f"error: {flag} {template!r} is not a format string: {e}") from None
    if any(name == "" or name.isdigit() for name in names):
        raise SystemExit(
            f"error: {flag} {template!r} has a positional field {{}}; name the row's field, e.g. {{question}}"
        )
    return [re.match(r"[^.\[]*", name).group() for name in names]


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
        prompt_ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
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
