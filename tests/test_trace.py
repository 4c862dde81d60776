"""collate: the trace's one path into tensors, against the trajectories it was given."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.trace import Sample, Trajectory, collate

ids = st.lists(st.integers(0, 511), max_size=6)
turn = st.tuples(ids, st.lists(st.tuples(st.integers(0, 511), st.floats(-20.0, 0.0), st.integers(0, 9)), min_size=1,
                                  max_size=4))


def trajectory(rollout: int, group: int, turns) -> Trajectory:
    traj = Trajectory(rollout_id=f"r{rollout}", group_id=f"g{group}", reward=float(rollout))
    for context, actions in turns:
        traj.add_context([1, *context])  # a prompt is never empty: position 0 is context
        traj.add_action(Sample(token_ids=[a[0] for a in actions], logprobs=[a[1] for a in actions],
                               versions=[a[2] for a in actions], finish_reason="stop"))
    return traj


@settings(max_examples=60, deadline=None)
@given(rollouts=st.lists(st.tuples(st.integers(0, 3), st.lists(turn, min_size=1, max_size=3)), min_size=1, max_size=6))
def test_collate_rows_are_the_trajectories_padded(rollouts):
    trajectories = [trajectory(i, group, turns) for i, (group, turns) in enumerate(rollouts)]
    batch = collate(trajectories)
    length = max(len(t.token_ids) for t in trajectories)
    assert batch.token_ids.shape == (len(trajectories), length)
    assert (batch.token_ids.dtype, batch.attention_mask.dtype, batch.action_mask.dtype,
            batch.rollout_logprobs.dtype, batch.versions.dtype) == (torch.long, torch.bool, torch.bool, torch.float32,
                                                                    torch.long)
    for row, t in enumerate(trajectories):
        pad = length - len(t.token_ids)
        assert batch.token_ids[row].tolist() == t.token_ids + [0] * pad
        assert batch.attention_mask[row].tolist() == [True] * len(t.token_ids) + [False] * pad
        assert batch.action_mask[row].tolist() == t.action_mask + [False] * pad
        assert batch.rollout_logprobs[row].tolist() == torch.tensor(t.logprobs + [0.0] * pad).tolist()
        assert batch.versions[row].tolist() == t.versions + [-1] * pad
    groups = [group for group, _ in rollouts]
    first_seen = {group: i for i, group in enumerate(dict.fromkeys(groups))}
    assert batch.group_ids.tolist() == [first_seen[g] for g in groups]
    assert batch.rollout_ids.tolist() == list(range(len(trajectories)))
    assert batch.rewards.tolist() == [float(i) for i in range(len(trajectories))]


def test_collate_refuses_a_token_the_engine_did_not_return():
    traj = trajectory(0, 0, [([5], [(7, -0.1, 0)])])
    traj.token_ids[-1] = 8
    with pytest.raises(AssertionError, match="token identity violated in rollout r0"):
        collate([traj])
