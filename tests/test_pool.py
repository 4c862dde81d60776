"""The prompt-group pool without an engine: dynamic filtering drops degenerate groups and backfills them, so
every step trains on trainer.groups_per_step complete groups; the shuffled prompt stream."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=50, deadline=None)
@given(n_rows=st.integers(1, 30), indices=st.lists(st.integers(0, 119), max_size=60))
def test_each_pass_visits_every_row_once_whatever_the_order_rows_are_asked_in(n_rows, indices):
    """row(i) depends on i alone: asked in any order (a resumed run re-issues old groups between new
    ones), the same index gives the same row, and every pass over the data is a permutation of it."""
    plan = valid_plan()
    rows = [{"prompt_ids": [n], "label": n} for n in range(n_rows)]
    expected = [RolloutPool(plan, rows, run_rollout=None).row(i)["label"] for i in range(120)]  # no history
    for start in range(0, 120 - n_rows + 1, n_rows):
        assert sorted(expected[start : start + n_rows]) == list(range(n_rows))
    pool = RolloutPool(plan, rows, run_rollout=None)
    assert [pool.row(i)["label"] for i in indices] == [expected[i] for i in indices]
