"""The prompt-group pool without an engine: dynamic filtering drops degenerate groups and backfills them, so
every step trains on trainer.groups_per_step complete groups."""

from __future__ import annotations

import asyncio

from molt.pool import RolloutPool
from molt.trace import Trajectory
from runs import valid_plan


def test_degenerate_groups_are_dropped_and_backfilled_to_a_full_step():
    plan = valid_plan("dynamic_filter.enabled=true", "trainer.groups_per_step=4", "rollout.samples_per_prompt=4",
                      "trainer.micro_batch_size=8")
    rows = [{"prompt_ids": [1], "label": n} for n in range(10)]

    async def run_rollout(row: dict, rollout_id: str, group_id: str) -> list[Trajectory]:
        await asyncio.sleep(0)
        sample = int(rollout_id.rsplit("-r", 1)[1])
        # every third prompt is degenerate: all of its rollouts score the same
        reward = 1.0 if row["label"] % 3 == 0 else float(sample % 2)
        return [Trajectory(rollout_id, group_id, reward=reward)]

    async def two_steps():
        pool = RolloutPool(plan, rows, run_rollout)
        batches = []
        for _ in range(2):
            batches.append(await pool.next_batch())
            pool.release_step()
        await pool.close()
        return pool, batches

    pool, batches = asyncio.run(two_steps())
    for groups in batches:
        assert len(groups) == plan.trainer.groups_per_step
        for group in groups:
            rewards = [rollout[0].reward for rollout in group.rollouts]
            assert len(rewards) == 4 and max(rewards) > min(rewards)
    assert pool.dropped["zero_spread"] >= 2  # 4 of the first 10 prompts are degenerate: replaced by later ones
    trained = [g.index for groups in batches for g in groups]
    assert len(set(trained)) == 8
