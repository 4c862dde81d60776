"""The prompt-group pool: keeps agent rollouts in flight and hands the training loop complete groups.

Each prompt is run samples_per_prompt times (a group); a group enters a batch only when all its rollouts
have finished, failed ones aside, and the dynamic filter accepts it (molt/estimators.py filter_group).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from dataclasses import dataclass

import ray

from molt.agent import RolloutFailed
from molt.estimators import filter_group
from molt.plan import Plan
from molt.trace import Trajectory


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
        self.order_epoch, self.order = -1, []  # the shuffled row order of the pass row() last read

    def row(self, index: int) -> dict:
        """The row at stream position `index`: each pass over the data is a fresh seeded shuffle."""
        epoch, offset = divmod(index, len(self.rows))
        if epoch != self.order_epoch:  # one shuffle per pass, not per row: it is O(rows)
            self.order_epoch = epoch
            self.order = random.Random(self.plan.seed * 100003 + epoch).sample(range(len(self.rows)), len(self.rows))
        return self.rows[self.order[offset]]

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
