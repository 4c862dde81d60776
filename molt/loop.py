"""The run's lifecycle. Read `_run` top to bottom to follow a run from launch to its summary.

Ray places the rollout engines (molt/generator.py) and the trainer ranks (molt/ranks.py, driven through
molt/trainer.py); this driver runs one asyncio event loop in which the prompt-group pool (molt/pool.py) keeps
agent rollouts in flight while the actor trains, so the engines never drain. Each optimizer step:

    wait for a batch of complete groups -> train on it (molt/step.py: log-probs, advantages, the loss and
    the optimizer step) -> refit the engines -> log, checkpoint
    (-> every logger.eval_every steps: score the eval split on the new weights)

`schedule.queue_depth` bounds how far generation runs ahead of training (1 = sync, no overlap).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import time
import traceback

import ray
from transformers import AutoTokenizer

from molt import checkpoint
from molt.agent import RolloutFailed, load_agent, run_chat_rollout, run_env_rollout
from molt.chat_server import ChatServer
from molt.console import console_line, print_summary, starting
from molt.critic import Critic
from molt.data import load_dataset, load_processor
from molt.generator import Generator
from molt.losses import adaptive_kl_coef
from molt.placement import reserve
from molt.plan import Plan
from molt.pool import EngineDied, Group, RolloutPool
from molt.step import connect_refit, optimizer_step, receive_refit, refit, rollout_metrics
from molt.tiny import build_tiny
from molt.trace import Trajectory
from molt.tracking import Tracker
from molt.trainer import RankDied, Trainer


# Ray call arguments up to this size travel inside the call, not through the object store (Ray's default
# limit: 100 KiB). A single trainer rank's batch (molt/trainer.py) is ~150 KB on the CPU default, and the
# object store's round trip cost 4-6 ms of a 0.35 s step there.
RAY_INLINE_BYTES = 1 << 20


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
    except RankDied as e:  # its shard of the weights is gone: only a checkpoint can continue the run
        tracker.finish("FAILED", error=traceback.format_exc())
        saved = checkpoint.latest(os.path.join(run_dir, plan.checkpoint.dir))
        raise RankDied(f"{e}\nmolt: the newest complete checkpoint is {saved}; run again in the same directory "
                       f"(hydra.run.dir={run_dir}) to resume from it") from e
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
    if plan.model.tiny:  # the tiny checkpoint is built at model.path on first use
        build_tiny(plan.model.tiny, plan.model.path, plan.model.warm_start_steps)
    if not ray.is_initialized():
        # read by this process's Ray when it starts; a user's own setting stays
        os.environ.setdefault("RAY_max_direct_call_object_size", str(RAY_INLINE_BYTES))
        with starting("Ray"):
            ray.init(address=plan.ray_address, include_dashboard=False,
                     log_to_driver=plan.logger.library_logs == "console")
    tokenizer = AutoTokenizer.from_pretrained(plan.model.path)
    processor = load_processor(plan)  # None for a text-only model
    agent = load_agent(plan.agent.path, plan.agent.form)
    rows = load_dataset(plan, agent, tokenizer, "train", size=plan.trainer.steps * plan.trainer.groups_per_step)
    eval_rows = load_dataset(plan, agent, tokenizer, "eval", size=plan.data.eval_size) if plan.logger.eval_every else []

    async with contextlib.AsyncExitStack() as stack:  # stops whatever has started, in reverse order
        placement = reserve(plan)  # checks the cluster against the plan, then holds each node's share
        stack.callback(placement.release)

        async def start_engines() -> Generator:
            with starting("rollout engine", plan.rollout.engines):
                return await Generator.start(plan, placement.engines)

        def start_ranks(role: str, actor_group: type, **options):
            with starting(f"{role} rank", plan.parallel.actor_ranks):
                return actor_group(plan, **options)

        # The engines and the ranks start side by side: the engine's start waits on its own process much of the
        # time (37 s alone, 48 s one after the other, 37 s side by side on 2 cores).
        starts = {"policy": asyncio.to_thread(start_ranks, "policy", Trainer, placement=placement.policy)}
        if plan.reference.enabled:
            starts["reference"] = asyncio.to_thread(start_ranks, "reference", Trainer, trainable=False,
                                                    placement=placement.reference)
        if plan.critic.enabled:
            starts["critic"] = asyncio.to_thread(start_ranks, "critic", Critic, placement=placement.critic)
        generator, *ranks = await asyncio.gather(start_engines(), *starts.values(), return_exceptions=True)
        # Whatever started is stopped on the way out, also when another part failed to start.
        if not isinstance(generator, BaseException):
            stack.push_async_callback(generator.shutdown)
        for actor_group in ranks:
            if not isinstance(actor_group, BaseException):
                stack.callback(actor_group.shutdown)
        for part in (generator, *ranks):
            if isinstance(part, BaseException):
                raise part
        started_ranks = dict(zip(starts, ranks))
        trainer, reference, critic = (started_ranks.get(role) for role in ("policy", "reference", "critic"))
        if plan.parallel.device == "cpu":  # chosen, not implied by Ray's CPU shares: say what they are
            print(f"molt: each policy rank trains on {trainer.threads[0]} torch threads (trainer.cpu_threads) at nice "
                  f"+{plan.trainer.cpu_nice} (trainer.cpu_nice); the engine's OpenMP threads bind to "
                  f"{plan.rollout.cpu_omp_threads_bind} (rollout.cpu_omp_threads_bind)", file=sys.stderr)
        server = ChatServer(generator, tokenizer, plan, processor) if plan.agent.form == "chat" else None
        if server:
            await server.start()
            stack.push_async_callback(server.stop)

        async def run_rollout(row: dict, rollout_id: str, group_id: str) -> list[Trajectory]:
            if server:
                return await run_chat_rollout(agent.AgentRunner, row, server, plan, rollout_id, group_id)
            return await run_env_rollout(agent.AgentRunner, row, generator, tokenizer, plan, rollout_id, group_id,
                                         processor)

        # Before any train call: rank 0 joins the group in a call of its own, which must not queue behind a step.
        await connect_refit(generator, trainer)
        state = {"step": 0, "pool": {"next_index": 0, "reissue": []}, "kl_coef": plan.loss.kl_coef}
        resume_from = checkpoint.latest(checkpoints) if plan.checkpoint.resume else None
        if resume_from:
            state = await asyncio.to_thread(trainer.load, resume_from)
            if critic:
                critic_state = await asyncio.to_thread(critic.load, checkpoint.latest(os.path.join(checkpoints, "critic")))
                if critic_state["step"] != state["step"]:
                    raise RuntimeError(f"{checkpoints}: the critic checkpoint is at step {critic_state['step']}, "
                                       f"the policy at {state['step']}; delete the newer one to resume")
            await refit(generator, trainer, version=state["step"], keep_requests=False)
            print(f"molt: resumed from {resume_from} at step {state['step']}", file=sys.stderr)
        # the policy's optimizer steps so far; the engines get each version at its refit (schedule.refit_every)
        version = state["step"]
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
            generator.check_loaded()  # the weights it scored loaded
            tracker.log_metrics(metrics, step=steps_done)
            with open(os.path.join(run_dir, "eval.jsonl"), "a") as log:
                log.write(json.dumps({"step": steps_done, **metrics}) + "\n")
            if plan.logger.console:
                print(f"eval after {steps_done} steps: reward {metrics['eval/reward_mean']:.3f} over "
                      f"{metrics['eval/samples']:.0f} rows", flush=True)

        if eval_rows and state["step"] == 0:
            await log_eval(0)
        stack.callback(gc.unfreeze)  # a later run in this process (tests) collects it again
        rewards_by_step = []
        for step in range(state["step"], plan.trainer.steps):
            if step < state["step"] + 2:
                # What exists before the first step (modules, Ray handles, the datasets) and what that step
                # imported lazily (~160K objects on the CPU default) live for the whole run: frozen, the collector
                # no longer scans them, and a full collection stops costing 0.1-0.5 s in the middle of a step.
                # Collected first, so that no garbage is frozen with them.
                gc.collect()
                gc.freeze()
            t0 = time.perf_counter()
            try:
                groups = await pool.next_batch()
                generator.check_loaded()  # the last refit's load (it overlaps the step) did not fail
            except (EngineDied, ray.exceptions.RayActorError) as e:  # keep what was learned, stop, resume later
                await save_checkpoint(step)
                raise RuntimeError(f"{e}; wrote a checkpoint at step {step} in {checkpoints}: run again in "
                                   f"the same directory (hydra.run.dir={run_dir}) to resume") from e
            t_batch = time.perf_counter()
            batch_path = os.path.join(batches, f"step_{step}.pt") if plan.logger.save_batches else None
            refit_due = (version + 1) % plan.schedule.refit_every == 0
            # Rank 0 sends the new weights the moment its optimizer step is done, with no round trip through this
            # process (refit_after), where the engines receive soon enough: in sync they pause and wait for them
            # while the actor trains (nothing generates until this refit), with partial rollout they pause right
            # after the step, for one engine step (requests are kept). A pause that lets requests finish could keep
            # the sender waiting past rollout.refit_timeout_s, so there the send waits for it.
            refit_after = refit_due and (plan.schedule.queue_depth == 1 or plan.schedule.partial_rollout)
            receiving = None
            if refit_due and plan.schedule.queue_depth == 1:
                receiving = asyncio.ensure_future(
                    receive_refit(generator, trainer, version + 1, keep_requests=plan.schedule.partial_rollout))
            metrics = await optimizer_step(plan, groups, trainer, reference, critic, version, kl_coef, batch_path,
                                           refit_after=refit_after)
            t_train = time.perf_counter()
            engine_died, drain_s = None, 0.0
            if refit_due:
                try:
                    drain_s = await refit(generator, trainer, version + 1, keep_requests=plan.schedule.partial_rollout,
                                          receiving=receiving)
                except ray.exceptions.RayActorError as e:  # the update is made: record the step, then stop
                    engine_died = EngineDied(f"a rollout engine died during the weight update: {e}")
            t_end = time.perf_counter()
            metrics |= {
                "pool/groups_dropped": float(sum(pool.dropped.values())),
                "pool/rollouts_failed": float(sum(pool.failed.values())),
                "timing/gen_wait": t_batch - t0,
                # part of gen_wait: the engines were still loading the last refit's weights (in sync, all of it)
                "timing/refit_load_wait": max(0.0, min(generator.loaded_at, t_batch) - t0),
                "timing/refit": t_end - t_train,
                "timing/refit_drain": drain_s,  # part of timing/refit: in-flight requests finishing on the old weights
                "timing/step": t_end - t0,
                "throughput/trained_tokens_per_s": metrics["train/tokens"] / (t_end - t0),
            }
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

        await generator.loaded()  # the last refit's error, if it failed, is the run's
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
