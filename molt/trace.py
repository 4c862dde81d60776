"""The token trace: the one representation of a rollout that the trainer reads.

A `Trajectory` is one token-exact segment of a rollout. Prompt and observation tokens are appended
with `add_context` (never trained); engine samples with `add_action`, which keeps, per token, the id,
the log-probability and the weight version the engine reported. Nothing here re-tokenizes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Optional

import numpy as np
import torch

# The image inputs of the actor's forward, as Idefics3-family HF models name them (molt/data.py: image_inputs).
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask")


@dataclass
class Sample:
    """What one engine request returns: the sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the behaviour policy
    versions: list[int]  # weight version each token was sampled under
    finish_reason: str  # "stop" | "length" | "abort"
    routed_experts: Optional[Any] = None  # [positions from routes_start, layers, top_k] when the engine returns routes
    routes_start: int = 0
    # A multimodal request's prompt as the engine rendered it (each image token expanded); None for text.
    prompt_ids: Optional[list[int]] = None


@dataclass
class Trajectory:
    rollout_id: str
    group_id: str
    segment: int = 0  # > 0 after the chat server sealed a segment on context compaction
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 on context tokens
    versions: list[int] = field(default_factory=list)  # -1 on context tokens
    # Per position, the experts the engine routed it to ([layers, top_k]) when it returns routes.
    routed_experts: list[Any] = field(default_factory=list)
    # The image tensors of the segment's images for the actor (IMAGE_INPUTS; each [images, ...]), or empty.
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    # Exactly the ids each engine call returned, in order: the token-identity audit compares against it.
    engine_outputs: list[list[int]] = field(default_factory=list)

    def add_context(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.action_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def add_action(self, sample: Sample) -> None:
        n = len(sample.token_ids)
        if len(sample.logprobs) != n or len(sample.versions) != n:
            raise ValueError(
                f"rollout {self.rollout_id}: engine returned {n} tokens but {len(sample.logprobs)} "
                f"logprobs and {len(sample.versions)} versions"
            )
        self.token_ids += sample.token_ids
        self.action_mask += [True] * n
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.engine_outputs.append(list(sample.token_ids))
        if sample.routed_experts is not None:
            # The engine returns routes from routes_start (SamplingParams.routed_experts_prompt_start); positions
            # the trace has keep the routes they were sampled with.
            known = len(self.routed_experts)
            if sample.routes_start > known:
                raise AssertionError(f"rollout {self.rollout_id}: the engine returned routes from position "
                                     f"{sample.routes_start}, the trace has them for {known} positions")
            self.routed_experts += list(sample.routed_experts[known - sample.routes_start :])

    @property
    def num_actions(self) -> int:
        return sum(self.action_mask)


def check_token_identity(traj: Trajectory) -> None:
    """Fail fast unless the action tokens are exactly, and only, the ids the engine returned."""
    actions = list(compress(traj.token_ids, traj.action_mask))
    sampled = [t for output in traj.engine_outputs for t in output]
    lengths = {len(traj.token_ids), len(traj.action_mask), len(traj.logprobs), len(traj.versions)}
    if actions != sampled or len(lengths) != 1:
        raise AssertionError(
            f"token identity violated in rollout {traj.rollout_id} segment {traj.segment}: the trained "
            f"action tokens are not exactly the ids the engine returned"
        )
    if any(v < 0 for v in compress(traj.versions, traj.action_mask)):
        raise AssertionError(f"rollout {traj.rollout_id}: an action token has no engine weight version")
    if not all(math.isfinite(lp) and lp <= 0 for lp in compress(traj.logprobs, traj.action_mask)):
        raise AssertionError(f"rollout {traj.rollout_id}: an action token's behaviour log-probability is not "
                             "one the engine could have returned (non-finite or positive)")


@dataclass
class TrainBatch:
    """Trajectories right-padded into tensors. Position t holds token t; a log-probability at t is
    log p(token_t | tokens_<t), so `action_mask[:, 0]` is always False."""

    token_ids: torch.Tensor  # [B, T] long, padded with 0
    attention_mask: torch.Tensor  # [B, T] bool
    action_mask: torch.Tensor  # [B, T] bool
    rollout_logprobs: torch.Tensor  # [B, T] float32, the engine's log-probabilities (0 off actions)
    versions: torch.Tensor  # [B, T] long, weight version of each action token (-1 off actions)
    rewards: torch.Tensor  # [B] float32, the reward of the row's rollout (equal on all its segments)
    group_ids: torch.Tensor  # [B] long, rollouts of one prompt share an id
    # [B] long: the segments of one rollout share an id, and their rows follow each other in segment order.
    # Group statistics count rollouts, not rows (molt/estimators.py).
    rollout_ids: torch.Tensor
    routed_experts: Optional[torch.Tensor] = None  # [B, T, layers, top_k] int16, -1 where no route
    # Multimodal: [B, images, 3, H, W] and [B, images, H, W]; padding images are all zero, which the
    # Idefics3 forward skips.
    pixel_values: Optional[torch.Tensor] = None
    pixel_attention_mask: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.token_ids.shape[0]


def collate(trajectories: list[Trajectory]) -> TrainBatch:
    """Pad trajectories into one TrainBatch; group and rollout ids become consecutive integers. Every
    trajectory must pass the token-identity check, and a rollout's segments must be consecutive and in
    segment order (as molt/agent.py returns them)."""
    group_index: dict[str, int] = {}
    rollout_index: dict[str, int] = {}
    for previous, t in zip([None, *trajectories], trajectories):
        check_token_identity(t)
        starts_rollout = previous is None or previous.rollout_id != t.rollout_id
        expected_segment = 0 if starts_rollout else previous.segment + 1
        if t.segment != expected_segment or (starts_rollout and t.rollout_id in rollout_index):
            raise ValueError(f"rollout {t.rollout_id}: its segments must be consecutive rows in order 0, 1, ...; "
                             f"got segment {t.segment} where segment {expected_segment} belongs")
        rollout_index.setdefault(t.rollout_id, len(rollout_index))
    lengths = torch.tensor([len(t.token_ids) for t in trajectories])
    length = int(lengths.max())

    def padded(name: str, pad, dtype) -> torch.Tensor:
        # One array for all rows: numpy converts nested lists ~2x faster than torch.tensor, ~20x than a tensor per row.
        return torch.from_numpy(np.array([getattr(t, name) + [pad] * (length - len(t.token_ids)) for t in trajectories],
                                         dtype=dtype))

    routed_experts = None
    if any(t.routed_experts for t in trajectories):
        shape = torch.as_tensor(next(t.routed_experts for t in trajectories if t.routed_experts)[0]).shape
        routed_experts = torch.full((len(trajectories), length, *shape), -1, dtype=torch.int16)
        for row, t in enumerate(trajectories):
            if t.routed_experts:
                routed_experts[row, : len(t.routed_experts)] = torch.as_tensor(t.routed_experts)
    images = {name: _pad_images([t.multimodal.get(name) for t in trajectories]) for name in IMAGE_INPUTS}
    return TrainBatch(
        token_ids=padded("token_ids", 0, np.int64),
        attention_mask=torch.arange(length) < lengths[:, None],
        action_mask=padded("action_mask", False, np.bool_),
        rollout_logprobs=padded("logprobs", 0.0, np.float32),
        versions=padded("versions", -1, np.int64),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([group_index.setdefault(t.group_id, len(group_index)) for t in trajectories]),
        rollout_ids=torch.tensor([rollout_index[t.rollout_id] for t in trajectories]),
        routed_experts=routed_experts,
        **images,
    )


def _pad_images(tensors: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """Per-sequence [images, ...] tensors -> one zero-padded [B, most images, ...] tensor (None if none)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    shape = [max(sizes) for sizes in zip(*(t.shape for t in present))]
    out = torch.zeros(len(tensors), *shape, dtype=present[0].dtype)
    for row, t in enumerate(tensors):
        if t is not None:
            out[(row, *(slice(0, n) for n in t.shape))] = t
    return out
