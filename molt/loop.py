"""The one training loop. Read `train` top to bottom to follow a sample from agent to policy loss.

Ray places the rollout engines (molt/generator.py) and the policy actor ranks (molt/trainer.py); this
driver runs one asyncio event loop in which the prompt-group pool keeps agent rollouts in flight while the
actor trains, so the engines never drain. Each optimizer step:

    wait for a batch of complete groups -> (reference log-probs and values) -> advantages (pure
    functions) -> train, the actor's log-probs against the engine's giving each token's importance
    weight -> refit the engines -> log, checkpoint
    (-> every logger.eval_every steps: score the eval split on the new weights)

`schedule.queue_depth` bounds how far generation runs ahead of training (1 = sync, no overlap).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass

import ray
import torch
from transformers import AutoTokenizer

from molt.agent import RolloutFailed, load_agent, run_chat_rollout, run_env_rollout
from molt.chat_server import ChatServer
from molt.critic import Critic
from molt.data import load_dataset, load_processor
from molt.estimators import ESTIMATORS, filter_group
from molt.generator import Generator
from molt.losses import (adaptive_kl_coef, importance_weights, kl_penalty, mismatch_metrics, staleness_mask,
                         token_mean)
from molt.placement import reserve
from molt.plan import Plan
from molt.tiny import build_tiny
from molt.trace import Trajectory, check_token_identity, collate
from molt.tracking import Tracker
from molt.trainer import Trainer, latest_checkpoint


class EngineDied(RuntimeError):
    """A rollout engine's process is gone; the loop checkpoints and stops."""


@dataclass
class Group:
    index: int  # position in the prompt stream: what a resumed run re-issues
    rollouts: list[list[Trajectory]]  # samples_per_prompt rollouts, each one or more segments


class RolloutPool:
    """Keeps prompt groups in flight and hands out complete ones in the order they finish.

    At most (released steps + schedule.queue_depth) x trainer.groups_per_step groups are accepted or
    running, so queue_depth=1 starts the next batch only after the previous refit (sync) and 2 generates
    one batch ahead. A group with a failed rollout, or one the dynamic filter rejects, frees its slot and a
    new prompt backfills it. Failed rollouts are counted by reason; the run stops when more than
    agent.max_failure_fraction of them fail.
    """

    def __init__(self, plan: Plan, rows: list[dict], run_rollout, next_index: int = 0, reissue: list[int] = ()):
        self.plan, self.rows, self.run_rollout = plan, rows, run_rollout
        self.group_size = plan.rollout.samples_per_prompt
        self.next_index = next_index
        self.reissue = deque(reissue)  # groups in flight at the checkpoint we resumed from
        self.allowed = plan.schedule.queue_depth * plan.trainer.groups_per_step
        self.accepted = 0
        self.running: dict[int, asyncio.Task] = {}
        self.ready: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        self.dropped: Counter[str] = Counter()  # groups, by reason
        self.failed: Counter[str] = Counter()  # rollouts, by reason
        self.finished_rollouts = 0

    def row(self, index: int) -> dict:
        """The row at stream position `index`: each pass over the data is a fresh seeded shuffle."""
        epoch, offset = divmod(index, len(self.rows))
        order = random.Random(self.plan.seed * 100003 + epoch).sample(range(len(self.rows)), len(self.rows))
        return self.rows[order[offset]]

    def fill(self) -> None:
        while self.accepted + len(self.running) < self.allowed:
            if self.reissue:
                index = self.reissue.popleft()
            else:
                index, self.next_index = self.next_index, self.next_index + 1
            self.running[index] = asyncio.create_task(self._run_group(index))

    async def _run_group(self, index: int) -> None:
        row = self.row(index)
        results = await asyncio.gather(
            *(self.run_rollout(row, f"g{index}-r{k}", f"g{index}") for k in range(self.group_size)),
            return_exceptions=True,
        )
        del self.running[index]
        rollouts = [r for r in results if not isinstance(r, BaseException)]
        for error in results:
            if isinstance(error, RolloutFailed):
                self.failed[error.reason.split(":")[0][:60]] += 1
            elif isinstance(error, BaseException):  # not the agent's failure: stop the run with it
                self.reissue.appendleft(index)  # a resumed run generates this group again
                if isinstance(error, ray.exceptions.RayActorError):
                    error = EngineDied(f"a rollout engine died: {error}")
                self.ready.put_nowait(error)
                return
        self.finished_rollouts += len(results)
        failed = sum(self.failed.values())
        # judged over at least one step's worth of rollouts (self.allowed counts groups, not rollouts)
        if failed > self.plan.agent.max_failure_fraction * max(self.finished_rollouts, self.plan.rollouts_per_step):
            self.ready.put_nowait(RuntimeError(
                f"{failed} of {self.finished_rollouts} rollouts failed (over agent.max_failure_fraction="
                f"{self.plan.agent.max_failure_fraction}); reasons: {dict(self.failed)}"
            ))
            return
        drop_reason = filter_group([r[0].reward for r in rollouts], self.group_size, self.plan.dynamic_filter)
        if drop_reason:
            self.dropped[drop_reason] += 1
        else:
            self.accepted += 1
            self.ready.put_nowait(Group(index, rollouts))
        self.fill()

    async def next_batch(self) -> list[Group]:
        self.fill()
        groups = []
        while len(groups) < self.plan.trainer.groups_per_step:
            item = await self.ready.get()
            if isinstance(item, BaseException):
                self.reissue.extendleft(g.index for g in reversed(groups))  # taken but not trained: redo on resume
                raise item
            groups.append(item)
        # Arrival order depends on timing; stream order gives a repeated sync run the same micro-batches.
        return sorted(groups, key=lambda g: g.index)

    def release_step(self) -> None:
        """The batch was trained on and the engines refitted: admit the next batch's groups."""
        self.allowed += self.plan.trainer.groups_per_step
        self.fill()

    def state(self) -> dict:
        """What a checkpoint needs so that a resumed run neither skips nor repeats a prompt."""
        pending = sorted(self.running) + [g.index for g in self.ready._queue if isinstance(g, Group)]
        return {"next_index": self.next_index, "reissue": pending + list(self.reissue)}

    async def close(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)


def action_versions(rollout: list[Trajectory]) -> set[int]:
    return {v for seg in rollout for v, is_action in zip(seg.versions, seg.action_mask) if is_action}


def rollout_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Reward, length, truncation, staleness and the agents' numeric info, over the rollouts of a batch."""
    rollouts = [rollout for group in groups for rollout in group.rollouts]
    rewards = torch.tensor([r[0].reward for r in rollouts])
    lengths = torch.tensor([float(sum(seg.num_actions for seg in r)) for r in rollouts])
    lags = torch.tensor([float(version - v) for r in rollouts for seg in r
                         for v, is_action in zip(seg.versions, seg.action_mask) if is_action])
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


def train(plan: Plan, run_dir: str) -> dict:
    """Run plan.trainer.steps optimizer steps; returns the run summary."""
    return asyncio.run(_train(plan, os.path.abspath(run_dir)))


async def _train(plan: Plan, run_dir: str) -> dict:
    started = time.perf_counter()
    tracker = Tracker(plan, run_dir)  # first, so that a run failing at start-up is recorded too
    try:
        summary = await _run(plan, run_dir, tracker, started)
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED", error=traceback.format_exc())
        raise
    tracker.finish("FINISHED")
    return summary


async def _run(plan: Plan, run_dir: str, tracker: Tracker, started: float) -> dict:
    checkpoints = os.path.join(run_dir, plan.checkpoint.dir)
    check_writable(checkpoints)
    batches = os.path.join(run_dir, "batches")
    if plan.logger.save_batches:
        os.makedirs(batches, exist_ok=True)
    if plan.model.tiny:
        plan.model.path = build_tiny(plan.model.tiny, plan.model.path, plan.model.warm_start_steps)
    if not ray.is_initialized():
        ray.init(address=plan.ray_address, include_dashboard=False, log_to_driver=False)
    tokenizer = AutoTokenizer.from_pretrained(plan.model.path)
    processor = load_processor(plan)  # None for a text-only model
    agent = load_agent(plan.agent.path, plan.agent.form)
    rows = load_dataset(plan, agent, tokenizer, "train", size=plan.trainer.steps * plan.trainer.groups_per_step)
    eval_rows = load_dataset(plan, agent, tokenizer, "eval", size=plan.data.eval_size) if plan.logger.eval_every else []

    async with contextlib.AsyncExitStack() as stack:  # stops whatever has started, in reverse order
        placement = reserve(plan)  # checks the cluster against the plan, then holds each node's share
        stack.callback(placement.release)
        generator = await Generator.start(plan, placement.engines)
        stack.push_async_callback(generator.shutdown)
        trainer = Trainer(plan, placement=placement.policy)
        stack.callback(trainer.shutdown)
        if plan.parallel.device == "cpu":  # chosen, not implied by Ray's CPU shares: say what they are
            print(f"molt: each policy rank trains on {trainer.threads[0]} torch threads (trainer.cpu_threads); the engine's "
                  f"OpenMP threads bind to {plan.rollout.cpu_omp_threads_bind} (rollout.cpu_omp_threads_bind)",
                  file=sys.stderr)
        reference = Trainer(plan, trainable=False, placement=placement.reference) if plan.reference.enabled else None
        critic = Critic(plan, placement=placement.critic) if plan.critic.enabled else None
        for actor_group in (reference, critic):
            if actor_group:
                stack.callback(actor_group.shutdown)
        server = ChatServer(generator, tokenizer, plan, processor) if plan.agent.form == "chat" else None
        if server:
            await server.start()
            stack.push_async_callback(server.stop)

        async def run_rollout(row: dict, rollout_id: str, group_id: str) -> list[Trajectory]:
            if server:
                return await run_chat_rollout(agent.AgentRunner, row, server, plan, rollout_id, group_id)
            return await run_env_rollout(agent.AgentRunner, row, generator, tokenizer, plan, rollout_id, group_id,
                                         processor)

        state = {"step": 0, "pool": {"next_index": 0, "reissue": []}, "kl_coef": plan.loss.kl_coef}
        resume_from = latest_checkpoint(checkpoints) if plan.checkpoint.resume else None
        if resume_from:
            state = await asyncio.to_thread(trainer.load, resume_from)
            if critic:
                critic_state = await asyncio.to_thread(critic.load, latest_checkpoint(os.path.join(checkpoints, "critic")))
                if critic_state["step"] != state["step"]:
                    raise RuntimeError(f"{checkpoints}: the critic checkpoint is at step {critic_state['step']}, "
                                       f"the policy at {state['step']}; delete the newer one to resume")
            await refit(generator, trainer, version=state["step"], keep_requests=False)
            print(f"molt: resumed from {resume_from} at step {state['step']}", file=sys.stderr)
        version = state["step"]  # the engines' weight version = optimizer steps behind them
        kl_coef = state.get("kl_coef", plan.loss.kl_coef)  # moved by the controller when loss.kl_target is set
        pool = RolloutPool(plan, rows, run_rollout, **state["pool"])
        stack.push_async_callback(pool.close)

        async def save_checkpoint(steps_done: int) -> None:
            extra = {"step": steps_done, "pool": pool.state(), "kl_coef": kl_coef}
            if critic:  # first, so a complete policy checkpoint always has its critic
                await asyncio.to_thread(critic.save, os.path.join(checkpoints, "critic"), extra)
            await asyncio.to_thread(trainer.save, checkpoints, extra)

        async def log_eval(steps_done: int) -> None:
            metrics = await evaluate(eval_rows, run_rollout)
            tracker.log_metrics(metrics, step=steps_done)
            with open(os.path.join(run_dir, "eval.jsonl"), "a") as log:
                log.write(json.dumps({"step": steps_done, **metrics}) + "\n")
            if plan.logger.console:
                print(f"eval after {steps_done} steps: reward {metrics['eval/reward_mean']:.3f} over "
                      f"{metrics['eval/samples']:.0f} rows", flush=True)

        if eval_rows and state["step"] == 0:
            await log_eval(0)
        rewards_by_step = []
        for step in range(state["step"], plan.trainer.steps):
            try:
                batch_path = os.path.join(batches, f"step_{step}.pt") if plan.logger.save_batches else None
                metrics, groups, engine_died = await optimizer_step(plan, pool, generator, trainer, reference, critic,
                                                                    version, kl_coef, batch_path)
            except EngineDied as e:  # documented choice: keep what was learned, stop, resume later
                await save_checkpoint(step)
                raise RuntimeError(f"{e}; wrote a checkpoint at step {step} in {checkpoints}: run again in "
                                   f"the same directory (hydra.run.dir={run_dir}) to resume") from e
            version += 1
            pool.release_step()
            if "kl/policy_ref" in metrics:
                kl_coef = adaptive_kl_coef(kl_coef, metrics["kl/policy_ref"], metrics["rollout/samples"], plan.loss)
            if step == state["step"]:
                metrics["timing/first_step_since_launch"] = time.perf_counter() - started
            rewards_by_step.append(metrics["rollout/reward_mean"])
            tracker.log_metrics(metrics, step=step)
            with open(os.path.join(run_dir, "steps.jsonl"), "a") as log:  # the local record of every step
                log.write(json.dumps({"step": step, "groups": [g.index for g in groups], **metrics}) + "\n")
            if plan.logger.console:
                print(console_line(step, plan.trainer.steps, metrics), flush=True)
            due = (plan.checkpoint.every and (step + 1) % plan.checkpoint.every == 0) or step + 1 == plan.trainer.steps
            if due or engine_died:  # a step trained before its weight update failed is kept
                await save_checkpoint(step + 1)
            eval_due = eval_rows and ((step + 1) % plan.logger.eval_every == 0 or step + 1 == plan.trainer.steps)
            if eval_due and not engine_died:
                await log_eval(step + 1)
            if engine_died:
                raise RuntimeError(f"{engine_died}; wrote a checkpoint at step {step + 1} in {checkpoints}: run again "
                                   f"in the same directory (hydra.run.dir={run_dir}) to resume") from engine_died

        summary = {"steps": len(rewards_by_step), "reward_by_step": rewards_by_step,
                   "wall_s": time.perf_counter() - started, "groups_dropped": dict(pool.dropped),
                   "rollouts_failed": dict(pool.failed)}
        if plan.checkpoint.export_hf:
            summary["hf_export"] = os.path.join(run_dir, "hf_export")
            await asyncio.to_thread(trainer.export_hf, summary["hf_export"])
            tracker.log_artifact_path(summary["hf_export"])
        print_summary(summary)
        return summary


async def evaluate(rows: list[dict], run_rollout) -> dict[str, float]:
    """Score each eval row once on the engines' current weights, without training: `eval/*` metrics.
    Training rollouts of an async schedule keep generating alongside."""
    results = await asyncio.gather(*(run_rollout(row, f"eval-r{i}", f"eval-r{i}") for i, row in enumerate(rows)),
                                   return_exceptions=True)
    for error in results:
        if isinstance(error, BaseException) and not isinstance(error, RolloutFailed):
            raise error
    rollouts = [r for r in results if not isinstance(r, BaseException)]
    if not rollouts:
        raise RuntimeError(f"every one of the {len(rows)} eval rollouts failed, e.g. {results[0]}")
    scored = rollout_metrics([Group(-1, rollouts)], version=0)
    metrics = {"eval/" + key.removeprefix("rollout/"): value for key, value in scored.items()
               if key.startswith(("rollout/", "info/")) and key != "rollout/mixed_version_frac"}
    return metrics | {"eval/failed": float(len(results) - len(rollouts))}


def check_writable(directory: str) -> None:
    """Fail before anything starts when checkpoints could not be written."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, ".molt-write-check")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise RuntimeError(f"checkpoint.dir: cannot write checkpoints to {directory}: {e.strerror}") from None


async def optimizer_step(plan: Plan, pool: RolloutPool, generator: Generator, trainer: Trainer,
                         reference: Trainer | None, critic: Critic | None, version: int, kl_coef: float,
                         batch_path: str | None = None) -> tuple[dict[str, float], list[Group], EngineDied | None]:
    """One optimizer step, stage by stage; every stage's wall time is a `timing/*` metric. Returns the
    step's metrics, the groups it trained on, and EngineDied if an engine died in the weight update after
    the step (the step itself is done). kl_coef weighs the KL to the reference (reward or loss term).
    With batch_path the trained batch, its advantages and loss mask are saved there (logger.save_batches)."""
    t0 = time.perf_counter()
    groups = await pool.next_batch()
    t_batch = time.perf_counter()
    segments = [segment for group in groups for rollout in group.rollouts for segment in rollout]
    for segment in segments:  # the invariant audit: train only on tokens, logprobs and versions the engine gave
        check_token_identity(segment)
    batch = collate(segments)
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
    )
    # the weights train_step applied, recomputed here over the whole batch for their metrics
    _, is_metrics = importance_weights(old_logprobs, batch.rollout_logprobs, loss_mask, loss.importance_sampling)
    if critic:
        critic_metrics = await asyncio.to_thread(critic.train_step, batch, returns, values, loss_mask)
        train_metrics |= {f"critic/{k}": v for k, v in critic_metrics.items()}
    t_train = time.perf_counter()

    engine_died = None
    if (version + 1) % plan.schedule.refit_every == 0:
        try:
            await refit(generator, trainer, version + 1, keep_requests=plan.schedule.partial_rollout)
        except ray.exceptions.RayActorError as e:  # the update is made: the loop records the step, then stops
            engine_died = EngineDied(f"a rollout engine died during the weight update: {e}")
    t_end = time.perf_counter()

    step_s = t_end - t0
    trained_tokens = float(batch.action_mask.sum())
    metrics = {
        **rollout_metrics(groups, version),
        "is/stale_token_frac": float((batch.action_mask & ~loss_mask).sum() / batch.action_mask.sum().clamp(min=1)),
        **is_metrics,
        **kl_metrics,
        **mismatch_metrics(batch.rollout_logprobs, old_logprobs, batch.action_mask),
        **{k if "/" in k else f"train/{k}": v for k, v in train_metrics.items()},
        "pool/groups_dropped": float(sum(pool.dropped.values())),
        # grpo, dr_grpo and reinforce_baseline give such a group advantage 0, rloo its reward
        "pool/single_rollout_groups": float(sum(len(g.rollouts) == 1 for g in groups)),
        "pool/rollouts_failed": float(sum(pool.failed.values())),
        "timing/gen_wait": t_batch - t0,
        "timing/logprobs": t_logprobs - t_batch,
        "timing/advantage": t_advantage - t_logprobs,
        "timing/train": t_train - t_advantage,
        "timing/refit": t_end - t_train,
        "timing/step": step_s,
        "throughput/trained_tokens_per_s": trained_tokens / step_s,
    }
    return metrics, groups, engine_died


async def refit(generator: Generator, trainer: Trainer, version: int, keep_requests: bool) -> None:
    """Pause the engines, load the actor's weights labelled `version`, resume.

    keep_requests (partial rollout) lets in-flight requests continue on the new weights, each token keeping
    the version it was sampled under; otherwise in-flight requests finish on the old weights first.
    """
    if not generator.refit_connected:  # the first refit forms the broadcast group (molt/refit_worker.py)
        group = await asyncio.to_thread(trainer.refit_offer)
        await generator.connect_refit(group, lambda group: asyncio.to_thread(trainer.join_refit, group))
    await generator.pause(keep_requests=keep_requests)
    try:
        # the trainer gathers and broadcasts while the engines receive: both sides wait on each bucket
        await generator.update_weights(version, lambda: asyncio.to_thread(trainer.send_weights))
    finally:
        await generator.resume()


def console_line(step: int, steps: int, m: dict[str, float]) -> str:
    return (
        f"step {step + 1}/{steps}  reward {m['rollout/reward_mean']:.3f}  len {m['rollout/response_length']:.1f}"
        f"  loss {m['loss/policy']:.4f}  stale {m['staleness/mean']:.2f}"
        f"  {m['throughput/trained_tokens_per_s']:.0f} tok/s  step {m['timing/step']:.2f}s"
        f" (wait {m['timing/gen_wait']:.2f} train {m['timing/train']:.2f} refit {m['timing/refit']:.2f})"
    )


def print_summary(summary: dict) -> None:
    rewards = summary["reward_by_step"]
    k = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(
        f"molt: {summary['steps']} steps in {summary['wall_s']:.0f}s; mean reward first {k} steps {first:.3f}, "
        f"last {k} steps {last:.3f}; groups dropped {summary['groups_dropped']}; rollouts failed "
        f"{summary['rollouts_failed']}; export {summary.get('hf_export')}",
        flush=True,
    )
