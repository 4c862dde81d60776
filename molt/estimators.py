"""Advantage estimators and dynamic filtering: pure tensor functions of rewards, groups and the token trace.

Every estimator has the same signature, so `ESTIMATORS[plan.estimator.name]` selects one:

    advantages, returns = estimator(rewards, group_ids, action_mask, cfg, kl_penalty=..., values=..., ...)

rewards [B] holds one outcome reward per rollout, group_ids [B] the prompt group of each rollout and
action_mask [B, T] the trained tokens. `advantages` is [B, T] and zero off the action mask; `returns` is the
critic's regression target (gae only, else None). Estimators read their inputs as constants (detached).

KL as a per-token reward (`kl_penalty`, β·KL_t computed by the caller) is subtracted from the token rewards
by reinforce_pp and gae and from the distillation advantage; the group estimators score whole rollouts, so
they reject it: use KL as a loss term with them (loss.kl_in_reward=false).

Whitening uses the action-masked mean and population std of the whole batch (cfg.whiten); reinforce_pp,
reinforce_baseline and gae whiten, the others are already normalized by their definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.plan import EstimatorPlan


def reinforce_pp(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
                 old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """REINFORCE++: token rewards −β·KL_t, plus r on the last action token; discounted return, whitened."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    token_rewards = _token_rewards(rewards, action_mask, kl_penalty)
    no_values = torch.zeros_like(token_rewards)
    returns = _discounted_advantages(token_rewards, no_values, action_mask, cfg.gamma, lam=1.0)
    return _whiten(returns, action_mask, cfg), None


def reinforce_baseline(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
                       old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """r − mean(group), whitened."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    _reject_kl_reward("reinforce_baseline", kl_penalty)
    group_mean, _ = _group_mean(rewards, group_ids)
    advantages = (rewards - group_mean)[:, None] * action_mask
    return _whiten(advantages, action_mask, cfg), None


def rloo(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
         old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Leave-one-out: r − mean of the other members' rewards; a single-member group keeps r."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    _reject_kl_reward("rloo", kl_penalty)
    group_mean, group_size = _group_mean(rewards, group_ids)
    # r − (sum − r)/(n − 1) = n/(n − 1)·(r − mean), which is exactly 0 when the group agrees.
    advantages = torch.where(group_size > 1, group_size / (group_size - 1) * (rewards - group_mean), rewards)
    return advantages[:, None] * action_mask, None


def grpo(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
         old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """(r − mean(group)) / (sample std(group) + eps); a single-member group gets 0."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    _reject_kl_reward("grpo", kl_penalty)
    group_mean, group_size = _group_mean(rewards, group_ids)
    deviation = rewards - group_mean
    mean_square, _ = _group_mean(deviation**2, group_ids)
    std = (mean_square * group_size / (group_size - 1).clamp(min=1)).sqrt()
    advantages = torch.where(group_size > 1, deviation / (std + cfg.eps), 0.0)
    return advantages[:, None] * action_mask, None


def dr_grpo(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
            old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Dr. GRPO: r − mean(group), not divided by the std."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    _reject_kl_reward("dr_grpo", kl_penalty)
    group_mean, _ = _group_mean(rewards, group_ids)
    return (rewards - group_mean)[:, None] * action_mask, None


def gae(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
        old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, Tensor]:
    """GAE(γ, λ) with a PPO critic over the action tokens; returns = A + V before whitening."""
    rewards = _clipped_rewards(rewards, group_ids, action_mask, cfg)
    if values is None or values.shape != action_mask.shape:
        raise ValueError(
            f"gae needs critic values of shape {tuple(action_mask.shape)}, got "
            f"{None if values is None else tuple(values.shape)}: enable the critic (critic.enabled=true)"
        )
    values = values.detach().float() * action_mask
    token_rewards = _token_rewards(rewards, action_mask, kl_penalty)
    advantages = _discounted_advantages(token_rewards, values, action_mask, cfg.gamma, cfg.lam)
    returns = (advantages + values) * action_mask
    return _whiten(advantages, action_mask, cfg), returns


def on_policy_distill(rewards, group_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
                      old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Per-token advantage −β·(log π_old − log π_teacher), not whitened; outcome rewards are unused."""
    _clipped_rewards(rewards, group_ids, action_mask, cfg)  # validates the shapes
    for name, logprobs in (("old_logprobs", old_logprobs), ("teacher_logprobs", teacher_logprobs)):
        if logprobs is None or logprobs.shape != action_mask.shape:
            raise ValueError(
                f"on_policy_distill needs {name} of shape {tuple(action_mask.shape)}, got "
                f"{None if logprobs is None else tuple(logprobs.shape)}: set reference.enabled=true and "
                f"reference.path to the teacher checkpoint"
            )
    advantages = -cfg.distill_coef * (old_logprobs.detach() - teacher_logprobs.detach())
    if kl_penalty is not None:
        advantages = advantages - kl_penalty.detach()
    return torch.where(action_mask, advantages, 0.0), None


ESTIMATORS = {
    "reinforce_pp": reinforce_pp,
    "reinforce_baseline": reinforce_baseline,
    "rloo": rloo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "gae": gae,
    "on_policy_distill": on_policy_distill,
}


def _clipped_rewards(rewards: Tensor, group_ids: Tensor, action_mask: Tensor, cfg: EstimatorPlan) -> Tensor:
    """Check the shared inputs and return the rewards clipped to cfg.reward_clip."""
    if action_mask.dtype != torch.bool or action_mask.dim() != 2:
        raise ValueError(
            f"action_mask must be a bool [B, T] tensor, got {action_mask.dtype} {tuple(action_mask.shape)}"
        )
    batch = action_mask.shape[0]
    if rewards.shape != (batch,) or group_ids.shape != (batch,):
        raise ValueError(
            f"rewards and group_ids must be [B]=[{batch}] (one per rollout), got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards of rollouts {bad} are not finite: the reward function must return numbers")
    if len(cfg.reward_clip) != 2 or cfg.reward_clip[0] > cfg.reward_clip[1]:
        raise ValueError(f"estimator.reward_clip must be [low, high] with low <= high, got {cfg.reward_clip}")
    low, high = cfg.reward_clip
    return rewards.detach().float().clamp(low, high)


def _reject_kl_reward(name: str, kl_penalty: Tensor | None) -> None:
    if kl_penalty is not None:
        raise ValueError(
            f"estimator '{name}' scores whole rollouts and cannot take KL as a per-token reward: set "
            f"loss.kl_in_reward=false (KL as a loss term) or use estimator=reinforce_pp or gae"
        )


def _group_mean(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per rollout, the mean of `values` over its group and the group's size.

    Summed in float64 so that the mean of equal values is exactly that value: a rounding error would
    survive GRPO's division by a near-zero std as a sizeable advantage.
    """
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64, device=values.device)
    sums.index_add_(0, index, values.double())
    return (sums / counts)[index].to(values.dtype), counts[index].to(values.dtype)


def _token_rewards(rewards: Tensor, action_mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
    """−β·KL_t on every action token, plus the outcome reward on the last one."""
    is_last = action_mask & (action_mask.cumsum(1) == action_mask.sum(1, keepdim=True))
    token_rewards = rewards[:, None] * is_last
    if kl_penalty is not None:
        token_rewards = token_rewards - torch.where(action_mask, kl_penalty.detach(), 0.0)
    return token_rewards


def _discounted_advantages(token_rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float,
                           lam: float) -> Tensor:
    """GAE over the action tokens only (context tokens are skipped, not steps). With zero values and
    lam=1 it is the discounted return G_t = reward_t + γ·G_{t+1}."""
    advantages = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    next_advantage = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        is_action = action_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(is_action, advantage, 0.0)
        next_value = torch.where(is_action, values[:, t], next_value)
        next_advantage = torch.where(is_action, advantage, next_advantage)
    return advantages


def _whiten(advantages: Tensor, action_mask: Tensor, cfg: EstimatorPlan) -> Tensor:
    """(A − mean) / (population std + eps) over the action tokens of the whole batch, if cfg.whiten."""
    if not cfg.whiten:
        return advantages
    values = advantages.double()  # as in _group_mean: equal advantages must whiten to exactly 0
    count = action_mask.sum().clamp(min=1)
    mean = (values * action_mask).sum() / count
    std = (((values - mean) ** 2 * action_mask).sum() / count).sqrt()
    return torch.where(action_mask, (values - mean) / (std + cfg.eps), 0.0).to(advantages.dtype)


@dataclass
class FilterResult:
    kept: list[str]  # group ids that carry a learning signal, in input order
    dropped: dict[str, int]  # reason -> number of groups: incomplete, mean_too_low, mean_too_high
    backfill: int  # replacement groups the caller must draw to keep the batch full


def dynamic_filter(group_scores: dict[str, list[float]], group_size: int, low: float,
                   high: float) -> FilterResult:
    """DAPO-style filter: keep complete groups whose mean score lies strictly inside (low, high).

    A group where every rollout scored the same extreme (all wrong, all right) has zero group-relative
    advantage and only dilutes the token mean, so it is dropped and replaced.
    """
    if not low < high:
        raise ValueError(f"dynamic_filter.low ({low}) must be below dynamic_filter.high ({high})")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1 (rollout.samples_per_prompt), got {group_size}")
    kept: list[str] = []
    dropped = {"incomplete": 0, "mean_too_low": 0, "mean_too_high": 0}
    for group_id, scores in group_scores.items():
        if len(scores) > group_size:
            raise ValueError(f"group {group_id} has {len(scores)} scores, more than group_size={group_size}")
        if not all(math.isfinite(score) for score in scores):
            raise ValueError(f"group {group_id} has a non-finite score in {scores}: rewards must be numbers")
        mean = sum(scores) / group_size
        if len(scores) < group_size:
            dropped["incomplete"] += 1
        elif mean <= low:
            dropped["mean_too_low"] += 1
        elif mean >= high:
            dropped["mean_too_high"] += 1
        else:
            kept.append(group_id)
    return FilterResult(kept=kept, dropped=dropped, backfill=len(group_scores) - len(kept))
