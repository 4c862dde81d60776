"""The driver-side handle on a group of trainer ranks (molt/ranks.py): the policy, or a reference model /
teacher. It creates the ranks, splits a `TrainBatch` across the data-parallel ranks, gathers the results,
and writes and reads checkpoints (molt/checkpoint.py); the training loop only talks to `Trainer`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import numpy as np
import ray
import torch
from torch import Tensor

from molt import checkpoint, losses
from molt.placement import rank_resources
from molt.plan import Plan
from molt.ranks import PolicyWorker
from molt.trace import IMAGE_INPUTS, TrainBatch


class RankDied(RuntimeError):
    """A trainer rank's process is gone: its shard of the weights and optimizer state is lost with it."""


class Trainer:
    """Driver-side handle on a group of `PolicyWorker` ranks (plan.parallel.actor_ranks of them).

    trainable=False makes a reference model / teacher: it loads plan.reference.path (or the policy's initial
    weights) and offers only `logprobs`.
    """

    worker_class = PolicyWorker

    def __init__(self, plan: Plan, trainable: bool = True, placement: Optional[list] = None):
        self.plan, self.trainable = plan, trainable
        path = plan.model.path if trainable else (plan.reference.path or plan.model.path)
        ranks = plan.parallel.actor_ranks
        # placement: one Ray scheduling strategy per rank (molt.placement.reserve); None lets Ray choose.
        worker = ray.remote(self.worker_class)
        self.workers = [
            worker.options(**rank_resources(plan), scheduling_strategy=strategy).remote(plan, rank, ranks, path, trainable)
            for rank, strategy in enumerate(placement or [None] * ranks)
        ]
        try:
            address, port = ray.get(self.workers[0].master_address.remote())
            self.threads = self.on_ranks("setup", address, port)  # torch threads per rank
        except Exception:
            self.shutdown(graceful=False)  # a failed start must not leave ranks holding CPUs or GPUs
            raise
        self.step = 0  # optimizer steps taken
        self.queued_send: Optional[list[ray.ObjectRef]] = None  # train_step's refit_after, until send_weights

    def on_ranks(self, method: str, *args) -> list:
        """Call `method` on every rank and wait for all; a dead rank is a RankDied naming the method."""
        return self._wait(method, [getattr(worker, method).remote(*args) for worker in self.workers])

    def _wait(self, method: str, calls: list[ray.ObjectRef]) -> list:
        try:
            return ray.get(calls)
        except ray.exceptions.RayActorError as e:
            raise RankDied(f"a trainer rank died in {method}: {e}") from e

    def _ranks_batch(self, batch: TrainBatch, **tensors: Optional[Tensor]) -> dict | ray.ObjectRef:
        """The batch's [B, T] tensors as the ranks' call argument, padded to a multiple of the data-parallel
        size with copies of row 0 that carry no loss (every rank must run the same number of forward passes).
        Several ranks read one copy in Ray's object store; a single rank gets the tensors inside its call (up
        to Ray's max_direct_call_object_size, which molt/loop.py raises), without the object store's round trip.
        They travel as numpy arrays (PolicyWorker._shard makes them tensors again): Ray pickles a tensor
        through torch.save, ~0.35 ms apiece here, and an array without a copy."""
        data = dict(token_ids=batch.token_ids, attention_mask=batch.attention_mask,
                    action_mask=batch.action_mask, **tensors)
        data.update({name: getattr(batch, name) for name in IMAGE_INPUTS if getattr(batch, name) is not None})
        pad = -len(batch) % self.plan.actor_dp_size
        if pad:
            rows = torch.cat([torch.arange(len(batch)), torch.zeros(pad, dtype=torch.long)])
            data = {k: None if v is None else v[rows] for k, v in data.items()}
            for mask in ("action_mask", "loss_mask"):
                if data.get(mask) is not None:
                    data[mask][-pad:] = False
            if data.get("loss_weights") is not None:
                data["loss_weights"][-pad:] = 0.0
            if data.get("routed_experts") is not None:
                data["routed_experts"][-pad:] = -1  # the copies do not count in the routing agreement
        data = {k: None if v is None else v.numpy() for k, v in data.items()}
        return ray.put(data) if len(self.workers) > 1 else data

    def logprobs(self, batch: TrainBatch, temperature: float, routed_experts: Optional[Tensor] = None) -> Tensor:
        """log p(token_t | tokens_<t) [B, T] of the batch's exact tokens, with the logits divided by the
        sampling temperature as the engine does; 0 off the action mask. With model.routing_replay the MoE
        layers replay `routed_experts` [B, T, layers, top_k] (-1: no recorded route; molt/routing.py)."""
        _check_routes(batch, routed_experts)
        data = self._ranks_batch(batch, routed_experts=routed_experts)
        return gather_rows(self.on_ranks("logprobs", data, temperature), len(batch))

    def train_step(self, batch: TrainBatch, advantages: Tensor, old_logprobs: Optional[Tensor], loss_mask: Tensor,
                   ref_logprobs: Optional[Tensor] = None, routed_experts: Optional[Tensor] = None,
                   kl_coef: Optional[float] = None, refit_after: bool = False) -> tuple[dict[str, float], Tensor]:
        """plan.trainer.epochs_per_batch passes over the batch, one optimizer step per pass, each token's
        loss weighted by its importance weight (loss.importance_sampling) of old_logprobs against the
        engine's batch.rollout_logprobs. old_logprobs None (one epoch only) takes the old log-probs from the
        training forward itself, which runs on the same weights as a separate `logprobs` pass would.
        Every per-token loss term becomes the step's loss through the weights of losses.token_weights
        (loss.aggregation), computed here over the whole batch.

        Returns the metrics and the old log-probs used [B, T]. Metrics: the loss terms (aggregated with
        loss_weights), grad_norm, lr, entropy, clip fraction, the importance weights' is/* fractions, tokens and
        timings; for MoE models loss/moe_aux and, given the engine's `routed_experts` [B, T, layers, top_k]
        (replayed with model.routing_replay), moe/routing_agreement. kl_coef (default loss.kl_coef) weighs the KL loss term against ref_logprobs;
        the loop passes the adaptive controller's current value.

        refit_after: queue the refit's send on the ranks right behind the step, so that rank 0 broadcasts the
        new weights the moment its optimizer step is done, with no round trip through this process; the
        engines must be receiving or about to (Generator.receive, pause_and_receive: the broadcast waits for them
        at most rollout.refit_timeout_s), and send_weights() then waits for this send. A step
        that fails sends nothing: rank 0 aborts the refit instead."""
        self._require_trainable("train")
        if old_logprobs is None and self.plan.trainer.epochs_per_batch != 1:
            raise ValueError(
                f"train_step needs old_logprobs with trainer.epochs_per_batch="
                f"{self.plan.trainer.epochs_per_batch}: later epochs must not score the old policy with "
                f"updated weights"
            )
        check_shapes(batch, advantages=advantages, old_logprobs=old_logprobs, loss_mask=loss_mask,
                     ref_logprobs=ref_logprobs)
        _check_routes(batch, routed_experts)
        start = time.perf_counter()
        num_tokens = int(loss_mask.sum())
        agent = self.plan.agent
        loss_weights = losses.token_weights(loss_mask, batch.rollout_ids, self.plan.loss.aggregation,
                                            max_rollout_tokens=agent.max_turns * agent.max_tokens_per_turn)
        data = self._ranks_batch(batch, advantages=advantages.float(), rollout_logprobs=batch.rollout_logprobs.float(),
                                 old_logprobs=None if old_logprobs is None else old_logprobs.float(),
                                 loss_mask=loss_mask.bool(), loss_weights=loss_weights, ref_logprobs=ref_logprobs,
                                 routed_experts=routed_experts)
        kl_coef = self.plan.loss.kl_coef if kl_coef is None else kl_coef
        calls = [worker.train_step.remote(data, kl_coef) for worker in self.workers]
        if refit_after:
            self.queued_send = [worker.send_weights.remote(True) for worker in self.workers]
        results = self._wait("train_step", calls)
        metrics = results[0][2]
        self.step = metrics.pop("optimizer_steps")
        if old_logprobs is None:
            old_logprobs = gather_rows([(dp_rank, own) for dp_rank, own, _ in results], len(batch))
        return metrics | {"tokens": num_tokens, "time/train_s": time.perf_counter() - start}, old_logprobs

    def _require_trainable(self, action: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"this Trainer is a reference model (trainable=False); it cannot {action}")

    def state_dict(self) -> dict[str, Tensor]:
        """The policy's full (unsharded) state dict on CPU, named as the HF model's state_dict(). For
        transformers-5 MoE models that is the fused expert layout (mlp.experts.gate_up_proj), not the per-expert
        tensors on disk; transformers.core_model_loading.revert_weight_conversion maps it back."""
        return self.on_ranks("state_dict")[0]

    def refit_offer(self):
        """The RefitGroup rank 0 offers the engines (Generator.connect_refit)."""
        return ray.get(self.workers[0].refit_offer.remote())

    def join_refit(self, group) -> None:
        """Rank 0 joins the refit group; call together with the engines (Generator.connect_refit)."""
        ray.get(self.workers[0].join_refit.remote(group))

    def send_weights(self) -> None:
        """Broadcast the policy's weights to the refit group (the engines receive them: Generator.receive), or
        wait for the broadcast the last train_step queued (refit_after)."""
        self._require_trainable("send weights")
        calls, self.queued_send = self.queued_send or [worker.send_weights.remote() for worker in self.workers], None
        self._wait("send_weights", calls)

    def save(self, root: str, extra: dict) -> str:
        """Write a distributed checkpoint of model, optimizer, scheduler and RNG plus the JSON `extra` to
        root/step_<n> (molt/checkpoint.py); returns its path. With ranks on several nodes, root must be on a
        file system they and the driver share."""
        self._require_trainable("save a checkpoint")
        return checkpoint.save(root, self.step, self.plan.checkpoint.keep, extra,
                               lambda directory: self.on_ranks("save", directory))

    def load(self, path: str) -> dict:
        """Restore a checkpoint written by `save` (model, optimizer, scheduler, RNG); returns its `extra`.
        `path` is one checkpoint (root/step_<n>, e.g. from checkpoint.latest), not the root."""
        self._require_trainable("load a checkpoint")
        extra = checkpoint.read_extra(path)
        self.step = self.on_ranks("load", os.path.abspath(path))[0]
        return extra

    def export_hf(self, path: str) -> None:
        """Save the current policy in HF save_pretrained format, with the tokenizer of model.path."""
        self.on_ranks("export_hf", os.path.abspath(path))

    def shutdown(self, graceful: bool = True) -> None:
        """Leave the process group on every rank (graceful), then end the rank processes."""
        if graceful:
            with contextlib.suppress(RankDied):  # after a rank died, the others still need ending
                self.on_ranks("shutdown")
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def gather_rows(results: list[tuple[int, np.ndarray]], rows: int) -> Tensor:
    """Concatenate per-rank results (numpy, as they travel: see _ranks_batch) in data-parallel order, dropping
    the padding rows."""
    by_dp_rank = dict(results)  # tensor-parallel ranks of one dp rank return the same rows
    return torch.from_numpy(np.concatenate([by_dp_rank[r] for r in sorted(by_dp_rank)])[:rows])


def check_shapes(batch: TrainBatch, **tensors: Optional[Tensor]) -> None:
    expected = tuple(batch.token_ids.shape)
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"train_step: {name} has shape {tuple(tensor.shape)}, the batch is {expected}")


def _check_routes(batch: TrainBatch, routed_experts: Optional[Tensor]) -> None:
    if routed_experts is None:
        return
    if routed_experts.dim() != 4 or routed_experts.shape[:2] != batch.token_ids.shape:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)}; it must be [B, T, layers, top_k] with "
            f"[B, T] = {tuple(batch.token_ids.shape)}, the batch's"
        )
    if routed_experts.is_floating_point() or not routed_experts.is_signed():
        raise ValueError(f"routed_experts must be signed integers (-1: no route), got {routed_experts.dtype}")
