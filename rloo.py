"""RLOO: REINFORCE with a leave-one-out baseline for RLHF, in one file.

Implements "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"
(Ahmadian et al. 2024, arXiv:2402.14740). The paper's argument: in RLHF the policy starts from a strong SFT model,
so PPO's machinery against high variance (a learned value model, GAE, per-token credit assignment, clipping) is
not needed; REINFORCE that treats the whole response as ONE action, with a good baseline, matches or beats PPO with
one model less to train. The baseline of REINFORCE Leave-One-Out (RLOO, Kool et al. 2019) comes from the other
samples of the same prompt:
  * k responses y_1..y_k are sampled for every prompt x;
  * each gets a sequence-level reward R_i = score(x, y_i) - beta * sum_t KL_t, the summed per-token KL estimate
    log pi(y_t) - log pi_ref(y_t) over its tokens (the KL penalty is part of the reward, as in PPO-RLHF);
  * its advantage is R_i minus the mean reward of the k - 1 OTHER samples, b_i = (sum_j R_j - R_i) / (k - 1),
    which does not depend on y_i, so the gradient stays unbiased (with k = 1 there is no baseline);
  * loss = -A_i * log pi(y_i | x), log pi(y_i | x) summed over the response tokens (the response is one action),
    averaged over the responses of the batch (each micro-batch's mean; all micro-batches hold as many responses, so
    gradient accumulation and the processes' average give the same mean, `rloo_micro_batch_loss`).
Options: `--normalize-advantage` whitens the advantages over the batch; `--num-ppo-epochs` > 1 or
`--num-mini-batches` > 1 reuse a batch for several updates with PPO's clipped surrogate on the SEQUENCE-level
ratio pi(y|x) / pi_old(y|x) (TRL's RLOOTrainer); with the defaults (one epoch, one minibatch) the ratio is 1 and
the loss is exactly REINFORCE. The paper reports k = 2 and k = 4; the default is 4. `--lora-r` trains LoRA adapters
(Hu et al. 2021, arXiv:2106.09685) through peft; the reference is then the policy with its adapters disabled.

Everything else is ppo_rlhf.py's (the N+ details of Huang et al. 2024, arXiv:2403.17031): left-padded prompts,
logprobs of the logits divided by the sampling temperature (recomputed by a forward pass, or, in float32 where the
two agree to 1e-5, kept from the sampler: --sampler-logprobs), responses truncated after their first EOS
(`--stop-token none`: decoded to `response_length` tokens, kept whole), responses without EOS scored
`penalty_reward_value` (-1), position ids from the attention mask, dropout off. The reward is a learned reward
model (TL;DR) or the verifiable math reward (1 if the final answer is right, else 0). Evaluation: greedy responses,
gold judge and win rate (tiny-tldr) or answer accuracy (math), before the first update and after the last.

Speed: sampling is a hand-written loop over the KV cache in which a finished response leaves the batch (it also keeps
the sampled tokens' logprobs, `--sampler-logprobs`), and the forward passes run on packed query + response
sequences (`pack`: several per row, no padding, a block-diagonal causal mask from the position ids).

Usage:
    python -m benchmark.assets && python -m benchmark.run tiny      # tiny world, SFT and reward models
    python rloo.py tiny-math
    python rloo.py tiny-tldr --rloo-k 2
    accelerate launch --multi_gpu --num_processes 2 rloo.py tiny-math    # two processes (gloo on CPU)
    accelerate launch --config_file benchmark/accelerate_configs/deepspeed_zero2.yaml rloo.py tldr-pythia-1b
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, DynamicCache

from clean_rlhf_utils.args import DataArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs
from clean_rlhf_utils.data import chat_messages, left_pad, template_fields, whole_field_messages
from clean_rlhf_utils.engines import (
    LoraReference,
    add_lora,
    configure_deepspeed,
    cpu_threads,
    make_accelerator,
    peak_mem_gb,
    prepare_frozen,
    shard_length,
    zero3,
)
from clean_rlhf_utils.loading import ensure_pad_token, load_split, require_hub
from clean_rlhf_utils.runs import Run, check_args

INVALID_LOGPROB = 1.0  # placeholder written into padded positions; masked out of every loss and statistic


@dataclass
class Args(OptimArgs, DataArgs, LoraArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
    exp_name: str = "rloo"
    """name of this experiment; the run name starts with it"""

    # ---- models ----
    sft_model_path: str = "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT model: initial policy and frozen reference (hub name or local directory)"""
    reward_model_path: str | None = "vwxyzjn/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the outcome reward model (saved by reward_model.py); None with `reward_source=math`"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the policy, reference and reward model are loaded in; the real presets load float32 and get bf16 from
    the accelerate config's mixed precision"""
    sampler_logprobs: bool | None = None
    """take the rollout logprobs from the sampler instead of a forward pass after sampling; default: on in float32
    without mixed precision (the two agree to 1e-5), off in half precision or bf16 mixed precision, where the
    KV-cache and full-sequence kernels differ enough to move the ratio off 1 (the N+ reason to recompute them)"""

    # ---- data ----
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompts: hub dataset, `save_to_disk` folder, folder of `{split}.jsonl|json|parquet`, or one such file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. `main` for openai/gsm8k)"""
    train_split: str = "train"
    """split to sample prompts from"""
    reference_template: str = "{reference_response}"
    """format string of the reference response (win rate on tiny-tldr, gold answer on math)"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512); longer prompts are an error unless `drop_overlong`"""

    # ---- reward ----
    reward_source: Literal["model", "math"] = "model"
    """`model`: the learned outcome reward model; `math`: 1 if the final answer is right, else 0"""
    answer_format: Literal["gsm8k", "boxed"] = "gsm8k"
    """(math) how final answers are written: `#### 42` or `\\boxed{42}`"""
    non_eos_penalty: bool = True
    """replace the score of responses without EOS by `penalty_reward_value` (N+)"""
    penalty_reward_value: float = -1.0
    """score of a response that never ends (N+: -1)"""
    stop_token: Literal["eos", "none"] = "eos"
    """`eos`: a response ends at its first EOS (sampling stops there); `none`: every sampled response is decoded to
    `response_length` tokens and kept whole, EOS or not (N+'s option). Evaluation's greedy `generate` stops at EOS
    either way"""

    # ---- RLOO ----
    total_episodes: int = 1_000_000
    """responses sampled over the whole run, all processes (N+: 1M)"""
    per_device_batch_size: int = 64
    """responses sampled per process per update (= prompts x rloo_k); the batch is this x processes"""
    rloo_k: int = 4
    """samples per prompt; the baseline of each is the mean reward of the other k - 1 (the paper: 2 and 4)"""
    normalize_advantage: bool = False
    """whiten the advantages over the batch (mean 0, std 1)"""
    num_ppo_epochs: int = 1
    """passes over each batch; 1 with one minibatch is plain REINFORCE (the paper), more uses the clipped ratio"""
    num_mini_batches: int = 1
    """minibatches (optimizer steps) per pass"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch"""
    learning_rate: float = 3e-6
    """AdamW learning rate (N+: 3e-6)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the updates (N+)"""
    response_length: int = 53
    """tokens sampled per response (N+: 53)"""
    temperature: float = 0.7
    """sampling temperature, also applied to the logits when computing logprobs (N+: 0.7)"""
    kl_coef: float = 0.05
    """beta of the KL penalty in the sequence reward (N+: 0.05)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimate: k1 = logp - ref_logp, k3 = exp(-d) - 1 + d with d = logp - ref_logp"""
    cliprange: float = 0.2
    """clip of the sequence-level ratio when a batch is reused (PPO's epsilon)"""

    # ---- evaluation and logging ----
    eval_task: Literal["none", "tldr", "gsm8k", "boxed"] = "none"
    """greedy evaluation: `tldr` gold judge + win rate (tiny world), `gsm8k` / `boxed` answer accuracy"""
    eval_every: int = 50
    """evaluate every N updates (and before the first and after the last)"""
    num_eval_examples: int = 200
    """evaluation prompts"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots gold reward against it); one more generation per eval"""
    per_device_eval_batch_size: int = 32
    """prompts per device at evaluation"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do, instead of training bf16 weights directly.
# The 2.8B and 6.9B presets keep the batch (8 x 64 responses: 128 prompts x k = 4) and double the gradient accumulation
# per size (4 / 8 / 16), as the N+ PPO runs do between these sizes (ppo_rlhf.py's presets), not numbers from the
# RLOO paper.
PRESETS = {
    "tldr-pythia-1b": (
        "RLOO on TL;DR, Pythia 1B, N+ hyperparameters where they apply, k = 4 (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            exp_name="rloo_tldr_pythia-1b",
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=4,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "tldr-pythia-2.8b": (
        "RLOO on TL;DR, Pythia 2.8B, k = 4 (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            exp_name="rloo_tldr_pythia-2.8b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__reward__tldr",
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=8,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "tldr-pythia-6.9b": (
        "RLOO on TL;DR, Pythia 6.9B, k = 4 (8 GPUs, DeepSpeed ZeRO-3)",
        Args(
            exp_name="rloo_tldr_pythia-6.9b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__reward__tldr",
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=16,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "gsm8k-qwen2.5-0.5b": (
        "RLOO on GSM8K with the verifiable reward, Qwen2.5-0.5B-Instruct (8 GPUs)",
        Args(
            exp_name="rloo_gsm8k_qwen2.5-0.5b",
            sft_model_path="Qwen/Qwen2.5-0.5B-Instruct",
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path="openai/gsm8k",
            dataset_config="main",
            eval_split="test",
            prompt_template='{question}\nLet\'s think step by step and output the final answer after "####".',
            use_chat_template=True,
            reference_template="{answer}",
            response_length=400,
            temperature=1.0,
            kl_coef=0.001,
            learning_rate=1e-6,
            total_episodes=7473 * 4,
            rloo_k=4,
            per_device_batch_size=32,
            gradient_accumulation_steps=4,
            eval_task="gsm8k",
            eval_every=20,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr on CPU (needs `python -m benchmark.run tiny-tldr` first)",
        Args(
            exp_name="rloo_tiny-tldr",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=2048,
            per_device_batch_size=64,
            rloo_k=4,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=8,
            num_eval_examples=200,
        ),
    ),
    "tiny-tldr-noisy": (
        "tiny-tldr-noisy (`python -m benchmark.run frontier-tldr`): the RM of noisy labels as reward",
        Args(
            exp_name="rloo_tiny-tldr-noisy",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr-noisy__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=2048,
            per_device_batch_size=64,
            rloo_k=4,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=4,
            num_eval_examples=200,
            eval_kl=True,
        ),
    ),
    "tiny-math": (
        "tiny-math on CPU, verifiable reward (needs `python -m benchmark.run tiny-math` first)",
        Args(
            exp_name="rloo_tiny-math",
            sft_model_path="runs/sft_tiny-math__1/model",
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path="runs/assets/tiny-math/gsm8k",
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            max_prompt_length=96,
            response_length=80,
            temperature=0.7,
            total_episodes=3072,
            per_device_batch_size=128,
            rloo_k=8,
            learning_rate=3e-5,
            kl_coef=0.01,
            eval_task="gsm8k",
            eval_every=8,
            num_eval_examples=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The RLOO math: small pure functions, each checked against hand-computed values in tests/test_rloo_remax.py
# --------------------------------------------------------------------------------------------------


def sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, padding_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Summed per-token KL estimate of each response (B,): padding (after the EOS) contributes nothing."""
    return kl_penalty(logprobs, ref_logprobs, estimator).masked_fill(padding_mask, 0).sum(1)


def sequence_rewards(scores: torch.Tensor, seq_kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The RL reward of a whole response: score - beta * summed KL (RLOO paper, section 3)."""
    return scores - kl_coef * seq_kl


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Leave-one-out advantages. `rewards` (B,) holds k consecutive samples per prompt (prompt-major). The baseline of
    sample i is the mean reward of the other k - 1 samples of its prompt: b_i = (sum_j R_j - R_i) / (k - 1), so the
    advantage R_i - b_i = k / (k - 1) * (R_i - mean_j R_j). With k = 1 there is no other sample: no baseline."""
    if rewards.numel() % k:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of k = {k}")
    if k == 1:
        return rewards.clone()
    grouped = rewards.view(-1, k)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)
    return (grouped - baseline).flatten()


def sequence_logprobs(logprobs: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each response: the sum of its token logprobs up to and including the EOS."""
    return logprobs.masked_fill(padding_mask, 0).sum(1)


def reinforce_loss(new_seq_logprobs, old_seq_logprobs, advantages, cliprange: float) -> tuple[torch.Tensor, dict]:
    """REINFORCE on whole responses, as PPO's clipped surrogate on the sequence-level ratio r = pi(y|x) / pi_old(y|x):
    mean over responses of max(-A r, -A clip(r, 1 - eps, 1 + eps)). On fresh samples r = 1 and the gradient is
    exactly REINFORCE's -A grad log pi(y|x); the clip only matters when a batch is reused."""
    log_ratio = new_seq_logprobs - old_seq_logprobs
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = torch.max(losses, losses_clipped).mean()
    stats = {
        "clipfrac": (losses_clipped > losses).float().mean(),
        "approxkl": 0.5 * (log_ratio**2).mean(),
        "ratio": ratio.mean(),
    }
    return loss, stats


def rloo_micro_batch_loss(
    model,
    queries: list[list[int]],
    responses: list[list[int]],
    old_seq_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    pad_id: int,
    capacity: int,
    temperature: float,
    cliprange: float,
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's RLOO loss, a mean over its responses: log pi(y | x) of each response under the policy (one
    packed forward pass, summed over the response's own tokens), then `reinforce_loss`."""
    new_logprobs = packed_logprobs(model, pack(queries, responses, pad_id, capacity), temperature)
    lengths = torch.tensor([len(r) for r in responses], device=new_logprobs.device)
    padding_mask = torch.arange(new_logprobs.shape[1], device=new_logprobs.device)[None] >= lengths[:, None]
    new_seq_logprobs = sequence_logprobs(new_logprobs, padding_mask)
    return reinforce_loss(new_seq_logprobs, old_seq_logprobs, advantages, cliprange)


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


def main(args: Args) -> dict:
    accelerator = make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=False)  # endless loader
    if accelerator.device.type == "cpu":  # one BLAS pool per process, or the processes fight over cores
        torch.set_num_threads(args.num_threads or cpu_threads(accelerator.num_processes))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}"
    check_args(args)
    run = Run(args, accelerator, PRESETS)  # refuses a used run directory now, before anything loads
    set_seed(args.seed)
    device = accelerator.device

    # ---- batch arithmetic: every prompt's k samples stay on one process, so the baseline needs no communication ----
    if args.per_device_batch_size % args.rloo_k:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} is not a multiple of rloo_k "
            f"(--rloo-k {args.rloo_k}): each process samples whole groups of k responses to a prompt"
        )
    prompts_per_device = args.per_device_batch_size // args.rloo_k
    mini_batch_size = args.per_device_batch_size // args.num_mini_batches
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    if micro_batch_size * args.gradient_accumulation_steps * args.num_mini_batches != args.per_device_batch_size:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} does not split into "
            f"--num-mini-batches {args.num_mini_batches} x --gradient-accumulation-steps "
            f"{args.gradient_accumulation_steps} equal micro-batches"
        )
    if args.cliprange <= 0:
        raise SystemExit(f"error: --cliprange is {args.cliprange}; it must be above 0")
    batch_size = args.per_device_batch_size * accelerator.num_processes
    num_updates = args.total_episodes // batch_size
    if num_updates == 0:
        raise SystemExit(
            f"error: --total-episodes {args.total_episodes} is less than one batch of {batch_size} "
            f"(--per-device-batch-size {args.per_device_batch_size} x {accelerator.num_processes} "
            "processes)"
        )

    # ---- models: policy (trained), reference and reward model (frozen); no value model ----
    tokenizer = load_tokenizer(args)
    policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "policy", "--sft-model-path")
    check_finite_weights(policy, run, "--sft-model-path", args.sft_model_path)
    if tokenizer.pad_token_id >= policy.config.vocab_size:  # prompts are left-padded with it: it needs an embedding row
        raise SystemExit(
            f"error: the pad token id {tokenizer.pad_token_id} is past the embedding of "
            f"{args.sft_model_path} ({policy.config.vocab_size} rows); add the pad token at the SFT stage "
            "(sft.py --add-pad-token)"
        )
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy = add_lora(policy, args)  # --lora-r: the adapters alone are trained
    ref_policy = None  # with LoRA the reference is the policy with its adapters disabled (LoraReference), not a copy
    if not args.lora_r:
        ref_policy = (
            load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "reference", "--sft-model-path")
            .eval()
            .requires_grad_(False)
        )
        ref_policy.generation_config.pad_token_id = tokenizer.pad_token_id
    reward_model = load_reward_model(args, tokenizer) if args.reward_source == "model" else None
    if reward_model is not None:
        check_finite_weights(reward_model, run, "--reward-model-path", args.reward_model_path)
    if reward_model is not None:  # its own forward refuses batches without a pad id (the score is read by position)
        reward_model.config.pad_token_id = tokenizer.pad_token_id

    # ---- data: every field training and evaluation use is checked now, before the first update ----
    config = policy.config
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions is not None and args.response_length >= max_positions:
        raise SystemExit(
            f"error: --response-length {args.response_length} leaves no room for a prompt in the "
            f"{max_positions} positions of --sft-model-path (max_position_embeddings)"
        )
    train_ds = load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    train_rows = prepare_prompts(train_ds, tokenizer, args, args.train_split, max_positions, evaluation=False)
    eval_ds = load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
    eval_rows = prepare_prompts(
        eval_ds.select(range(min(args.num_eval_examples, len(eval_ds)))),
        tokenizer,
        args,
        args.eval_split,
        max_positions,
        evaluation=True,
    )
    if len(train_rows) < prompts_per_device:  # the endless loader below would never yield a batch
        raise SystemExit(
            f"error: split '{args.train_split}' has {len(train_rows)} usable prompts, fewer than one "
            f"batch of {prompts_per_device} (--per-device-batch-size / --rloo-k)"
        )
    loader = torch.utils.data.DataLoader(
        list(range(len(train_rows))),
        batch_size=prompts_per_device,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )

    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps)
    configure_deepspeed(accelerator, micro_batch_size, args.max_grad_norm)  # the samples of one backward pass
    model, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    ref_policy, reward_model = (prepare_frozen(m, accelerator) for m in (ref_policy, reward_model))
    if args.lora_r:
        ref_policy = LoraReference(accelerator.unwrap_model(model))
    use_sampler_logprobs = (
        args.sampler_logprobs
        if args.sampler_logprobs is not None
        else args.dtype == "float32" and accelerator.mixed_precision == "no"
    )
    synced = zero3(accelerator)  # ZeRO-3: every forward pass is a collective, so sampling steps in step on all ranks
    unwrapped = accelerator.unwrap_model(model)
    check_packing(unwrapped)
    run.begin()

    def batches():
        while True:
            yield from loader

    def loop_state(update: int) -> dict:
        """The loop's state after `update` updates (the learning rate follows from it; the data position is
        replayed)."""
        return {"step": update, "episode": update * batch_size, "metrics": metrics}

    iterator, start = batches(), 0
    if state := run.resume():  # weights, optimizer and every process's RNG; the loop's counters below
        start, metrics = state["step"], state["metrics"]
        for _ in range(start):  # the prompts the finished updates drew (the loader's own generator, no compute)
            next(iterator)
    else:
        metrics = evaluate(unwrapped, reward_model, tokenizer, eval_rows, args, accelerator, ref_policy)
        run.log(metrics, 0, 0)
        accelerator.print("before training: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    start_time = time.time()
    progress = tqdm(
        range(start + 1, num_updates + 1),
        initial=start,
        total=num_updates,
        disable=not accelerator.is_main_process,
        desc="rloo",
    )
    for update in progress:
        if args.anneal_lr:
            for group in optimizer.param_groups:
                group["lr"] = (1.0 - (update - 1.0) / num_updates) * args.learning_rate
        # k consecutive copies of every prompt (prompt-major), the layout rloo_advantages expects
        rows = [train_rows[i] for i in next(iterator).tolist() for _ in range(args.rloo_k)]

        # ---- 1. rollout: sample; the logprobs are the sampler's (or a forward pass's), the reference's a forward pass
        # ----
        with torch.no_grad():
            queries, qmask = left_pad([r["prompt_ids"] for r in rows], tokenizer.pad_token_id)
            queries, qmask = queries.to(device), qmask.to(device)
            # When every sample stops early, fewer than response_length columns come back; no forward pass below spends
            # time on all-pad columns (as in ppo_rlhf.py).
            stop_id = tokenizer.eos_token_id if args.stop_token == "eos" else -1  # -1 never matches: no row stops early
            sampled = None
            try:
                sampled = sample_responses(
                    unwrapped,
                    queries,
                    qmask,
                    stop_id,
                    tokenizer.pad_token_id,
                    args.response_length,
                    args.temperature,
                    synced=synced,
                )
            except RuntimeError as e:  # torch.multinomial: "probability tensor contains either inf, nan or element < 0"
                if "probability tensor" not in str(e):
                    raise
            if not run.all_finite(sampled[1] if sampled else torch.tensor(float("nan"))):
                run.stop(loop_state(update - 1), non_finite_policy(update, args))
            responses, logprobs, entropy = sampled

            # ---- 2. reward: truncate after EOS, score, penalise responses that never end ----
            postprocessed = (
                truncate_response(responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
                if args.stop_token == "eos"
                else responses
            )
            sequence_lengths = (
                first_true_indices(postprocessed == tokenizer.pad_token_id) - 1
            )  # index of the last real token
            if run.any_process(bool((sequence_lengths < 0).any())):
                run.stop(
                    loop_state(update - 1),
                    f"a response sampled at update {update} is empty (its first token is "
                    f"the pad token {tokenizer.pad_token_id}): the policy samples PAD; check --sft-model-path",
                )
            texts = tokenizer.batch_decode(postprocessed, skip_special_tokens=True)
            scores, contain_eos = score_responses(reward_model, queries, postprocessed, texts, rows, tokenizer, args)
            response_idxs = torch.arange(responses.shape[1], device=device).repeat(responses.shape[0], 1)
            padding_mask = response_idxs > sequence_lengths.unsqueeze(1)

            # every forward pass runs on `pack`ed query + response token lists (no padding, see pack)
            query_tokens = [q[m.bool()].tolist() for q, m in zip(queries, qmask)]
            response_tokens = [r[: n + 1].tolist() for r, n in zip(postprocessed, sequence_lengths.tolist())]
            capacity = args.max_prompt_length + args.response_length
            packed = pack(query_tokens, response_tokens, tokenizer.pad_token_id, capacity)
            C = packed["targets"].shape[1]
            if not use_sampler_logprobs:
                logprobs = torch.zeros_like(logprobs)
                logprobs[:, :C] = packed_logprobs(model, packed, args.temperature)
            ref_logprobs = torch.zeros_like(logprobs)
            ref_logprobs[:, :C] = packed_logprobs(ref_policy, packed, args.temperature)
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)

            # ---- 3. sequence-level reward and leave-one-out advantages ----
            seq_kl = sequence_kl(logprobs, ref_logprobs, padding_mask, args.kl_estimator)
            rlhf_reward = sequence_rewards(scores, seq_kl, args.kl_coef)
            advantages = rloo_advantages(rlhf_reward, args.rloo_k)
            if args.normalize_advantage:
                advantages = masked_whiten(advantages, torch.ones_like(advantages))
            old_seq_logprobs = sequence_logprobs(logprobs, padding_mask)

        # ---- 4. REINFORCE (several clipped passes when asked) ----
        stats = {k: [] for k in ("approxkl", "clipfrac", "pg_loss", "ratio")}
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.per_device_batch_size, device=device)
            for mb_start in range(0, args.per_device_batch_size, mini_batch_size):
                for micro_start in range(mb_start, mb_start + mini_batch_size, micro_batch_size):
                    with accelerator.accumulate(model):
                        mb = order[micro_start : micro_start + micro_batch_size]
                        mb_list = mb.tolist()
                        mb_queries = [query_tokens[i] for i in mb_list]
                        mb_responses = [response_tokens[i] for i in mb_list]
                        pg_loss, pg_stats = rloo_micro_batch_loss(
                            model,
                            mb_queries,
                            mb_responses,
                            old_seq_logprobs[mb],
                            advantages[mb],
                            tokenizer.pad_token_id,
                            capacity,
                            args.temperature,
                            args.cliprange,
                        )
                        if not run.all_finite(pg_loss):  # a collective: every process checks every micro-batch
                            run.stop(
                                loop_state(update - 1),
                                f"non-finite RLOO loss at update {update}: lower "
                                f"--learning-rate (now {args.learning_rate:g}) or check the rewards",
                            )
                        # a mean over this micro-batch's responses: every micro-batch holds micro_batch_size of them, so
                        # accelerate's 1 / accumulation steps and DDP's process average make it the mini-batch's mean
                        accelerator.backward(pg_loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                                run.stop(
                                    loop_state(update - 1),
                                    f"non-finite gradient norm at update {update}: lower "
                                    f"--learning-rate (now {args.learning_rate:g})",
                                )
                        optimizer.step()
                        optimizer.zero_grad()
                    for k, v in (
                        ("approxkl", pg_stats["approxkl"]),
                        ("clipfrac", pg_stats["clipfrac"]),
                        ("pg_loss", pg_loss),
                        ("ratio", pg_stats["ratio"]),
                    ):
                        stats[k].append(v.detach())

        # ---- logging ----
        episode = update * batch_size
        if update % args.log_every == 0 or update == num_updates:
            g = lambda x: accelerator.gather(x.float().mean()[None]).mean().item()  # noqa: E731
            logged = {
                "objective/reward": g(scores),
                "objective/kl": g(seq_kl),
                "objective/entropy": g((entropy * ~padding_mask).sum(1)),
                "objective/non_score_reward": g(-args.kl_coef * seq_kl),
                "objective/rlhf_reward": g(rlhf_reward),
                "objective/advantage_std": g(advantages.std()),
                "objective/completion_length": g((sequence_lengths + 1).float()),
                "objective/eos_rate": g(contain_eos.float()),
                "policy/approxkl_avg": g(torch.stack(stats["approxkl"])),
                "policy/clipfrac_avg": g(torch.stack(stats["clipfrac"])),
                "loss/policy_avg": g(torch.stack(stats["pg_loss"])),
                "val/ratio": g(torch.stack(stats["ratio"])),
                "val/num_eos_tokens": g((responses == tokenizer.eos_token_id).sum(1).float()),
                "objective/kl_coef": args.kl_coef,
                "lr": optimizer.param_groups[0]["lr"],
                "perf/episodes_per_sec": (update - start) * batch_size / (time.time() - start_time),
                "perf/peak_mem_gb": peak_mem_gb(device),
            }
            run.log(logged, update, episode)
            progress.set_postfix(reward=f"{logged['objective/reward']:.3f}", kl=f"{logged['objective/kl']:.2f}")
        if update % args.eval_every == 0 or update == num_updates:
            metrics = evaluate(unwrapped, reward_model, tokenizer, eval_rows, args, accelerator, ref_policy)
            run.log(metrics, update, episode)
            accelerator.print(f"update {update}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            run.log_samples([{"response": t, "score": s} for t, s in list(zip(texts, scores.tolist()))[:4]], update)
        if run.stop_requested():  # a collective: every process asks after every update
            run.stop(loop_state(update))
        if args.save_every and update % args.save_every == 0 and update < num_updates:
            run.checkpoint(loop_state(update))
    progress.close()

    run.finish(
        model,
        tokenizer,
        {
            "step": num_updates,
            "episode": num_updates * batch_size,
            "total_steps": num_updates,
            "total_episodes": num_updates * batch_size,
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


def render(template: str, row: dict, index: int, split: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the row, the field and the flag, never a silent `None` or `[...]`."""
    for name in template_fields(template, flag):
        value = row.get(name)
        if name not in row:
            raise SystemExit(
                f"error: row {index} of split '{split}' has no field '{name}' used by the {what} template "
                f"({flag} {template!r}); its fields are {sorted(row)}"
            )
        if value is None:
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is missing or null; fill it in or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' holds chat messages, which a "
                f"text template cannot hold; pass {flag} '{{{name}}}' alone to render them with the "
                "tokenizer's chat template"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is a {type(value).__name__}, not text: {str(value)[:60]!r}"
            )
    try:
        text = template.format(**row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(
            f"error: row {index} of split '{split}': {flag} {template!r} cannot be filled in: {e}"
        ) from None
    if not text.strip():
        raise SystemExit(f"error: row {index} of split '{split}' renders an empty {what} ({flag} {template!r})")
    return text


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
# Metrics
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Shared RL pieces (copied from ppo_rlhf.py)
# ----------------------------------------------------------------------------------------------------


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True in each row, or the row length when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(responses: torch.Tensor, stop_token_id: int, pad_id: int) -> torch.Tensor:
    """Everything after the first stop token (EOS) becomes pad; the stop token itself is kept."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.size(1), device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_id)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the valid (mask = 1) entries only; padding must not move the statistics."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimates from samples of the policy (Schulman, "Approximating KL
    divergence", 2020): k1 = log r with r = p/q (unbiased, can be negative), k3 = (r^-1 - 1) + log r (unbiased,
    >= 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    return torch.exp(-log_ratio) - 1 + log_ratio


def padded_inputs(query_responses: torch.Tensor, pad_id: int) -> dict:
    """Attention mask from the pad token (PAD != EOS is checked at load) and position ids that start at 0 on
    the first real token, so a left-padded query scores the same as an unpadded one."""
    attention_mask = (query_responses != pad_id).long()
    position_ids = (attention_mask.cumsum(1) - attention_mask).clamp(min=0)
    return {
        "input_ids": query_responses.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


@torch.no_grad()
def sample_responses(
    model,
    queries: torch.Tensor,
    qmask: torch.Tensor,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
    synced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled responses (B, T), PAD after each one's first EOS, with the logprob and the entropy of softmax(logits / T)
    at every sampled token (T: the steps decoded, at most max_new_tokens). Plain sampling, no top-k / top-p. A
    hand-written loop over the model's KV cache rather than `model.generate`: a finished response leaves the batch (its
    rows are dropped from the cache), so the batch shrinks instead of decoding padding until the longest response
    ends, and the logprobs of the sampling policy come for free (see --sampler-logprobs). `synced` (DeepSpeed ZeRO-3,
    where every forward pass is a collective of all ranks): every rank makes as many forward passes as the rank that
    decodes longest; a rank whose rows have all ended keeps one of them in the batch as a dummy (nothing of it is
    written, no random number is drawn) until the all-reduced flag says no rank has a row left to decode."""
    B, device = len(queries), queries.device
    cache = DynamicCache()
    position = (qmask.cumsum(1) - 1).clamp(min=0)
    logits = model(
        input_ids=queries,
        attention_mask=qmask,
        position_ids=position,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    mask, position, alive = qmask, position[:, -1], torch.arange(B, device=device)  # alive: rows still being decoded
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs, entropy = torch.zeros(B, max_new_tokens, device=device), torch.zeros(B, max_new_tokens, device=device)
    steps, live = max_new_tokens, True  # live: this rank still has a row being decoded
    for t in range(max_new_tokens):
        if live:
            logp = (logits.float() / (temperature + 1e-7)).log_softmax(-1)
            token = torch.multinomial(logp.exp(), 1).squeeze(1)
            tokens[alive, t], logprobs[alive, t] = token, logp.gather(1, token[:, None]).squeeze(1)
            entropy[alive, t] = -(logp.exp() * logp).sum(-1)
            keep = (token != eos_id).nonzero().squeeze(1)
            if len(keep) == 0:
                steps, live = t + 1, False
                if not synced:
                    break
                keep = keep.new_zeros(1)  # one finished row stays in the batch as a dummy, its outputs never written
            if len(keep) < len(alive):
                alive, token, mask, position = alive[keep], token[keep], mask[keep], position[keep]
                cache.batch_select_indices(keep)
        if synced:  # 1 while this rank decodes; the max over ranks says whether any rank still does
            flag = torch.tensor([float(live)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() == 0:
                break
        if t + 1 < max_new_tokens:
            mask, position = torch.cat([mask, mask.new_ones(len(alive), 1)], 1), position + 1
            logits = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
    return tokens[:, :steps], logprobs[:, :steps], entropy[:, :steps]


def math_verify_equal(gold: str, predicted: str | None) -> bool:
    """MATH grading with math-verify: both answers wrapped in `\\boxed{}` (what its LaTeX extractor looks for), gold
    first (`verify` is not symmetric: the gold decides e.g. whether a set or an interval is meant). math-verify has its
    own timeouts (signal based, main thread only); any exception counts as wrong, never a crash."""
    if predicted is None:
        return False
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{predicted}}}")))
    except Exception:
        return False


def extract_answer(text: str, answer_format: str) -> str | None:
    return (extract_gsm8k_answer if answer_format == "gsm8k" else extract_boxed_answer)(text)


def success_reward(text: str, gold: str, answer_format: str) -> float:
    """1.0 if the completion's final answer equals the gold answer (numerically for GSM8K, math-verify for MATH)."""
    predicted = extract_answer(text, answer_format)
    return float(numbers_equal(predicted, gold) if answer_format == "gsm8k" else math_verify_equal(gold, predicted))


# ----------------------------------------------------------------------------------------------------
# Data, rewards and evaluation (copied from ppo_rlhf.py)
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def score_responses(
    reward_model,
    queries: torch.Tensor,
    postprocessed: torch.Tensor,
    texts: list[str],
    rows: list[dict],
    tokenizer,
    args: Args,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The score of each truncated response (reward model at the last real token, or the verifiable math reward),
    replaced by `penalty_reward_value` when the response has no EOS (N+). Returns (scores, contain_eos)."""
    if args.reward_source == "model":
        scores = outcome_reward(
            reward_model,
            **{
                k: v
                for k, v in padded_inputs(torch.cat([queries, postprocessed], 1), tokenizer.pad_token_id).items()
                if k != "position_ids"
            },
        ).float()
    else:
        scores = torch.tensor(
            [success_reward(t, r["gold"], args.answer_format) for t, r in zip(texts, rows)], device=queries.device
        )
    contain_eos = (postprocessed == tokenizer.eos_token_id).any(dim=1)
    if args.non_eos_penalty:
        scores = torch.where(contain_eos, scores, torch.full_like(scores, args.penalty_reward_value))
    return scores, contain_eos


def prompt_token_ids(row: dict, index: int, split: str, tokenizer, args: Args) -> list[int]:
    """The prompt of a row as token ids: `--prompt-template` filled in (wrapped as a user message with
    `--use-chat-template`), or, where the template is one field holding chat messages (TRL's conversational prompt
    format, {"prompt": [{"role": "user", "content": ...}]}), those messages in the tokenizer's chat template, ready for
    the assistant's turn."""
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render(args.prompt_template, row, index, split, "prompt", "--prompt-template")
        if not args.use_chat_template:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not tokenizer.chat_template:
            raise SystemExit(
                f"error: --use-chat-template: the tokenizer of --sft-model-path {args.sft_model_path} has "
                "no chat template; drop the flag or give a model that has one"
            )
        messages = [{"role": "user", "content": prompt}]
    elif messages[-1]["role"] == "assistant":
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --prompt-template "
            f"{args.prompt_template!r} end with an assistant turn; an RL prompt ends before the answer: "
            "give the prompt's messages only (TRL's conversational prompt format, the completion "
            "elsewhere)"
        )
    elif not tokenizer.chat_template:
        raise SystemExit(
            f"error: row {index} of split '{split}' holds chat messages, but the tokenizer of "
            f"--sft-model-path {args.sft_model_path} has no chat template to render them; give "
            "plain-text prompts or a model with a chat template"
        )
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def reference_text(row: dict, index: int, split: str, args: Args) -> str:
    """The reference response: `--reference-template` filled in, or the assistant turns of a field of chat messages
    (TRL's conversational completion, [{"role": "assistant", "content": ...}])."""
    messages = whole_field_messages(args.reference_template, row)
    if messages is None:
        return render(args.reference_template, row, index, split, "reference", "--reference-template")
    text = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
    if not text.strip():
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --reference-template "
            f"{args.reference_template!r} hold no assistant turn to take the reference from"
        )
    return text


def prepare_prompts(
    ds: Dataset, tokenizer, args: Args, split: str, max_positions: int | None, evaluation: bool
) -> list[dict]:
    """Prompt token ids plus what the reward and evaluation need: the reference response, the gold answer (math) and
    the key facts (tiny-tldr), each checked on every row now, so a bad row fails before the first update and not at
    an evaluation hours in. A prompt longer than `--max-prompt-length`, or one that leaves fewer than
    `--response-length` of the model's positions, is an error (or dropped with `--drop-overlong`)."""
    rows, dropped = [], 0
    needs_gold = args.reward_source == "math" or (evaluation and args.eval_task in ("gsm8k", "boxed"))
    needs_reference = needs_gold or (evaluation and args.eval_task == "tldr")
    for i, row in enumerate(ds):
        ids = prompt_token_ids(row, i, split, tokenizer, args)
        too_long = len(ids) > args.max_prompt_length
        no_room = max_positions is not None and len(ids) + args.response_length > max_positions
        if too_long or no_room:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_long:
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(ids)}-token prompt; the limit is "
                    f"--max-prompt-length {args.max_prompt_length}. Raise it or pass --drop-overlong."
                )
            raise SystemExit(
                f"error: row {i} of split '{split}' has a {len(ids)}-token prompt, and --response-length "
                f"{args.response_length} more tokens do not fit the {max_positions} positions of "
                f"--sft-model-path (max_position_embeddings); lower --max-prompt-length (now "
                f"{args.max_prompt_length}) with --drop-overlong, or --response-length"
            )
        item = {"prompt_ids": ids, "reference": None, "facts": None}
        if needs_reference:
            item["reference"] = reference_text(row, i, split, args)
        if needs_gold:
            item["gold"] = (extract_gsm8k_answer if args.answer_format == "gsm8k" else extract_boxed_answer)(
                item["reference"]
            )
            if item["gold"] is None:
                raise SystemExit(
                    f"error: row {i} of split '{split}': the reference {item['reference'][-80:]!r} has no "
                    f"final answer in the {args.answer_format} format (--reference-template, "
                    "--answer-format)"
                )
        if evaluation and args.eval_task == "tldr":
            facts = row.get("facts")
            if not (isinstance(facts, list) and facts and all(isinstance(f, str) for f in facts)):
                found = "has none" if facts is None else f"holds {str(facts)[:60]!r}"
                raise SystemExit(
                    f"error: row {i} of split '{split}': --eval-task tldr judges summaries by the row's "
                    f"'facts' (a list of words, as in tiny-tldr), but it {found}; use --eval-task none "
                    "for other data"
                )
            item["facts"] = facts
        rows.append(item)
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} prompts of '{split}' longer than --max-prompt-length "
            f"{args.max_prompt_length} or than the model's positions less --response-length"
        )
    if not rows:
        raise SystemExit(f"error: no usable prompts in split '{split}'")
    return rows


@torch.no_grad()
def sampled_kl(policy, reference, queries, qmask, response_length: int, pad_id: int, eos_id: int, synced: bool) -> list:
    """(--eval-kl) KL(pi || pi_ref) per prompt, estimated the same way in every script (the x-axis of the benchmark's
    gold-reward-against-KL frontier): one response sampled at temperature 1, then the sum over its tokens of
    log pi - log pi_ref (the unbiased k1 estimator, Schulman 2020 "Approximating KL Divergence"). Its own generator
    seeded from the prompts, so evaluating leaves the training's random stream alone and repeats exactly."""
    devices = [queries.device.index or 0] if queries.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(queries.sum()))
        out = policy.generate(
            input_ids=queries,
            attention_mask=qmask,
            max_new_tokens=response_length,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            synced_gpus=synced,
        )
    responses = out[:, queries.shape[1] :]
    ended = (responses == eos_id).long()
    # the response up to its first EOS, from positions, not from the pad id: a sampled pad token is a token
    valid = (ended.cumsum(1) - ended == 0).long()
    mask = torch.cat([qmask, valid], 1)
    inputs = {
        "input_ids": torch.cat([queries, responses], 1).masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - mask).clamp(min=0),
    }
    kl = torch.zeros(len(queries), device=queries.device)
    for model, sign in ((policy, 1.0), (reference, -1.0)):
        logits = model(**inputs, logits_to_keep=responses.shape[1] + 1).logits[:, :-1].float()
        logprobs = torch.gather(logits.log_softmax(-1), 2, responses[..., None])[..., 0]
        kl += sign * (logprobs * valid).sum(1)
    return kl.tolist()


@torch.no_grad()
def evaluate(
    policy, reward_model, tokenizer, rows: list[dict], args: Args, accelerator: Accelerator, reference=None
) -> dict:
    """Greedy responses to the evaluation prompts, scored by the task's judge (and the reward model if any)."""
    policy.eval()
    records = []
    # under ZeRO-3 every forward pass is a collective: every rank gets as many rows (the last one repeated), so as
    # many batches, and `generate` keeps stepping until every rank is done
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
                scores = outcome_reward(
                    reward_model,
                    **{
                        k: v
                        for k, v in padded_inputs(torch.cat([queries, responses], 1), tokenizer.pad_token_id).items()
                        if k != "position_ids"
                    },
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
                elif args.eval_task in ("gsm8k", "boxed"):
                    rec["correct"] = success_reward(text, r["gold"], args.answer_format)
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
    elif args.eval_task in ("gsm8k", "boxed"):
        metrics["eval/accuracy"] = sum(r["correct"] for r in records) / n
    return metrics


def load_pretrained(cls, path: str, args: Args, what: str, flag: str, **kwargs):
    local = os.path.isdir(path)
    if not local:
        require_hub(path, "model", flag)
    try:
        model = cls.from_pretrained(
            path,
            trust_remote_code=args.trust_remote_code,
            local_files_only=local,
            dtype=getattr(torch, args.dtype),
            **kwargs,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # no config.json, no weights, mismatched shapes
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(f"error: {flag} {path} cannot be loaded as the {what} ({cls.__name__}): {reason}") from None
    for module in model.modules():  # N+: dropout off, so rollout and training logprobs agree
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def load_tokenizer(args: Args):
    """The SFT model's tokenizer, with a pad token distinct from EOS (`ensure_pad_token`)."""
    local = os.path.isdir(args.sft_model_path)
    if not local:
        require_hub(args.sft_model_path, "model", "--sft-model-path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            args.sft_model_path, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: --sft-model-path {args.sft_model_path} holds no tokenizer that transformers can "
            f"load (is it a model saved with save_pretrained?): {reason}"
        ) from None
    return ensure_pad_token(tokenizer, args.add_pad_token, args.sft_model_path)


def load_reward_model(args: Args, tokenizer):
    """The frozen outcome reward model of `--reward-model-path` (saved by reward_model.py: a sequence classifier with
    one label), checked before training: a process reward model, or one whose tokenizer gives the policy's tokens
    other ids (it scores the policy's token ids), is a one-line error. A checkpoint without a trained score head (a
    causal LM) loads with a random head: a warning."""
    path, flag = args.reward_model_path, "--reward-model-path"
    if path is None:
        raise SystemExit("error: --reward-source model needs --reward-model-path (or --reward-source math)")
    model = load_pretrained(AutoModelForSequenceClassification, path, args, "reward model", flag, num_labels=1)
    kind = getattr(model.config, "reward_type", "outcome")
    if kind != "outcome":
        raise SystemExit(
            f"error: {flag} {path} is a {kind} reward model (config.reward_type); this script scores "
            "whole responses: give an outcome reward model (reward_model.py --objective outcome)"
        )
    if not any(a.endswith("ForSequenceClassification") for a in model.config.architectures or []):
        print(
            f"warning: {flag} {path} is a {(model.config.architectures or ['?'])[0]}, not a reward model: its score "
            "head is untrained, so the rewards are noise",
            file=sys.stderr,
        )
    try:
        rm_vocab = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path)).get_vocab()
    except (OSError, ValueError, KeyError, TypeError):
        rm_vocab = None  # no tokenizer saved with it: nothing to compare
    if rm_vocab is not None:
        differ = [t for t, i in tokenizer.get_vocab().items() if i != tokenizer.pad_token_id and rm_vocab.get(t) != i]
        if differ:
            raise SystemExit(
                f"error: the tokenizer of {flag} {path} differs from the policy's ({len(differ)} tokens, "
                f"e.g. {differ[0]!r}); it scores the policy's token ids, so it needs the same tokenizer"
            )
    return model.eval().requires_grad_(False)


def non_finite_policy(update: int, args: Args) -> str:
    """The error line of a policy whose logits are no longer finite, met by sampling (torch's "probability tensor
    contains either inf, nan or element < 0"): the update before moved the weights too far in one step whose loss and
    gradient were finite (Adam moves each weight by about the learning rate), so the checks before the optimizer step
    could not see it."""
    if update == 1:
        return f"the logits of --sft-model-path {args.sft_model_path} are not finite (inf or nan); nothing to sample"
    return (
        f"the policy's logits are not finite at update {update} (sampling met inf or nan): update {update - 1} "
        f"moved the weights too far; lower --learning-rate (now {args.learning_rate:g}) and start over with "
        "--overwrite"
    )


def check_finite_weights(model, run: Run, flag: str, path: str) -> None:
    """A checkpoint with a NaN or inf weight (saved by a run that diverged, or broken in conversion) is a one-line
    error now, not NaN logits at the first update. Under ZeRO-3 each process checks its shard (`ds_tensor`); the
    answer is or-ed over the processes."""
    bad = next(
        (name for name, p in model.named_parameters() if not torch.isfinite(getattr(p, "ds_tensor", p)).all()), None
    )
    if run.any_process(bad is not None):
        raise SystemExit(
            f"error: {flag} {path} has non-finite weights ({bad or 'on another process'}): the run that "
            "saved it diverged, or the file is broken; give a finite checkpoint"
        )


# ----------------------------------------------------------------------------------------------------
# Engines: one process, DDP, DeepSpeed ZeRO-2/3 and FSDP, all through `accelerate launch`
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Durable runs: the run directory, checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the
# argument checks (copied verbatim between scripts; tests/test_faults.py)
# ----------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Speed work (skippable on a first reading): the same results, faster
# --------------------------------------------------------------------------------------------------


def pack(queries: list[list[int]], responses: list[list[int]], pad_id: int, capacity: int) -> dict:
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


def packed_logprobs(model, packed: dict, temperature: float) -> torch.Tensor:
    """Logprobs (N, C) of the response tokens of a `pack`ed batch under logits / temperature (N+ detail).
    use_cache=False: with a cache, transformers would not read the packing from the position ids."""
    device = next(model.parameters()).device
    rows, cols = packed["rows"].to(device), packed["cols"].to(device)
    keep = cols.unique()  # sorted; the LM head runs on the columns that predict a response token, not on the prompts
    logits = model(
        input_ids=packed["input_ids"].to(device),
        position_ids=packed["position_ids"].to(device),
        use_cache=False,
        logits_to_keep=keep,
    ).logits
    logits = logits[rows, torch.searchsorted(keep, cols)].float() / (temperature + 1e-7)
    return torch.gather(logits.log_softmax(-1), 2, packed["targets"].to(device).unsqueeze(-1)).squeeze(-1)


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
