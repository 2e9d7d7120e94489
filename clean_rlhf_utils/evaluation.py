"""Evaluation: the harnesses that score a model on the evaluation split and change no training number. They take the
script's losses, rewards and truncation as arguments: sft.py's loss and greedy samples, the reward model's pairwise
and step accuracies and the normalisation's reference rewards, math questions (greedy pass@1, and from k samples per
question pass@k, maj@k and mean@k), DPO's held-out pairs, and the greedy responses of every RL script
(`evaluate_responses`). What they score with (the tiny world's judge, the answer parsers, `eval/kl`): judges.py. A
harness puts the model in eval mode and leaves it there: the script's `main` switches it back to train mode."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object

from clean_rlhf_utils.data import check_gold_answer, left_pad
from clean_rlhf_utils.engines import LoraReference, shard_length, sharded
from clean_rlhf_utils.judges import (
    extract_boxed_answer,
    extract_gsm8k_answer,
    gold_judge,
    majority_vote,
    numbers_equal,
    sampled_kl,
    vote_key,
)
from clean_rlhf_utils.packing import padded_attention
from clean_rlhf_utils.preferences import collate_preference_pairs


def check_sft_evaluation_fields(row: dict, response: str, index: int, split: str, args) -> None:
    """(SFT) What `evaluate_sft` needs of an evaluation row, checked when the split is loaded, not at the first
    evaluation: the key `facts` the tiny-tldr judge scores (`--eval-task tldr`), a final answer in the reference (gsm8k,
    boxed)."""
    where = f"row {index} of split '{split}'"
    if args.eval_task == "tldr":
        facts = row.get("facts")
        if not (isinstance(facts, list) and facts and all(isinstance(f, str) and f for f in facts)):
            raise SystemExit(
                f"error: {where}: --eval-task tldr judges summaries by the row's 'facts' (a list of "
                f"words, as in tiny-tldr), but {'it has none' if facts is None else f'it is {str(facts)[:60]!r}'}; "
                "use --eval-task none for other "
                "data"
            )
    elif args.eval_task in ("gsm8k", "boxed"):
        extract = extract_gsm8k_answer if args.eval_task == "gsm8k" else extract_boxed_answer
        if args.eval_task == "gsm8k":
            field = f"the reference response (--response-template {args.response_template!r})"
            check_gold_answer(response, f"{args.dataset_name_or_path}, {where}", field)
        if extract(response) is None:
            marker = "`#### <number>`" if args.eval_task == "gsm8k" else "`\\boxed{...}`"
            raise SystemExit(
                f"error: {where}: the reference response holds no final answer {marker} for --eval-task "
                f"{args.eval_task}: {response[-60:]!r}; use another --eval-task (or none), or a "
                "--response-template that holds the answer"
            )


@torch.no_grad()
def evaluate_sft(
    model, tokenizer, examples: list[dict], args, accelerator: Accelerator, loss, collate, truncate
) -> tuple[dict, list[dict]]:
    """(SFT) Validation loss on reference responses (`loss(logits, labels)` of each row, as `collate(rows, pad_id)`
    labels it), then greedy samples, cut after their first EOS by `truncate(tokens, eos_id, pad_id)`, scored by the
    task's checker. Each
    process takes a shard of the examples; results are gathered on every process. Under ZeRO-3 every forward pass
    is a collective, so the shards are padded to one length (the padded rows' records are dropped) and `generate`
    keeps stepping until every rank is done."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    records = []
    with accelerator.split_between_processes(examples, apply_padding=sharded(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            tensors = {k: v.to(accelerator.device) for k, v in collate(batch, tokenizer.pad_token_id).items()}
            logits = unwrapped(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
            losses = [loss(logits[i : i + 1], tensors["labels"][i : i + 1]).item() for i in range(len(batch))]
            ids, mask = left_pad([e["prompt_ids"] for e in batch], tokenizer.pad_token_id)
            out = unwrapped.generate(
                input_ids=ids.to(accelerator.device),
                attention_mask=mask.to(accelerator.device),
                max_new_tokens=args.max_response_length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=sharded(accelerator),
            )
            responses = truncate(out[:, ids.shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id)
            for e, row_loss, r in zip(batch, losses, responses):
                text = tokenizer.decode(r, skip_special_tokens=True)
                rec = {
                    "loss": row_loss,
                    "response": text,
                    "reference": e["response"],
                    "ends_with_eos": bool((r == tokenizer.eos_token_id).any()),
                }
                if args.eval_task == "tldr":
                    rec["gold_reward"] = gold_judge(text, e["row"]["facts"])
                    rec["reference_gold_reward"] = gold_judge(e["response"], e["row"]["facts"])
                elif args.eval_task in ("gsm8k", "boxed"):
                    extract = extract_gsm8k_answer if args.eval_task == "gsm8k" else extract_boxed_answer
                    gold = extract(e["response"])
                    if gold is None:
                        raise SystemExit(
                            f"error: the reference response has no final answer for --eval-task {args.eval_task}: "
                            f"{e['response']!r}"
                        )
                    rec["correct"] = numbers_equal(extract(text), gold) or extract(text) == gold
                records.append(rec)
    records = gather_object(records[: shard_length(len(examples), accelerator)])  # without the padded rows
    metrics = {
        "eval/loss": sum(r["loss"] for r in records) / len(records),
        "eval/eos_rate": sum(r["ends_with_eos"] for r in records) / len(records),
    }
    if args.eval_task == "tldr":
        metrics["eval/gold_reward"] = sum(r["gold_reward"] for r in records) / len(records)
        metrics["eval/reference_gold_reward"] = sum(r["reference_gold_reward"] for r in records) / len(records)
        metrics["eval/win_rate"] = sum(
            1.0
            if r["gold_reward"] > r["reference_gold_reward"]
            else 0.5
            if r["gold_reward"] == r["reference_gold_reward"]
            else 0.0
            for r in records
        ) / len(records)
    elif args.eval_task in ("gsm8k", "boxed"):
        metrics["eval/accuracy"] = sum(r["correct"] for r in records) / len(records)
    return metrics, records


@torch.no_grad()
def evaluate_reward_model(
    model, examples: list[dict], args, accelerator: Accelerator, collate, forward, step_loss
) -> dict:
    """(Reward model) Outcome: pairwise accuracy (overall and by confidence), mean chosen/rejected reward and margin.
    Process: per-step accuracy (sigmoid(logit) > 0.5 against the label), and the share of solutions whose every step is
    classified right. `collate(rows)` makes a batch, `forward(model, batch)` gives its loss and its rewards or step
    logits, `step_loss(logits, labels)` a solution's loss. Under ZeRO-3 every forward pass is a collective, so the
    shards are padded to one length and the padded rows' records dropped."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    records = []
    with accelerator.split_between_processes(examples, apply_padding=sharded(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            chunk = shard[start : start + args.per_device_eval_batch_size]
            batch = {k: v.to(accelerator.device) for k, v in collate(chunk).items()}
            _, out = forward(unwrapped, batch)
            if args.objective == "outcome":
                for e, rc, rr in zip(chunk, out["r_chosen"].tolist(), out["r_rejected"].tolist()):
                    records.append(
                        {
                            "loss": -F.logsigmoid(torch.tensor(rc - rr - e["margin"])).item(),
                            "r_chosen": rc,
                            "r_rejected": rr,
                            "correct": rc > rr,
                            "confidence": e["confidence"],
                        }
                    )
            else:
                for logits, labels in zip(out["logits"], out["labels"]):
                    mask = labels != -100
                    right = ((logits[mask] > 0).long() == labels[mask]).tolist()
                    records.append(
                        {
                            "loss": step_loss(logits[None], labels[None]).item(),
                            "steps_right": sum(right),
                            "steps": len(right),
                        }
                    )
    records = gather_object(records[: shard_length(len(examples), accelerator)])  # without the padded rows
    n = len(records)
    metrics = {"eval/loss": sum(r["loss"] for r in records) / n}
    if args.objective == "outcome":
        metrics["eval/accuracy"] = sum(r["correct"] for r in records) / n
        metrics["eval/reward_chosen"] = sum(r["r_chosen"] for r in records) / n
        metrics["eval/reward_rejected"] = sum(r["r_rejected"] for r in records) / n
        metrics["eval/reward_margin"] = metrics["eval/reward_chosen"] - metrics["eval/reward_rejected"]
        by_conf = defaultdict(list)
        for r in records:
            if r["confidence"] is not None:
                by_conf[r["confidence"]].append(r["correct"])
        for conf, correct in sorted(by_conf.items()):
            metrics[f"eval/accuracy_confidence_{conf}"] = sum(correct) / len(correct)
    else:
        metrics["eval/step_accuracy"] = sum(r["steps_right"] for r in records) / sum(r["steps"] for r in records)
        metrics["eval/solution_accuracy"] = sum(r["steps_right"] == r["steps"] for r in records) / n
    return metrics


@torch.no_grad()
def reference_rewards(model, seqs: list[list[int]], args, accelerator: Accelerator, pad, reward) -> torch.Tensor:
    """(Reward model) Rewards `reward(model, ids, mask)` of the reference (SFT) responses `seqs`, batched by
    `pad(seqs) -> (ids, mask, labels)`, without the current bias, gathered from every process (the
    shards padded to one length under ZeRO-3, where every forward pass is a collective)."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    rewards = []
    with accelerator.split_between_processes(seqs, apply_padding=sharded(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            ids, mask, _ = pad(shard[start : start + args.per_device_eval_batch_size])
            r = reward(unwrapped, ids.to(accelerator.device), mask.to(accelerator.device))
            rewards.extend((r - getattr(unwrapped.config, "reward_bias", 0.0)).tolist())
    return torch.tensor(gather_object(rewards[: shard_length(len(seqs), accelerator)]))


def evaluate_math(
    sample,
    tokenizer,
    rows: list[dict],
    accelerator,
    k: int,
    temperature: float,
    answer_format: str,
    success_reward,
    extract_answer,
    kl=None,
    kl_batch: int = 1,
) -> tuple[dict, list[dict]]:
    """k completions per evaluation question (`rows` of `prompt_ids`, `prompt`, `gold`; `sample(prompts, temperature)`
    returns the completions; k = 1 and T = 0: greedy pass@1, `eval/accuracy`); with k > 1 pass@k (any of the k right),
    maj@k (the majority answer right) and mean@k. The script's `success_reward(text, gold, answer_format)` grades and
    its `extract_answer(text, answer_format)` gives the answer that votes; `kl(queries, mask)` (--eval-kl) gives
    KL(pi || pi_ref) per prompt, `kl_batch` prompts at a time (`eval/kl`). Each process takes a shard; under ZeRO-3
    the shards are padded to equal size (every forward pass is a collective) and the padded duplicates dropped
    after."""
    records = []
    with accelerator.split_between_processes(rows, apply_padding=sharded(accelerator)) as shard:
        completions = sample([r["prompt_ids"] for r in shard for _ in range(k)], temperature)[0] if shard else []
        for j, row in enumerate(shard):
            outs = completions[j * k : (j + 1) * k]
            texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
            correct = [success_reward(t, row["gold"], answer_format) for t in texts]
            keys = [vote_key(extract_answer(t, answer_format), answer_format) for t in texts]
            vote = majority_vote(keys)
            records.append(
                {
                    "question": row["prompt"],
                    "gold": row["gold"],
                    "completion": texts[0],
                    "correct": correct,
                    "maj_correct": vote is not None and correct[keys.index(vote)] == 1.0,
                    "length": sum(len(o) for o in outs) / k,
                    "eos": sum(tokenizer.eos_token_id in o for o in outs) / k,
                }
            )
        if kl is not None:  # (--eval-kl) KL(pi || pi_ref) of one sample per question
            for start in range(0, len(shard), kl_batch):
                queries, qmask = left_pad(
                    [r["prompt_ids"] for r in shard[start : start + kl_batch]], tokenizer.pad_token_id
                )
                kls = kl(queries.to(accelerator.device), qmask.to(accelerator.device))
                for rec, value in zip(records[start : start + kl_batch], kls):
                    rec["kl"] = value
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    n = len(records)
    if k == 1:
        metrics = {
            "eval/accuracy": sum(r["correct"][0] for r in records) / n,
            "eval/completion_length": sum(r["length"] for r in records) / n,
            "eval/eos_rate": sum(r["eos"] for r in records) / n,
        }
        if kl is not None:
            metrics["eval/kl"] = sum(r["kl"] for r in records) / n
        return metrics, records
    return {
        "eval/pass@k": sum(max(r["correct"]) for r in records) / n,
        "eval/maj@k": sum(r["maj_correct"] for r in records) / n,
        "eval/mean@k": sum(sum(r["correct"]) / k for r in records) / n,
        "eval/k": k,
    }, records


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
    with accelerator.split_between_processes(items, apply_padding=sharded(accelerator)) as shard:
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
    n = len(records)
    return {
        "eval/loss": sum(r[0] for r in records) / n,
        "eval/accuracy": sum(r[3] for r in records) / n,
        "eval/reward_chosen": sum(r[1] for r in records) / n,
        "eval/reward_rejected": sum(r[2] for r in records) / n,
        "eval/reward_margin": sum(r[1] - r[2] for r in records) / n,
    }


def evaluate_dpo(run, step: int, models: tuple, pairs: list, rows: list, args, accelerator, pieces: dict) -> dict:
    """dpo.py's evaluations after `step` optimizer steps, logged: the DPO loss and implicit-reward accuracy on held-out
    `pairs` (`evaluate_dpo_pairs`), and greedy responses to the evaluation prompts `rows` (`evaluate_responses`).
    `models`: (policy, reference, reward model, tokenizer); `pieces`: the script's functions by name
    (forward_logprobs, pair_losses, implicit_accuracy, truncate_response, outcome_reward)."""
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
        pad_id, outcome_reward = tokenizer.pad_token_id, pieces["outcome_reward"]

        def score(queries, responses):  # the reward model at the last real token, in the training precision
            seqs = torch.cat([queries, responses], 1)
            with accelerator.autocast():
                return outcome_reward(reward_model, seqs.masked_fill(seqs == pad_id, 0), (seqs != pad_id).long())

        score = score if reward_model is not None else None
        truncate, where = pieces["truncate_response"], (rows, args, accelerator)
        gen_metrics, records = evaluate_responses(policy, tokenizer, *where, truncate, score, ref_policy)
        metrics.update(gen_metrics)
        run.log_samples(records[:8], step)
    if metrics:  # --num-eval-pairs 0 and --num-eval-examples 0: nothing evaluated, nothing logged
        batch_pairs = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
        run.log(metrics, step, step * batch_pairs)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


@torch.no_grad()
def evaluate_responses(
    policy,
    tokenizer,
    rows: list[dict],
    args,
    accelerator: Accelerator,
    truncate: Callable,
    score: Callable | None = None,
    reference=None,
    correct: Callable | None = None,
    frozen: tuple = (),
) -> tuple[dict, list[dict]]:
    """Greedy responses (`generate`, up to `args.response_length` tokens, `args.per_device_eval_batch_size` prompts a
    batch) to the evaluation `rows` (from `prompts.prepare_prompts`), cut by the script's `truncate(responses, eos_id,
    pad_id)` (PAD after the end), and the means over every process of `eval/completion_length`, `eval/eos_rate`,
    `eval/score` (with `score(queries, responses)`, the reward model's score of each row), `eval/kl` (`--eval-kl` with a
    `reference`: `judges.sampled_kl`), and per `--eval-task`: tldr `eval/gold_reward` (`gold_judge`) and `eval/win_rate`
    against the reference response, gsm8k / boxed `eval/accuracy` (`correct(text, gold, answer_format)`). Also the
    records, one per row, with the response's text. `frozen`: the models besides the policy and the reference that
    `score` runs, switched with them to padded attention (`padded_attention`). Under ZeRO-3 the shards are padded to
    equal size (every forward pass is a collective) and the padded duplicates dropped."""
    pad_id, eos_id, synced = tokenizer.pad_token_id, tokenizer.eos_token_id, sharded(accelerator)
    with_kl = args.eval_kl and reference is not None
    # (LoRA) the reference is the policy itself with its adapters disabled, whose attention is switched with it
    ref_model = (reference.policy[0] if isinstance(reference, LoraReference) else reference) if with_kl else None
    policy.eval()
    records = []
    with accelerator.split_between_processes(rows, apply_padding=synced) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            queries, qmask = left_pad([r["prompt_ids"] for r in batch], pad_id)
            queries, qmask = queries.to(accelerator.device), qmask.to(accelerator.device)
            with padded_attention(policy, ref_model, *frozen):
                out = policy.generate(
                    input_ids=queries,
                    attention_mask=qmask,
                    max_new_tokens=args.response_length,
                    do_sample=False,
                    pad_token_id=pad_id,
                    eos_token_id=eos_id,
                    synced_gpus=synced,
                )
                responses = truncate(out[:, queries.shape[1] :], eos_id, pad_id)
                scores = score(queries, responses).tolist() if score is not None else None
                kls = None
                if with_kl:
                    kls = sampled_kl(policy, reference, queries, qmask, args.response_length, pad_id, eos_id, synced)
            for i, (row, resp) in enumerate(zip(batch, responses)):
                text = tokenizer.decode(resp, skip_special_tokens=True)
                rec = {"completion_length": int((resp != pad_id).sum()), "eos_rate": bool((resp == eos_id).any())}
                if scores is not None:
                    rec["score"] = scores[i]
                if kls is not None:
                    rec["kl"] = kls[i]
                if args.eval_task == "tldr":
                    gold, reference_gold = gold_judge(text, row["facts"]), gold_judge(row["reference"], row["facts"])
                    rec["gold_reward"] = gold
                    rec["win_rate"] = 1.0 if gold > reference_gold else 0.5 if gold == reference_gold else 0.0
                elif args.eval_task in ("gsm8k", "boxed"):
                    rec["accuracy"] = correct(text, row["gold"], args.answer_format)
                records.append({"response": text, **rec})
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    keys = [k for k in records[0] if k != "response"]
    return {f"eval/{k}": sum(r[k] for r in records) / len(records) for k in keys}, records
