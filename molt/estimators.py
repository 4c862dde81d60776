"""Advantage estimators and dynamic filtering: pure tensor functions of rewards, groups and the token trace.

Every estimator has the same signature, so `ESTIMATORS[plan.estimator.name]` selects one:

    advantages, returns = estimator(rewards, group_ids, rollout_ids, action_mask, cfg, kl_penalty=..., ...)

A row of the batch is one segment of a rollout (an agent that compacts its context has several). rewards
[B] holds each row's rollout reward (equal on all segments of a rollout), group_ids [B] the prompt group,
rollout_ids [B] the rollout (a rollout's rows follow each other in segment order) and action_mask [B, T] the
trained tokens. Every statistic counts rollouts, not rows: a group's size, mean, std and leave-one-out
baseline are over its rollouts, and a discounted return runs across a rollout's segments as if they were
one sequence; splitting a rollout into segments never changes any token's advantage (tests/test_estimators.py).
`advantages` is [B, T] and zero off the action mask; `returns` is the critic's regression target (gae
only, else None). Estimators read their inputs as constants (detached).

KL as a per-token reward (`kl_penalty`, β·KL_t computed by the caller) is subtracted from the token rewards
by reinforce_pp and gae and from the distillation advantage; the group estimators score whole rollouts and
ignore it (the validator refuses loss.kl_in_reward=true with them: KL_REWARD_ESTIMATORS). The estimators trust
what the validator checked (cfg, and that gae gets values and on_policy_distill a teacher's log-probs); they
check only the batch.

Whitening uses the mean and population std over the action tokens of the whole batch, (A − mean) / (std +
eps), eps added to the std (cfg.whiten); reinforce_pp, reinforce_baseline and gae whiten, the others are
already normalized by their definition.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from molt.plan import DynamicFilterPlan, EstimatorPlan

# What each estimator needs, declared here and read by the validator (molt/validate.py).
GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "reinforce_baseline"}  # baseline from the prompt's group
CRITIC_ESTIMATORS = {"gae"}  # read the critic's values
TEACHER_ESTIMATORS = {"on_policy_distill"}  # read the reference model's log-probs as a teacher
KL_REWARD_ESTIMATORS = {"reinforce_pp", "gae", "on_policy_distill"}  # take KL as a per-token reward
FILTER_CRITERIA = ("zero_spread", "mean_bounds")  # dynamic_filter.criterion


def reinforce_pp(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None,
                 values=None, old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """REINFORCE++: token rewards −β·KL_t, plus r on the rollout's last action token; discounted return
    across its segments, whitened."""
    rollout_rewards, _, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    no_values = torch.zeros(action_mask.shape)
    returns = _discounted_advantages(rollout_rewards, row_rollout, action_mask, kl_penalty, no_values, cfg.gamma,
                                     lam=1.0)
    return _whiten(returns, action_mask, cfg), None


def reinforce_baseline(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None,
                       values=None, old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """r − mean(group), whitened; a single-rollout group gets 0 before whitening."""
    rollout_rewards, groups, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    group_mean, _ = _group_mean(rollout_rewards, groups)
    advantages = (rollout_rewards - group_mean)[row_rollout, None] * action_mask
    return _whiten(advantages, action_mask, cfg), None


def rloo(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
         old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Leave-one-out: r − mean of the other rollouts' rewards; a single-rollout group keeps r."""
    rollout_rewards, groups, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    group_mean, group_size = _group_mean(rollout_rewards, groups)
    # r − (sum − r)/(n − 1) = n/(n − 1)·(r − mean), which is exactly 0 when the group agrees.
    advantages = torch.where(group_size > 1, group_size / (group_size - 1) * (rollout_rewards - group_mean),
                             rollout_rewards)
    return advantages[row_rollout, None] * action_mask, None


def grpo(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
         old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """(r − mean(group)) / (sample std(group) + eps); a single-rollout group gets 0."""
    rollout_rewards, groups, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    group_mean, group_size = _group_mean(rollout_rewards, groups)
    deviation = rollout_rewards - group_mean
    mean_square, _ = _group_mean(deviation**2, groups)
    std = (mean_square * group_size / (group_size - 1).clamp(min=1)).sqrt()
    advantages = torch.where(group_size > 1, deviation / (std + cfg.eps), 0.0)
    return advantages[row_rollout, None] * action_mask, None


def dr_grpo(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
            old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Dr. GRPO: r − mean(group), not divided by the std; a single-rollout group gets 0."""
    rollout_rewards, groups, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    group_mean, _ = _group_mean(rollout_rewards, groups)
    return (rollout_rewards - group_mean)[row_rollout, None] * action_mask, None


def gae(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None, values=None,
        old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, Tensor]:
    """GAE(γ, λ) with a PPO critic over the action tokens of each rollout (across its segments);
    returns = A + V before whitening."""
    rollout_rewards, _, row_rollout = _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)
    values = values.detach().float() * action_mask
    advantages = _discounted_advantages(rollout_rewards, row_rollout, action_mask, kl_penalty, values, cfg.gamma,
                                        cfg.lam)
    returns = (advantages + values) * action_mask
    return _whiten(advantages, action_mask, cfg), returns


def on_policy_distill(rewards, group_ids, rollout_ids, action_mask, cfg: EstimatorPlan, *, kl_penalty=None,
                      values=None, old_logprobs=None, teacher_logprobs=None) -> tuple[Tensor, None]:
    """Per-token advantage −β·(log π_old − log π_teacher), not whitened; outcome rewards are unused."""
    _rollout_rewards(rewards, group_ids, rollout_ids, action_mask, cfg)  # validates the shapes
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


def _rollout_rewards(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor, action_mask: Tensor,
                     cfg: EstimatorPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Check the shared inputs. Returns, per rollout, its reward clipped to cfg.reward_clip and its group id,
    and per row the index of its rollout in those."""
    if action_mask.dtype != torch.bool or action_mask.dim() != 2:
        raise ValueError(
            f"action_mask must be a bool [B, T] tensor, got {action_mask.dtype} {tuple(action_mask.shape)}"
        )
    batch = action_mask.shape[0]
    if rewards.shape != (batch,) or group_ids.shape != (batch,) or rollout_ids.shape != (batch,):
        raise ValueError(
            f"rewards, group_ids and rollout_ids must be [B]=[{batch}] (one per row), got {tuple(rewards.shape)}, "
            f"{tuple(group_ids.shape)} and {tuple(rollout_ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards of rows {bad} are not finite: the reward function must return numbers")
    _, row_rollout = torch.unique(rollout_ids, return_inverse=True)
    num_rollouts = int(row_rollout.max()) + 1 if batch else 0
    first_row = torch.full((num_rollouts,), batch).scatter_reduce(0, row_rollout, torch.arange(batch), "amin")
    rollout_rewards, rollout_groups = rewards[first_row], group_ids[first_row]
    disagree = (rewards != rollout_rewards[row_rollout]) | (group_ids != rollout_groups[row_rollout])
    if disagree.any():
        raise ValueError(f"rows {torch.nonzero(disagree).flatten().tolist()} are segments of a rollout whose "
                         f"other segments have another reward or group: one rollout has one reward and one group")
    low, high = cfg.reward_clip
    return rollout_rewards.detach().float().clamp(low, high), rollout_groups, row_rollout


def _group_mean(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per rollout, the mean of `values` over its group's rollouts and the group's size.

    Summed in float64 so that the mean of equal values is exactly that value: a rounding error would
    survive GRPO's division by a near-zero std as a sizeable advantage.
    """
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64, device=values.device)
    sums.index_add_(0, index, values.double())
    return (sums / counts)[index].to(values.dtype), counts[index].to(values.dtype)


def _discounted_advantages(rollout_rewards: Tensor, row_rollout: Tensor, action_mask: Tensor,
                           kl_penalty: Tensor | None, values: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE(γ, λ) over each rollout's action tokens, its segments' rows joined in order: context tokens are
    skipped, not steps. Token rewards are −KL_t on every action token plus the outcome reward on the
    rollout's last one. With zero values and lam=1 it is the discounted return G_t = reward_t + γ·G_{t+1}."""
    # Each rollout's action tokens as one row of a [rollouts, L] table: `index` points into the flat batch.
    rows, columns = action_mask.nonzero(as_tuple=True)  # row-major: a row's tokens in order, rows in order
    token_rollout = row_rollout[rows]
    order = torch.sort(token_rollout, stable=True).indices  # stable: keeps the segments' order
    token_rollout, flat_index = token_rollout[order], (rows * action_mask.shape[1] + columns)[order]
    counts = torch.bincount(token_rollout, minlength=len(rollout_rewards))
    position = torch.arange(len(flat_index)) - (counts.cumsum(0) - counts)[token_rollout]
    length = int(counts.max()) if len(counts) else 0
    index = torch.zeros(len(counts), length, dtype=torch.long)
    valid = torch.zeros(len(counts), length, dtype=torch.bool)
    index[token_rollout, position], valid[token_rollout, position] = flat_index, True

    def per_rollout(per_row: Tensor) -> Tensor:
        return torch.where(valid, per_row.detach().float().flatten()[index], 0.0)

    token_rewards = torch.zeros(valid.shape)
    has_actions = counts > 0
    token_rewards[has_actions, counts[has_actions] - 1] = rollout_rewards[has_actions]
    if kl_penalty is not None:
        token_rewards = token_rewards - per_rollout(kl_penalty)
    values = per_rollout(values)

    advantages = torch.zeros(valid.shape)
    next_value, next_advantage = torch.zeros(len(counts)), torch.zeros(len(counts))
    for t in reversed(range(length)):  # positions past a rollout's end are zero and stay zero
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(valid[:, t], delta + gamma * lam * next_advantage, 0.0)
        next_value = values[:, t]
        advantages[:, t] = next_advantage
    result = torch.zeros(action_mask.numel())
    result[index[valid]] = advantages[valid]
    return result.view(action_mask.shape)


def _whiten(advantages: Tensor, action_mask: Tensor, cfg: EstimatorPlan) -> Tensor:
    """(A − mean) / (population std + eps) over the action tokens of the whole batch, if cfg.whiten."""
    if not cfg.whiten:
        return advantages
    values = advantages.double()  # as in _group_mean: equal advantages must whiten to exactly 0
    count = action_mask.sum().clamp(min=1)
    mean = (values * action_mask).sum() / count
    std = (((values - mean) ** 2 * action_mask).sum() / count).sqrt()
    return torch.where(action_mask, (values - mean) / (std + cfg.eps), 0.0).to(advantages.dtype)


def filter_group(scores: list[float], group_size: int, cfg: DynamicFilterPlan) -> str | None:
    """Why a finished group is dropped (the pool then draws a fresh prompt in its place), or None to train on it.

    A group that lost a rollout (a failure) is always dropped: "incomplete". With cfg.enabled, DAPO's dynamic
    sampling drops a group whose rewards are all equal ("zero_spread"): every group baseline gives it zero
    advantage, so it only dilutes the token mean. criterion=mean_bounds instead keeps a group only when its
    mean reward lies strictly inside (cfg.low, cfg.high).
    """
    if len(scores) > group_size:
        raise ValueError(f"a group has {len(scores)} rewards, more than rollout.samples_per_prompt={group_size}")
    if not all(math.isfinite(score) for score in scores):
        raise ValueError(f"a group has a non-finite reward in {scores}: rewards must be numbers")
    if len(scores) < group_size:
        return "incomplete"
    if not cfg.enabled:
        return None
    if cfg.criterion == "zero_spread":
        return "zero_spread" if max(scores) == min(scores) else None
    mean = sum(scores) / group_size
    if mean <= cfg.low:
        return "mean_too_low"
    if mean >= cfg.high:
        return "mean_too_high"
    return None
