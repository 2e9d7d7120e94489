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
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification

from clean_rlhf_utils.args import DataArgs, ModelArgs, RunArgs
from clean_rlhf_utils.data import chat_messages, chat_prompt_ids, end_with_eos, whole_field_messages
from clean_rlhf_utils.engines import configure_deepspeed, global_count, zero3
from clean_rlhf_utils.evaluation import evaluate_reward_model, reference_rewards
from clean_rlhf_utils.loading import (
    check_tokenizer_fits,
    load_checked_tokenizer,
    load_config,
    load_pretrained,
    load_split,
    load_train_and_eval_rows,
    model_positions,
)
from clean_rlhf_utils.metrics import training_metrics
from clean_rlhf_utils.packing import check_pair_packing, pack_reward_pairs, packed_pair_rewards
from clean_rlhf_utils.prompts import render
from clean_rlhf_utils.runs import cli, loop_state, one_error_line, start_run


@dataclass
class Args(DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
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
    """peak learning rate (N+: 3e-6) (range: > 0)"""
    adam_eps: float = 1e-5
    """AdamW epsilon (N+: 1e-5) (range: > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm: a negative one ascends the gradient, 0 stops learning (range: > 0)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0 (range: [0, 1))"""
    weight_decay: float = 0.0
    """AdamW weight decay (range: >= 0)"""
    center_rewards_coef: float = 0.0
    """(outcome) weight of (r_chosen + r_rejected)^2, which keeps rewards centred at 0; 0 disables it (range: >= 0)"""
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

    OUTCOME, PROCESS = (
        (lambda a: a.objective == "outcome", "--objective outcome"),
        (lambda a: a.objective == "process", "--objective process"),
    )
    NEEDS = {  # the flags that act only with another, refused before anything loads (clean_rlhf_utils/args.py NEEDS)
        **dict.fromkeys(
            ["chosen_field", "rejected_field", "margin_field", "confidence_field", "pack_pairs", "center_rewards_coef"],
            OUTCOME,
        ),
        **dict.fromkeys(["steps_field", "labels_field", "step_separator"], PROCESS),
    }


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do. max_length 638: the N+ preference data's longest
# query + response pair member (queries at most 512 tokens, responses at most 169 with their EOS; shared/real-assets
# README); the normalisation's SFT references (at most 512 + 53 = 562 tokens) fit too. The labeller confidence is
# nested in N+ rows (`extra.confidence`, 1-9 or absent).
# They checkpoint ten times a run (`save_every`): about 92,850 pairs / 64 a step = 1,450 steps.
PRESETS = {
    "tldr-pythia-1b": (
        "N+ reward model on TL;DR preferences, Pythia 1B (8 GPUs)",
        Args(
            save_every=145,
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
            save_every=145,
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
            save_every=145,
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
    divides by their number in the whole batch, `global_count`, in its loss scale), and the detached rewards or
    step logits."""
    if args.objective == "outcome":
        if "allowed" in batch:  # packed by `pack_reward_pairs` (speed work: the same rewards)
            rewards = packed_pair_rewards(model, batch)
        else:
            rewards = outcome_reward(model, batch["input_ids"], batch["attention_mask"])
        r_chosen, r_rejected = rewards.chunk(2)
        loss = bradley_terry_loss(r_chosen, r_rejected, batch["margin"], args.center_rewards_coef, reduction="sum")
        return loss, {"r_chosen": r_chosen.detach(), "r_rejected": r_rejected.detach()}
    logits = token_scores(model, batch["input_ids"], batch["attention_mask"])
    loss = process_loss(logits, batch["labels"], reduction="sum")
    return loss, {"logits": logits.detach(), "labels": batch["labels"]}


def init_score_head(model, accelerator) -> None:
    """N+: the head starts from N(0, 1/sqrt(hidden + 1)), so initial rewards are small but not all zero (its bias, if it
    has one, at 0). Under ZeRO-3 the head is partitioned (an empty tensor on each rank): gather it, let rank 0 draw it,
    and share its draw."""
    if zero3(accelerator):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.score.parameters()), modifier_rank=0)
    else:
        gathered = contextlib.nullcontext()
    with gathered:
        torch.nn.init.normal_(model.score.weight, std=1.0 / math.sqrt(model.config.hidden_size + 1))
        if getattr(model.score, "bias", None) is not None:
            torch.nn.init.zeros_(model.score.bias)


def disable_dropout(*models) -> None:
    """N+: every dropout off in each model (None: no model), so that sampling, the reference, the update and evaluation
    all see the same deterministic model: `nn.Dropout` modules (p = 0) and the dropout a module keeps as a float, read
    in train mode (GPT-NeoX's and Llama's `attention_dropout` on their attention modules). The config is left as loaded:
    it is saved with the model. `main` calls it on every model it loads."""
    for module in (m for model in models if model is not None for m in model.modules()):
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress if schedule == "linear" else 1.0

    return f


def step_micro_batches(loader: Iterable, gradient_accumulation_steps: int) -> Iterator[list]:
    """One pass over `loader` as the micro-batches of each optimizer step: `gradient_accumulation_steps` of them, the
    last step shorter when the loader's length is no multiple of that (a real epoch ends there). A step's micro-batches
    are drawn before its first backward pass, so its loss can be averaged over all of them."""
    batches = iter(loader)
    while micro := list(itertools.islice(batches, gradient_accumulation_steps)):
        yield micro


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


@one_error_line
def main(args: Args) -> dict:
    """Reward model: 1. start the run; 2. load and check the data; 3. load the SFT model with a fresh score head,
    dropout off; 4. the loader, AdamW and the schedule; 5. the update loop, one mean of `bradley_terry_loss` over the
    pairs (`process_loss` over the labelled steps) of each step; 6. log, evaluate and checkpoint; 7. normalise the
    reward; 8. save model/ and done.json. Returns the last evaluation's metrics."""
    # ---- 1. the run: accelerator, argument checks, run directory (a used one is refused before anything loads), seed.
    # Real epochs: `step_micro_batches` ends a step at the loader's end; the gradient sync is set per step below
    accelerator, run = start_run(args, PRESETS, sync_with_dataloader=False)
    set_seed(args.seed)

    # ---- 2. data, loaded and checked before the first step: the tokenizer against the model; the training, evaluation
    # and normalisation rows, row by row
    tokenizer = load_checked_tokenizer(args.sft_model_path, args)
    positions = model_positions(load_config(args.sft_model_path, args))
    if args.use_chat_template and not tokenizer.chat_template:
        raise SystemExit(
            f"error: --use-chat-template: the tokenizer of --sft-model-path {args.sft_model_path} has no "
            "chat template; drop the flag"
        )
    tokenize = tokenize_pairs if args.objective == "outcome" else tokenize_steps
    train_rows, eval_rows = load_train_and_eval_rows(args)
    train = tokenize(train_rows, tokenizer, args, args.train_split, positions)
    evals = tokenize(eval_rows, tokenizer, args, args.eval_split, positions)
    if args.confidence_field and args.objective == "outcome" and all(e["confidence"] is None for e in evals):
        accelerator.print(
            f"warning: no evaluation row has a value at --confidence-field {args.confidence_field!r}; "
            "the accuracy by confidence will not be logged"
        )
    normalize = args.objective == "outcome" and args.normalize
    references = tokenize_references(tokenizer, args, positions) if normalize else None

    # ---- 3. the reward model: the SFT model, a fresh score head (N+ init), its reward type in the config, dropout off
    model = load_model(args, tokenizer)
    if args.pack_pairs:
        check_pair_packing(model)
    model.config.pad_token_id = tokenizer.pad_token_id
    init_score_head(model, accelerator)
    model.config.reward_type = args.objective
    model.config.reward_bias = 0.0
    if args.objective == "process":
        model.config.step_separator = args.step_separator
    disable_dropout(model)

    # ---- 4. the shuffled loader (packed pairs with --pack-pairs), AdamW and the learning-rate schedule
    collate_batch = partial(collate, pad_id=tokenizer.pad_token_id, objective=args.objective, pack=args.pack_pairs)
    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=collate_batch,
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

    # ---- 5. the update loop: each step's micro-batches, the loss a mean over the pairs (outcome) or labelled steps
    # (process) of all of them
    step, running, losses, n_micro, n_steps, t_last, metrics = 0, defaultdict(list), [], 0, 0, time.time(), {}
    if state := run.resume():  # the loop's counters; the data position is replayed below
        mine = state["running"][accelerator.process_index]
        losses = [torch.tensor(v) for v in mine["losses"]]
        running = defaultdict(list, {k: [torch.tensor(v) for v in values] for k, values in mine["running"].items()})
        n_micro, n_steps, metrics = state["n_micro"], state["n_steps"], state["metrics"]
    resumed_at, grad_norm = state["step"] if state else 0, None
    progress = tqdm(
        total=total_steps,
        initial=resumed_at,
        disable=not accelerator.is_main_process,
        desc=f"{args.exp_name} ({args.objective})",
    )
    for epoch in range(args.num_train_epochs):
        for micro in step_micro_batches(loader, args.gradient_accumulation_steps):
            if step < resumed_at:  # replay the data order up to the checkpoint, without training
                step += 1
                continue
            # the loss is the mean over the pairs (outcome) or labelled steps (process) of the whole step: every
            # micro-batch and process (a process's solutions hold different numbers of steps)
            total = global_count(sum(loss_units(b, args.objective) for b in micro), accelerator)
            # `accumulate` syncs when its count of micro-batches reaches the accumulation steps: on this step's last
            accelerator.step = args.gradient_accumulation_steps - len(micro)
            for batch in micro:
                with accelerator.accumulate(model):
                    loss_sum, out = micro_batch_loss(model, batch, args)
                    if not run.all_finite(loss_sum):
                        run.fail(
                            f"non-finite reward-model loss at step {step + 1}: lower --learning-rate (now "
                            f"{args.learning_rate:g}) or check the data"
                        )
                    # the micro-batch's share of the mean over every process's batch (/ total); x accumulation
                    # steps x processes undoes accelerate's and DDP's averaging
                    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0)
                    accelerator.backward(loss_sum * scale)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                            run.fail(
                                f"non-finite gradient norm at step {step + 1}: lower --learning-rate (now "
                                f"{args.learning_rate:g})"
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

            # ---- 6. log, evaluate, checkpoint
            if step % args.log_every == 0 or step == total_steps:
                now = time.time()
                speed = batch_episodes * n_micro / args.gradient_accumulation_steps / (now - t_last)
                lr = scheduler.get_last_lr()[0]
                logged = training_metrics(accelerator, losses, n_steps, running, lr, epoch, speed, grad_norm)
                run.log(logged, step, step * batch_episodes)
                progress.set_postfix(loss=f"{logged['train/loss']:.3f}")
                running, losses, n_micro, n_steps, t_last = defaultdict(list), [], 0, 0, now
            if step % args.eval_every == 0 or step == total_steps:
                forward = partial(micro_batch_loss, args=args)
                metrics = evaluate_reward_model(model, evals, args, accelerator, collate_batch, forward, process_loss)
                model.train()  # evaluation leaves it in eval mode
                run.log(metrics, step, step * batch_episodes)
                accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                t_last = time.time()
            stats = {"losses": losses, "running": running}
            if run.stop_requested():
                run.stop(loop_state(step, len(losses), n_micro, n_steps, stats, metrics, batch_episodes))
            if run.checkpoint_due(step, total_steps):
                run.checkpoint(loop_state(step, len(losses), n_micro, n_steps, stats, metrics, batch_episodes))
    progress.close()

    # ---- 7. normalisation (N+): the bias that makes the reference responses' mean reward 0; after the last step, also
    # on a resumed run (the loop only checkpoints up to the last step)
    if normalize:
        pad = partial(right_pad, pad_id=tokenizer.pad_token_id)
        raw = reference_rewards(model, references, args, accelerator, pad, outcome_reward)
        accelerator.unwrap_model(model).config.reward_bias = -raw.mean().item()
        bias = accelerator.unwrap_model(model).config.reward_bias
        after = reference_rewards(model, references, args, accelerator, pad, outcome_reward) + bias
        metrics["eval/reward_bias"] = -raw.mean().item()
        metrics["eval/reference_reward_mean"] = after.mean().item()
        normalisation = {k: metrics[k] for k in ("eval/reward_bias", "eval/reference_reward_mean")}
        run.log(normalisation, step, step * batch_episodes)
        accelerator.print(
            f"normalised: reward_bias {metrics['eval/reward_bias']:.4f}, reference mean reward now "
            f"{metrics['eval/reference_reward_mean']:.2e}"
        )

    # ---- 8. model/ (loads as AutoModelForSequenceClassification), done.json
    budget = {"step": step, "episode": step * batch_episodes, "total_steps": total_steps}
    run.finish(model, tokenizer, {**budget, "total_episodes": total_steps * batch_episodes})
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# Plumbing: what is specific to this script (the rest is in clean_rlhf_utils/): the reward model's loading, its data
# --------------------------------------------------------------------------------------------------


def load_model(args: Args, tokenizer):
    """The SFT model with a one-label score head (AutoModelForSequenceClassification), its embedding grown for an added
    `[PAD]`; a directory whose weights cannot be loaded is a one-line error naming it and the flag."""
    model = load_pretrained(
        AutoModelForSequenceClassification,
        args.sft_model_path,
        args,
        "reward model",
        "--sft-model-path",
        num_labels=1,
        revision=args.revision,
    )
    check_tokenizer_fits(tokenizer, model.config, args.sft_model_path, "--sft-model-path")
    if len(tokenizer) > model.config.vocab_size:  # not the weight's shape: ZeRO-3 partitions it (shape 0)
        model.resize_token_embeddings(len(tokenizer))
    return model


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
    return chat_prompt_ids(tokenizer, messages, where)


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
        chosen, rejected = [b["chosen"] for b in batch], [b["rejected"] for b in batch]
        return {**pack_reward_pairs(chosen, rejected, pad_id), "margin": margin}
    if objective == "outcome":  # chosen rows first, then rejected rows: one forward pass for both
        ids, mask, _ = right_pad([b["chosen"] for b in batch] + [b["rejected"] for b in batch], pad_id)
        return {"input_ids": ids, "attention_mask": mask, "margin": margin}
    ids, mask, labels = right_pad([b["input_ids"] for b in batch], pad_id, [b["labels"] for b in batch])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


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


if __name__ == "__main__":
    main(cli(PRESETS))
