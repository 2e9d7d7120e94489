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
