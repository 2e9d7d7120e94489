"""Packing (speed work): padding-free batches laid out so that one forward pass gives what the padded batch gives, in
less time. Sequences laid end to end in one row with position ids that restart for every sequence (the model builds a
block-diagonal causal mask from them), and preference pairs that share their prompt. Nothing here changes a number
beyond float rounding of the same computation: tests check packed rewards, losses and gradients against padded ones."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface


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


@contextlib.contextmanager
def last_mlp_only_at(body, positions: torch.Tensor):
    """Run the MLP of the body's last layer only at `positions` (sorted, unique) of a packed row; its output is zero
    elsewhere. Why: every layer but the last must run on all tokens (the next layer's attention reads their keys and
    values), but the last layer's output is read only where a head runs (the response positions, or the last token
    for a reward), and its MLP, two thirds of a layer's matmuls, would otherwise run on every prompt token too. Exact:
    outputs and gradients at `positions` are unchanged (tested), the other positions are never read. Done with
    forward hooks on `layers[-1].mlp`, so checkpoints keep their parameter names; a body laid out otherwise runs in
    full."""
    layers = getattr(body, "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if isinstance(layers, nn.ModuleList) and len(layers) else None
    if mlp is None:
        yield
        return
    tokens = {}

    def keep_positions(module, args):  # (1, T, hidden) -> (1, len(positions), hidden)
        tokens["T"] = args[0].shape[1]
        return (args[0].index_select(1, positions), *args[1:])

    def put_back(module, args, out):  # (1, len(positions), hidden) -> (1, T, hidden), zeros elsewhere
        x = out[0] if isinstance(out, tuple) else out
        x = x.new_zeros(x.shape[0], tokens["T"], x.shape[2]).index_copy(1, positions, x)
        return (x, *out[1:]) if isinstance(out, tuple) else x

    handles = [mlp.register_forward_pre_hook(keep_positions), mlp.register_forward_hook(put_back)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def packed_sdpa_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None, **kwargs
):
    """Padding-free attention over a packed row (`pack_one_row`), registered with transformers below as the attention
    implementation "packed_sdpa". query (1, heads, T, head_dim) and key / value (1, kv_heads, T, head_dim) hold
    sequences laid end to end, each starting at position id 0; each sequence is attended causally by PyTorch's SDPA on
    its own tokens. Why: the linear layers, most of the compute, then run on real tokens only, and attention costs the
    sum of the sequences' squared lengths, not T^2 for a block-diagonal mask over the whole row (flash-attention does
    the same from the position ids, as variable-length sequences; this is that for SDPA, which has no variable-length
    kernel). On CPU, one SDPA call per sequence on slices (views) of the row: a third faster than gathering the
    sequences into a padded batch, which copies every token in and out and pads each sequence to the longest (measured
    on the tiny preset). On a GPU, one call per sequence would be one small kernel launch per sequence, so there
    `attend_gathered` does the gather instead. transformers builds no mask for a custom implementation, so left-padded
    batches (sampling, `generate`) switch back to SDPA with `padded_attention`."""
    T = query.shape[2]
    if position_ids is None or query.shape[0] != 1 or position_ids.numel() != T or key.shape[2] != T:
        raise RuntimeError(
            f"packed_sdpa attention takes one packed row, without KV cache, with the position ids passed to the "
            f"attention layer ({type(module).__name__} got otherwise); padded batches run under `padded_attention`"
        )
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise RuntimeError(
            f"{type(module).__name__} needs attention logit softcapping or a position bias, which packed_sdpa "
            "does not implement; use flash attention"
        )
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().squeeze(1)
    if len(starts) == 0 or starts[0] != 0:
        raise RuntimeError(
            "packed_sdpa attention: a packed row must start a sequence (position id 0) at its first token"
        )
    lengths = torch.diff(starts, append=starts.new_tensor([T]))
    window = kwargs.get("sliding_window")
    if window is not None and window < int(lengths.max()):
        raise RuntimeError(
            f"{type(module).__name__} attends within a sliding window of {window} < {int(lengths.max())} tokens, "
            "which packed_sdpa does not implement; use flash attention"
        )
    sdpa = dict(scale=scaling, dropout_p=dropout if module.training else 0.0, enable_gqa=key.shape[1] != query.shape[1])
    if query.device.type != "cpu":
        return attend_gathered(query, key, value, starts, lengths, **sdpa), None
    sizes = lengths.tolist()
    # SDPA keeps its inputs for the backward pass. A value that is a view of a fused QKV projection's output (GPT-NeoX)
    # would keep all of that output alive, though rotary embedding has already copied the query and key out of it;
    # a copy of the value alone frees the other two thirds (docs/speed.md).
    storage = value.untyped_storage()
    if storage.nbytes() > value.nbytes and storage.data_ptr() not in (
        query.untyped_storage().data_ptr(),
        key.untyped_storage().data_ptr(),
    ):
        value = value.contiguous()
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa).transpose(1, 2)  # (1, length, heads, D)
        for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))
    ]
    return torch.cat(outs, 1), None  # (1, T, heads, D), as transformers' attention functions return


def attend_gathered(query, key, value, starts, lengths, **sdpa) -> torch.Tensor:
    """packed_sdpa's attention in one SDPA call (for GPUs): each sequence of the packed row is gathered into its own
    row of a (sequences, heads, L, head_dim) batch (L: the longest), attended causally and scattered back, (1, T, heads,
    D)."""
    T, L = query.shape[2], int(lengths.max())
    steps = torch.arange(L, device=query.device)
    valid = steps[None, :] < lengths[:, None]  # (sequences, L): the real tokens of each gathered sequence
    gather = (starts[:, None] + steps[None, :]).clamp(max=T - 1)  # past a sequence's end: tokens of the next, masked

    def by_sequence(x):  # (1, heads, T, D) -> (sequences, heads, L, D)
        return x[0].transpose(0, 1)[gather].transpose(1, 2)

    # causal within each gathered row: a real token sees only its own sequence's earlier tokens (the gathered tokens
    # after its end come later, so they are never seen; their outputs are dropped)
    out = F.scaled_dot_product_attention(
        by_sequence(query), by_sequence(key), by_sequence(value), is_causal=True, **sdpa
    )
    return out.transpose(1, 2)[valid][None]


AttentionInterface.register("packed_sdpa", packed_sdpa_attention)


def use_packed_attention(model):
    """Every forward pass on packed rows (`pack_one_row`) goes through packed_sdpa (an SDPA model) or flash-attention,
    which reads packed sequences from the position ids itself; any other implementation keeps its block-diagonal
    mask."""
    if model is not None and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("packed_sdpa")
    return model


@contextlib.contextmanager
def padded_attention(*models):
    """Back to SDPA (masks from the attention mask) while sampling or `generate` run on left-padded batches."""
    switched = [m for m in models if m is not None and m.config._attn_implementation == "packed_sdpa"]
    for m in switched:
        m.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for m in switched:
            m.set_attn_implementation("packed_sdpa")


def pack_one_row(queries: list[list[int]], responses: list[list[int]], pad_id: int) -> dict:
    """A padding-free batch for the forward passes: every query + response laid end to end in one row, position ids
    restarting at 0 for every sequence and no attention mask (see `packed_sdpa_attention`). Why: prompts and responses
    vary in length, so a padded batch is a quarter to a third padding, and the matmuls, most of a PPO update, scale
    with the tokens. `index` (N, C + 1) holds, for a response of c tokens, the c positions whose logits predict them and
    then its last token, whose value N+ still trains, and the reward model reads (C: the longest response; entries past
    c repeat the last token and are masked out); `targets` are the response tokens; `last` the position of each
    sequence's last token."""
    C = max(len(r) for r in responses)
    index = torch.zeros((len(queries), C + 1), dtype=torch.long)
    targets = torch.full((len(queries), C + 1), pad_id, dtype=torch.long)
    ids, positions, offset = [], [], 0
    for i, (q, r) in enumerate(zip(queries, responses)):
        n, c = len(q) + len(r), len(r)
        ids += q + r
        positions += range(n)
        index[i] = torch.arange(offset + len(q) - 1, offset + len(q) + C).clamp(
            max=offset + n - 1
        )  # position t predicts token t + 1
        targets[i, :c] = torch.tensor(r)
        offset += n
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.tensor([positions]),
        "index": index,
        "targets": targets,
        "last": index[torch.arange(len(responses)), torch.tensor([len(r) for r in responses])],
    }


def check_one_row_packing(model) -> None:
    """Packing relies on the attention reading sequence boundaries from the position ids (packed_sdpa and
    flash-attention do; transformers' eager attention builds a block-diagonal mask from them); with a model whose
    attention ignores them, packed sequences would see each other and every number would be silently wrong, so fail
    instead: two sequences in one row must score as each alone in a padded batch."""
    device = next(model.parameters()).device
    with torch.no_grad():
        together = (
            model(
                input_ids=torch.tensor([[5, 6, 7, 8, 9]], device=device),
                position_ids=torch.tensor([[0, 1, 2, 0, 1]], device=device),
                use_cache=False,
            )
            .logits[0]
            .float()
        )
        with padded_attention(model):
            alone = model(
                input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]], device=device),
                attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]], device=device),
                use_cache=False,
            ).logits.float()
    alone = torch.cat([alone[0], alone[1, :2]])
    if not torch.allclose(together, alone, atol=0.05, rtol=0.05):
        raise SystemExit(
            f"error: {type(model).__name__} (attention: {model.config._attn_implementation}) does not read packed "
            "sequences from the position ids (a packed row differs from its sequences alone by "
            f"{(together - alone).abs().max().item():.3f}); use a transformers model with sdpa, eager or flash "
            "attention"
        )


def body_of(model):
    """The transformer body of a causal LM or sequence classifier, without its head; of a peft (LoRA) model, the body
    of its base model, the adapters inside it (peft's own `base_model_prefix` would name the whole model)."""
    model = model.get_base_model() if hasattr(model, "peft_config") else model
    return getattr(model, model.base_model_prefix)


def packed_hidden(model, packed: dict, at: torch.Tensor) -> torch.Tensor:
    """Last hidden states of a frozen model's body at the positions `at` (any shape) of a packed row (`pack_one_row`),
    for its heads."""
    body = body_of(model)
    with last_mlp_only_at(body, at.unique()):
        hidden = body(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).last_hidden_state
    return hidden[0, at]


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
