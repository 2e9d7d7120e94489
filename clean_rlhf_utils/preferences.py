"""Preference pairs: the chosen and rejected responses of a row (plain text or TRL's conversational format), checked
and tokenized, and their padded (or packed) batches. Nothing here changes a number: which tokens count is the loss
mask the script's loss reads."""

from __future__ import annotations

import sys

import torch

from clean_rlhf_utils.data import chat_messages, end_with_eos
from clean_rlhf_utils.packing import pack_pairs_for_logprobs


def preference_response_text(row: dict, index: int, split: str, field: str, flag: str) -> str:
    """The chosen or rejected response of a row: the field's text, or the assistant turn of TRL's conversational
    preference format ({"prompt": [user messages], "chosen": [{"role": "assistant", "content": ...}], ...}). A missing,
    null, empty or non-text field, or a whole conversation (TRL's implicit-prompt format, the prompt repeated in both
    responses), is a one-line error naming the row, the field and the flag."""
    if field not in row:
        raise SystemExit(
            f"error: row {index} of split '{split}' has no field '{field}' ({flag}); its fields are {sorted(row)}"
        )
    value = row[field]
    if value is None:
        raise SystemExit(
            f"error: row {index} of split '{split}': field '{field}' ({flag}) is missing or null; fill it "
            "in or drop the row"
        )
    if chat_messages(value):
        if any(m["role"] != "assistant" for m in value):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{field}' ({flag}) holds a whole "
                f"conversation (roles {[m['role'] for m in value]}), TRL's implicit-prompt format; give "
                "the prompt's messages in their own field (--prompt-template '{prompt}') and only the "
                "assistant's turn in chosen and rejected (TRL's prompt/chosen/rejected format)"
            )
        value = "\n".join(m["content"] for m in value)
    elif not isinstance(value, str):
        raise SystemExit(
            f"error: row {index} of split '{split}': field '{field}' ({flag}) is a "
            f"{type(value).__name__}, not text: {str(value)[:60]!r}"
        )
    if not value.strip():
        raise SystemExit(f"error: row {index} of split '{split}': field '{field}' ({flag}) is empty")
    return value


def tokenize_preference_pairs(
    ds, tokenizer, args, split: str, max_positions: int | None, prompt_token_ids
) -> list[dict]:
    """Prompt ids and chosen / rejected response ids, each ending in exactly one EOS (the N+ responses already end
    with the text `<|endoftext|>`), every field checked now (`preference_response_text`, and the prompt by the script's
    `prompt_token_ids(row, index, split, tokenizer, args)`). A pair longer than `--max-prompt-length` /
    `--max-response-length`, or than the model's positions, is an error (or dropped with `--drop-overlong`); so is a
    split whose every pair has chosen = rejected (no preference to learn)."""
    out, dropped, same = [], 0, 0
    for i, row in enumerate(ds):
        item = {}
        for key, name, flag in (
            ("chosen", args.chosen_field, "--chosen-field"),
            ("rejected", args.rejected_field, "--rejected-field"),
        ):
            ids = tokenizer(preference_response_text(row, i, split, name, flag), add_special_tokens=False)["input_ids"]
            item[key] = end_with_eos(ids, tokenizer.eos_token_id)
        # the prompt after the responses: TRL's implicit-prompt rows get the message about their format
        prompt_ids = item["prompt_ids"] = prompt_token_ids(row, i, split, tokenizer, args)
        longest = max(len(item["chosen"]), len(item["rejected"]))
        too_long = len(prompt_ids) > args.max_prompt_length or longest > args.max_response_length
        no_room = max_positions is not None and len(prompt_ids) + longest > max_positions
        if too_long or no_room:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_long:
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a "
                    f"{longest}-token response (EOS included); the limits are --max-prompt-length "
                    f"{args.max_prompt_length} and --max-response-length {args.max_response_length}. "
                    "Raise them or pass --drop-overlong."
                )
            raise SystemExit(
                f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a {longest}-"
                f"token response, {len(prompt_ids) + longest} tokens, more than the {max_positions} "
                f"positions of --sft-model-path (max_position_embeddings); lower --max-prompt-length (now "
                f"{args.max_prompt_length}) or --max-response-length, with --drop-overlong"
            )
        same += item["chosen"] == item["rejected"]
        out.append(item)
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} pairs of '{split}' longer than --max-prompt-length / "
            "--max-response-length or than the model's positions"
        )
    if not out:
        raise SystemExit(f"error: no usable pairs in split '{split}'")
    if same == len(out):
        raise SystemExit(
            f"error: every pair of split '{split}' has the same chosen and rejected response "
            f"(--chosen-field '{args.chosen_field}', --rejected-field '{args.rejected_field}'): there is "
            "no preference to learn; check the two fields"
        )
    if same:
        print(
            f"warning: {same} of {len(out)} pairs of '{split}' have the same chosen and rejected response: they "
            "count in the loss's mean but carry no preference",
            file=sys.stderr,
        )
    return out


def collate_preference_pairs(items: list[dict], pad_id: int, pack: bool = False) -> dict[str, torch.Tensor]:
    """Chosen rows first, then rejected rows, right-padded (one forward pass for both); the loss mask marks the response
    tokens and EOS. With `pack`, the `pack_pairs_for_logprobs` batch instead (speed work, the same logprobs). Cached
    reference logprobs travel with the pairs when present."""
    if pack:
        batch = pack_pairs_for_logprobs(items, pad_id)
        if "ref_chosen" in items[0]:
            batch["ref_chosen"] = torch.tensor([it["ref_chosen"] for it in items])
            batch["ref_rejected"] = torch.tensor([it["ref_rejected"] for it in items])
        return batch
    seqs = [(it["prompt_ids"], it[key]) for key in ("chosen", "rejected") for it in items]
    width = max(len(p) + len(r) for p, r in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) : len(p) + len(r)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if "ref_chosen" in items[0]:
        batch["ref_chosen"] = torch.tensor([it["ref_chosen"] for it in items])
        batch["ref_rejected"] = torch.tensor([it["ref_rejected"] for it in items])
    return batch
