"""Packing and attention kernels (speed work): the same numbers as a padded batch, faster. Nothing here changes a
number: a packed forward pass gives each sequence the outputs it gets alone (tests/test_ppo_rlhf.py).

`pack_one_row` lays every query + response of a batch end to end in one row, position ids restarting at 0 for every
sequence; `packed_sdpa_attention` (registered with transformers as "packed_sdpa") attends within each sequence;
`padded_attention` switches back to SDPA for left-padded batches (sampling, `generate`); `check_one_row_packing` fails
fast for a model whose attention would let packed sequences see each other; `last_mlp_only_at` runs the last layer's
MLP only where a head reads it; `packed_hidden` is a frozen model's last hidden states at chosen positions of a packed
row. (ppo_rlhf.py's packing; rloo.py, remax.py and grpo_math.py pack into rows of a capacity with their own kernels.)
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface


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
