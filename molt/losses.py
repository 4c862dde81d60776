"""Per-token loss terms: KL estimators, importance-sampling correction, policy and value losses, entropy.

Every loss term is a per-token tensor [B, T]; `aggregate` sums it with the weights of `token_weights`
(loss.aggregation), which the driver computes once over the whole optimizer step, so the update does not
depend on how the batch is split across data-parallel ranks and micro-batches. A log-probability at position t is
log p(token_t | tokens_<t), as in `molt.trace.TrainBatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from molt.plan import ImportanceSamplingPlan, LossPlan

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")  # loss.aggregation
IS_LEVELS = ("token", "seq", "geo")  # loss.importance_sampling.level
IS_MODES = ("mask", "clip", "trunc")  # loss.importance_sampling.mode
MAX_LOG_RATIO = 20.0  # |log ratio| bound before exp() (policy ratios, importance weights, KL), finite in float32
KL_BOUND = 10.0  # |per-token KL estimate| bound (kl_penalty)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate from Δ = log π − log π_ref on tokens sampled from π, bounded to ±KL_BOUND.

    Values: k1 = Δ and k3 = exp(−Δ) − 1 + Δ are unbiased estimates of KL(π || π_ref) (k3 ≥ 0, lower
    variance); k2 = Δ²/2 is biased but close for small Δ. Gradients, as a loss term on samples of π (what the
    trainer differentiates): E[∇k1] = E[∇log π] = 0, so k1 is useless as a loss term (the validator refuses
    it; as a reward it is the classic per-token KL penalty); E[∇k2] = ∇KL(π || π_ref); E[∇k3] = ∇KL(π_ref || π),
    the reverse direction (tests/test_losses.py checks all three exactly on a small softmax).
    Δ is clamped to ±MAX_LOG_RATIO (a non-finite Δ counts as 0) so exp() stays finite, and the estimate to
    ±KL_BOUND: at Δ = −10, k3 would be 22,000 with a gradient of −22,000; bounded, it is 10 with gradient 0,
    so one degenerate token cannot dominate the loss, `kl/policy_ref` or the adaptive KL controller.
    """
    delta = torch.nan_to_num(logprobs - ref_logprobs, nan=0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        estimate = delta
    elif estimator == "k2":
        estimate = delta**2 / 2
    elif estimator == "k3":
        estimate = torch.expm1(-delta) + delta
    else:
        raise ValueError(f"loss.kl_estimator='{estimator}' is not one of {', '.join(KL_ESTIMATORS)}")
    return estimate.clamp(-KL_BOUND, KL_BOUND)


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
    caps them at high. On top, the sequence gate (cfg.seq_gate = [low, high], the paper's hard sequence-level
    gate) zeroes every weight of a sequence whose geometric-mean weight exp(mean of log w_t over its loss
    tokens) leaves [low, high]: one wild token in a short sequence, or a drift spread over a long one, drops
    the sequence whole. A sequence is one row: a compacted rollout's segments are gated separately. Masked
    and gated tokens stay in the loss denominator. Weights are meaningful on loss_mask only; with
    cfg.enabled False they are all ones. The second value holds counts (tokens, sequences, filtered and
    gated ones, the weight sum) that add up over micro-batches and ranks; importance_metrics reads them.
    """
    if not cfg.enabled:
        return torch.ones_like(old_logprobs), {}
    # A NaN log-probability is a broken token: treat it as maximal mismatch so the gate removes it.
    log_w = (old_logprobs - rollout_logprobs).detach().float()
    log_w = torch.where(loss_mask, torch.nan_to_num(log_w, nan=MAX_LOG_RATIO), 0.0)
    log_w = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    tokens_per_seq = loss_mask.sum(1, keepdim=True)
    seq_mean_log_w = log_w.sum(1, keepdim=True) / tokens_per_seq.clamp(min=1)
    if cfg.level == "seq":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    elif cfg.level == "geo":
        log_w = seq_mean_log_w.expand_as(log_w)
    weights = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()

    outside = (weights > cfg.high) if cfg.mode == "trunc" else (weights < cfg.low) | (weights > cfg.high)
    if cfg.mode == "mask":
        weights = torch.where(outside, 0.0, weights)
    elif cfg.mode == "clip":
        weights = weights.clamp(cfg.low, cfg.high)
    else:
        weights = weights.clamp(max=cfg.high)

    has_tokens = tokens_per_seq.squeeze(1) > 0
    gated = torch.zeros_like(has_tokens)
    if cfg.seq_gate is not None:
        gate_low, gate_high = cfg.seq_gate
        seq_weight = seq_mean_log_w.squeeze(1).exp()
        gated = has_tokens & ((seq_weight < gate_low) | (seq_weight > gate_high))
        weights = torch.where(gated[:, None], 0.0, weights)

    filtered = outside & loss_mask
    return weights, {
        "tokens": float(loss_mask.sum()),
        "seqs": float(has_tokens.sum()),
        "filtered_tokens": float(filtered.sum()),
        "filtered_seqs": float(filtered.any(1).sum()),
        "gated_seqs": float(gated.sum()),
        "gated_tokens": float((gated[:, None] & loss_mask).sum()),
        "weight_sum": float((weights * loss_mask).sum()),
    }


def importance_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The `is/*` fractions from importance_weights' counts, summed over however the batch was split."""
    if not counts:  # importance sampling off
        return {}
    tokens, seqs = max(counts["tokens"], 1.0), max(counts["seqs"], 1.0)
    return {
        "is/filtered_token_frac": counts["filtered_tokens"] / tokens,
        "is/filtered_seq_frac": counts["filtered_seqs"] / seqs,
        "is/gated_seq_frac": counts["gated_seqs"] / seqs,
        "is/gated_token_frac": counts["gated_tokens"] / tokens,
        "is/weight_mean": counts["weight_sum"] / tokens,
    }


def mismatch_metrics(rollout_logprobs: Tensor, old_logprobs: Tensor, action_mask: Tensor) -> dict[str, float]:
    """How far the trainer's log-probabilities are from the engine's on the same tokens.

    k3 estimates KL(π_rollout || π_old) from the tokens the engine sampled.
    """
    rollout_logprobs, old_logprobs = rollout_logprobs.detach().float(), old_logprobs.detach().float()
    delta = torch.where(action_mask, rollout_logprobs - old_logprobs, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    abs_delta = delta.abs()
    return {
        "mismatch/abs_mean": _masked_mean(abs_delta, action_mask),
        "mismatch/abs_max": abs_delta.max().item() if abs_delta.numel() else 0.0,
        # unbounded here: a diagnostic, not a loss term
        "mismatch/k3": _masked_mean(torch.expm1(-delta) + delta, action_mask),
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
    ratio = (logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    clipped = ratio > cfg.cispo_max_weight
    weight = ratio.clamp(max=cfg.cispo_max_weight)
    return -weight * advantages * logprobs, clipped


POLICY_LOSSES = {"ppo": ppo, "gspo": gspo, "cispo": cispo}


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, cfg: LossPlan,
                is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Per-token policy loss [B, T] of POLICY_LOSSES[cfg.name], times the importance weights, zero off the
    loss mask. Reduce it with `aggregate`."""
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
    log_ratio = (logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)  # 0·(−inf) would be NaN
    return -(logp.exp() * logp).sum(-1)


def token_weights(loss_mask: Tensor, rollout_ids: Tensor, aggregation: str, max_rollout_tokens: int) -> Tensor:
    """Per-token weights [B, T], zero off the loss mask, that make the step's loss Σ w_t·ℓ_t (`aggregate`).

    Computed once per optimizer step over the whole batch, so each micro-batch on each data-parallel rank
    adds its own share and the update does not depend on how the batch is split (the trainer sums gradients
    over micro-batches and ranks). A rollout counts once, however many segments (rows) it has.
      token_mean           1 / (loss tokens of the step): every token weighs the same (PPO, CISPO; the paper's)
      seq_mean_token_mean  1 / (rollouts x loss tokens of the rollout): every rollout weighs the same (GSPO)
      seq_mean_token_sum   1 / (rollouts x max_rollout_tokens): a constant normaliser (Dr. GRPO), no length bias
    Rollouts count when they have at least one loss token.
    """
    loss_mask = loss_mask.bool()
    if aggregation == "token_mean":
        return loss_mask / loss_mask.sum().clamp(min=1)
    _, row_rollout = torch.unique(rollout_ids, return_inverse=True)
    rollout_tokens = torch.zeros(int(row_rollout.max()) + 1 if len(row_rollout) else 0).index_add_(
        0, row_rollout, loss_mask.sum(1).float())
    rollouts = (rollout_tokens > 0).sum().clamp(min=1)
    if aggregation == "seq_mean_token_mean":
        per_row = 1 / (rollouts * rollout_tokens[row_rollout].clamp(min=1))
    else:
        per_row = torch.full(row_rollout.shape, 1 / (float(rollouts) * max_rollout_tokens))
    return loss_mask * per_row[:, None]


def aggregate(per_token: Tensor, weights: Tensor) -> Tensor:
    """Σ weights·per_token: this micro-batch's share of the step's loss (weights from `token_weights`)."""
    return torch.where(weights != 0, per_token * weights, 0.0).sum()


def token_mean(per_token: Tensor, loss_mask: Tensor, num_tokens: int | Tensor) -> Tensor:
    """sum(per_token over loss_mask) / max(num_tokens, 1), num_tokens counted over the whole step by the caller:
    this micro-batch's share of the global token mean (the critic's value loss, KL metrics)."""
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
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if cfg.dual_clip is not None:
        dual_bound = -cfg.dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(dual_clipped, dual_bound, loss)
        is_clipped = is_clipped | dual_clipped
    return loss, is_clipped


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    return (torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)).item()


def _fraction(selected: Tensor, mask: Tensor) -> float:
    return (selected.sum() / mask.sum().clamp(min=1)).item()
