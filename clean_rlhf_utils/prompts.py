"""Prompts: the RL scripts' prompts and what their rewards and evaluations need of each row (the reference response,
the gold final answer, the tiny world's key facts), rendered from templates or chat messages and checked on every row
before the first update, and the endless prompt loader. Nothing here changes a number: the scripts choose the
templates and parse the answers (`extract_answer` comes in as an argument)."""

from __future__ import annotations

import json
import string

import torch

from clean_rlhf_utils.data import (
    chat_messages,
    chat_prompt_ids,
    check_gold_answer,
    template_fields,
    whole_field_messages,
)


def render(template: str, row: dict, where: str, what: str, flag: str, null_as_missing: bool = False) -> str:
    """`template` filled in with the row's fields: the one renderer of the RL scripts and reward_model.py. A field it
    uses that is missing, null or not text (a list, a dict, chat messages) is a one-line error naming the row
    (`where`, e.g. "row 3 of split 'train'"), the field and the flag, never a silent `None` or `[...]`; the template
    takes fields by name only (`data.template_fields`). `null_as_missing`: a null field is reported as a field the row
    has not, as ppo_rlhf.py words it."""
    for name in template_fields(template, flag):
        value = row.get(name)
        if name not in row:
            chat = [k for k, v in row.items() if chat_messages(v)]
            hint = f"; for TRL's conversational format pass {flag} '{{{chat[0]}}}'" if chat else ""
            raise SystemExit(
                f"error: {where} has no field '{name}' used by the {what} template ({flag} {template!r}); its "
                f"fields are {sorted(row)}{hint}"
            )
        if value is None and null_as_missing:  # a JSON Lines row without the field reads as null too
            raise SystemExit(
                f"error: {where} has no field '{name}' (it is null) used by the {what} template ({flag} "
                f"{template!r}); fill it in or drop the row"
            )
        if value is None:
            raise SystemExit(
                f"error: {where}: field '{name}' of the {what} ({flag} {template!r}) is missing or null; fill it "
                "in or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: {where}: field '{name}' holds chat messages, which a text template cannot hold; pass "
                f"{flag} '{{{name}}}' alone to render them with the tokenizer's chat template"
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


def reference_text(row: dict, index: int, split: str, args, null_as_missing: bool = False) -> str:
    """The reference response: `--reference-template` filled in (`render`), or the assistant turns of a field of chat
    messages (TRL's conversational completion, [{"role": "assistant", "content": ...}])."""
    messages = whole_field_messages(args.reference_template, row)
    if messages is None:
        template = args.reference_template
        return render(
            template, row, f"row {index} of split '{split}'", "reference", "--reference-template", null_as_missing
        )
    text = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
    if not text.strip():
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --reference-template "
            f"{args.reference_template!r} hold no assistant turn to take the reference from"
        )
    return text


def prompt_token_ids(row: dict, index: int, split: str, tokenizer, args, null_as_missing: bool = False) -> list[int]:
    """The prompt of a row as token ids: `--prompt-template` filled in (wrapped as a user message with
    `--use-chat-template`), or, where the template is one field holding chat messages (TRL's conversational prompt
    format, {"prompt": [{"role": "user", "content": ...}]}), those messages in the tokenizer's chat template, ready for
    the assistant's turn."""
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        where = f"row {index} of split '{split}'"
        prompt = render(args.prompt_template, row, where, "prompt", "--prompt-template", null_as_missing)
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
    return chat_prompt_ids(tokenizer, messages, f"row {index} of split '{split}'")


def prepare_prompts(
    ds,
    tokenizer,
    args,
    split: str,
    max_positions: int | None,
    evaluation: bool,
    extract_answer=None,
    *,
    train_facts: str | None = None,
    null_as_missing: bool = False,
) -> list[dict]:
    """Prompt token ids plus what the reward and evaluation need: the reference response (`reference_text`), the
    gold answer (math: `extract_answer(reference, answer_format)`) and
    the key facts (tiny-tldr), each checked on every row now, so a bad row fails before the first update and not at
    an evaluation hours in. A prompt longer than `--max-prompt-length`, or one that leaves fewer than
    `--response-length` of the model's positions, is an error (or dropped with `--drop-overlong`). `train_facts`: the
    flag that makes the training prompts need the facts too (dpo.py's `--judge gold`); None: evaluation only.
    `null_as_missing`: see `render`."""
    rows, dropped = [], 0
    needs_gold = getattr(args, "reward_source", None) == "math" or (evaluation and args.eval_task in ("gsm8k", "boxed"))
    needs_reference = needs_gold or (evaluation and args.eval_task == "tldr")
    needs_facts = (evaluation and args.eval_task == "tldr") or (not evaluation and train_facts is not None)
    why, hint = ("--eval-task tldr" if evaluation else train_facts), f" and not {train_facts}" if train_facts else ""
    for i, row in enumerate(ds):
        ids = prompt_token_ids(row, i, split, tokenizer, args, null_as_missing)
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
            item["reference"] = reference_text(row, i, split, args, null_as_missing)
        if needs_gold:
            if args.answer_format == "gsm8k":
                source = getattr(args, "prompt_dataset_name_or_path", None) or args.dataset_name_or_path
                field = f"the reference (--reference-template {args.reference_template!r})"
                check_gold_answer(item["reference"], f"{source}, row {i} of split '{split}'", field)
            item["gold"] = extract_answer(item["reference"], args.answer_format)
            if item["gold"] is None:
                raise SystemExit(
                    f"error: row {i} of split '{split}': the reference {item['reference'][-80:]!r} has no "
                    f"final answer in the {args.answer_format} format (--reference-template, "
                    "--answer-format)"
                )
        if needs_facts:
            facts = row.get("facts")
            if not (isinstance(facts, list) and facts and all(isinstance(f, str) for f in facts)):
                found = "has none" if facts is None else f"holds {str(facts)[:60]!r}"
                raise SystemExit(
                    f"error: row {i} of split '{split}': {why} judges summaries by the row's "
                    f"'facts' (a list of words, as in tiny-tldr), but it {found}; use --eval-task none{hint} "
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


def is_message_list(value) -> bool:
    """A list of {"role", "content"} messages: TRL's conversational format."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)
    )


def fill_template(template: str, row: dict, index: int, split: str, what: str) -> str:
    """`template` filled in with the row's fields; a missing field or an empty result is a one-line error."""
    try:
        text = template.format(**row)
    except KeyError as e:
        raise SystemExit(
            f"error: row {index} of split '{split}' has no field {e} used by the {what} template "
            f"{template!r}; its fields are {sorted(row)}"
        ) from None
    if not text.strip():
        raise SystemExit(f"error: row {index} of split '{split}' renders an empty {what}")
    return text


def prepare_math_questions(ds, tokenizer, args, split: str, extract_answer, positions: int | None = None) -> list[dict]:
    """Prompt token ids and the gold final answer of every row. Malformed rows are errors naming row and field: a field
    missing, null or not text, a prompt over `--max-prompt-length` or, with the completion budget, over the model's
    `positions`, a reference without a final answer. A conversation (TRL's conversational format) in a field that is
    the whole prompt template is rendered with the tokenizer's chat template (it must end with a user turn); one that
    is the whole reference template gives the text of its messages. The gold answer is the script's
    `extract_answer(reference, args.answer_format)`."""
    ref_fields = [f for _, f, _, _ in string.Formatter().parse(args.reference_template) if f]
    prompt_fields = [f for _, f, _, _ in string.Formatter().parse(args.prompt_template) if f]
    name, budget = args.model_name_or_path, args.max_completion_length
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if args.use_chat_template and not has_template:
        raise SystemExit(f"error: --use-chat-template: the tokenizer of {name} has no chat template; drop the flag")
    rows, dropped = [], 0
    for i, row in enumerate(ds):
        where = f"row {i} of split '{split}'"
        chats = {}
        for f in dict.fromkeys(prompt_fields + ref_fields):
            value = row.get(f)
            if f in row and value is None:  # null, or absent from this row of a JSON file (datasets fills in null)
                raise SystemExit(f"error: {where} has no field '{f}' (missing or null); its fields are {sorted(row)}")
            whole = f"{{{f}}}" in (args.prompt_template, args.reference_template)
            if is_message_list(value) and not whole:
                flag = "--prompt-template" if f in prompt_fields else "--reference-template"
                raise SystemExit(
                    f"error: {where}: field '{f}' is a conversation (a list of role/content messages) "
                    f"inside a template with more text; pass {flag} '{{{f}}}' to use it as a whole"
                )
            if is_message_list(value):
                chats[f] = value
            elif isinstance(value, (list, dict)):
                raise SystemExit(
                    f"error: {where}: field '{f}' is a {type(value).__name__}, not text: "
                    f"{json.dumps(value)[:60]}; give it as a string"
                )
        if prompt_fields and args.prompt_template == f"{{{prompt_fields[0]}}}" and prompt_fields[0] in chats:
            messages = chats[prompt_fields[0]]
            if messages[-1]["role"] == "assistant":
                raise SystemExit(
                    f"error: {where}: the conversation in field '{prompt_fields[0]}' ends with an "
                    "assistant message; the prompt must end with the user's turn (the policy answers it)"
                )
            if not has_template:
                raise SystemExit(
                    f"error: {where}: field '{prompt_fields[0]}' is a conversation and the tokenizer of "
                    f"{name} has no chat template to render it; give the question as text"
                )
            prompt, ids = chat_prompt_ids(tokenizer, messages, where, text=True)
        else:
            prompt = fill_template(args.prompt_template, row, i, split, "prompt")
            if args.use_chat_template:
                ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}], where)
            else:
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        too_many = positions is not None and len(ids) + budget > positions
        if len(ids) > args.max_prompt_length or too_many:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_many:
                raise SystemExit(
                    f"error: {where} has a {len(ids)}-token prompt, which with --max-completion-length "
                    f"{budget} needs {len(ids) + budget} positions; {name} has {positions} "
                    "(max_position_embeddings). Shorten the prompt, lower --max-completion-length, or "
                    "pass --drop-overlong to skip such rows."
                )
            raise SystemExit(
                f"error: {where} has a {len(ids)}-token prompt; the limit is --max-prompt-length "
                f"{args.max_prompt_length}. Raise it or pass --drop-overlong."
            )
        if ref_fields and args.reference_template == f"{{{ref_fields[0]}}}" and ref_fields[0] in chats:
            reference = "\n".join(str(m["content"]) for m in chats[ref_fields[0]])
        else:
            reference = fill_template(args.reference_template, row, i, split, "reference")
        if args.answer_format == "gsm8k":
            field = f"field(s) {ref_fields} (--reference-template {args.reference_template!r})"
            check_gold_answer(reference, f"{args.dataset_name_or_path}, {where}", field)
        gold = extract_answer(reference, args.answer_format)
        if gold is None:
            marker = "`#### <number>`" if args.answer_format == "gsm8k" else "`\\boxed{...}`"
            raise SystemExit(
                f"error: {where}: field(s) {ref_fields} (--reference-template "
                f"{args.reference_template!r}) hold no final answer {marker} "
                f"(--answer-format {args.answer_format})"
            )
        rows.append({"prompt_ids": ids, "prompt": prompt, "gold": gold})
    if dropped:
        limit = args.max_prompt_length if positions is None else min(args.max_prompt_length, positions - budget)
        print(f"dropped {dropped} of {len(ds)} questions of '{split}' longer than {limit} tokens")
    if not rows:
        raise SystemExit(f"error: no usable questions in split '{split}'")
    return rows
