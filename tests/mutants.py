"""Planted algorithmic bugs (issue 66 item 4): each a textual patch `old` -> `new` of one library script, applied to a
copy by tests/test_mutations.py, which runs the main job's stage of that script for a few updates and asserts that
`benchmark.reproduce`'s early check says "differs". Each is a mistake a port or a fork of an RLHF library makes, in a
computation the stage's preset runs (its loss type, KL estimator and coefficient, whitening, advantage estimator), and
moves a statistic of the first logged training rows (the comment above each says which, and at which update; sft.py
and reward_model.py log every 10 steps, offline DPO every 5, the others every update). An `equivalent` mutant changes
no number of its stage, weights or logged statistics; it is listed, not counted.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str  # short id, e.g. "ppo-kl-sign"
    script: str  # e.g. "ppo_rlhf.py"
    stage: str  # the main job's run name it changes, e.g. "ppo_tiny-tldr__1"
    old: str  # exact text occurring EXACTLY ONCE in the script
    new: str
    what: str  # one line: the bug, as a user would describe it
    equivalent: bool = False  # True when it changes no trained weight (e.g. a constant rescaling Adam cannot see)
    logged: bool = True  # an equivalent one: whether a logged statistic still moves (else it must pass as honest)


MUTANTS = [
    # ---- sft.py ----
    # step 10 (row 1): train/loss (the prompt tokens' cross-entropy joins the mean), train/grad_norm
    Mutant(
        name="sft-prompt-in-loss",
        script="sft.py",
        stage="sft_tiny-tldr__1",
        old='labels[i, len(e["prompt_ids"]) : len(s)] = torch.tensor(e["response_ids"])',
        new="labels[i, : len(s)] = torch.tensor(s)",
        what="SFT trains on the prompt tokens too: the labels are the whole sequence, not the response and its EOS",
    ),
    # step 10 (row 1): lr (x3), then train/loss and train/grad_norm
    Mutant(
        name="sft-lr-x3",
        script="sft.py",
        stage="sft_tiny-tldr__1",
        old='dataset_name_or_path="runs/assets/tiny-tldr/sft",\n            learning_rate=1e-3,',
        new='dataset_name_or_path="runs/assets/tiny-tldr/sft",\n            learning_rate=3e-3,',
        what="the tiny-tldr SFT preset's learning rate is 3e-3, three times the library's 1e-3",
    ),
    # step 10 (row 1): train/loss (predicting the token it reads is learnt at once: the loss collapses), grad_norm
    Mutant(
        name="sft-no-shift",
        script="sft.py",
        stage="sft_tiny-math__1",
        old="logits, labels = logits[:, :-1].float(), labels[:, 1:]",
        new="logits, labels = logits.float(), labels",
        what="the SFT loss forgets the next-token shift: the logits at position t are scored against token t itself",
    ),
    # ---- reward_model.py ----
    # step 10 (row 1): train/loss (-log sigmoid(d - 1) starts at 1.31, not 0.69), train/reward_margin, grad_norm
    Mutant(
        name="rm-margin",
        script="reward_model.py",
        stage="rm_tiny-tldr__1",
        old="diff = r_chosen - r_rejected - (margin if margin is not None else 0.0)",
        new="diff = r_chosen - r_rejected - (margin if margin is not None else 0.0) - 1.0",
        what="the Bradley-Terry loss has a fixed margin of 1 built in (Llama 2's margin loss without a margin field)",
    ),
    # step 10 (row 1): train/accuracy (below 0.5), train/reward_margin (negative), train/loss
    Mutant(
        name="rm-loss-swapped",
        script="reward_model.py",
        stage="rm_tiny-tldr__1",
        old='loss = bradley_terry_loss(r_chosen, r_rejected, batch["margin"]',
        new='loss = bradley_terry_loss(r_rejected, r_chosen, batch["margin"]',
        what="the reward model's loss takes chosen and rejected the wrong way round (its accuracy statistic does not)",
    ),
    # ---- ppo_rlhf.py (tiny-tldr: k1 KL in the reward, kl_coef 0.05, advantages whitened, clip 0.2, EOS penalty) ----
    # update 2: objective/non_score_reward (sign), objective/rlhf_reward, then every loss statistic; update 1's KL is
    # ~1e-7 (policy = reference), so row 1 cannot show it
    Mutant(
        name="ppo-kl-sign",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="non_score_reward = -kl_coef * kl",
        new="non_score_reward = kl_coef * kl",
        what="PPO's per-token KL penalty has its sign flipped: the reward pays the policy for moving off the reference",
    ),
    # update 2: objective/kl (k3 per sample instead of k1), objective/non_score_reward, rlhf_reward, loss/policy_avg
    Mutant(
        name="ppo-kl-k3",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator, args.kl_clamp, args.log_ratio_clamp)",
        new='kl = kl_penalty(logprobs, ref_logprobs, "k3", args.kl_clamp, args.log_ratio_clamp)',
        what="PPO's reward takes the k3 KL estimator whatever --kl-estimator says (the preset's, and N+'s, is k1)",
    ),
    # update 1: objective/kl, objective/non_score_reward, objective/rlhf_reward (the KL is no longer ~0 at the start)
    Mutant(
        name="ppo-ref-temperature",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old='ref_logprobs[:, :width] = response_logprobs(ref_logits, packed["targets"], args.temperature)[:, :width]',
        new='ref_logprobs[:, :width] = response_logprobs(ref_logits, packed["targets"], 1.0)[:, :width]',
        what="the reference logprobs are taken at temperature 1, the policy's at the sampling temperature 0.7",
    ),
    # update 1: loss/policy_avg (raw GAE advantages: no longer mean 0 over the batch), policy/approxkl_avg, val/ratio
    Mutant(
        name="ppo-no-whiten",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)",
        new="advantages = advantages.masked_fill(padding_mask, 0)",
        what="PPO's advantages are not whitened over the batch's valid tokens",
    ),
    # update 1 when a token's ratio leaves [0.8, 1.2] in its later epochs (policy/clipfrac_avg > 0 in the honest
    # run): loss/policy_avg, policy/approxkl_avg, val/ratio; then update 2's rollout statistics
    Mutant(
        name="ppo-no-clip",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="per_token, clipped = torch.max(losses, losses_clipped), losses_clipped > losses",
        new="per_token, clipped = losses, losses_clipped > losses",
        what="PPO's policy loss drops the clip: the plain importance-weighted surrogate (clipfrac still logged)",
    ),
    # update 1: objective/entropy (the EOS token's entropy left out), loss/policy_avg, policy/approxkl_avg
    Mutant(
        name="ppo-eos-masked",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="return response_idxs > sequence_lengths.unsqueeze(1), response_idxs",
        new="return response_idxs >= sequence_lengths.unsqueeze(1), response_idxs",
        what="PPO's response mask is off by one: the EOS token is masked out of the policy loss, the KL and whitening",
    ),
    # ---- rloo.py (tiny-tldr: k = 4, one REINFORCE step per batch, k1 KL in the sequence reward) ----
    # update 1: objective/advantage_std (x 3/4); the weights move only through Adam's eps and the gradient clip, as
    # the plain mean's advantage is the leave-one-out one times (k - 1) / k
    Mutant(
        name="rloo-mean-baseline",
        script="rloo.py",
        stage="rloo_tiny-tldr__1",
        old="baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)",
        new="baseline = grouped.mean(1, keepdim=True)",
        what="RLOO's baseline is the mean reward of all k samples, the sample itself included, not of the other k - 1: "
        "the advantage times (k - 1) / k, a constant that Adam's update does not see (the issue's equivalent kind)",
        equivalent=True,
    ),
    # update 1: loss/policy_avg (mean advantage -mean(R) / (k - 1), not 0), objective/advantage_std
    Mutant(
        name="rloo-baseline-with-self",
        script="rloo.py",
        stage="rloo_tiny-tldr__1",
        old="baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)",
        new="baseline = grouped.sum(1, keepdim=True) / (k - 1)",
        what="RLOO's leave-one-out baseline forgets to leave the sample out: the group's sum over k - 1",
    ),
    # update 2: objective/rlhf_reward, objective/advantage_std (update 1's KL is ~1e-8; objective/non_score_reward
    # is logged with the flag's coefficient and does not move)
    Mutant(
        name="rloo-kl-x10",
        script="rloo.py",
        stage="rloo_tiny-tldr__1",
        old="rlhf_reward = sequence_rewards(scores, seq_kl, args.kl_coef)",
        new="rlhf_reward = sequence_rewards(scores, seq_kl, 10 * args.kl_coef)",
        what="RLOO's sequence reward subtracts ten times the KL coefficient it logs (0.5 instead of 0.05)",
    ),
    # ---- remax.py (tiny-tldr: the greedy response's score as baseline, reward clip 5, k1 KL per token) ----
    # update 1: objective/advantage, objective/advantage_std, loss/policy_avg
    Mutant(
        name="remax-no-baseline",
        script="remax.py",
        stage="remax_tiny-tldr__1",
        old="diff = scores - greedy_scores",
        new="diff = scores",
        what="ReMax drops its greedy baseline: plain REINFORCE on the clipped score",
    ),
    # update 1: objective/greedy_reward (a sampled response's score), objective/advantage, loss/policy_avg
    Mutant(
        name="remax-sampled-baseline",
        script="remax.py",
        stage="remax_tiny-tldr__1",
        old="args.response_length, 0.0, synced=synced)[0]",
        new="args.response_length, args.temperature, synced=synced)[0]",
        what="ReMax's baseline response is sampled at the training temperature instead of decoded greedily",
    ),
    # ---- dpo.py (offline tiny-tldr: sigmoid loss, beta 0.1, cached reference logprobs; online: tiny-tldr-online) ----
    # step 5 (row 1): train/loss (close to log 2), train/grad_norm (about x beta at the start)
    Mutant(
        name="dpo-beta-twice",
        script="dpo.py",
        stage="dpo_tiny-tldr__1",
        old="h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)",
        new="h = beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected))",
        what="DPO's beta is applied twice: the log-ratio margin is scaled by beta before the loss scales it again",
    ),
    # step 5 (row 1): rewards/chosen, rewards/rejected, rewards/margins (all 0), rewards/accuracies (0.5), train/loss
    # (log 2): the policy is pushed along beta * grad h from pi = ref for ever, no KL anchor
    Mutant(
        name="dpo-ref-is-policy",
        script="dpo.py",
        stage="dpo_tiny-tldr__1",
        old='ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]',
        new="ref_c, ref_r = chosen.detach(), rejected.detach()",
        what="DPO's reference logprobs are the policy's own, detached, instead of the frozen SFT model's",
    ),
    # step 2 (row 2): objective/kl (0), rewards/* (0), rewards/accuracies (0.5), train/loss (log 2); step 1 is the same
    # (the policy is still the reference)
    Mutant(
        name="online-dpo-ref-moves",
        script="dpo.py",
        stage="online-dpo_tiny-tldr__1",
        old="ref_logprobs = forward_logprobs(ref_policy, batch)",
        new="ref_logprobs = forward_logprobs(gen_policy, batch)",
        what="online DPO scores its pairs' reference logprobs with the current policy: the reference moves every step",
    ),
    # ---- grpo_math.py (tiny, --loss-type grpo: group std, sequence mean, beta 0.04 on k3, two mini-batches) ----
    # step 1: loss/policy, train/grad_norm (the first mini-batch is on the unchanged policy), then policy/ratio
    Mutant(
        name="grpo-batch-std",
        script="grpo_math.py",
        stage="grpo-fixed-start_tiny-math__1",
        old="return centered / (rewards.std(dim=1, keepdim=True) + eps) if scale else centered",
        new="return centered / (rewards.std() + eps) if scale else centered",
        what="GRPO divides the group-centred rewards by the std of the whole batch, not of each question's group",
    ),
    # step 1: loss/policy, train/grad_norm, policy/ratio
    Mutant(
        name="grpo-no-std",
        script="grpo_math.py",
        stage="grpo-fixed-start_tiny-math__1",
        old="return centered / (rewards.std(dim=1, keepdim=True) + eps) if scale else centered",
        new="return centered",
        what="GRPO's advantages are not divided by the group's std (Dr. GRPO's advantage under --loss-type grpo)",
    ),
    # step 1: loss/policy, train/grad_norm (long completions weigh more), policy/ratio
    Mutant(
        name="grpo-token-mean",
        script="grpo_math.py",
        stage="grpo-fixed-start_tiny-math__1",
        old='LOSS_AGGREGATION = {"grpo": "sequence",',
        new='LOSS_AGGREGATION = {"grpo": "token",',
        what="GRPO's loss is a mean over all the mini-batch's tokens, not over completions of each one's token mean",
    ),
    # step 1: train/grad_norm (k1's gradient beta * grad log pi is not 0 at pi = ref, unlike k3's), then
    # policy/ratio and objective/kl
    Mutant(
        name="grpo-kl-k1",
        script="grpo_math.py",
        stage="grpo-fixed-start_tiny-math__1",
        old='args.kl_estimator == "k2" else kl',
        new='args.kl_estimator == "k2" else logprobs - ref_logprobs',
        what="GRPO's KL loss term is the k1 estimate log pi - log pi_ref, not DeepSeekMath's k3",
    ),
    # step 1 only through the second mini-batch's gradient (k3's gradient is 0 at pi = ref): train/grad_norm;
    # steps 2-3: train/grad_norm, objective/kl, policy/ratio
    Mutant(
        name="grpo-beta-x10",
        script="grpo_math.py",
        stage="grpo-fixed-start_tiny-math__1",
        old='args.advantage_estimator == "distill" else 0.04',
        new='args.advantage_estimator == "distill" else 0.4',
        what="GRPO's default KL coefficient beta is 0.4, ten times DeepSeekMath's 0.04",
    ),
    # ---- equivalent: no number of the stage changes ----
    Mutant(
        name="sft-dropout-kept",
        script="sft.py",
        stage="sft_tiny-tldr__1",
        old="    disable_dropout(model)\n    model = add_lora(model, args)\n",
        new="    model = add_lora(model, args)\n",
        what="SFT leaves dropout on (N+ turns it off): no number changes on the tiny world, whose tiny-neox config has "
        "hidden and attention dropout 0.0 (a p = 0 dropout returns its input on CPU, drawing no random number)",
        equivalent=True,
        logged=False,
    ),
    Mutant(
        name="ppo-invalid-logprob-zero",
        script="ppo_rlhf.py",
        stage="ppo_tiny-tldr__1",
        old="INVALID_LOGPROB = 1.0",
        new="INVALID_LOGPROB = 0.0",
        what="PPO's placeholder logprob of padded positions is 0.0, not TRL's 1.0: no number changes, as the old and "
        "new logprobs get the same placeholder (ratio exp(0) = 1, advantage 0) and every loss and statistic masks it",
        equivalent=True,
        logged=False,
    ),
]
