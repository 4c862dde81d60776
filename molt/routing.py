"""MoE routing in the actor forward: rollout routing replay, the routers' own choices, and routing metrics.

The engine and the actor each pick every token's top-k experts; tiny numeric differences flip choices, and a
flipped choice means the actor trains a different function from the one that sampled (DESIGN.md, section 3).
Rollout routing replay (R3; Ma et al., 2025) makes the actor use the engine's choices:

- replayed: the selection, i.e. which top_k experts each token goes to in each MoE layer;
- live: the gate weights of those experts, softmax(router logits) gathered at the replayed experts and
  renormalised exactly as the router does. So the loss still trains the router (unless it is frozen), and
  replaying the router's own choice reproduces its forward bit for bit.

Routes are expert ids [..., layers, top_k], flattened in the order the routers see tokens (row-major over
[batch, time], like `ids.reshape(-1)`); position t holds the route of token t as input, so the
log-probability of token t depends on the routes of positions < t. A (token, layer) whose route holds a -1
keeps the live choice. Works on the transformers routers of the softmax top-k kind (Qwen3-MoE, Qwen3.5-MoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class RouterCall:
    """One router forward."""

    logits: Tensor  # [N, experts], carries the gradient
    live: Tensor  # [N, top_k] the router's own top-k
    chosen: Tensor  # [N, top_k] the experts the tokens went to: the replayed route, else `live`


class RouterHooks:
    """Forward hooks on every MoE router of a model, in layer order. Each router forward appends a
    `RouterCall` to `calls`; `begin` starts a forward and sets the routes to replay in it (and in its
    recomputation under activation checkpointing, until the next `begin`)."""

    def __init__(self, routers: list[nn.Module]):
        self.routers = routers
        self.top_k = routers[0].top_k
        self.calls: list[RouterCall] = []
        self.replay: Optional[Tensor] = None  # [N, layers, top_k]
        self.handles = [r.register_forward_hook(partial(self._hook, i)) for i, r in enumerate(routers)]

    def begin(self, replay: Optional[Tensor] = None) -> None:
        """Forget earlier calls. `replay` [..., layers, top_k] expert ids (-1: keep the live choice), or None
        for the routers' own choices."""
        if replay is not None:
            expected = (len(self.routers), self.top_k)
            if tuple(replay.shape[-2:]) != expected:
                raise ValueError(
                    f"routed_experts has {tuple(replay.shape[-2:])} (layers, top_k) per token, the model's MoE "
                    f"routers need {expected}"
                )
            replay = replay.reshape(-1, *expected).long()
        self.replay, self.calls = replay, []

    def _hook(self, layer: int, router: nn.Module, inputs, output):
        logits, weights, live = output
        chosen = live
        if self.replay is not None:
            replay = self.replay[:, layer].to(live.device)
            if len(replay) != len(live):
                raise ValueError(f"routed_experts covers {len(replay)} tokens, the forward has {len(live)}")
            chosen = torch.where((replay >= 0).all(-1, keepdim=True), replay, live)
            # As the router computes its weights, at the chosen experts instead of its own top-k.
            weights = logits.softmax(-1, dtype=torch.float).gather(-1, chosen)
            if getattr(router, "norm_topk_prob", True):  # Qwen3.5-MoE always normalises
                weights = weights / weights.sum(-1, keepdim=True)
            weights = weights.to(logits.dtype)
        self.calls.append(RouterCall(logits, live, chosen))
        return logits, weights, chosen

    def live_routes(self) -> Tensor:
        """The routers' own choices [N, layers, top_k] in the forward since `begin`."""
        return torch.stack([call.live for call in self.calls[: len(self.routers)]], 1)

    def parameters(self) -> list[nn.Parameter]:
        return [p for router in self.routers for p in router.parameters()]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model` in layer order: transformers' Qwen3-MoE and Qwen3.5-MoE routers, whose
    forward(h) returns (logits, top-k weights, top-k ids). Empty for a dense model."""
    # Imported here: the transformers model modules take seconds, and only the trainer ranks need them.
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, (Qwen3MoeTopKRouter, Qwen3_5MoeTopKRouter))]


def load_balancing_loss(calls: list[RouterCall], token_mask: Tensor) -> Tensor:
    """Switch-Transformer load-balancing loss, mean over layers: experts x sum_e f_e p_e over the tokens in
    `token_mask` (flattened like the routes), where f_e is the fraction of the tokens' top-k slots that went
    to expert e and p_e its mean router probability. 1 when balanced; the gradient flows through p_e."""
    losses = []
    for call in calls:
        mask = token_mask.reshape(-1, 1).to(call.logits.device, torch.float32)
        tokens = mask.sum().clamp(min=1)
        probs = call.logits.float().softmax(-1)
        slots = F.one_hot(call.chosen, probs.shape[-1]).sum(1).float()  # [N, experts]: slots per expert
        fraction = (slots * mask).sum(0) / (tokens * call.chosen.shape[-1])
        mean_prob = (probs * mask).sum(0) / tokens
        losses.append(probs.shape[-1] * (fraction * mean_prob).sum())
    return torch.stack(losses).mean()


def routing_agreement(actor: Tensor, engine: Tensor) -> tuple[int, int]:
    """(matching, compared): of the (token, layer)s where the engine recorded a route (no -1), how many
    top-k expert sets the actor's routes equal. Both [..., layers, top_k]."""
    recorded = (engine >= 0).all(-1)
    same = (actor.sort(-1).values == engine.to(actor.device).long().sort(-1).values).all(-1)
    return int((same & recorded).sum()), int(recorded.sum())
