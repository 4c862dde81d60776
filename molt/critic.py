"""The optional PPO critic (critic.enabled): the policy's backbone class with a scalar value head per token,
trained with the clipped value loss on ranks built like the policy's (molt/ranks.py, molt/trainer.py)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from molt import losses
from molt.plan import Plan
from molt.trace import TrainBatch
from molt.ranks import PolicyWorker, all_reduce_metrics
from molt.trainer import Trainer, check_shapes, gather_rows


class CriticWorker(PolicyWorker):
    """One critic rank: the clipped value loss with its own AdamW (critic.lr), schedule and checkpoint."""

    value_head = True

    def _values(self, token_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """V_t [b, T]: the value of the state before token t, read at position t-1 like the logprobs; 0 at t=0."""
        length = int(attention_mask.sum(1).max())
        ids = token_ids[:, :length].to(self.device)
        values = self.model(input_ids=ids, use_cache=False).logits[:, :-1, 0].float()
        return F.pad(values, (1, token_ids.shape[1] - length))

    @torch.no_grad()
    def values(self, data: dict) -> tuple[int, np.ndarray]:
        self.model.eval()
        shard = self._shard(data)
        parts = [self._values(mb["token_ids"], mb["attention_mask"]).cpu() for mb in self._micro_batches(shard)]
        return self.dp_rank, self._masked_rows(shard, parts)

    def train_step(self, data: dict, num_tokens: int) -> dict[str, float]:
        self.model.train()
        loss_sum, grad_norms, lrs = 0.0, [], []
        for _ in range(self.plan.trainer.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in self._micro_batches(self._shard(data)):
                mb = {k: v.to(self.device) for k, v in mb.items()}
                values = self._values(mb["token_ids"], mb["attention_mask"])
                per_token = losses.value_loss(values, mb["old_values"], mb["returns"], mb["loss_mask"],
                                              self.plan.loss.value_clip)
                loss = losses.token_mean(per_token, mb["loss_mask"], num_tokens)
                (loss * self.dp_size).backward()  # a sum over dp ranks, as in PolicyWorker.train_step
                loss_sum += loss.item()
            lrs.append(self.optimizer.param_groups[0]["lr"])
            grad_norms.append(float(self._clip_and_step()))
        loss = all_reduce_metrics({"loss": loss_sum}, dist.ReduceOp.SUM, self.dp_group)["loss"]
        return {
            "loss": loss / len(grad_norms),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": lrs[-1],
            "optimizer_steps": self.scheduler.last_epoch,
        }


class Critic(Trainer):
    """Driver-side handle on the critic ranks, initialised from model.path. `values` and `train_step` are its
    own; state_dict, save/load (in a directory of its own) and shutdown work as for the policy."""

    worker_class = CriticWorker

    def __init__(self, plan: Plan, placement: Optional[list] = None):
        super().__init__(plan, trainable=True, placement=placement)

    def values(self, batch: TrainBatch) -> Tensor:
        """V_t [B, T] for every action position (0 elsewhere): the old values for GAE and value clipping."""
        data = self._ranks_batch(batch)
        return gather_rows(self.on_ranks("values", data), len(batch))

    def train_step(self, batch: TrainBatch, returns: Tensor, old_values: Tensor,
                   loss_mask: Tensor) -> dict[str, float]:
        """Clipped value loss (loss.value_clip) toward `returns`, one optimizer step per epoch pass."""
        check_shapes(batch, returns=returns, old_values=old_values, loss_mask=loss_mask)
        data = self._ranks_batch(batch, returns=returns.float(), old_values=old_values.float(),
                                 loss_mask=loss_mask.bool())
        metrics = self.on_ranks("train_step", data, int(loss_mask.sum()))[0]
        self.step = metrics.pop("optimizer_steps")
        return metrics
