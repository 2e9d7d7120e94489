"""ppo_rlhf.py's own plumbing: its flag checks and batch sizes, the prompts it loads, the pad ids it sets, `--resume`,
the statistics it logs and its evaluation harness. The algorithmic pieces (the reference response, answer parsing,
truncation, the reward model's score, the KL estimate, the math reward) come in as arguments. Nothing here changes a
number."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from clean_rlhf_utils.data import prepare_prompts
from clean_rlhf_utils.engines import LoraReference, zero3
from clean_rlhf_utils.evaluation import evaluate_greedy_responses, gold_judge
from clean_rlhf_utils.loading import load_split
from clean_rlhf_utils.runs import Run, updates_in_budget


def check_ppo_args(args) -> None:
    """PPO's own flags, checked before anything loads (`check_args` checks the shared ones): a one-line error."""
    for flag, value in (("--cliprange", args.cliprange), ("--cliprange-value", args.cliprange_value)):
        if value <= 0:
            raise SystemExit(f"error: {flag} is {value}; it must be above 0")
    for flag, value in (("--gamma", args.gamma), ("--lam", args.lam)):
        if not 0 <= value <= 1:
            raise SystemExit(f"error: {flag} is {value}; it must be in [0, 1]")
    if args.kl_coef < 0:
        raise SystemExit(
            f"error: --kl-coef is {args.kl_coef}; a negative coefficient rewards moving away from the reference policy"
        )
    if args.adaptive_kl and (args.target_kl <= 0 or args.kl_horizon < 1):
        raise SystemExit(
            f"error: --adaptive-kl needs --target-kl above 0 and --kl-horizon of at least 1 (now "
            f"{args.target_kl} and {args.kl_horizon})"
        )
    if args.reward_source == "model" and args.reward_model_path is None:
        raise SystemExit("error: --reward-source model needs --reward-model-path (or --reward-source math)")
    if args.prm_path is None and args.prm_refine != "none":
        raise SystemExit(
            f"error: --prm-refine {args.prm_refine} refines the rewards of a process reward model; pass --prm-path too"
        )


def batch_sizes(args, accelerator: Accelerator) -> tuple[int, int, int, int, bool]:
    """(minibatch, micro-batch, batch of all processes, updates, separate_backward), or a one-line error."""
    mini_batch_size = args.per_device_batch_size // args.num_mini_batches
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    if micro_batch_size * args.gradient_accumulation_steps * args.num_mini_batches != args.per_device_batch_size:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} does not split into "
            f"--num-mini-batches {args.num_mini_batches} x --gradient-accumulation-steps "
            f"{args.gradient_accumulation_steps} equal micro-batches"
        )
    batch_size, num_updates = updates_in_budget(args, accelerator.num_processes)
    separate_backward = (
        args.separate_backward
        if args.separate_backward is not None
        else accelerator.distributed_type == DistributedType.NO
    )
    if separate_backward and accelerator.distributed_type != DistributedType.NO:
        raise SystemExit(
            f"error: --separate-backward needs a plain single process; under {accelerator.distributed_type.value} the "
            "policy and value model are one engine that takes one backward pass per step (leave --separate-backward "
            "unset)"
        )
    return mini_batch_size, micro_batch_size, batch_size, num_updates, separate_backward


def load_prompts(args, tokenizer, config, reference_text, extract_answer) -> tuple[list[dict], list[dict]]:
    """The training and evaluation prompts (`data.prepare_prompts`, with the script's `reference_text` and
    `extract_answer`), every field checked now, before the first update."""
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    train_ds = load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    train_rows = prepare_prompts(
        train_ds,
        tokenizer,
        args,
        args.train_split,
        max_positions,
        False,
        reference_text,
        extract_answer,
        null_as_missing=True,
    )
    eval_ds = load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
    eval_ds = eval_ds.select(range(min(args.num_eval_examples, len(eval_ds))))
    eval_rows = prepare_prompts(
        eval_ds,
        tokenizer,
        args,
        args.eval_split,
        max_positions,
        True,
        reference_text,
        extract_answer,
        null_as_missing=True,
    )
    if len(train_rows) < args.per_device_batch_size:  # the endless loader would never yield a batch
        raise SystemExit(
            f"error: split '{args.train_split}' has {len(train_rows)} usable prompts, fewer than one "
            f"batch of --per-device-batch-size {args.per_device_batch_size}"
        )
    return train_rows, eval_rows


def set_pad_token_id(pad_id: int, generators: tuple, scorers: tuple) -> None:
    """The pad id for `generate` (the policy and reference) and for the classifiers' own forward, which refuses batches
    without one (the score is read by position)."""
    for m in generators:
        if m is not None:
            m.generation_config.pad_token_id = pad_id
    for m in scorers:
        if m is not None:
            m.config.pad_token_id = pad_id


def resume(run: Run, kl_ctl, iterator) -> tuple[int, dict | None]:
    """With `--resume`: the checkpoint's weights, optimizer and RNGs loaded (`Run.resume`), the adaptive KL coefficient
    restored and the prompts the finished updates drew replayed; returns (updates done, last evaluation). A new run:
    (0, None)."""
    state = run.resume()
    if not state:
        return 0, None
    if kl_ctl and state["kl_coef"] is not None:  # None: checkpointed without --adaptive-kl
        kl_ctl.value = state["kl_coef"]
    for _ in range(state["step"]):  # the loader's own generator, no compute
        next(iterator)
    return state["step"], state["metrics"]


STATISTICS = {  # `ppo_micro_batch`'s statistics, averaged over the micro-batches of every process
    "approxkl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "vf_clipfrac": "val/clipfrac_avg",
    "ratio": "val/ratio",
}


def statistics_to_log(per_row: dict, stats: list[dict], step_rewards, n_steps) -> dict:
    """The tensors whose means over every process are logged (`runs.log_global_means`): the rollout's `per_row`, the
    micro-batches' `stats` and the process rewards and steps, if any."""
    tensors = per_row | {name: torch.stack([s[k] for s in stats]) for k, name in STATISTICS.items()}
    if step_rewards is not None:
        tensors["objective/process_reward"] = step_rewards.sum(1)
        tensors["objective/num_steps"] = torch.tensor(n_steps, dtype=torch.float, device=step_rewards.device)
    return tensors


def log_evaluation(run: Run, accelerator: Accelerator, metrics: dict, step: int, episode: int, when: str) -> None:
    run.log(metrics, step, episode)
    accelerator.print(f"{when}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def evaluate_ppo(
    policy, reward_model, tokenizer, rows: list[dict], args, accelerator: Accelerator, reference, pieces: tuple
) -> dict:
    """Greedy responses to the evaluation prompts, truncated after EOS, scored by the reward model if any and the
    task's judge (`evaluation.evaluate_greedy_responses`); with `--eval-kl`, the sampled KL to the reference. `pieces`:
    the script's (truncate_response, padded_inputs, outcome_reward, sampled_kl, success_reward)."""
    truncate_response, padded_inputs, outcome_reward, sampled_kl, success_reward = pieces
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id

    def score(queries, responses):  # the reward model at the last real token, plus its bias (`outcome_reward`)
        inputs = padded_inputs(torch.cat([queries, responses], 1), pad_id)
        return outcome_reward(reward_model, inputs["input_ids"], inputs["attention_mask"]).tolist()

    def kl(queries, qmask):
        return sampled_kl(policy, reference, queries, qmask, args.response_length, pad_id, eos_id, zero3(accelerator))

    def judge(text: str, row: dict) -> dict:
        if args.eval_task == "tldr":
            gold, reference_gold = gold_judge(text, row["facts"]), gold_judge(row["reference"], row["facts"])
            return {
                "gold_reward": gold,
                "win_rate": 1.0 if gold > reference_gold else 0.5 if gold == reference_gold else 0.0,
            }
        if args.eval_task in ("gsm8k", "boxed"):
            return {"accuracy": success_reward(text, row["gold"], args.answer_format)}
        return {}

    with_kl = args.eval_kl and reference is not None
    # (LoRA) the reference is the policy itself, whose attention is switched with it
    frozen = reference.policy[0] if isinstance(reference, LoraReference) else reference
    return evaluate_greedy_responses(
        policy,
        tokenizer,
        rows,
        accelerator,
        args.per_device_eval_batch_size,
        args.response_length,
        truncate=lambda responses: truncate_response(responses, eos_id, pad_id),
        judge=judge,
        score=score if reward_model is not None else None,
        kl=kl if with_kl else None,
        frozen=(reward_model, frozen if with_kl else None),
    )
