"""Evaluation harnesses: held-out preference pairs and greedy responses to evaluation prompts, sharded over the
processes and gathered. They take the script's algorithmic pieces (logprobs, losses, truncation, rewards, judges) as
arguments, so evaluating changes no training number."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from clean_rlhf_utils.data import collate_preference_pairs, left_pad
from clean_rlhf_utils.engines import shard_length, zero3


@torch.no_grad()
def evaluate_dpo_pairs(
    policy,
    ref_policy,
    items: list[dict],
    pad_id: int,
    args,
    accelerator: Accelerator,
    forward_logprobs,
    pair_losses,
    implicit_accuracy,
) -> dict:
    """DPO loss and implicit-reward accuracy on held-out preference pairs (under ZeRO-3, shards padded to equal size
    and the padded duplicates dropped after), by the script's `forward_logprobs(model, batch)`, `pair_losses(batch,
    chosen, rejected, ref_chosen, ref_rejected, args)` and `implicit_accuracy(r_chosen, r_rejected)`."""
    policy.eval()
    records = []
    with accelerator.split_between_processes(items, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = {
                k: v.to(accelerator.device)
                for k, v in collate_preference_pairs(
                    shard[start : start + args.per_device_eval_batch_size], pad_id, args.pack_pairs
                ).items()
            }
            with accelerator.autocast():
                chosen, rejected = forward_logprobs(policy, batch)
                if "ref_chosen" in batch:
                    ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
                else:
                    ref_c, ref_r = forward_logprobs(ref_policy, batch)
            losses, rc, rr = pair_losses(batch, chosen, rejected, ref_c, ref_r, args)
            records.extend(zip(losses.tolist(), rc.tolist(), rr.tolist(), implicit_accuracy(rc, rr).tolist()))
    records = gather_object(records[: shard_length(len(items), accelerator)])  # without the padded rows
    policy.train()
    n = len(records)
    return {
        "eval/loss": sum(r[0] for r in records) / n,
        "eval/accuracy": sum(r[3] for r in records) / n,
        "eval/reward_chosen": sum(r[1] for r in records) / n,
        "eval/reward_rejected": sum(r[2] for r in records) / n,
        "eval/reward_margin": sum(r[1] - r[2] for r in records) / n,
    }


@torch.no_grad()
def evaluate_dpo_responses(
    policy,
    reward_model,
    tokenizer,
    rows: list[dict],
    args,
    accelerator: Accelerator,
    reference,
    truncate_response,
    outcome_reward,
    gold_judge,
    sampled_kl,
) -> tuple[dict, list[dict]]:
    """Greedy responses to the evaluation prompts, scored by the gold judge (tiny-tldr) and the reward model if any,
    with the script's `truncate_response`, `outcome_reward`, `gold_judge` and (`--eval-kl`, against `reference`)
    `sampled_kl`. Under ZeRO-3 the shards are padded to equal size and `generate` synced (every forward pass is a
    collective)."""
    policy.eval()
    records = []
    with accelerator.split_between_processes(rows, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            queries, qmask = left_pad([r["prompt_ids"] for r in batch], tokenizer.pad_token_id)
            queries, qmask = queries.to(accelerator.device), qmask.to(accelerator.device)
            out = policy.generate(
                input_ids=queries,
                attention_mask=qmask,
                max_new_tokens=args.response_length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=zero3(accelerator),
            )
            responses = truncate_response(out[:, queries.shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id)
            scores = [None] * len(batch)
            if reward_model is not None:
                seqs = torch.cat([queries, responses], 1)
                with accelerator.autocast():
                    scores = outcome_reward(
                        reward_model,
                        seqs.masked_fill(seqs == tokenizer.pad_token_id, 0),
                        (seqs != tokenizer.pad_token_id).long(),
                    ).tolist()
            kls = [None] * len(batch)
            if args.eval_kl and reference is not None:
                kls = sampled_kl(
                    policy,
                    reference,
                    queries,
                    qmask,
                    args.response_length,
                    tokenizer.pad_token_id,
                    tokenizer.eos_token_id,
                    zero3(accelerator),
                )
            for r, resp, score, kl in zip(batch, responses, scores, kls):
                text = tokenizer.decode(resp, skip_special_tokens=True)
                rec = {
                    "response": text,
                    "score": score,
                    "kl": kl,
                    "length": int((resp != tokenizer.pad_token_id).sum()),
                    "eos": bool((resp == tokenizer.eos_token_id).any()),
                }
                if args.eval_task == "tldr":
                    rec["gold_reward"], rec["reference_gold_reward"] = (
                        gold_judge(text, r["facts"]),
                        gold_judge(r["reference"], r["facts"]),
                    )
                records.append(rec)
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    policy.train()
    n = len(records)
    metrics = {
        "eval/completion_length": sum(r["length"] for r in records) / n,
        "eval/eos_rate": sum(r["eos"] for r in records) / n,
    }
    if reward_model is not None:
        metrics["eval/score"] = sum(r["score"] for r in records) / n
    if args.eval_kl and reference is not None:
        metrics["eval/kl"] = sum(r["kl"] for r in records) / n
    if args.eval_task == "tldr":
        metrics["eval/gold_reward"] = sum(r["gold_reward"] for r in records) / n
        metrics["eval/win_rate"] = (
            sum(
                1.0
                if r["gold_reward"] > r["reference_gold_reward"]
                else 0.5
                if r["gold_reward"] == r["reference_gold_reward"]
                else 0.0
                for r in records
            )
            / n
        )
    return metrics, records


def evaluate_dpo(run, step: int, models: tuple, pairs: list, rows: list, args, accelerator, pieces: dict) -> dict:
    """dpo.py's evaluations after `step` optimizer steps, logged: the DPO loss and implicit-reward accuracy on held-out
    `pairs` (`evaluate_dpo_pairs`), and greedy responses to the evaluation prompts `rows` (`evaluate_dpo_responses`).
    `models`: (policy, reference, reward model, tokenizer); `pieces`: the script's functions by name
    (forward_logprobs, pair_losses, implicit_accuracy, truncate_response, outcome_reward, gold_judge, sampled_kl)."""
    policy, ref_policy, reward_model, tokenizer = models
    metrics = {}
    if pairs:
        metrics.update(
            evaluate_dpo_pairs(
                policy,
                ref_policy,
                pairs,
                tokenizer.pad_token_id,
                args,
                accelerator,
                pieces["forward_logprobs"],
                pieces["pair_losses"],
                pieces["implicit_accuracy"],
            )  # fmt: skip
        )
    if rows:
        gen_metrics, records = evaluate_dpo_responses(
            policy, reward_model, tokenizer, rows, args, accelerator, ref_policy,
            pieces["truncate_response"], pieces["outcome_reward"], pieces["gold_judge"], pieces["sampled_kl"],
        )  # fmt: skip
        metrics.update(gen_metrics)
        run.log_samples(records[:8], step)
    if metrics:  # --num-eval-pairs 0 and --num-eval-examples 0: nothing evaluated, nothing logged
        batch_pairs = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
        run.log(metrics, step, step * batch_pairs)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
