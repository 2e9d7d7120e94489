"""Packing (speed work): padding-free batches laid out so that one forward pass gives what the padded batch gives, in
less time. Sequences laid end to end in one row with position ids that restart for every sequence (the model builds a
block-diagonal causal mask from them), and preference pairs that share their prompt. Nothing here changes a number
beyond float rounding of the same computation: tests check packed rewards, losses and gradients against padded ones."""

from __future__ import annotations

import torch


def pack_reward_pairs(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> dict:
    """(Reward model) A padding-free batch of preference pairs for one forward pass. Why: in a right-padded batch of
    prompt + response rows about a quarter of the tokens are padding, and chosen and rejected repeat the same prompt,
    often most of the tokens; the matmuls, most of a step's time, scale with the tokens. A causal model computes the
    same hidden states for a shared prefix whatever follows it, so each pair is laid out once as [common prefix, rest of
    chosen, rest of rejected] (the prefix is capped so both rests keep at least their last token, where the reward is
    read). The rest of rejected sees the prefix and itself but not the chosen tokens, and its position ids continue from
    the prefix, so every token sees exactly what it sees in its own padded row. Pairs are laid end to end in rows of at
    most `capacity` tokens (first-fit, longest first; twice the longest sequence packed best on CPU: the attention and
    mask cost grow with the row length). `allowed` (rows, W, W) says which key each query may attend to (block-diagonal
    per pair, causal, rejected not seeing chosen); `rows`, `cols` (2N,) locate the last token of each sequence, chosen
    sequences first, then rejected ones, as in the padded batch."""
    n = len(chosen)
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
    width = capacity - min(free)
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    pair = torch.full((len(members), width), -1, dtype=torch.long)  # which pair of the row a token belongs to
    part = torch.zeros(
        (len(members), width), dtype=torch.long
    )  # 0: shared prefix or padding, 1: rest of chosen, 2: rest of rejected
    rows, cols = torch.zeros(2 * n, dtype=torch.long), torch.zeros(2 * n, dtype=torch.long)
    for r, row in enumerate(members):
        offset = 0
        for i in row:
            c, rej, s = chosen[i], rejected[i], shared[i]
            input_ids[r, offset : offset + units[i]] = torch.tensor(c + rej[s:])
            position_ids[r, offset : offset + len(c)] = torch.arange(len(c))
            position_ids[r, offset + len(c) : offset + units[i]] = torch.arange(s, len(rej))
            pair[r, offset : offset + units[i]] = i
            part[r, offset + s : offset + len(c)], part[r, offset + len(c) : offset + units[i]] = 1, 2
            rows[i], cols[i] = r, offset + len(c) - 1
            rows[n + i], cols[n + i] = r, offset + units[i] - 1
            offset += units[i]
        position_ids[r, offset:] = torch.arange(width - offset)  # the padding tail sees only itself; it is never read
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (pair[:, :, None] == pair[:, None, :]) & causal & ~((part[:, :, None] == 2) & (part[:, None, :] == 1))
    return {"input_ids": input_ids, "position_ids": position_ids, "allowed": allowed, "rows": rows, "cols": cols}


def packed_pair_rewards(model, packed: dict) -> torch.Tensor:
    """(Reward model) Rewards (2N,) of a `pack_reward_pairs` batch, chosen first, read from the `score` head's per-token
    output as `token_scores` does (a hook, so the call goes through the possibly DDP-wrapped model), plus the stored
    bias. The mask goes in as a 4D additive mask, which transformers hands to the attention as is (eager and sdpa
    attention; flash-attention kernels take no such mask). use_cache=False: no KV cache is needed to train."""
    captured = {}
    inner = getattr(model, "module", model)  # DDP / DeepSpeed wrappers keep the model in `.module`
    dtype = next(inner.parameters()).dtype
    mask = torch.zeros(packed["allowed"].shape, dtype=dtype, device=packed["allowed"].device)
    mask = mask.masked_fill(~packed["allowed"], torch.finfo(dtype).min)[:, None]
    handle = inner.score.register_forward_hook(lambda module, inputs, output: captured.update(scores=output))
    try:
        model(input_ids=packed["input_ids"], attention_mask=mask, position_ids=packed["position_ids"], use_cache=False)
    finally:
        handle.remove()
    scores = captured["scores"].squeeze(-1).float()
    return scores[packed["rows"], packed["cols"]] + getattr(inner.config, "reward_bias", 0.0)


def check_pair_packing(model) -> None:
    """(Reward model) `pack_reward_pairs` hands the attention a 4D mask, which eager and sdpa attention take and
    flash-attention kernels do not: any other attention is a one-line error."""
    if model.config._attn_implementation not in ("eager", "sdpa"):
        raise SystemExit(
            f"error: --pack-pairs hands the attention a 4D mask, which {model.config._attn_implementation} attention "
            "does not "
            "take; pass --no-pack-pairs (or use sdpa / eager attention)"
        )


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
