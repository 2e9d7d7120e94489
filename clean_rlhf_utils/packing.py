"""Packing: speed work. A packed batch lays several sequences end to end in one row, with an attention mask that keeps
them apart, so a forward pass computes no padding; it gives the padded batch's numbers, faster. The scripts compute
their logprobs from the logits these return (which tokens count and how they are summed stay in the scripts)."""

from __future__ import annotations

import torch


def pack_pairs_for_logprobs(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """A padding-free batch of preference pairs for one forward pass. Why: in a right-padded batch of prompt + response
    rows about a quarter of the tokens are padding, and chosen and rejected repeat the same prompt, most of the tokens
    in TL;DR; the matmuls, most of a step's time, scale with the tokens. A causal model computes the same hidden states
    for a shared prefix whatever follows it, so each pair is laid out once as [common prefix, rest of chosen, rest of
    rejected] (the prefix is the prompt plus any first response tokens both share, capped so both rests keep at least
    one token). The rest of rejected sees the prefix and itself but not the chosen tokens, and its position ids
    continue from the prefix, so every token sees exactly what it sees in its own padded row. Pairs are laid end to end
    in rows of at most `capacity` tokens (first-fit, longest first; twice the longest sequence packed best on CPU: the
    attention and mask cost grow with the row length). `allowed` (rows, W, W) says which key each query may attend to
    (block-diagonal per pair, causal, rejected not seeing chosen). `rows`, `cols` (2N, C) locate the positions whose
    logits predict each response token (C: the longest response), chosen sequences first, then rejected ones, as in
    the padded batch; `targets` are those tokens and `mask` marks the real ones."""
    n = len(items)
    prompts = [it["prompt_ids"] for it in items]
    chosen = [it["prompt_ids"] + it["chosen"] for it in items]
    rejected = [it["prompt_ids"] + it["rejected"] for it in items]
    shared = [
        min(next((k for k, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r))), min(len(c), len(r)) - 1)
        for c, r in zip(chosen, rejected)
    ]
    units = [len(c) + len(r) - s for c, r, s in zip(chosen, rejected, shared)]
    capacity = max(2 * max(len(s) for s in chosen + rejected), max(units))
    members, free = [], []
    for i in sorted(range(n), key=lambda i: -units[i]):
        row = next((r for r in range(len(members)) if free[r] >= units[i]), None)
        if row is None:
            members.append([]), free.append(capacity)
            row = len(members) - 1
        members[row].append(i)
        free[row] -= units[i]
    width, C = capacity - min(free), max(len(it[k]) for it in items for k in ("chosen", "rejected"))
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    pair = torch.full((len(members), width), -1, dtype=torch.long)  # which pair of the row a token belongs to
    part = torch.zeros(
        (len(members), width), dtype=torch.long
    )  # 0: shared prefix or padding, 1: rest of chosen, 2: rest of rejected
    rows, cols = torch.zeros((2 * n, C), dtype=torch.long), torch.zeros((2 * n, C), dtype=torch.long)
    targets, mask = torch.full((2 * n, C), pad_id, dtype=torch.long), torch.zeros((2 * n, C), dtype=torch.long)
    for r, row in enumerate(members):
        offset = 0
        for i in row:
            c, rej, s, P = chosen[i], rejected[i], shared[i], len(prompts[i])
            input_ids[r, offset : offset + units[i]] = torch.tensor(c + rej[s:])
            position_ids[r, offset : offset + len(c)] = torch.arange(len(c))
            position_ids[r, offset + len(c) : offset + units[i]] = torch.arange(s, len(rej))
            pair[r, offset : offset + units[i]] = i
            part[r, offset + s : offset + len(c)], part[r, offset + len(c) : offset + units[i]] = 1, 2
            # token t of a sequence is predicted by the logits at token t - 1; rejected token t - 1 sits in the prefix
            # while t - 1 < s, and after the whole chosen sequence from then on
            before_c, before_r = torch.arange(P - 1, len(c) - 1), torch.arange(P - 1, len(rej) - 1)
            rows[i, : len(before_c)], cols[i, : len(before_c)] = r, offset + before_c
            rows[n + i, : len(before_r)] = r
            cols[n + i, : len(before_r)] = torch.where(before_r < s, offset + before_r, offset + len(c) + before_r - s)
            targets[i, : len(before_c)], mask[i, : len(before_c)] = torch.tensor(c[P:]), 1
            targets[n + i, : len(before_r)], mask[n + i, : len(before_r)] = torch.tensor(rej[P:]), 1
            offset += units[i]
        position_ids[r, offset:] = torch.arange(width - offset)  # the padding tail sees only itself; it is never read
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (pair[:, :, None] == pair[:, None, :]) & causal & ~((part[:, :, None] == 2) & (part[:, None, :] == 1))
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "allowed": allowed,
        "rows": rows,
        "cols": cols,
        "targets": targets,
        "mask": mask,
    }


def packed_response_logits(model, packed: dict) -> torch.Tensor:
    """The logits (2N, C, vocab) at the positions of a `pack_pairs_for_logprobs` batch that predict each response token
    (chosen sequences first, then rejected ones; the script turns them into logprobs). The mask goes in as a 4D
    additive mask, which transformers hands to the attention as is (eager and sdpa attention; flash-attention kernels
    take no such mask). use_cache=False: no KV cache is needed here."""
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(packed["allowed"].shape, dtype=dtype, device=packed["allowed"].device)
    mask = mask.masked_fill(~packed["allowed"], torch.finfo(dtype).min)[:, None]
    logits = model(
        input_ids=packed["input_ids"], attention_mask=mask, position_ids=packed["position_ids"], use_cache=False
    ).logits
    return logits[packed["rows"], packed["cols"]]


def check_packing_attention(model, pack: bool) -> None:
    """Packed batches hand the attention a 4D mask, which only eager and sdpa attention take: a one-line error."""
    if pack and model.config._attn_implementation not in ("eager", "sdpa"):
        raise SystemExit(
            f"error: --pack-pairs hands the attention a 4D mask, which {model.config._attn_implementation} attention "
            "does not "
            "take; pass --no-pack-pairs (or use sdpa / eager attention)"
        )
