"""Supervised fine-tuning (SFT) of a causal language model on prompt/response pairs.

The first stage of the RLHF pipeline of "Learning to summarize from human feedback" (Stiennon et al. 2020),
as reproduced in "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization"
(Huang et al. 2024, arXiv:2403.17031; code: github.com/vwxyzjn/summarize_from_feedback_details), and the
starting policy of the math track.

Details that matter (N+ paper, sections 3-5):
  * The loss is next-token cross-entropy on the response tokens only: prompt and pad positions get label
    -100. It is averaged over the response tokens of the whole batch of an optimizer step (every micro-batch of the
    gradient accumulation, every process; not over sequences, nor per micro-batch), as TRL does with
    `num_items_in_batch`: the micro-batches of a step are counted before its first backward pass.
  * Every response ends with exactly one EOS, so the model learns to stop: EOS is appended unless the response
    already ends with it (the N+ TL;DR responses end with the text `<|endoftext|>`, Pythia's EOS). PAD must be a
    different token from EOS, or EOS would be masked out with the padding and the model would never learn to stop
    (N+ adds a `[PAD]` token to Pythia's tokenizer; `--add-pad-token` does that here, and a tokenizer without a pad
    token, or with PAD = EOS, is an error otherwise).
  * Right padding for training, left padding for generation (so every prompt ends at the same position and
    `generate` continues it directly).
  * Prompts are never truncated silently: too long a prompt or response is an error (or, with
    `--drop-overlong`, the row is dropped and counted). N+ filters TL;DR queries to 512 tokens and
    reference responses to 53 tokens.
  * Real-track hyperparameters (N+ paper, Table 3 and the repository's `sft.py`): learning rate 3e-6,
    cosine schedule, 1 epoch, batch size 128, AdamW with eps 1e-5, dropout disabled.

`--lora-r` trains LoRA adapters (Hu et al. 2021, arXiv:2106.09685) through peft instead of every weight; `model/` is the
plain model with the adapters merged in, so the next stage loads it without peft.

Usage:
    python -m benchmark.assets                 # builds the tiny offline world under runs/assets
    python sft.py tiny-tldr                    # CPU, a few minutes
    python sft.py tiny-math
    accelerate launch --multi_gpu --num_processes 8 sft.py tldr-pythia-1b
    python sft.py tiny-tldr --help             # every flag, with its documentation
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from clean_rlhf_utils.args import DataArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs
from clean_rlhf_utils.data import chat_messages, end_with_eos, left_pad, template_fields, whole_field_messages
from clean_rlhf_utils.engines import (
    add_lora,
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
class Args(OptimArgs, DataArgs, LoraArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
    exp_name: str = "sft"
    """name of this experiment; the run name starts with it"""
    seed: int = 1
    """seed of the experiment (model init of added tokens, data order, sampling)"""
    save_every: int = 0
    """write a checkpoint every N optimizer steps; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss)"""

    # ---- model ----
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """base model: a hub name or a local directory saved with `save_pretrained`"""
    revision: str | None = None
    """hub revision (branch, tag or commit) of the model"""

    # ---- LoRA (peft) ----
    lora_r: int | None = None
    """LoRA rank (Hu et al. 2021, arXiv:2106.09685): train rank-r adapters beside the frozen weights instead of every
    weight (`pip install -e '.[peft]'`); `model/` is saved as the plain model, the adapters merged into its weights"""

    # ---- data ----
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """a hub dataset, a `save_to_disk` folder, a folder of `{split}.jsonl|json|parquet` files, or one such file"""
    prompt_template: str = "{query}"
    """Python format string building the prompt from a row's fields (each must be text: a missing, null or list field
    is an error). Conversational data is rendered with the tokenizer's chat template when the template is one field
    alone holding chat messages: TRL's `messages` format (`{messages}` here and in `response_template`: the prompt is
    every turn before the last, an assistant turn, with the generation prompt) or its conversational
    prompt/completion format (`{prompt}`, the prompt's messages)"""
    response_template: str = "{reference_response}"
    """Python format string building the response from a row's fields (EOS is appended unless it already ends
    with the EOS token); a field alone holding chat messages gives the content of their last turn, an assistant turn
    (`{messages}`, or TRL's conversational `{completion}`)"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512 for TL;DR); longer prompts are an error unless `drop_overlong`"""
    max_response_length: int = 53
    """longest response in tokens, EOS included (N+: 53 for TL;DR); also the generation budget at eval"""
    drop_overlong: bool = False
    """drop (and count) rows whose prompt or response is too long instead of failing"""
    max_train_samples: int | None = None
    """use only the first N training rows (debugging)"""

    # ---- optimisation ----
    learning_rate: float = 3e-6
    """peak learning rate (N+: 3e-6)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    num_train_epochs: int = 1
    """passes over the training split"""
    per_device_train_batch_size: int = 16
    """sequences per device per micro-batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step; the global batch is this x per-device batch x processes"""

    # ---- evaluation and logging ----
    eval_task: Literal["none", "tldr", "gsm8k", "boxed"] = "none"
    """task-specific evaluation of greedy samples: `tldr` gold judge + win rate (tiny world), `gsm8k`
    (`#### number`) or `boxed` (`\\boxed{}`) exact-answer accuracy; `none` logs validation loss only. What it needs
    (each row's `facts` for tldr, a final answer in each reference) is checked when the evaluation split is loaded"""
    eval_every: int = 100
    """evaluate every N optimizer steps (and at the end)"""
    num_eval_examples: int = 200
    """evaluation rows used for loss and samples"""
    per_device_eval_batch_size: int = 32
    """sequences per device at evaluation"""
    log_every: int = 10
    """log training metrics every N optimizer steps"""
    save_model: bool = True
    """save the final model and tokenizer to `runs/<run_name>/model` (safetensors)"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do. Lengths: the default limits 512 / 53 fit the N+ TL;DR
# SFT data (queries at most 512 tokens; longest reference response 53 tokens with its EOS; shared/real-assets README).
PRESETS = {
    "tldr-pythia-1b": (
        "N+ SFT on TL;DR, Pythia 1B (8 GPUs)",
        Args(
            exp_name="sft_tldr_pythia-1b",
            model_name_or_path="EleutherAI/pythia-1b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            eval_every=200,
        ),
    ),
    "tldr-pythia-2.8b": (
        "N+ SFT on TL;DR, Pythia 2.8B (8 GPUs)",
        Args(
            exp_name="sft_tldr_pythia-2.8b",
            model_name_or_path="EleutherAI/pythia-2.8b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            eval_every=200,
        ),
    ),
    "tldr-pythia-6.9b": (
        "N+ SFT on TL;DR, Pythia 6.9B (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            exp_name="sft_tldr_pythia-6.9b",
            model_name_or_path="EleutherAI/pythia-6.9b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            eval_every=200,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr on CPU (needs `python -m benchmark.assets`)",
        Args(
            exp_name="sft_tiny-tldr",
            model_name_or_path="runs/assets/models/tiny-neox",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            learning_rate=1e-3,
            lr_schedule="cosine",
            # 6 epochs, not 2: copying the post's feeling word into the summary forms late (docs/sft.md)
            warmup_ratio=0.05,
            num_train_epochs=6,
            per_device_train_batch_size=32,
            max_prompt_length=96,
            max_response_length=48,
            eval_task="tldr",
            eval_every=200,
            num_eval_examples=200,
        ),
    ),
    "tiny-math": (
        "tiny-math (GSM8K schema) on CPU (needs `python -m benchmark.assets`)",
        Args(
            exp_name="sft_tiny-math",
            model_name_or_path="runs/assets/models/tiny-llama",
            # 60% of the answers skip the working, so RL has something to teach; 6 epochs, not 3 (docs/sft.md)
            dataset_name_or_path="runs/assets/tiny-math/sft",
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            response_template="{answer}",
            learning_rate=1e-3,
            warmup_ratio=0.05,
            num_train_epochs=6,
            per_device_train_batch_size=32,
            max_prompt_length=96,
            max_response_length=80,
            eval_task="gsm8k",
            eval_every=250,
            num_eval_examples=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The SFT math: the loss on the response tokens, one mean over the whole mini-batch of every process
# --------------------------------------------------------------------------------------------------


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Next-token cross-entropy averaged (or summed) over the positions whose label is not -100 (response tokens and
    EOS). Position t predicts label t+1, hence the shift."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    mask = labels != -100
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none")
    total = (nll.view_as(labels) * mask).sum()
    return total if reduction == "sum" else total / mask.sum().clamp(min=1)


def response_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens `sft_loss` counts in a collated batch: those with a label (response tokens and EOS)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def micro_batch_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch of `main`: the cross-entropy summed over its response tokens (`main` divides by the response
    tokens of the whole batch, `global_count`, in `backward_share`)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sft_loss(logits, batch["labels"], reduction="sum")


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

    tokenizer = load_tokenizer(args)
    train_rows = load_split(args.dataset_name_or_path, args.train_split)
    if args.max_train_samples:
        train_rows = train_rows.select(range(min(args.max_train_samples, len(train_rows))))
    positions = model_positions(args)
    train = tokenize_split(train_rows, tokenizer, args, args.train_split, positions=positions)
    eval_rows = load_split(args.dataset_name_or_path, args.eval_split)
    evals = tokenize_split(
        eval_rows.select(range(min(args.num_eval_examples, len(eval_rows)))),
        tokenizer,
        args,
        args.eval_split,
        evaluation=True,
        positions=positions,
    )  # what `evaluate` needs, checked now
    model = add_lora(load_causal_lm(args, tokenizer), args)

    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=lambda b: collate_right_padded(b, tokenizer.pad_token_id),
        drop_last=True,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps, weight_decay=args.weight_decay)
    configure_deepspeed(accelerator, None, args.max_grad_norm)  # micro-batch: the loader's
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the loader's last, possibly partial, accumulation steps the optimizer too (`step_micro_batches`)
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    total_steps = steps_per_epoch * args.num_train_epochs
    if total_steps == 0:
        raise SystemExit(
            f"error: {len(train)} training rows make no full batch of {args.per_device_train_batch_size} x "
            f"{args.gradient_accumulation_steps} x {accelerator.num_processes} processes"
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, int(args.warmup_ratio * total_steps), total_steps)
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    batch_episodes = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    run.begin()
    accelerator.print(
        f"run {args.run_name}: {len(train)} training rows, {total_steps} optimizer steps of {batch_episodes} sequences"
    )

    step, running, n_micro, n_steps, t_last, metrics = 0, [], 0, 0, time.time(), {}
    if state := run.resume():  # the loop's counters; the data position is replayed below
        running = [torch.tensor(v) for v in state["running"][accelerator.process_index]]
        n_micro, n_steps, metrics = state["n_micro"], state["n_steps"], state["metrics"]
    progress = tqdm(
        total=total_steps, initial=state["step"] if state else 0, disable=not accelerator.is_main_process, desc="sft"
    )
    grad_norm = None
    for epoch in range(args.num_train_epochs):
        for micro in step_micro_batches(loader, args.gradient_accumulation_steps):
            if state and step < state["step"]:  # replay the data order up to the checkpoint, without training
                step += 1
                continue
            before = (step, len(running), n_micro, n_steps)  # for a checkpoint after a non-finite loss
            # the loss is the mean over the response tokens of the whole step: every micro-batch and process
            total = global_count(sum(response_tokens(b) for b in micro), accelerator)
            # `accumulate` syncs when its count of micro-batches reaches the accumulation steps: on this step's last
            accelerator.step = args.gradient_accumulation_steps - len(micro)
            for batch in micro:
                with accelerator.accumulate(model):
                    loss_sum = micro_batch_loss(model, batch)
                    if not run.all_finite(loss_sum):
                        run.stop(
                            sft_loop_state(*before, running, metrics, batch_episodes),
                            f"non-finite SFT loss at step {step + 1}: lower --learning-rate or check the data",
                        )
                    backward_share(accelerator, loss_sum, total)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                            run.stop(
                                sft_loop_state(*before, running, metrics, batch_episodes),
                                f"non-finite gradient norm at step {step + 1}: lower --learning-rate",
                            )
                    optimizer.step()
                    optimizer.zero_grad()
                running.append(loss_sum.detach() / max(total, 1.0))  # summed over micro-batches and processes: the mean
            n_micro, n_steps = n_micro + len(micro), n_steps + 1
            scheduler.step()
            step += 1
            progress.update(1)
            if step % args.log_every == 0 or step == total_steps:
                now = time.time()
                # the mean over the logged steps of each step's token mean (every micro-batch and process)
                mean_loss = accelerator.gather(torch.stack(running).sum()[None]).sum().item() / n_steps
                episodes_per_sec = batch_episodes * n_micro / args.gradient_accumulation_steps / (now - t_last)
                logged = {
                    "train/loss": mean_loss,
                    "lr": scheduler.get_last_lr()[0],
                    "epoch": epoch,
                    "perf/episodes_per_sec": episodes_per_sec,
                    "perf/peak_mem_gb": peak_mem_gb(accelerator.device),
                }
                if grad_norm is not None:  # DeepSpeed clips inside its own step and may report no norm
                    logged["train/grad_norm"] = float(grad_norm)
                run.log(logged, step, step * batch_episodes)
                progress.set_postfix(loss=f"{mean_loss:.3f}")
                running, n_micro, n_steps, t_last = [], 0, 0, now
            if step % args.eval_every == 0 or step == total_steps:
                metrics, records = evaluate(model, tokenizer, evals, args, accelerator)
                run.log(metrics, step, step * batch_episodes)
                accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                run.log_samples(records[:8], step)
                t_last = time.time()
            if run.stop_requested():
                run.stop(sft_loop_state(step, len(running), n_micro, n_steps, running, metrics, batch_episodes))
            if args.save_every and step % args.save_every == 0 and step < total_steps:
                run.checkpoint(sft_loop_state(step, len(running), n_micro, n_steps, running, metrics, batch_episodes))
    progress.close()

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
# Offline-first loading: a local path never touches the network; a hub name that cannot be reached
# fails in milliseconds with a message that says what to do, instead of a minute of HTTP retries.
# ----------------------------------------------------------------------------------------------------


def load_tokenizer(args: Args):
    local = os.path.isdir(args.model_name_or_path)
    if not local:
        require_hub(args.model_name_or_path, "model", "--model-name-or-path")
    tok = AutoTokenizer.from_pretrained(
        args.model_name_or_path,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        local_files_only=local,
    )
    return ensure_pad_token(tok, args.add_pad_token, args.model_name_or_path)


def load_causal_lm(args: Args, tokenizer):
    local = os.path.isdir(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        local_files_only=local,
        dtype=getattr(torch, args.dtype),
    )
    if len(tokenizer) > model.config.vocab_size:  # not the weight's shape: ZeRO-3 partitions it (shape 0)
        model.resize_token_embeddings(len(tokenizer))  # the added [PAD] needs an embedding row
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    for module in model.modules():  # N+: dropout off, so training and evaluation see the same model
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


# ----------------------------------------------------------------------------------------------------
# Engines: one process, DDP, DeepSpeed ZeRO-2/3 and FSDP, all through `accelerate launch` (helpers copied
# verbatim between scripts), and the tokenizer checks
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Data: render, tokenize, check, pad
# ----------------------------------------------------------------------------------------------------


def conversation_hint(row: dict) -> str:
    """How to pass a conversational row (TRL's formats) to the templates, when it has fields of chat messages."""
    chat = [k for k, v in row.items() if chat_messages(v)]
    if not chat:
        return ""
    if len(chat) == 1:  # language modelling: {"messages": [...]}, the last assistant turn the response
        return (
            f"; for TRL's conversational format pass --prompt-template '{{{chat[0]}}}' --response-template "
            f"'{{{chat[0]}}}' (the last assistant turn is the response)"
        )
    return (
        f"; for TRL's conversational format pass --prompt-template '{{{chat[0]}}}' --response-template '{{{chat[-1]}}}'"
    )


def render(template: str, row: dict, index: int, split: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the split, the row, the field and the flag, never a silent `None` or
    `[...]` in the text the model trains on."""
    where = f"row {index} of split '{split}'"
    for name in template_fields(template, flag):
        if name not in row:
            raise SystemExit(
                f"error: {where} has no field '{name}' used by the {what} template ({flag} {template!r}); "
                f"its fields are {sorted(row)}{conversation_hint(row)}"
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


def prompt_and_response(row: dict, index: int, split: str, tokenizer, args: Args) -> tuple[list[int], str]:
    """A row's prompt token ids and response text. Text fields fill `--prompt-template` (wrapped as a user message with
    `--use-chat-template`) and `--response-template`. A template that is one field alone holding chat messages is
    rendered with the tokenizer's chat template: TRL's conversational language-modelling format (`{messages}` for both
    templates: the prompt is every turn before the last, an assistant turn, which is the response) or its
    prompt/completion format (`{prompt}`, the prompt's messages; `{completion}`, the assistant's turn)."""
    where = f"row {index} of split '{split}'"
    same_field = args.prompt_template.strip() == args.response_template.strip()
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render(args.prompt_template, row, index, split, "prompt", "--prompt-template")
        if args.use_chat_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif messages[-1]["role"] == "assistant":
        if not same_field:
            raise SystemExit(
                f"error: {where}: the chat messages of --prompt-template {args.prompt_template!r} end "
                "with an assistant turn; give the same field as --response-template to train on that "
                "turn (TRL's `messages` format), or the prompt's messages only (its prompt/completion "
                "format)"
            )
        messages = messages[:-1]
        if not messages:
            raise SystemExit(
                f"error: {where}: the chat messages of --prompt-template {args.prompt_template!r} hold "
                "only the assistant's turn: there is no prompt before it"
            )
    if messages is not None:
        if not tokenizer.chat_template:
            raise SystemExit(
                f"error: the tokenizer of --model-name-or-path {args.model_name_or_path} has no chat "
                f"template, so the chat messages of {where} (or --use-chat-template) cannot be rendered; "
                "give plain-text prompts and responses"
            )
        prompt_ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    turns = whole_field_messages(args.response_template, row)
    if turns is None:
        return prompt_ids, render(args.response_template, row, index, split, "response", "--response-template")
    if turns[-1]["role"] != "assistant":
        raise SystemExit(
            f"error: {where}: the chat messages of --response-template {args.response_template!r} do not "
            "end with an assistant turn, which is the response to train on"
        )
    if not same_field and any(m["role"] != "assistant" for m in turns):
        raise SystemExit(
            f"error: {where}: the chat messages of --response-template {args.response_template!r} hold "
            f"turns other than the assistant's (roles {[m['role'] for m in turns]}); give the whole "
            "conversation as both templates (TRL's `messages` format) or the prompt's turns elsewhere"
        )
    if not turns[-1]["content"].strip():
        raise SystemExit(
            f"error: {where} renders an empty response (the last assistant turn of "
            f"--response-template {args.response_template!r})"
        )
    return prompt_ids, turns[-1]["content"]


def check_evaluation_fields(row: dict, response: str, index: int, split: str, args: Args) -> None:
    """What `evaluate` needs of an evaluation row, checked when the split is loaded, not at the first evaluation: the
    key `facts` the tiny-tldr judge scores (`--eval-task tldr`), a final answer in the reference (gsm8k, boxed)."""
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
        if extract(response) is None:
            marker = "`#### <number>`" if args.eval_task == "gsm8k" else "`\\boxed{...}`"
            raise SystemExit(
                f"error: {where}: the reference response holds no final answer {marker} for --eval-task "
                f"{args.eval_task}: {response[-60:]!r}; use another --eval-task (or none), or a "
                "--response-template that holds the answer"
            )


def model_positions(args: Args) -> int | None:
    """The longest sequence the model's position embeddings cover, from its config (None when it does not say, or the
    config cannot be read: loading the model reports that)."""
    try:
        config = AutoConfig.from_pretrained(
            args.model_name_or_path,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
            local_files_only=os.path.isdir(args.model_name_or_path),
        ).get_text_config()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def tokenize_split(
    ds: Dataset, tokenizer, args: Args, split: str, evaluation: bool = False, positions: int | None = None
) -> list[dict]:
    """Prompt and response token ids for every row, the response ending in exactly one EOS (`end_with_eos`), every
    field checked now (`prompt_and_response`; with `evaluation`, what `evaluate` needs too). Overlong rows, past the
    length limits or the model's `positions`, are an error (or dropped with `--drop-overlong`): truncating a TL;DR query
    would silently cut the post."""
    examples, dropped = [], 0
    for i, row in enumerate(ds):
        prompt_ids, response = prompt_and_response(row, i, split, tokenizer, args)
        if evaluation:
            check_evaluation_fields(row, response, i, split, args)
        response_ids = end_with_eos(tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
        too_long = len(prompt_ids) > args.max_prompt_length or len(response_ids) > args.max_response_length
        no_room = positions is not None and len(prompt_ids) + len(response_ids) > positions
        if too_long or no_room:
            if not args.drop_overlong:
                if too_long:
                    raise SystemExit(
                        f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a "
                        f"{len(response_ids)}-token response (EOS included); the limits are --max-prompt-length "
                        f"{args.max_prompt_length} and --max-response-length {args.max_response_length}. Raise them or "
                        "pass --drop-overlong."
                    )
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a {len(response_ids)}-"
                    f"token response, more than the {positions} positions of --model-name-or-path "
                    f"(max_position_embeddings); lower --max-prompt-length (now {args.max_prompt_length}) to fit them "
                    "and pass --drop-overlong"
                )
            dropped += 1
            continue
        examples.append({"prompt_ids": prompt_ids, "response_ids": response_ids, "row": row, "response": response})
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} rows of '{split}' that exceed the length limits or the model's positions"
        )
    if not examples:
        raise SystemExit(f"error: no usable rows in split '{split}'")
    return examples


def collate_right_padded(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """prompt + response, right-padded; labels are -100 on the prompt and on padding."""
    seqs = [e["prompt_ids"] + e["response_ids"] for e in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        labels[i, len(e["prompt_ids"]) : len(s)] = torch.tensor(e["response_ids"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def truncate_after_eos(tokens: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """Keep each row up to and including its first EOS; everything after becomes pad."""
    is_eos = tokens == eos_id
    after_first_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return tokens.masked_fill(after_first_eos, pad_id)


# ----------------------------------------------------------------------------------------------------
# Tiny-world evaluation helpers (copied verbatim from benchmark/tiny_world.py; tests check they match)
# ----------------------------------------------------------------------------------------------------


TLDR_FACT_WORDS = {
    "who": [
        "roommate",
        "boyfriend",
        "girlfriend",
        "boss",
        "sister",
        "brother",
        "neighbor",
        "friend",
        "coworker",
        "landlord",
    ],
    "what": ["rent", "car", "dog", "cat", "wedding", "job", "phone", "laptop", "party", "exam"],
    "feel": ["angry", "sad", "confused", "anxious", "happy", "jealous", "tired", "worried"],
}


TLDR_MAX_WORDS = 12


def gold_judge(summary: str, facts: list[str]) -> float:
    """Gold reward of a tiny-tldr summary: the share of the post's key `facts` it mentions, minus 0.5 for
    every fact word it invents (a fact word of the tiny world that is not one of this post's facts),
    minus 0.1 for every whitespace-separated token past TLDR_MAX_WORDS (digits and symbols count, so
    padding cannot dodge it). Repeated words count towards length, so repeating a fact cannot earn more
    than mentioning it once. Range: about [-inf, 1]; 1 is a perfect summary."""
    words = re.findall(r"[a-z]+", summary.lower())
    vocab = {w for group in TLDR_FACT_WORDS.values() for w in group}
    covered = sum(1 for f in facts if f in words) / len(facts)
    invented = len({w for w in words if w in vocab and w not in facts})
    too_long = max(0, len(summary.split()) - TLDR_MAX_WORDS)
    return covered - 0.5 * invented - 0.1 * too_long


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (GSM8K's final-answer marker), commas, `$` and a trailing period
    removed; None when there is no `####` followed by a number."""
    matches = re.findall(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (MATH's final-answer marker), with nested braces matched;
    None when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def numbers_equal(predicted: str | None, gold: str) -> bool:
    """Numeric comparison of two answer strings (so `6`, `6.0` and `06` agree); False for a missing or
    non-numeric prediction, never an exception."""
    if predicted is None:
        return False
    try:
        return abs(float(predicted.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------------
# Run directory, metrics and evaluation
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], args: Args, accelerator: Accelerator) -> tuple[dict, list[dict]]:
    """Validation loss on reference responses, then greedy samples scored by the task's checker. Each
    process takes a shard of the examples; results are gathered on every process. Under ZeRO-3 every forward pass
    is a collective, so the shards are padded to one length (the padded rows' records are dropped) and `generate`
    keeps stepping until every rank is done."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    records = []
    with accelerator.split_between_processes(examples, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            tensors = {
                k: v.to(accelerator.device) for k, v in collate_right_padded(batch, tokenizer.pad_token_id).items()
            }
            logits = unwrapped(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
            losses = [sft_loss(logits[i : i + 1], tensors["labels"][i : i + 1]).item() for i in range(len(batch))]
            ids, mask = left_pad([e["prompt_ids"] for e in batch], tokenizer.pad_token_id)
            out = unwrapped.generate(
                input_ids=ids.to(accelerator.device),
                attention_mask=mask.to(accelerator.device),
                max_new_tokens=args.max_response_length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=zero3(accelerator),
            )
            responses = truncate_after_eos(out[:, ids.shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id)
            for e, loss, r in zip(batch, losses, responses):
                text = tokenizer.decode(r, skip_special_tokens=True)
                rec = {
                    "loss": loss,
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
    model.train()
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


def step_micro_batches(loader: Iterable, gradient_accumulation_steps: int) -> Iterator[list]:
    """One pass over `loader` as the micro-batches of each optimizer step: `gradient_accumulation_steps` of them, the
    last step shorter when the loader's length is no multiple of that (a real epoch ends there). A step's micro-batches
    are drawn before its first backward pass, so its loss can be averaged over all of them."""
    batches = iter(loader)
    while micro := list(itertools.islice(batches, gradient_accumulation_steps)):
        yield micro


def sft_loop_state(
    step: int, n_running: int, n_micro: int, n_steps: int, running: list, metrics: dict, batch_episodes: int
) -> dict:
    """What the loop carries between steps, for a checkpoint after `step`: the counters, the last evaluation, and
    every process's running losses since the last log (the first `n_running`), gathered so the main process saves
    them."""
    return {
        "step": step,
        "episode": step * batch_episodes,
        "n_micro": n_micro,
        "n_steps": n_steps,
        "metrics": metrics,
        "running": gather_object([[v.item() for v in running[:n_running]]]),
    }


# ----------------------------------------------------------------------------------------------------
# Durable runs: the run directory, checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the
# argument checks (copied verbatim between scripts; tests/test_faults.py)
# ----------------------------------------------------------------------------------------------------


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
