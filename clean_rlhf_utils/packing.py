"""Packing (speed work): several prompt + completion sequences laid end to end in one row, no padding, with position
ids that restart for every sequence, so the model builds a block-diagonal causal mask from them. The same numbers as a
padded batch (the scripts check the model reads packing from the position ids), in a fraction of the time."""

from __future__ import annotations

import torch


def pack_rows(batch: dict, idx: torch.Tensor, pad_id: int, capacity: int) -> tuple[dict, int]:
    """The packed micro-batch of rows idx of a sampled batch, and the width of their longest completion."""
    rows = idx.tolist()
    packed = pack_completions(
        [batch["prompts"][i] for i in rows], [batch["completions"][i] for i in rows], pad_id, capacity
    )
    return packed, packed["mask"].shape[1]


def pack_completions(prompts: list[list[int]], completions: list[list[int]], pad_id: int, capacity: int) -> dict:
    """A padding-free batch for the forward passes. Each prompt + completion is laid end to end with others in rows of
    at most `capacity` tokens (first-fit, longest first); position ids restart at 0 for every sequence and no attention
    mask is passed, so transformers builds a block-diagonal causal mask from the position ids (a token sees only its own
    sequence; flash-attention kernels take the same position ids as variable-length sequences). Why: completions of a
    GSM8K batch range from a few tokens to the limit, so a padded batch is about a third padding, and the matmuls, most
    of a step's time, scale with the tokens. `rows`, `cols` (N, C) index the positions whose logits predict each
    completion token (C: the longest completion), `targets` are those tokens and `mask` marks the real ones."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    capacity = max(capacity, max(len(s) for s in seqs))
    members, free = [], []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        row = next((r for r in range(len(members)) if free[r] >= len(seqs[i])), None)
        if row is None:
            members.append([]), free.append(capacity)
            row = len(members) - 1
        members[row].append(i)
        free[row] -= len(seqs[i])
    width, C = capacity - min(free), max(len(c) for c in completions)
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    rows, cols = torch.zeros((len(seqs), C), dtype=torch.long), torch.zeros((len(seqs), C), dtype=torch.long)
    targets, mask = torch.full((len(seqs), C), pad_id, dtype=torch.long), torch.zeros((len(seqs), C), dtype=torch.long)
    for r, row in enumerate(members):
        offset = 0
        for i in row:
            n, P, c = len(seqs[i]), len(prompts[i]), len(completions[i])
            input_ids[r, offset : offset + n] = torch.tensor(seqs[i])
            position_ids[r, offset : offset + n] = torch.arange(n)
            rows[i, :c], cols[i, :c] = (
                r,
                torch.arange(offset + P - 1, offset + P - 1 + c),
            )  # position t predicts token t + 1
            targets[i, :c], mask[i, :c] = torch.tensor(completions[i]), 1
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)  # the padding tail is a sequence of its own, never read
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "rows": rows,
        "cols": cols,
        "targets": targets,
        "mask": mask,
    }
