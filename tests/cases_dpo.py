"""Loss-aggregation invariance cases of dpo.py (see tests/invariance.py): the DPO loss of a step is the mean over the
pairs of its whole batch (online: the untied pairs only), so pairs of uneven lengths, and online batches whose
micro-batches and processes hold uneven numbers of untied pairs, must give the gradient of that one mean. The reference
policy is a second, frozen tiny model with other weights; its logprobs come live (offline sigmoid) or cached with the
pairs (offline IPO, as --precompute-ref-logprobs does; online, as `sample_pairs` does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM

import dpo

PAD = 0
BETA = 0.1


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        pad_token_id=PAD,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).float()


def make_model() -> torch.nn.Module:
    return _model(0)


REF = _model(1).eval().requires_grad_(False)


def seq_logprob(model, prompt: list[int], response: list[int], average: bool) -> torch.Tensor:
    """log pi(y|x) = sum over the response tokens of log p(y_t | x, y_<t), the sequence alone; / |y| when averaged."""
    ids = torch.tensor([prompt + response])
    logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    total = logp[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).sum()
    return total / len(response) if average else total


def _pairs(seed: int, valid: list[bool] | None = None, cached: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, 50, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for p, c, r in [(3, 2, 6), (5, 7, 1), (2, 3, 3), (4, 1, 8), (6, 5, 2), (1, 4, 4)]:  # uneven lengths
        item = {"prompt_ids": ids(p), "chosen": ids(c), "rejected": ids(r)}
        # summed reference logprobs travel with the pair, as `cache_reference_logprobs` and `sample_pairs` store them
        if cached:
            with torch.no_grad():
                item["ref_chosen"] = seq_logprob(REF, item["prompt_ids"], item["chosen"], False).item()
                item["ref_rejected"] = seq_logprob(REF, item["prompt_ids"], item["rejected"], False).item()
        out.append(item)
    for item, v in zip(out, valid or []):
        item["valid"] = v
    return out


def _case(name: str, loss_type: str, items: list[dict], pack: bool) -> Case:
    args = dpo.Args(loss_type=loss_type, beta=BETA, pack_pairs=pack)
    average = loss_type == "ipo" and args.ipo_average

    def reference(model, batch: list[dict]) -> torch.Tensor:
        """h = (log pi(y_c|x) - log pi(y_r|x)) - (log ref(y_c|x) - log ref(y_r|x)), per-token averaged for IPO;
        sigmoid: -log sigmoid(beta h) (Rafailov et al. 2023); ipo: (h - 1/(2 beta))^2 (Azar et al. 2023); the mean
        over the pairs that count (online: untied)."""
        total, n = 0.0, 0
        for it in batch:
            if not it.get("valid", True):
                continue
            with torch.no_grad():
                ref_c = seq_logprob(REF, it["prompt_ids"], it["chosen"], average)
                ref_r = seq_logprob(REF, it["prompt_ids"], it["rejected"], average)
            h = (
                seq_logprob(model, it["prompt_ids"], it["chosen"], average)
                - seq_logprob(model, it["prompt_ids"], it["rejected"], average)
            ) - (ref_c - ref_r)
            total = total + (-F.logsigmoid(BETA * h) if loss_type == "sigmoid" else (h - 1 / (2 * BETA)) ** 2)
            n += 1
        return total / n

    def collate(batch: list[dict]) -> dict:
        mb = dpo.collate_preference_pairs(batch, PAD, pack)
        if "valid" in batch[0]:  # as `main` attaches the online pairs' tie flags to each micro-batch
            mb["valid"] = torch.tensor([it["valid"] for it in batch])
        return mb

    def step(accelerator, model, batch: list[dict], total: float) -> None:
        loss_sum, _ = dpo.micro_batch_loss(model, REF, collate(batch), args)
        accelerator.backward(
            loss_sum * (accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0))
        )  # as in main

    return Case(
        name,
        make_model,
        items,
        reference,
        lambda batch: float(dpo.pair_weights(collate(batch)).sum()),
        step,
        lambda acc, c: dpo.global_count(c, acc),
        micro_splits=(1, 3, 2),
    )


def cases() -> list[Case]:
    # online: the halves hold 1 and 3 untied pairs, and the first half's second micro-batch none
    return [
        _case("dpo/offline-sigmoid", "sigmoid", _pairs(4), pack=False),
        _case("dpo/offline-ipo-average", "ipo", _pairs(5, cached=True), pack=True),
        _case(
            "dpo/online-uneven-valid",
            "sigmoid",
            _pairs(6, valid=[True, False, False, True, True, True], cached=True),
            pack=True,
        ),
    ]
