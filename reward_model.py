"""Reward models: a Bradley-Terry outcome reward model, and a process reward model (PRM).

Outcome (`--objective outcome`, the default): the reward model of "Learning to summarize from human
feedback" (Stiennon et al. 2020) as reproduced in "The N+ Implementation Details of RLHF with PPO: A Case
Study on TL;DR Summarization" (Huang et al. 2024, arXiv:2403.17031). A scalar head on the SFT model reads
the reward at the last non-pad token of `prompt + response + EOS` (one EOS: appended unless the response already
ends with it, as the N+ responses, which end with the text `<|endoftext|>`, do), trained with the Bradley-Terry loss
`-log sigmoid(r_chosen - r_rejected)`; optionally with a margin (Touvron et al. 2023, Llama 2) and the
reward-centering term `coef * (r_chosen + r_rejected)^2` (Eisenstein et al. 2023, "Helping or Herding?"), averaged
over the pairs of the whole batch of an optimizer step (every micro-batch and process).
N+ details kept here:
  * The RM starts from the SFT model; the head `Linear(hidden, 1)` is initialised from N(0, 1/sqrt(hidden+1)).
  * The reward is read at the last non-pad token, located from the attention mask, and position ids come
    from the attention mask too, so the reward does not depend on the side padding is on.
  * Training and evaluation run on packed pairs (`--pack-pairs`, default; `pack_pairs`): no padding, and the prefix
    shared by the chosen and rejected sequences (the prompt) computed once, the rest of rejected masked off from the
    rest of chosen; the rewards equal those of the padded batch (tests check it), in about half the time on CPU.
  * After training the reward is normalised: the reference (SFT) responses are scored and the negated mean
    is stored as `config.reward_bias`, so that their mean reward is 0 (they are loaded and checked before training,
    so a wrong path fails at the start).
  * Real-track hyperparameters (N+ paper): learning rate 3e-6, 1 epoch, batch size 64; reported validation
    accuracies 0.628 / 0.669 / 0.689 for Pythia 1B / 2.8B / 6.9B.

Process (`--objective process`): a PRM scoring every reasoning step, as used in "On Designing Effective RL
Reward at Training Time for LLM Reasoning" (Gao et al. 2024) and trained like Math-Shepherd (Wang et al.
2024) on per-step binary labels: each step is followed by a separator token, the head's logit at that
token is the step's score, and the loss is binary cross-entropy against the step's correctness label, averaged over
the labelled steps of the whole batch of an optimizer step (every micro-batch and process), so a solution weighs by
its number of steps (a token-level mean, as in TRL's PRMTrainer, which trains the PRM as token classification).

The saved format, which every consumer (ppo_rlhf.py, grpo_math.py, ...) reads without importing this file:
  * the directory loads with `AutoModelForSequenceClassification.from_pretrained(path)` (num_labels = 1);
  * per-token scores are the `score` head's output at every position (what the model's forward computes
    before pooling), with position ids from the attention mask;
  * `config.reward_type` is "outcome" or "process"; `config.reward_bias` is added to every outcome
    reward; a PRM has `config.step_separator` (the text that ends every step, e.g. "\\n") and its step
    score is `sigmoid(logit at the separator)`, the probability that the step is correct.

Usage:
    python reward_model.py tiny-tldr --sft-model-path runs/<sft run>/model
    python reward_model.py tiny-math-prm --sft-model-path runs/<sft run>/model
    python reward_model.py tiny-tldr ... --resume  # continue a run stopped by SIGTERM / Ctrl-C, from its checkpoint
    accelerate launch --multi_gpu --num_processes 8 reward_model.py tldr-pythia-1b --sft-model-path ...
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from clean_rlhf_utils.args import DataArgs, ModelArgs, OptimArgs, RunArgs
from clean_rlhf_utils.data import chat_messages, end_with_eos, template_fields, whole_field_messages
from clean_rlhf_utils.engines import (
    backward_share,
    configure_deepspeed,
    cpu_threads,
    global_count,
    make_accelerator,
    peak_mem_gb,
    shard_length,
    zero3,
)
from clean_rlhf_utils.loading import ensure_pad_token, load_split, require_hub
from clean_rlhf_utils.runs import Run, check_args


@dataclass
class Args(OptimArgs, DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
    exp_name: str = "reward_model"
    """name of this experiment; the run name starts with it"""
    seed: int = 1
    """seed of the experiment (head init, data order)"""
    save_every: int = 0
    """write a checkpoint every N optimizer steps; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss)"""

    # ---- model ----
    sft_model_path: str = "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT model the reward model starts from: a hub name or a local directory"""
    revision: str | None = None
    """hub revision of the SFT model"""
    objective: Literal["outcome", "process"] = "outcome"
    """`outcome`: Bradley-Terry on preference pairs; `process`: per-step binary labels (PRM)"""

    # ---- data ----
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """preference pairs (outcome) or stepwise labels (process): hub name, `save_to_disk` folder, folder of
    `{split}.jsonl|json|parquet`, or one such file"""
    prompt_template: str = "{query}"
    """Python format string building the prompt from a row's fields (each must be text: a missing, null or list field
    is an error). A template that is one field alone (`{prompt}`) holding chat messages, TRL's conversational
    format [{"role": "user", "content": ...}], is rendered with the tokenizer's chat template, ready for the
    assistant's turn"""
    chosen_field: str = "chosen"
    """(outcome) field of the preferred response: text, or TRL's conversational [{"role": "assistant", "content": ...}]
    (with the prompt's messages in their own field); TRL's implicit-prompt format, the whole conversation in chosen and
    rejected, is refused with a message saying how to split it"""
    rejected_field: str = "rejected"
    """(outcome) field of the dispreferred response (as `chosen_field`)"""
    margin_field: str | None = None
    """(outcome) optional field with a per-pair margin m, making the loss -log sigmoid(r_c - r_r - m)"""
    confidence_field: str | None = None
    """(outcome) optional field whose values group the validation accuracy (OpenAI's labeller confidence); a dotted
    path reads a nested field (`extra.confidence` in the N+ data); rows where it is absent or null are not grouped"""
    steps_field: str = "completions"
    """(process) field with the list of step texts (TRL stepwise-supervision format)"""
    labels_field: str = "labels"
    """(process) field with one boolean per step, as many as the steps: is the step correct"""
    step_separator: str = "\n"
    """(process) text appended after every step; it must be one token, at which the step is scored"""
    max_length: int = 638
    """longest prompt + response + EOS in tokens (N+ preference data: 638 at most); longer rows are an error unless
    dropped"""
    pack_pairs: bool = True
    """(outcome) run the forward passes on packed pairs: no padding, and the prefix the chosen and rejected sequences
    share (the prompt) computed once; the rewards equal the padded batch's. False: the right-padded batch"""
    drop_overlong: bool = False
    """drop (and count) overlong rows instead of failing"""
    max_train_samples: int | None = None
    """use only the first N training rows (debugging)"""

    # ---- reward normalisation (outcome) ----
    normalize: bool = True
    """after training, set `config.reward_bias` so the mean reward of reference responses is 0 (N+); the reference
    responses are loaded and checked before training"""
    norm_dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """dataset with the reference (SFT) responses used for normalisation"""
    norm_split: str = "train"
    """split of the normalisation dataset"""
    norm_response_template: str = "{reference_response}"
    """format string of the reference response (the prompt uses `prompt_template`), or one field alone holding TRL's
    conversational completion [{"role": "assistant", "content": ...}]; one EOS ends it, appended unless it already ends
    with EOS. Every row is checked before training"""
    num_norm_examples: int = 1024
    """reference responses scored for the normalisation"""

    # ---- optimisation ----
    learning_rate: float = 3e-6
    """peak learning rate (N+: 3e-6)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    center_rewards_coef: float = 0.0
    """(outcome) weight of (r_chosen + r_rejected)^2, which keeps rewards centred at 0; 0 disables it"""
    num_train_epochs: int = 1
    """passes over the training split"""
    per_device_train_batch_size: int = 8
    """pairs (outcome) or solutions (process) per device per micro-batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step; the global batch is this x per-device batch x processes"""

    # ---- evaluation and logging ----
    eval_every: int = 100
    """evaluate every N optimizer steps (and at the end)"""
    num_eval_examples: int = 400
    """validation rows"""
    per_device_eval_batch_size: int = 32
    """rows per device at evaluation"""
    log_every: int = 10
    """log training metrics every N optimizer steps"""
    save_model: bool = True
    """save the final model and tokenizer to `runs/<run_name>/model` (safetensors)"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do. max_length 638: the N+ preference data's longest
# query + response pair member (queries at most 512 tokens, responses at most 169 with their EOS; shared/real-assets
# README); the normalisation's SFT references (at most 512 + 53 = 562 tokens) fit too. The labeller confidence is
# nested in N+ rows (`extra.confidence`, 1-9 or absent).
PRESETS = {
    "tldr-pythia-1b": (
        "N+ reward model on TL;DR preferences, Pythia 1B (8 GPUs)",
        Args(
            exp_name="rm_tldr_pythia-1b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr",
            add_pad_token=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            max_length=638,
            confidence_field="extra.confidence",
        ),
    ),
    "tldr-pythia-2.8b": (
        "N+ reward model, Pythia 2.8B (8 GPUs)",
        Args(
            exp_name="rm_tldr_pythia-2.8b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__sft__tldr",
            add_pad_token=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_length=638,
            confidence_field="extra.confidence",
        ),
    ),
    "tldr-pythia-6.9b": (
        "N+ reward model, Pythia 6.9B (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            exp_name="rm_tldr_pythia-6.9b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__sft__tldr",
            add_pad_token=True,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            max_length=638,
            confidence_field="extra.confidence",
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr Bradley-Terry RM on CPU (needs assets and a tiny-tldr SFT model)",
        Args(
            exp_name="rm_tiny-tldr",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/preference",
            norm_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            learning_rate=3e-4,
            warmup_ratio=0.05,
            per_device_train_batch_size=32,
            max_length=160,
            confidence_field="confidence",
            eval_every=50,
            num_norm_examples=512,
        ),
    ),
    "tiny-tldr-noisy": (
        "tiny-tldr RM on 1,000 noisy, length-biased labels (an imperfect proxy; its eval/accuracy is against gold)",
        Args(
            exp_name="rm_tiny-tldr-noisy",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr-noisy/preference",
            norm_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            learning_rate=3e-4,
            warmup_ratio=0.05,
            num_train_epochs=2,
            per_device_train_batch_size=32,
            max_length=160,
            eval_every=50,
            num_norm_examples=512,
        ),
    ),
    "tiny-math-prm": (
        "tiny-math process reward model on CPU (needs assets and a tiny-math SFT model)",
        Args(
            exp_name="prm_tiny-math",
            objective="process",
            sft_model_path="runs/sft_tiny-math__1/model",
            dataset_name_or_path="runs/assets/tiny-math/prm",
            eval_split="test",
            prompt_template="Question: {prompt}\nAnswer:\n",
            normalize=False,
            learning_rate=5e-4,
            warmup_ratio=0.05,
            num_train_epochs=6,
            per_device_train_batch_size=32,
            max_length=192,
            eval_every=125,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The reward-model math: small pure functions, each checked against hand-computed values in
# tests/test_reward_model.py
# --------------------------------------------------------------------------------------------------


def bradley_terry_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
    reduction: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2 per pair, averaged (or summed) over pairs."""
    diff = r_chosen - r_rejected - (margin if margin is not None else 0.0)
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (r_chosen + r_rejected) ** 2
    return losses.sum() if reduction == "sum" else losses.mean()


def process_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"] = "mean"
) -> torch.Tensor:
    """Binary cross-entropy between the step logits and the step labels, averaged (or summed) over the labelled steps;
    label -100 marks non-step tokens."""
    mask = labels != -100
    return F.binary_cross_entropy_with_logits(logits[mask], labels[mask].float(), reduction=reduction)


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token scalar scores (B, T) of a reward model saved as AutoModelForSequenceClassification: the
    `score` head applied to every hidden state. The model's own forward computes exactly these per-token
    scores before pooling them at one position; a forward hook on the head captures them. Going through the
    model's forward (not its backbone directly) keeps DistributedDataParallel's gradient all-reduce working
    when `model` is wrapped. Position ids follow the attention mask, so left and right padding give the
    same scores for the real tokens."""
    captured = {}
    head = getattr(model, "module", model).score  # DDP / DeepSpeed wrappers keep the model in `.module`
    handle = head.register_forward_hook(lambda module, inputs, output: captured.update(scores=output))
    try:
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        handle.remove()
    return captured["scores"].squeeze(-1).float()


def outcome_reward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward (B,) read at the last non-pad token of each row, whatever side the padding is on, plus
    the normalisation bias stored in the config."""
    scores = token_scores(model, input_ids, attention_mask)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask * positions).argmax(dim=1)
    bias = getattr(getattr(model, "module", model).config, "reward_bias", 0.0)
    return scores[torch.arange(len(scores), device=scores.device), last] + bias


def loss_units(batch: dict, objective: str) -> int:
    """What the training loss averages over in `batch`: its pairs (outcome) or its labelled steps (process)."""
    return len(batch["margin"]) if objective == "outcome" else int((batch["labels"] != -100).sum())


def micro_batch_loss(model, batch: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """One micro-batch of `main`: the loss summed over its pairs (outcome) or labelled steps (process) (`main`
    divides by their number in the whole batch, `global_count`, in `backward_share`), and the detached rewards or
    step logits."""
    if args.objective == "outcome":
        if "allowed" in batch:  # packed by `pack_pairs`
            rewards = packed_rewards(model, batch)
        else:
            rewards = outcome_reward(model, batch["input_ids"], batch["attention_mask"])
        r_chosen, r_rejected = rewards.chunk(2)
        loss = bradley_terry_loss(r_chosen, r_rejected, batch["margin"], args.center_rewards_coef, reduction="sum")
        return loss, {"r_chosen": r_chosen.detach(), "r_rejected": r_rejected.detach()}
    logits = token_scores(model, batch["input_ids"], batch["attention_mask"])
    loss = process_loss(logits, batch["labels"], reduction="sum")
    return loss, {"logits": logits.detach(), "labels": batch["labels"]}


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress if schedule == "linear" else 1.0

    return f


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


def main(args: Args) -> dict:
    # real epochs: `step_micro_batches` ends a step at the loader's end; the sync is set per step below
    accelerator = make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=False)
    if accelerator.device.type == "cpu":  # one BLAS pool per process, or the processes fight over cores
        torch.set_num_threads(args.num_threads or cpu_threads(accelerator.num_processes))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}"
    check_args(args)
    run = Run(args, accelerator, PRESETS)  # refuses a used run directory now, before anything loads
    set_seed(args.seed)

    # everything the run needs is loaded and checked before the first step: the tokenizer against the model, the
    # training, evaluation and normalisation data, row by row
    tokenizer = load_tokenizer(args.sft_model_path, args)
    positions = model_positions(load_config(args.sft_model_path, args))
    if args.use_chat_template and not tokenizer.chat_template:
        raise SystemExit(
            f"error: --use-chat-template: the tokenizer of --sft-model-path {args.sft_model_path} has no "
            "chat template; drop the flag"
        )
    tokenize = tokenize_pairs if args.objective == "outcome" else tokenize_steps
    train_rows = load_split(args.dataset_name_or_path, args.train_split)
    if args.max_train_samples:
        train_rows = train_rows.select(range(min(args.max_train_samples, len(train_rows))))
    train = tokenize(train_rows, tokenizer, args, args.train_split, positions)
    eval_rows = load_split(args.dataset_name_or_path, args.eval_split)
    evals = tokenize(
        eval_rows.select(range(min(args.num_eval_examples, len(eval_rows)))),
        tokenizer,
        args,
        args.eval_split,
        positions,
    )
    if args.confidence_field and args.objective == "outcome" and all(e["confidence"] is None for e in evals):
        accelerator.print(
            f"warning: no evaluation row has a value at --confidence-field {args.confidence_field!r}; "
            "the accuracy by confidence will not be logged"
        )
    normalize = args.objective == "outcome" and args.normalize
    references = tokenize_references(tokenizer, args, positions) if normalize else None

    model = load_model(args, tokenizer)
    if args.pack_pairs and model.config._attn_implementation not in ("eager", "sdpa"):
        raise SystemExit(
            f"error: --pack-pairs hands the attention a 4D mask, which {model.config._attn_implementation} attention "
            "does not "
            "take; pass --no-pack-pairs (or use sdpa / eager attention)"
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    # N+: the head starts from N(0, 1/sqrt(hidden + 1)), so initial rewards are small but not all zero. Under ZeRO-3 the
    # head is partitioned (an empty tensor on each rank): gather it, let rank 0 draw it, and share its draw
    if zero3(accelerator):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.score.parameters()), modifier_rank=0)
    else:
        gathered = contextlib.nullcontext()
    with gathered:
        torch.nn.init.normal_(model.score.weight, std=1.0 / math.sqrt(model.config.hidden_size + 1))
        if getattr(model.score, "bias", None) is not None:
            torch.nn.init.zeros_(model.score.bias)
    model.config.reward_type = args.objective
    model.config.reward_bias = 0.0
    if args.objective == "process":
        model.config.step_separator = args.step_separator
    for module in model.modules():  # N+: dropout off
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=lambda b: collate(b, tokenizer.pad_token_id, args.objective, args.pack_pairs),
        drop_last=True,
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    configure_deepspeed(accelerator, None, args.max_grad_norm)  # micro-batch: the loader's
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the loader's last, possibly partial, accumulation steps the optimizer too (`step_micro_batches`)
    total_steps = math.ceil(len(loader) / args.gradient_accumulation_steps) * args.num_train_epochs
    if total_steps == 0:
        raise SystemExit(
            f"error: {len(train)} training rows make no full batch of "
            f"{args.per_device_train_batch_size} x {accelerator.num_processes} processes "
            "(--per-device-train-batch-size)"
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, int(args.warmup_ratio * total_steps), total_steps)
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    batch_episodes = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    run.begin()
    accelerator.print(
        f"run {args.run_name}: {args.objective} reward model, {len(train)} training rows, {total_steps} steps"
    )

    step, running, losses, n_micro, n_steps, t_last, metrics = 0, defaultdict(list), [], 0, 0, time.time(), {}
    if state := run.resume():  # the loop's counters; the data position is replayed below
        mine = state["running"][accelerator.process_index]
        losses = [torch.tensor(v) for v in mine["losses"]]
        running = defaultdict(list, {k: [torch.tensor(v) for v in values] for k, values in mine["running"].items()})
        n_micro, n_steps, metrics = state["n_micro"], state["n_steps"], state["metrics"]
    progress = tqdm(
        total=total_steps,
        initial=state["step"] if state else 0,
        disable=not accelerator.is_main_process,
        desc=f"{args.objective} rm",
    )
    grad_norm = None
    for epoch in range(args.num_train_epochs):
        for micro in step_micro_batches(loader, args.gradient_accumulation_steps):
            if state and step < state["step"]:  # replay the data order up to the checkpoint, without training
                step += 1
                continue
            before = (step, len(losses), n_micro, n_steps)  # for a checkpoint after a non-finite loss
            # the loss is the mean over the pairs (outcome) or labelled steps (process) of the whole step: every
            # micro-batch and process (a process's solutions hold different numbers of steps)
            total = global_count(sum(loss_units(b, args.objective) for b in micro), accelerator)
            # `accumulate` syncs when its count of micro-batches reaches the accumulation steps: on this step's last
            accelerator.step = args.gradient_accumulation_steps - len(micro)
            for batch in micro:
                with accelerator.accumulate(model):
                    loss_sum, out = micro_batch_loss(model, batch, args)
                    if not run.all_finite(loss_sum):
                        run.stop(
                            rm_loop_state(*before, losses, running, metrics, batch_episodes),
                            f"non-finite reward-model loss at step {step + 1}: lower --learning-rate (now "
                            f"{args.learning_rate:g}) or check the data",
                        )
                    backward_share(accelerator, loss_sum, total)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                            run.stop(
                                rm_loop_state(*before, losses, running, metrics, batch_episodes),
                                f"non-finite gradient norm at step {step + 1}: lower --learning-rate (now "
                                f"{args.learning_rate:g})",
                            )
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss_sum.detach() / max(total, 1.0))  # summed over micro-batches and processes: the mean
                if args.objective == "outcome":
                    running["train/accuracy"].append((out["r_chosen"] > out["r_rejected"]).float().mean())
                    running["train/reward_margin"].append((out["r_chosen"] - out["r_rejected"]).mean())
            n_micro, n_steps = n_micro + len(micro), n_steps + 1
            scheduler.step()
            step += 1
            progress.update(1)
            if step % args.log_every == 0 or step == total_steps:
                now = time.time()
                logged = {k: accelerator.gather(torch.stack(v).mean()[None]).mean().item() for k, v in running.items()}
                # the mean over the logged steps of each step's mean (every micro-batch and process)
                logged["train/loss"] = accelerator.gather(torch.stack(losses).sum()[None]).sum().item() / n_steps
                logged.update(
                    {
                        "lr": scheduler.get_last_lr()[0],
                        "epoch": epoch,
                        "perf/episodes_per_sec": batch_episodes
                        * n_micro
                        / args.gradient_accumulation_steps
                        / (now - t_last),
                        "perf/peak_mem_gb": peak_mem_gb(accelerator.device),
                    }
                )
                if grad_norm is not None:  # DeepSpeed clips inside its own step and may report no norm
                    logged["train/grad_norm"] = float(grad_norm)
                run.log(logged, step, step * batch_episodes)
                progress.set_postfix(loss=f"{logged['train/loss']:.3f}")
                running, losses, n_micro, n_steps, t_last = defaultdict(list), [], 0, 0, now
            if step % args.eval_every == 0 or step == total_steps:
                metrics = evaluate(model, evals, tokenizer, args, accelerator)
                run.log(metrics, step, step * batch_episodes)
                accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                t_last = time.time()
            if run.stop_requested():
                run.stop(rm_loop_state(step, len(losses), n_micro, n_steps, losses, running, metrics, batch_episodes))
            if args.save_every and step % args.save_every == 0 and step < total_steps:
                run.checkpoint(
                    rm_loop_state(step, len(losses), n_micro, n_steps, losses, running, metrics, batch_episodes)
                )
    progress.close()

    if normalize:  # after the last step, also on a resumed run (the loop only checkpoints up to the last step)
        raw = reference_rewards(model, references, tokenizer, args, accelerator)
        accelerator.unwrap_model(model).config.reward_bias = -raw.mean().item()
        bias = accelerator.unwrap_model(model).config.reward_bias
        after = reference_rewards(model, references, tokenizer, args, accelerator) + bias
        metrics["eval/reward_bias"] = -raw.mean().item()
        metrics["eval/reference_reward_mean"] = after.mean().item()
        normalisation = {k: metrics[k] for k in ("eval/reward_bias", "eval/reference_reward_mean")}
        run.log(normalisation, step, step * batch_episodes)
        accelerator.print(
            f"normalised: reward_bias {metrics['eval/reward_bias']:.4f}, reference mean reward now "
            f"{metrics['eval/reference_reward_mean']:.2e}"
        )

    run.finish(
        model,
        tokenizer,
        {
            "step": step,
            "episode": step * batch_episodes,
            "total_steps": total_steps,
            "total_episodes": total_steps * batch_episodes,
        },
    )
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# Plumbing: loading, engines, data, sampling, evaluation, durable runs (copied helpers are kept equal
# across scripts by tests/test_conventions.py)
# --------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Offline-first loading (same helpers as every script of this repository)
# ----------------------------------------------------------------------------------------------------


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def load_config(name_or_path: str, args: Args):
    """The model config of `--sft-model-path` (read before the weights: the positions bound every row's length)."""
    local = os.path.isdir(name_or_path)
    if not local:
        require_hub(name_or_path, "model", "--sft-model-path")
    try:
        return AutoConfig.from_pretrained(
            name_or_path, revision=args.revision, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # no or a broken config.json, an unknown model type
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: --sft-model-path {name_or_path} holds no model config that transformers can load: {reason}"
        ) from None


def load_tokenizer(name_or_path: str, args: Args):
    """The SFT model's tokenizer, with a pad token distinct from EOS (`ensure_pad_token`). A directory without tokenizer
    files, or whose tokenizer has far fewer tokens than the model's embedding has rows, is refused in one line: from
    such a directory (a model/ whose save was killed after the weights, or a copy without its tokenizer) transformers
    builds a tokenizer of a few tokens from the model type alone, and every text would become unknown tokens."""
    flag, local = "--sft-model-path", os.path.isdir(name_or_path)
    config = load_config(name_or_path, args)
    if local and not any((Path(name_or_path) / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(
            f"error: {flag} {name_or_path} holds no tokenizer (no {', '.join(TOKENIZER_FILES[:3])}, ...): "
            "was its save interrupted? Pass a complete model directory (weights and tokenizer)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(
            name_or_path, revision=args.revision, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing or truncated tokenizer files
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: {flag} {name_or_path} holds no tokenizer that transformers can load: {reason}"
        ) from None
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab and len(tok) < vocab // 2:
        raise SystemExit(
            f"error: the tokenizer of {flag} {name_or_path} has {len(tok)} tokens for a model "
            f"embedding of {vocab} rows: its tokenizer files are incomplete (was its save interrupted?); "
            "pass a complete model directory (weights and tokenizer)"
        )
    return ensure_pad_token(tok, args.add_pad_token, name_or_path)


def load_model(args: Args, tokenizer):
    """The SFT model with a one-label score head (AutoModelForSequenceClassification), its embedding grown for an added
    `[PAD]`; a directory whose weights cannot be loaded is a one-line error naming it and the flag."""
    local = os.path.isdir(args.sft_model_path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            args.sft_model_path,
            num_labels=1,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
            local_files_only=local,
            dtype=getattr(torch, args.dtype),
        )
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # no weights, truncated safetensors, mismatched shapes
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: --sft-model-path {args.sft_model_path} cannot be loaded as a reward model "
            f"(AutoModelForSequenceClassification): {reason}"
        ) from None
    if len(tokenizer) > model.config.vocab_size:  # not the weight's shape: ZeRO-3 partitions it (shape 0)
        model.resize_token_embeddings(len(tokenizer))
    return model


# ----------------------------------------------------------------------------------------------------
# Engines: one process, DDP, DeepSpeed ZeRO-2/3 and FSDP, all through `accelerate launch` (helpers copied
# verbatim between scripts), and the tokenizer checks
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def render(template: str, row: dict, where: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the row (`where`), the field and the flag, never a silent `None` or
    `[...]` in the text."""
    for name in template_fields(template, flag):
        if name not in row:
            chat = [k for k, v in row.items() if chat_messages(v)]
            hint = f"; for TRL's conversational format pass {flag} '{{{chat[0]}}}'" if chat else ""
            raise SystemExit(
                f"error: {where} has no field '{name}' used by the {what} template ({flag} {template!r}); "
                f"its fields are {sorted(row)}{hint}"
            )
        value = row[name]
        if value is None:
            raise SystemExit(
                f"error: {where}: field '{name}' of the {what} ({flag} {template!r}) is null; fill it in "
                "or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: {where}: field '{name}' holds chat messages, which a text template cannot hold; "
                f"pass {flag} '{{{name}}}' alone to render them with the tokenizer's chat template"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SystemExit(
                f"error: {where}: field '{name}' of the {what} ({flag} {template!r}) is a "
                f"{type(value).__name__}, not text: {str(value)[:60]!r}"
            )
    try:
        text = template.format(**row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: {where}: {flag} {template!r} cannot be filled in: {e}") from None
    if not text.strip():
        raise SystemExit(f"error: {where} renders an empty {what} ({flag} {template!r})")
    return text


def prompt_token_ids(row: dict, where: str, tokenizer, args: Args) -> list[int]:
    """The prompt of a row as token ids: `--prompt-template` filled in (wrapped as a user message with
    `--use-chat-template`), or, where the template is one field holding chat messages (TRL's conversational format,
    {"prompt": [{"role": "user", "content": ...}], ...}), those messages in the tokenizer's chat template, ready for
    the assistant's turn."""
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render(args.prompt_template, row, where, "prompt", "--prompt-template")
        if not args.use_chat_template:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": prompt}]
    elif messages[-1]["role"] == "assistant":
        raise SystemExit(
            f"error: {where}: the chat messages of --prompt-template {args.prompt_template!r} end with an "
            "assistant turn; the prompt ends before the response: give the prompt's messages only and the "
            "responses in their own fields (TRL's conversational prompt/chosen/rejected format)"
        )
    if not tokenizer.chat_template:
        raise SystemExit(
            f"error: the tokenizer of --sft-model-path {args.sft_model_path} has no chat template, so the "
            f"chat messages of {where} (or --use-chat-template) cannot be rendered; give plain-text "
            "prompts"
        )
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def response_text(row: dict, where: str, name: str, flag: str) -> str:
    """A response of a row (chosen, rejected, or the normalisation's reference): the field's text, or the assistant
    turn of TRL's conversational format ({"prompt": [user messages], "chosen": [{"role": "assistant", "content": ...}],
    ...}). A missing, null, empty or non-text field, or a whole conversation (TRL's implicit-prompt format, the prompt
    repeated in both responses), is a one-line error naming the row, the field and the flag."""
    if name not in row:
        raise SystemExit(f"error: {where} has no field '{name}' ({flag}); its fields are {sorted(row)}")
    value = row[name]
    if value is None:
        raise SystemExit(f"error: {where}: field '{name}' ({flag}) is null; fill it in or drop the row")
    if chat_messages(value):
        if any(m["role"] != "assistant" for m in value):
            raise SystemExit(
                f"error: {where}: field '{name}' ({flag}) holds a whole conversation (roles "
                f"{[m['role'] for m in value]}), TRL's implicit-prompt format; give the prompt's messages "
                "in their own field (--prompt-template '{prompt}') and only the assistant's turn in the "
                "response fields (TRL's conversational prompt/chosen/rejected format)"
            )
        value = "\n".join(m["content"] for m in value)
    elif not isinstance(value, str):
        raise SystemExit(
            f"error: {where}: field '{name}' ({flag}) is a {type(value).__name__}, not text: {str(value)[:60]!r}"
        )
    if not value.strip():
        raise SystemExit(f"error: {where}: field '{name}' ({flag}) is empty; it must be a non-empty string")
    return value


def lookup(row: dict, path: str):
    """The value at a dotted path (`extra.confidence` is row["extra"]["confidence"]); None where a level is absent."""
    value = row
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def margin_value(row: dict, where: str, args: Args) -> float:
    """The pair's `--margin-field` (0 without the flag): a finite number, or a one-line error."""
    if not args.margin_field:
        return 0.0
    value = row.get(args.margin_field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        got = "no such field" if args.margin_field not in row else repr(value)[:60]
        raise SystemExit(
            f"error: {where}: the margin (--margin-field {args.margin_field}) must be a finite number; got {got}"
        )
    return float(value)


def model_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover (None when its config does not say)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_length(ids: list[int], args: Args, where: str, positions: int | None = None) -> bool:
    """Whether a sequence fits `--max-length` and the model's positions; too long is an error, or False (drop the row)
    with `--drop-overlong`."""
    if len(ids) <= args.max_length and (positions is None or len(ids) <= positions):
        return True
    if args.drop_overlong:
        return False
    if len(ids) > args.max_length:
        raise SystemExit(
            f"error: {where} is {len(ids)} tokens long; the limit is --max-length {args.max_length}. "
            "Raise it or pass --drop-overlong."
        )
    raise SystemExit(
        f"error: {where} is {len(ids)} tokens long, more than the {positions} positions of "
        f"--sft-model-path (max_position_embeddings); lower --max-length (now {args.max_length}) to at "
        "most that and pass --drop-overlong"
    )


def tokenize_pairs(ds: Dataset, tokenizer, args: Args, split: str, positions: int | None = None) -> list[dict]:
    """prompt + response + one EOS (`end_with_eos`) for the chosen and the rejected response of every pair, every field
    checked now (`prompt_token_ids`, `response_text`, `margin_value`). A pair longer than `--max-length` or the
    model's `positions` is an error (or dropped with `--drop-overlong`); so is a split whose every pair has chosen =
    rejected."""
    out, dropped, same = [], 0, 0
    for i, row in enumerate(ds):
        where = f"row {i} of split '{split}'"
        responses = [
            response_text(row, where, name, flag)
            for name, flag in ((args.chosen_field, "--chosen-field"), (args.rejected_field, "--rejected-field"))
        ]
        prompt_ids = prompt_token_ids(row, where, tokenizer, args)
        encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
        ids = {
            key: prompt_ids + end_with_eos(e, tokenizer.eos_token_id) for key, e in zip(("chosen", "rejected"), encoded)
        }
        margin = margin_value(row, where, args)
        if not all(check_length(ids[key], args, where, positions) for key in ("chosen", "rejected")):
            dropped += 1
            continue
        confidence = lookup(row, args.confidence_field) if args.confidence_field else None
        same += ids["chosen"] == ids["rejected"]
        out.append({**ids, "margin": margin, "confidence": confidence})
    if dropped:
        print(f"dropped {dropped} of {len(ds)} pairs of '{split}' longer than --max-length or the model's positions")
    if not out:
        raise SystemExit(f"error: no usable pairs in split '{split}'")
    if same == len(out):
        raise SystemExit(
            f"error: every pair of split '{split}' has the same chosen and rejected response "
            f"(--chosen-field '{args.chosen_field}', --rejected-field '{args.rejected_field}'): there is "
            "no preference to learn; check the two fields"
        )
    return out


def tokenize_steps(ds: Dataset, tokenizer, args: Args, split: str, positions: int | None = None) -> list[dict]:
    """prompt, then every step followed by the separator token; the separator carries the step's label, every other
    position the label -100 (TRL's stepwise-supervision format: `completions`, a list of step texts, and `labels`, one
    boolean per step). A missing, null or mistyped field, or labels that do not match the steps one to one, is a
    one-line error naming the row and the flag."""
    sep = tokenizer(args.step_separator, add_special_tokens=False)["input_ids"]
    if len(sep) != 1:
        raise SystemExit(
            f"error: the step separator {args.step_separator!r} is {len(sep)} tokens; it must be exactly one"
        )
    out, dropped = [], 0
    for i, row in enumerate(ds):
        where = f"row {i} of split '{split}'"
        ids = prompt_token_ids(row, where, tokenizer, args)
        labels = [-100] * len(ids)
        fields = []
        for name, flag, what in (
            (args.steps_field, "--steps-field", "step texts"),
            (args.labels_field, "--labels-field", "booleans, one per step"),
        ):
            if name not in row:
                raise SystemExit(f"error: {where} has no field '{name}' ({flag}); its fields are {sorted(row)}")
            if not isinstance(row[name], list) or not row[name]:
                raise SystemExit(
                    f"error: {where}: field '{name}' ({flag}) must be a non-empty list of {what}, got "
                    f"{str(row[name])[:60]!r}"
                )
            fields.append(row[name])
        steps, step_labels = fields
        if len(steps) != len(step_labels):
            raise SystemExit(
                f"error: {where} has {len(steps)} steps but {len(step_labels)} labels (--steps-field "
                f"'{args.steps_field}', --labels-field '{args.labels_field}'): give one label per step"
            )
        for k, (step, label) in enumerate(zip(steps, step_labels)):
            if not isinstance(step, str) or not step.strip():
                raise SystemExit(
                    f"error: {where}: step {k} of field '{args.steps_field}' (--steps-field) is "
                    f"{repr(step)[:60]}, not a non-empty text"
                )
            if not (isinstance(label, (bool, int, float)) and label in (0, 1)):  # a column of numbers reads 0 / 1
                raise SystemExit(
                    f"error: {where}: label {k} of field '{args.labels_field}' (--labels-field) is "
                    f"{repr(label)[:60]}, not a boolean (is step {k} correct)"
                )
            step_ids = tokenizer(step, add_special_tokens=False)["input_ids"]
            ids += step_ids + sep
            labels += [-100] * len(step_ids) + [int(label)]
        if not check_length(ids, args, where, positions):
            dropped += 1
            continue
        out.append({"input_ids": ids, "labels": labels})
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} solutions of '{split}' longer than --max-length or the model's positions"
        )
    if not out:
        raise SystemExit(f"error: no usable solutions in split '{split}'")
    return out


def right_pad(seqs: list[list[int]], pad_id: int, fill_labels: list[list[int]] | None = None):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        if fill_labels is not None:
            labels[i, : len(s)] = torch.tensor(fill_labels[i])
    return ids, mask, labels


def collate(batch: list[dict], pad_id: int, objective: str, pack: bool = False) -> dict[str, torch.Tensor]:
    margin = torch.tensor([b["margin"] for b in batch]) if objective == "outcome" else None
    if objective == "outcome" and pack:
        return {**pack_pairs([b["chosen"] for b in batch], [b["rejected"] for b in batch], pad_id), "margin": margin}
    if objective == "outcome":  # chosen rows first, then rejected rows: one forward pass for both
        ids, mask, _ = right_pad([b["chosen"] for b in batch] + [b["rejected"] for b in batch], pad_id)
        return {"input_ids": ids, "attention_mask": mask, "margin": margin}
    ids, mask, labels = right_pad([b["input_ids"] for b in batch], pad_id, [b["labels"] for b in batch])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------------------------------
# Logging, evaluation, normalisation
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, examples: list[dict], tokenizer, args: Args, accelerator: Accelerator) -> dict:
    """Outcome: pairwise accuracy (overall and by confidence), mean chosen/rejected reward and margin.
    Process: per-step accuracy (sigmoid(logit) > 0.5 against the label), and the share of solutions whose
    every step is classified right. Under ZeRO-3 every forward pass is a collective, so the shards are padded to one
    length and the padded rows' records dropped."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    records = []
    with accelerator.split_between_processes(examples, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            chunk = shard[start : start + args.per_device_eval_batch_size]
            batch = {
                k: v.to(accelerator.device)
                for k, v in collate(chunk, tokenizer.pad_token_id, args.objective, args.pack_pairs).items()
            }
            _, out = micro_batch_loss(unwrapped, batch, args)
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
                            "loss": process_loss(logits[None], labels[None]).item(),
                            "steps_right": sum(right),
                            "steps": len(right),
                        }
                    )
    records = gather_object(records[: shard_length(len(examples), accelerator)])  # without the padded rows
    model.train()
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


def tokenize_references(tokenizer, args: Args, positions: int | None = None) -> list[list[int]]:
    """prompt + reference response + one EOS for the normalisation, loaded and checked before training (a wrong path,
    a missing, null or non-text field, an overlong row), so that a bad normalisation dataset fails at the start, not
    after the whole run. The prompt is built as the training prompts are (`--prompt-template`); the reference is
    `--norm-response-template` filled in, or the assistant turn of a conversational completion field."""
    flag = "--norm-dataset-name-or-path"
    ds = load_split(args.norm_dataset_name_or_path, args.norm_split, flag=flag)
    ds = ds.select(range(min(args.num_norm_examples, len(ds))))
    seqs, dropped = [], 0
    for i, row in enumerate(ds):
        where = f"row {i} of split '{args.norm_split}' of {flag} {args.norm_dataset_name_or_path}"
        prompt_ids = prompt_token_ids(row, where, tokenizer, args)
        messages = whole_field_messages(args.norm_response_template, row)
        if messages is None:
            response = render(args.norm_response_template, row, where, "reference response", "--norm-response-template")
        else:
            response = response_text({"reference": messages}, where, "reference", "--norm-response-template")
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        seq = prompt_ids + end_with_eos(response_ids, tokenizer.eos_token_id)
        if check_length(seq, args, where, positions):
            seqs.append(seq)
        else:
            dropped += 1
    if dropped:
        print(f"dropped {dropped} of {len(ds)} reference responses longer than --max-length or the model's positions")
    if not seqs:
        raise SystemExit(
            f"error: split '{args.norm_split}' of {flag} {args.norm_dataset_name_or_path} has no rows to "
            "normalise the reward with"
        )
    return seqs


@torch.no_grad()
def reference_rewards(model, seqs: list[list[int]], tokenizer, args: Args, accelerator: Accelerator) -> torch.Tensor:
    """Rewards of the reference (SFT) responses `seqs`, without the current bias, gathered from every process (the
    shards padded to one length under ZeRO-3, where every forward pass is a collective)."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    rewards = []
    with accelerator.split_between_processes(seqs, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            ids, mask, _ = right_pad(shard[start : start + args.per_device_eval_batch_size], tokenizer.pad_token_id)
            r = outcome_reward(unwrapped, ids.to(accelerator.device), mask.to(accelerator.device))
            rewards.extend((r - getattr(unwrapped.config, "reward_bias", 0.0)).tolist())
    return torch.tensor(gather_object(rewards[: shard_length(len(seqs), accelerator)]))


def step_micro_batches(loader: Iterable, gradient_accumulation_steps: int) -> Iterator[list]:
    """One pass over `loader` as the micro-batches of each optimizer step: `gradient_accumulation_steps` of them, the
    last step shorter when the loader's length is no multiple of that (a real epoch ends there). A step's micro-batches
    are drawn before its first backward pass, so its loss can be averaged over all of them."""
    batches = iter(loader)
    while micro := list(itertools.islice(batches, gradient_accumulation_steps)):
        yield micro


# ----------------------------------------------------------------------------------------------------
# Durable runs: the run directory, checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the
# argument checks (copied verbatim between scripts; tests/test_faults.py)
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# The script's own argument checks and loop state
# ----------------------------------------------------------------------------------------------------


def rm_loop_state(
    step: int,
    n_running: int,
    n_micro: int,
    n_steps: int,
    losses: list,
    running: dict,
    metrics: dict,
    batch_episodes: int,
) -> dict:
    """What the loop carries between steps, for a checkpoint after `step`: the counters, the last evaluation, and
    every process's running losses and accuracies since the last log (the first `n_running` of each), gathered so the
    main process saves them."""
    mine = {
        "losses": [v.item() for v in losses[:n_running]],
        "running": {k: [v.item() for v in values[:n_running]] for k, values in running.items()},
    }
    return {
        "step": step,
        "episode": step * batch_episodes,
        "n_micro": n_micro,
        "n_steps": n_steps,
        "metrics": metrics,
        "running": gather_object([mine]),
    }


# --------------------------------------------------------------------------------------------------
# Speed work (skippable on a first reading): the same results, faster
# --------------------------------------------------------------------------------------------------


def pack_pairs(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> dict:
    """A padding-free batch of preference pairs for one forward pass. Why: in a right-padded batch of prompt + response
    rows about a quarter of the tokens are padding, and chosen and rejected repeat the same prompt, often most of the
    tokens; the matmuls, most of a step's time, scale with the tokens. A causal model computes the same hidden states
    for a shared prefix whatever follows it, so each pair is laid out once as [common prefix, rest of chosen, rest of
    rejected] (the prefix is capped so both rests keep at least their last token, where the reward is read). The rest
    of rejected sees the prefix and itself but not the chosen tokens, and its position ids continue from the prefix,
    so every token sees exactly what it sees in its own padded row. Pairs are laid end to end in rows of at most
    `capacity` tokens (first-fit, longest first; twice the longest sequence packed best on CPU: the attention and
    mask cost grow with the row length). `allowed` (rows, W, W) says which key each query may attend to (block-
    diagonal per pair, causal, rejected not seeing chosen); `rows`, `cols` (2N,) locate the last token of each
    sequence, chosen sequences first, then rejected ones, as in the padded batch."""
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


def packed_rewards(model, packed: dict) -> torch.Tensor:
    """Rewards (2N,) of a `pack_pairs` batch, chosen first, read from the `score` head's per-token output as
    `token_scores` does (a hook, so the call goes through the possibly DDP-wrapped model), plus the stored bias.
    The mask goes in as a 4D additive mask, which transformers hands to the attention as is (eager and sdpa
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


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
