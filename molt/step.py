"""One optimizer step on a batch of complete groups, stage by stage, and the weight update after it.

    the engine's trace -> collate (token identity checked) -> the actor's old log-probs, the reference's,
    the critic's values -> advantages (molt/estimators.py) -> the loss and the optimizer step on the trainer
    ranks (molt/ranks.py, molt/losses.py) -> [the critic's step] -> refit: the engines load the new weights

Each stage's wall time is a `timing/*` metric; the loop adds the wait for the batch and the refit's.
"""

from __future__ import annotations

import asyncio
import time
from itertools import compress
from typing import Awaitable, Optional

import torch

from molt.critic import Critic
from molt.estimators import ESTIMATORS
from molt.generator import Generator
from molt.losses import kl_penalty, mismatch_metrics, staleness_mask, token_mean
from molt.plan import Plan
from molt.pool import Group
from molt.trace import Trajectory, collate
from molt.trainer import Trainer


def action_versions(rollout: list[Trajectory]) -> set[int]:
    return {v for seg in rollout for v in compress(seg.versions, seg.action_mask)}


def rollout_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Reward, length, truncation, staleness and the agents' numeric info, over the rollouts of a batch."""
    rollouts = [rollout for group in groups for rollout in group.rollouts]
    rewards = torch.tensor([r[0].reward for r in rollouts])
    lengths = torch.tensor([float(sum(seg.num_actions for seg in r)) for r in rollouts])
    lags = torch.tensor([float(version - v) for r in rollouts for seg in r
                         for v in compress(seg.versions, seg.action_mask)])
    metrics = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/response_length": lengths.mean().item(),
        "rollout/truncated_frac": sum(r[0].truncated for r in rollouts) / len(rollouts),
        "rollout/samples": float(len(rollouts)),
        "rollout/segments": float(sum(len(r) for r in rollouts)),
        "rollout/mixed_version_frac": sum(len(action_versions(r)) > 1 for r in rollouts) / len(rollouts),
        "staleness/mean": lags.mean().item() if len(lags) else 0.0,
        "staleness/max": lags.max().item() if len(lags) else 0.0,
    }
    for key in {k for r in rollouts for k, v in r[0].info.items() if isinstance(v, (int, float))}:
        values = [float(r[0].info[key]) for r in rollouts if isinstance(r[0].info.get(key), (int, float))]
        metrics[f"info/{key}"] = sum(values) / len(values)
    return metrics


async def optimizer_step(plan: Plan, groups: list[Group], trainer: Trainer, reference: Trainer | None,
                         critic: Critic | None, version: int, kl_coef: float, batch_path: str | None,
                         refit_after: bool = False) -> dict[str, float]:
    """Train the policy (and critic) on `groups`, rollouts sampled by weight versions up to `version`, the
    trainer's optimizer steps so far. kl_coef weighs the KL to the reference (a reward or loss term). With
    batch_path the trained batch, its advantages and loss mask are saved there (logger.save_batches).
    refit_after: the trainer sends the new weights right after its step (Trainer.train_step), to engines
    already receiving them. Returns the step's metrics."""
    t0 = time.perf_counter()
    # the one gate: only tokens, log-probs and versions the engine gave reach the trainer
    batch = collate([segment for group in groups for rollout in group.rollouts for segment in rollout])
    t_collate = time.perf_counter()
    if plan.schedule.force_on_policy and (batch.versions[batch.action_mask] != version).any():
        raise RuntimeError(f"schedule.force_on_policy=true: a batch holds tokens sampled by weight versions "
                           f"{sorted(set(batch.versions[batch.action_mask].tolist()))}, the trainer is at {version}")
    temperature, loss = plan.rollout.temperature, plan.loss

    # The actor scores the exact sampled ids; the engine's log-probs stay for the importance correction.
    # Its old log-probs come from a pass of their own only where something needs them before the update
    # (the reference's KL or teacher term, or several epochs); otherwise the one training forward runs on
    # the same weights and train_step takes them from it.
    old_logprobs = None
    if reference or plan.trainer.epochs_per_batch > 1:
        old_logprobs = await asyncio.to_thread(trainer.logprobs, batch, temperature, batch.routed_experts)
    ref_logprobs = await asyncio.to_thread(reference.logprobs, batch, temperature) if reference else None
    values = await asyncio.to_thread(critic.values, batch) if critic else None
    t_logprobs = time.perf_counter()

    loss_mask = staleness_mask(batch.action_mask, batch.versions, version, loss.importance_sampling.max_staleness)
    kl_reward, kl_metrics = None, {}
    if ref_logprobs is not None:
        kl_tokens = kl_penalty(old_logprobs, ref_logprobs, loss.kl_estimator) * batch.action_mask
        # what the adaptive controller (loss.kl_target) steers: the sampling policy's KL to the reference
        kl_metrics = {"kl/policy_ref": float(token_mean(kl_tokens, batch.action_mask, int(batch.action_mask.sum()))),
                      "kl/coef": kl_coef}
        if loss.kl_in_reward:
            kl_reward = kl_coef * kl_tokens
    advantages, returns = ESTIMATORS[plan.estimator.name](
        batch.rewards, batch.group_ids, batch.rollout_ids, batch.action_mask, plan.estimator,
        kl_penalty=kl_reward, values=values, old_logprobs=old_logprobs, teacher_logprobs=ref_logprobs,
    )
    t_advantage = time.perf_counter()

    if batch_path:
        torch.save({"batch": batch, "advantages": advantages, "loss_mask": loss_mask}, batch_path)
    kl_loss_ref = ref_logprobs if (kl_coef > 0 and not loss.kl_in_reward) else None
    train_metrics, old_logprobs = await asyncio.to_thread(
        trainer.train_step, batch, advantages, old_logprobs, loss_mask, kl_loss_ref, batch.routed_experts, kl_coef,
        refit_after,
    )
    if critic:
        critic_metrics = await asyncio.to_thread(critic.train_step, batch, returns, values, loss_mask)
        train_metrics |= {f"critic/{k}": v for k, v in critic_metrics.items()}
    t_train = time.perf_counter()

    return {
        **rollout_metrics(groups, version),
        "is/stale_token_frac": float((batch.action_mask & ~loss_mask).sum() / batch.action_mask.sum().clamp(min=1)),
        **kl_metrics,
        **mismatch_metrics(batch.rollout_logprobs, old_logprobs, batch.action_mask),
        **{k if "/" in k else f"train/{k}": v for k, v in train_metrics.items()},
        # grpo, dr_grpo and reinforce_baseline give such a group advantage 0, rloo its reward
        "pool/single_rollout_groups": float(sum(len(g.rollouts) == 1 for g in groups)),
        "timing/collate": t_collate - t0,
        "timing/logprobs": t_logprobs - t_collate,
        "timing/advantage": t_advantage - t_logprobs,
        "timing/train": t_train - t_advantage,
    }


async def connect_refit(generator: Generator, trainer: Trainer) -> None:
    """Form the refit group of trainer rank 0 and every engine worker (molt/refit.py), once."""
    group = await asyncio.to_thread(trainer.refit_offer)
    await generator.connect_refit(group, lambda group: asyncio.to_thread(trainer.join_refit, group))


async def receive_refit(generator: Generator, trainer: Trainer, version: int, keep_requests: bool) -> int:
    """The engines' half of a refit: form the refit group the first time (molt/refit.py), pause the engines
    and have them receive the trainer's next weights, labelled `version` (Generator.receive); they wait for
    the send. Returns how many requests were in flight at a pause that let them finish (0 when kept).

    keep_requests (partial rollout) lets in-flight requests continue on the new weights, each token keeping
    the version it was sampled under, and the pause is part of the engines' receive call; otherwise in-flight
    requests finish on the old weights first, inside the pause: with an async schedule that is generation the
    step waits for, not weight transfer.
    """
    if not generator.refit_connected:
        await connect_refit(generator, trainer)
    if keep_requests:
        await generator.pause_and_receive(version)
        return 0
    in_flight = await generator.pause()
    generator.receive(version)
    return in_flight


async def refit(generator: Generator, trainer: Trainer, version: int, keep_requests: bool,
                receiving: Optional[Awaitable[int]] = None) -> float:
    """Send the engines the actor's weights labelled `version`: receive_refit, unless the caller started it
    already (`receiving`), then the trainer's send (or the one its train step queued: Trainer.train_step's
    refit_after). Returns once the trainer has sent them, with the seconds the refit waited for in-flight
    requests (`timing/refit_drain`: the pause's, when requests were in flight and not kept). Each engine then
    loads the weights and resumes by itself while the caller goes on, so the trainer can start the next step."""
    started = time.perf_counter()
    in_flight = await (receiving or receive_refit(generator, trainer, version, keep_requests))
    paused = time.perf_counter()
    await generator.send_weights(lambda: asyncio.to_thread(trainer.send_weights))
    return paused - started if in_flight and not keep_requests else 0.0
