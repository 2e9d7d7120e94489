"""Packing (speed work): query + response sequences laid end to end in rows without padding, read by the model as
separate sequences through their position ids. Nothing here changes a number: the forward passes on a packed batch
give each sequence's logits as a padded batch would, faster."""

from __future__ import annotations

import torch


def pack_sequences(queries: list[list[int]], responses: list[list[int]], pad_id: int, capacity: int) -> dict:
    """A padding-free batch for the forward passes. Each query + response is laid end to end with others in rows of
    at most `capacity` tokens (first-fit, longest first); position ids restart at 0 for every sequence and no attention
    mask is passed, so transformers builds a block-diagonal causal mask from the position ids (a token sees only its own
    sequence; flash-attention kernels take the same position ids as variable-length sequences). Why: responses range
    from a few tokens to the limit, so a padded batch is much padding, and the matmuls, most of the time, scale with the
    tokens. `rows`, `cols` (N, C) index the positions whose logits predict each response token (C: the longest
    response), `targets` are those tokens."""
    seqs = [q + r for q, r in zip(queries, responses)]
    capacity = max(capacity, max(len(s) for s in seqs))
    members, free = [], []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        row = next((r for r in range(len(members)) if free[r] >= len(seqs[i])), None)
        if row is None:
            members.append([]), free.append(capacity)
            row = len(members) - 1
        members[row].append(i)
        free[row] -= len(seqs[i])
    width, C = capacity - min(free), max(len(r) for r in responses)
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    rows, cols = torch.zeros((len(seqs), C), dtype=torch.long), torch.zeros((len(seqs), C), dtype=torch.long)
    targets = torch.full((len(seqs), C), pad_id, dtype=torch.long)
    for r, row in enumerate(members):
        offset = 0
        for i in row:
            n, q, c = len(seqs[i]), len(queries[i]), len(responses[i])
            input_ids[r, offset : offset + n] = torch.tensor(seqs[i])
            position_ids[r, offset : offset + n] = torch.arange(n)
            rows[i, :c], cols[i, :c] = (
                r,
                torch.arange(offset + q - 1, offset + q - 1 + c),
            )  # position t predicts token t + 1
            targets[i, :c] = torch.tensor(responses[i])
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)  # the padding tail is a sequence of its own, never read
    return {"input_ids": input_ids, "position_ids": position_ids, "rows": rows, "cols": cols, "targets": targets}


def check_packing(model) -> None:
    """Packing relies on the model building its attention mask from the position ids (transformers' own models do,
    through `create_causal_mask`); with a model whose attention ignores them, packed sequences would see each other and
    every number would be silently wrong, so fail instead: two sequences in one row must score as each alone."""
    device = next(model.parameters()).device
    with torch.no_grad():
        together = (
            model(
                input_ids=torch.tensor([[5, 6, 7, 8, 9]], device=device),
                position_ids=torch.tensor([[0, 1, 2, 0, 1]], device=device),
                use_cache=False,
            )
            .logits[0, 3:]
            .float()
        )
        alone = model(input_ids=torch.tensor([[8, 9]], device=device), use_cache=False).logits[0].float()
    if not torch.allclose(together, alone, atol=0.05, rtol=0.05):
        raise SystemExit(
            f"error: {type(model).__name__} (attention: {model.config._attn_implementation}) does not read packed "
            "sequences from the position ids (a packed row differs from its sequences alone by "
            f"{(together - alone).abs().max().item():.3f}); use a transformers model with sdpa, eager or flash "
            "attention"
        )
