"""Per-token loss terms: KL estimators, importance-sampling correction, policy and value losses, entropy.

Every function returns per-token tensors [B, T]; `token_mean` turns each into a scalar with one shared
denominator, the number of loss tokens in the whole optimizer step, so the update does not depend on how
the batch is split across data-parallel ranks and micro-batches. A log-probability at position t is
log p(token_t | tokens_<t), as in `molt.trace.TrainBatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from molt.plan import ImportanceSamplingPlan, LossPlan

MAX_LOG_WEIGHT = 20.0  # |log w| bound of an importance weight, so exp() stays finite in float32


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: float = 10.0) -> Tensor:
    """Per-token KL(π || π_ref) estimate from Δ = log π − log π_ref on tokens sampled from π.

    k1 = Δ (unbiased, can be negative), k2 = Δ²/2, k3 = exp(−Δ) − 1 + Δ (unbiased, non-negative).
    Δ is clamped to ±clamp (a non-finite Δ too), so one degenerate token cannot dominate the batch.
    """
    delta = torch.nan_to_num(logprobs - ref_logprobs, nan=0.0).clamp(-clamp, clamp)
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return delta**2 / 2
    if estimator == "k3":
        return torch.expm1(-delta) + delta
    raise ValueError(f"loss.kl_estimator='{estimator}' is not one of k1, k2, k3")


def staleness_mask(action_mask: Tensor, versions: Tensor, current_version: int,
                   max_staleness: int | None) -> Tensor:
    """The loss mask: the action tokens sampled at most max_staleness weight versions before
    current_version (all of them with max_staleness None). Tokens outside it drop out of the loss and of
    its denominator."""
    if max_staleness is None:
        return action_mask
    return action_mask & (current_version - versions <= max_staleness)


def importance_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                       cfg: ImportanceSamplingPlan) -> tuple[Tensor, dict[str, float]]:
    """Stop-gradient weights that correct for tokens sampled by the engine's policy, not the trainer's.

    w_t = exp(log π_old − log π_rollout). Level `token` weights each token by w_t, `seq` every token of a
    sequence by the product of its w_t, `geo` by their geometric mean. Mode `mask` zeroes weights outside
    [low, high] (at seq/geo level this gates out the whole sequence), `clip` clamps them into it, `trunc`
    caps them at high. Masked tokens stay in the loss denominator. Weights are meaningful on loss_mask
    only; with cfg.enabled False they are all ones.
    """
    if not cfg.enabled:
        return torch.ones_like(old_logprobs), {}
    if cfg.level not in ("token", "seq", "geo") or cfg.mode not in ("mask", "clip", "trunc"):
        raise ValueError(
            f"loss.importance_sampling level='{cfg.level}' mode='{cfg.mode}': level must be token, seq or "
            f"geo and mode mask, clip or trunc"
        )

    # A NaN log-probability is a broken token: treat it as maximal mismatch so the gate removes it.
    log_w = (old_logprobs - rollout_logprobs).detach().float()
    log_w = torch.where(loss_mask, torch.nan_to_num(log_w, nan=MAX_LOG_WEIGHT), 0.0)
    if cfg.level == "seq":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    elif cfg.level == "geo":
        log_w = (log_w.sum(1, keepdim=True) / loss_mask.sum(1, keepdim=True).clamp(min=1)).expand_as(log_w)
    weights = log_w.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT).exp()

    outside = (weights > cfg.high) if cfg.mode == "trunc" else (weights < cfg.low) | (weights > cfg.high)
    if cfg.mode == "mask":
        weights = torch.where(outside, 0.0, weights)
    elif cfg.mode == "clip":
        weights = weights.clamp(cfg.low, cfg.high)
    else:
        weights = weights.clamp(max=cfg.high)

    filtered = outside & loss_mask
    has_tokens = loss_mask.any(1)
    return weights, {
        "is/filtered_token_frac": _fraction(filtered, loss_mask),
        "is/filtered_seq_frac": _fraction(filtered.any(1), has_tokens),
        "is/weight_mean": _masked_mean(weights, loss_mask),
    }


def mismatch_metrics(rollout_logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> dict[str, float]:
    """How far the trainer's log-probabilities are from the engine's on the same tokens.

    k3 estimates KL(π_rollout || π_old) from the tokens the engine sampled.
    """
    rollout_logprobs, old_logprobs = rollout_logprobs.detach().float(), old_logprobs.detach().float()
    abs_delta = torch.where(action_mask, (rollout_logprobs - old_logprobs).abs(), 0.0)
    return {
        "mismatch/abs_mean": _masked_mean(abs_delta, action_mask),
        "mismatch/abs_max": abs_delta.max().item() if abs_delta.numel() else 0.0,
        "mismatch/k3": _masked_mean(kl_penalty(rollout_logprobs, old_logprobs, "k3"), action_mask),
    }


def ppo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
        cfg: LossPlan) -> tuple[Tensor, Tensor]:
    """Clipped surrogate on the per-token ratio π/π_old."""
    return _clipped_surrogate(logprobs - old_logprobs, advantages, cfg)


def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
         cfg: LossPlan) -> tuple[Tensor, Tensor]:
    """GSPO-token: the clipped surrogate on the sequence ratio (geometric mean of the token ratios over
    the sequence's loss tokens), with each token's gradient flowing through its own log π."""
    log_ratio = torch.where(loss_mask, logprobs - old_logprobs, 0.0)
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / loss_mask.sum(1, keepdim=True).clamp(min=1)
    # Value: the sequence log-ratio. Gradient: ∇ log π_t of each token.
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    return _clipped_surrogate(token_log_ratio, advantages, cfg)


def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
          cfg: LossPlan) -> tuple[Tensor, Tensor]:
    """CISPO: −sg(min(ρ, cispo_max_weight))·A·log π: every token keeps its gradient, its weight is capped."""
    ratio = (logprobs - old_logprobs).detach().clamp(-cfg.logratio_clamp, cfg.logratio_clamp).exp()
    clipped = ratio > cfg.cispo_max_weight
    weight = ratio.clamp(max=cfg.cispo_max_weight)
    return -weight * advantages * logprobs, clipped


POLICY_LOSSES = {"ppo": ppo, "gspo": gspo, "cispo": cispo}


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, cfg: LossPlan,
                is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Per-token policy loss [B, T] of POLICY_LOSSES[cfg.name], times the importance weights, zero off the
    loss mask. Reduce it with `token_mean`."""
    if cfg.name not in POLICY_LOSSES:
        raise ValueError(f"loss.name='{cfg.name}' is not one of {', '.join(POLICY_LOSSES)}")
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape):
        raise ValueError(
            f"policy_loss inputs must share one [B, T] shape, got logprobs {tuple(logprobs.shape)}, "
            f"old_logprobs {tuple(old_logprobs.shape)}, advantages {tuple(advantages.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)}"
        )
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    per_token, clipped = POLICY_LOSSES[cfg.name](logprobs, old_logprobs, advantages, loss_mask, cfg)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    log_ratio = (logprobs - old_logprobs).detach().clamp(-cfg.logratio_clamp, cfg.logratio_clamp)
    ratio = torch.where(loss_mask, log_ratio.exp(), 0.0)
    metrics = {
        "loss/clip_frac": _fraction(clipped & loss_mask, loss_mask),
        "loss/ratio_mean": _masked_mean(ratio, loss_mask),
        "loss/ratio_max": ratio.max().item() if ratio.numel() else 0.0,
    }
    return torch.where(loss_mask, per_token, 0.0), metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, clip: float) -> Tensor:
    """Per-token clipped value loss ½·max((V − R)², (V_clipped − R)²), V_clipped = V_old ± clip."""
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return torch.where(loss_mask, loss, 0.0)


def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy [...] of softmax(logits / temperature) over the last dimension, -inf logits allowed."""
    if temperature <= 0:
        raise ValueError(f"entropy temperature must be positive (rollout.temperature), got {temperature}")
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)  # 0·(−inf) would be NaN
    return -(logp.exp() * logp).sum(-1)


def token_mean(per_token: Tensor, loss_mask: Tensor, num_tokens: int | Tensor) -> Tensor:
    """sum(per_token over loss_mask) / max(num_tokens, 1): this micro-batch's share of the global token mean.

    num_tokens is the number of loss tokens in the whole optimizer step: every micro-batch on every
    data-parallel rank, counted by the caller (an all-reduce SUM of loss_mask.sum()). For the update to be
    invariant to the number of ranks and micro-batches, the trainer must SUM gradients over micro-batches
    (plain backward accumulation) and over ranks, not average them: FSDP2 averages by default, so call
    `model.set_gradient_divide_factor(1.0)` or multiply the loss by the data-parallel world size.
    """
    total = torch.where(loss_mask, per_token, 0.0).sum()
    if isinstance(num_tokens, Tensor):
        return total / num_tokens.clamp(min=1)
    return total / max(num_tokens, 1)


def adaptive_kl_coef(coef: float, observed_kl: float, num_samples: int, cfg: LossPlan) -> float:
    """Next KL coefficient of the proportional controller of Ziegler et al. (2019) toward cfg.kl_target.

    The coefficient moves by at most ±20 % per cfg.kl_horizon samples; num_samples is the number of
    rollouts since the last update. With cfg.kl_target None the coefficient is fixed.
    """
    if cfg.kl_target is None:
        return coef
    error = min(max(observed_kl / cfg.kl_target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / cfg.kl_horizon)


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, cfg: LossPlan) -> tuple[Tensor, Tensor]:
    """−min(ρA, clip(ρ, 1−clip_low, 1+clip_high)·A), bounded by dual_clip·|A| when A < 0.
    Returns the per-token loss and where a clip was active."""
    ratio = log_ratio.clamp(-cfg.logratio_clamp, cfg.logratio_clamp).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if cfg.dual_clip is not None:
        if cfg.dual_clip <= 1:
            raise ValueError(f"loss.dual_clip must be greater than 1, got {cfg.dual_clip}")
        dual_bound = -cfg.dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(dual_clipped, dual_bound, loss)
        is_clipped = is_clipped | dual_clipped
    return loss, is_clipped


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    return (torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)).item()


def _fraction(selected: Tensor, mask: Tensor) -> float:
    return (selected.sum() / mask.sum().clamp(min=1)).item()
