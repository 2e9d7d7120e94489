"""Data: prompt templates (format strings and chat templates) and padding. Nothing here changes a number: the
scripts choose what is rendered and which tokens count."""

from __future__ import annotations

import re
import string

import torch


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


def end_with_eos(ids: list[int], eos_id: int) -> list[int]:
    """Token ids ending in exactly one EOS. The N+ TL;DR responses already end with the text `<|endoftext|>`, which the
    Pythia tokenizer encodes as its EOS: appending another would teach two EOS and move the reward's position."""
    return ids if ids and ids[-1] == eos_id else [*ids, eos_id]


def render(template: str, row: dict, index: int, split: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the row, the field and the flag, never a silent `None` or `[...]`."""
    for name in template_fields(template, flag):
        value = row.get(name)
        if name not in row:
            raise SystemExit(
                f"error: row {index} of split '{split}' has no field '{name}' used by the {what} template "
                f"({flag} {template!r}); its fields are {sorted(row)}"
            )
        if value is None:
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is missing or null; fill it in or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' holds chat messages, which a "
                f"text template cannot hold; pass {flag} '{{{name}}}' alone to render them with the "
                "tokenizer's chat template"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is a {type(value).__name__}, not text: {str(value)[:60]!r}"
            )
    try:
        text = template.format(**row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(
            f"error: row {index} of split '{split}': {flag} {template!r} cannot be filled in: {e}"
        ) from None
    if not text.strip():
        raise SystemExit(f"error: row {index} of split '{split}' renders an empty {what} ({flag} {template!r})")
    return text


def prompt_token_ids(row: dict, index: int, split: str, tokenizer, args) -> list[int]:
    """The prompt of a row as token ids: `--prompt-template` filled in (wrapped as a user message with
    `--use-chat-template`), or, where the template is one field holding chat messages (TRL's conversational prompt
    format, {"prompt": [{"role": "user", "content": ...}]}), those messages in the tokenizer's chat template, ready for
    the assistant's turn."""
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render(args.prompt_template, row, index, split, "prompt", "--prompt-template")
        if not args.use_chat_template:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not tokenizer.chat_template:
            raise SystemExit(
                f"error: --use-chat-template: the tokenizer of --sft-model-path {args.sft_model_path} has "
                "no chat template; drop the flag or give a model that has one"
            )
        messages = [{"role": "user", "content": prompt}]
    elif messages[-1]["role"] == "assistant":
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --prompt-template "
            f"{args.prompt_template!r} end with an assistant turn; an RL prompt ends before the answer: "
            "give the prompt's messages only (TRL's conversational prompt format, the completion "
            "elsewhere)"
        )
    elif not tokenizer.chat_template:
        raise SystemExit(
            f"error: row {index} of split '{split}' holds chat messages, but the tokenizer of "
            f"--sft-model-path {args.sft_model_path} has no chat template to render them; give "
            "plain-text prompts or a model with a chat template"
        )
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def prepare_prompts(
    ds, tokenizer, args, split: str, max_positions: int | None, evaluation: bool, reference_text, extract_answer
) -> list[dict]:
    """Prompt token ids plus what the reward and evaluation need: the reference response (the script's
    `reference_text(row, index, split, args)`), the gold answer (math: `extract_answer(reference, answer_format)`) and
    the key facts (tiny-tldr), each checked on every row now, so a bad row fails before the first update and not at
    an evaluation hours in. A prompt longer than `--max-prompt-length`, or one that leaves fewer than
    `--response-length` of the model's positions, is an error (or dropped with `--drop-overlong`)."""
    rows, dropped = [], 0
    needs_gold = args.reward_source == "math" or (evaluation and args.eval_task in ("gsm8k", "boxed"))
    needs_reference = needs_gold or (evaluation and args.eval_task == "tldr")
    for i, row in enumerate(ds):
        ids = prompt_token_ids(row, i, split, tokenizer, args)
        too_long = len(ids) > args.max_prompt_length
        no_room = max_positions is not None and len(ids) + args.response_length > max_positions
        if too_long or no_room:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_long:
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(ids)}-token prompt; the limit is "
                    f"--max-prompt-length {args.max_prompt_length}. Raise it or pass --drop-overlong."
                )
            raise SystemExit(
                f"error: row {i} of split '{split}' has a {len(ids)}-token prompt, and --response-length "
                f"{args.response_length} more tokens do not fit the {max_positions} positions of "
                f"--sft-model-path (max_position_embeddings); lower --max-prompt-length (now "
                f"{args.max_prompt_length}) with --drop-overlong, or --response-length"
            )
        item = {"prompt_ids": ids, "reference": None, "facts": None}
        if needs_reference:
            item["reference"] = reference_text(row, i, split, args)
        if needs_gold:
            item["gold"] = extract_answer(item["reference"], args.answer_format)
            if item["gold"] is None:
                raise SystemExit(
                    f"error: row {i} of split '{split}': the reference {item['reference'][-80:]!r} has no "
                    f"final answer in the {args.answer_format} format (--reference-template, "
                    "--answer-format)"
                )
        if evaluation and args.eval_task == "tldr":
            facts = row.get("facts")
            if not (isinstance(facts, list) and facts and all(isinstance(f, str) for f in facts)):
                found = "has none" if facts is None else f"holds {str(facts)[:60]!r}"
                raise SystemExit(
                    f"error: row {i} of split '{split}': --eval-task tldr judges summaries by the row's "
                    f"'facts' (a list of words, as in tiny-tldr), but it {found}; use --eval-task none "
                    "for other data"
                )
            item["facts"] = facts
        rows.append(item)
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} prompts of '{split}' longer than --max-prompt-length "
            f"{args.max_prompt_length} or than the model's positions less --response-length"
        )
    if not rows:
        raise SystemExit(f"error: no usable prompts in split '{split}'")
    return rows


def prompt_loader(rows: list[dict], prompts_per_device: int, seed: int, split: str, flag: str):
    """The endless prompt stream's loader: shuffled indices of `rows` with its own generator seeded with `seed`,
    `prompts_per_device` a batch (`flag` names where that number comes from in the error when a split is smaller)."""
    if len(rows) < prompts_per_device:  # the endless loader would never yield a batch
        raise SystemExit(
            f"error: split '{split}' has {len(rows)} usable prompts, fewer than one batch of {prompts_per_device} "
            f"({flag})"
        )
    return torch.utils.data.DataLoader(
        list(range(len(rows))),
        batch_size=prompts_per_device,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
