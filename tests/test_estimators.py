"""Advantage estimators and dynamic filtering against hand-computed examples and their defining properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.estimators import (ESTIMATORS, GROUP_ESTIMATORS, dr_grpo, filter_group, gae, grpo, on_policy_distill,
                             reinforce_baseline, reinforce_pp, rloo)
from molt.plan import DynamicFilterPlan, EstimatorPlan

GROUP_BASELINES = [grpo, dr_grpo, rloo, reinforce_baseline]


def plan(**overrides) -> EstimatorPlan:
    return EstimatorPlan(**{"whiten": False, **overrides})


def own(group_ids):
    """Rollout ids when every row is a whole rollout."""
    return torch.arange(len(group_ids))


def one_token_each(rewards, group_ids):
    """Rollouts with a single action token, so the advantage is one number per rollout."""
    rewards = torch.tensor(rewards, dtype=torch.float32)
    return rewards, torch.tensor(group_ids), torch.ones(len(rewards), 1, dtype=torch.bool)


def test_table_holds_every_estimator_by_name():
    assert {name: fn.__name__ for name, fn in ESTIMATORS.items()} == {name: name for name in ESTIMATORS}
    assert set(ESTIMATORS) == {"reinforce_pp", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae",
                               "on_policy_distill"}
    assert set(GROUP_ESTIMATORS) <= set(ESTIMATORS)


def test_reinforce_pp_discounts_kl_and_outcome_rewards():
    mask = torch.tensor([[False, True, True, True]])
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3]])  # the context token's KL must not count
    advantages, returns = reinforce_pp(torch.tensor([1.0]), torch.tensor([0]), own(torch.tensor([0])), mask, plan(gamma=0.5),
                                       kl_penalty=kl)
    # G3 = 1 - 0.3; G2 = -0.2 + 0.5·G3; G1 = -0.1 + 0.5·G2
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -0.025, 0.15, 0.7]]))
    assert returns is None


def test_reinforce_pp_skips_context_tokens_between_turns():
    mask = torch.tensor([[False, True, False, True, False]])
    advantages, _ = reinforce_pp(torch.tensor([2.0]), torch.tensor([0]), own(torch.tensor([0])), mask, plan(gamma=0.5))
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]]))


def test_reinforce_pp_whitens_over_all_action_tokens_of_the_batch():
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    rewards, groups = torch.tensor([1.0, -1.0]), torch.tensor([0, 1])
    raw, _ = reinforce_pp(rewards, groups, own(groups), mask, plan(gamma=0.5))
    whitened, _ = reinforce_pp(rewards, groups, own(groups), mask, plan(gamma=0.5, whiten=True))
    actions = raw[mask]  # [0.25, 0.5, 1, -0.5, -1]
    expected = (actions - actions.mean()) / (actions.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(whitened[mask], expected)
    assert (whitened[~mask] == 0).all()
    assert whitened[mask].mean().item() == pytest.approx(0, abs=1e-6)
    assert whitened[mask].std(unbiased=False).item() == pytest.approx(1, abs=1e-5)


def test_reinforce_baseline_subtracts_group_mean_then_whitens():
    rewards, groups, mask = one_token_each([1.0, 0.0, 1.0, 2.0], [0, 0, 1, 1])
    torch.testing.assert_close(reinforce_baseline(rewards, groups, own(groups), mask, plan())[0][:, 0],
                               torch.tensor([0.5, -0.5, -0.5, 0.5]))
    torch.testing.assert_close(reinforce_baseline(rewards, groups, own(groups), mask, plan(whiten=True))[0][:, 0],
                               torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)


def test_rloo_leaves_one_out_and_single_member_keeps_reward():
    rewards, groups, mask = one_token_each([1.0, 0.0, 0.0, 3.0], [7, 7, 7, 2])
    advantages, _ = rloo(rewards, groups, own(groups), mask, plan())
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1.0, -0.5, -0.5, 3.0]))


def test_grpo_divides_by_sample_std_and_zeroes_single_member():
    rewards, groups, mask = one_token_each([1.0, 0.0, 0.0, 1.0, 5.0], [0, 0, 0, 0, 1])
    z = 0.5 / math.sqrt(1 / 3)  # sample std of {1, 0, 0, 1} is sqrt(1/3)
    advantages, _ = grpo(rewards, groups, own(groups), mask, plan())
    torch.testing.assert_close(advantages[:, 0], torch.tensor([z, -z, -z, z, 0.0]))


def test_dr_grpo_subtracts_mean_without_std():
    rewards, groups, mask = one_token_each([1.0, 0.0, 0.0, 5.0], [0, 0, 0, 1])
    torch.testing.assert_close(dr_grpo(rewards, groups, own(groups), mask, plan())[0][:, 0],
                               torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))


def test_group_advantage_is_spread_over_every_action_token():
    mask = torch.tensor([[False, True, True], [True, False, False]])
    advantages, _ = dr_grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), own(torch.tensor([0, 0])), mask, plan())
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.5, 0.5], [-0.5, 0.0, 0.0]]))


def test_gae_hand_example():
    mask = torch.tensor([[False, True, True, True]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7]])
    cfg = plan(gamma=0.9, lam=0.8)
    advantages, returns = gae(torch.tensor([1.0]), torch.tensor([0]), own(torch.tensor([0])), mask, cfg, values=values)
    # δ3 = 1 - 0.7; δ2 = 0.9·0.7 - 0.6; δ1 = 0.9·0.6 - 0.5; A_t = δ_t + 0.72·A_{t+1}
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.71712, 0.846, 1.0]]))


def test_gae_bootstraps_across_context_tokens_from_the_next_action_value():
    mask = torch.tensor([[True, False, True]])
    values = torch.tensor([[0.5, 99.0, 0.7]])  # the observation token's value is never used
    kl = torch.tensor([[0.0, 0.0, 0.1]])
    advantages, returns = gae(torch.tensor([1.0]), torch.tensor([0]), own(torch.tensor([0])), mask, plan(), values=values,
                              kl_penalty=kl)
    torch.testing.assert_close(advantages, torch.tensor([[0.4, 0.0, 0.2]]))
    torch.testing.assert_close(returns, torch.tensor([[0.9, 0.0, 0.9]]))


def test_on_policy_distill_is_scaled_reverse_kl_per_token():
    mask = torch.tensor([[True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0, 0.0]])
    kl = torch.full((1, 3), 0.1)
    advantages, _ = on_policy_distill(torch.tensor([0.0]), torch.tensor([0]), own(torch.tensor([0])), mask, plan(distill_coef=0.5),
                                      old_logprobs=old, teacher_logprobs=teacher, kl_penalty=kl)
    torch.testing.assert_close(advantages, torch.tensor([[-0.35, 0.4, 0.0]]))


def test_rewards_are_clipped_first():
    rewards, groups, mask = one_token_each([100.0, -100.0, 0.5], [0, 1, 2])
    advantages, _ = rloo(rewards, groups, own(groups), mask, plan(reward_clip=[-1.0, 1.0]))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1.0, -1.0, 0.5]))


def test_bad_inputs_fail_early_with_the_reason():
    rewards, groups, mask = one_token_each([1.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match=r"rows \[1\] are not finite"):
        grpo(rewards, groups, own(groups), mask, plan())
    with pytest.raises(ValueError, match="one per row"):
        grpo(torch.zeros(3), groups, own(groups), mask, plan())
    with pytest.raises(ValueError, match="bool"):
        grpo(torch.zeros(2), groups, own(groups), mask.float(), plan())


def test_advantages_carry_no_gradient():
    mask = torch.ones(2, 3, dtype=torch.bool)
    values = torch.rand(2, 3, requires_grad=True)
    kl = torch.rand(2, 3, requires_grad=True)
    advantages, returns = gae(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1]), mask, plan(),
                              values=values, kl_penalty=kl)
    assert not advantages.requires_grad and not returns.requires_grad


# Properties


@st.composite
def batches(draw, min_group=1):
    """Random rollouts: B rows of T tokens, a random action mask, rewards beyond the clip range."""
    num_groups = draw(st.integers(0, 3))
    sizes = [draw(st.integers(min_group, 4)) for _ in range(num_groups)]
    group_ids = torch.tensor([g for g, size in enumerate(sizes) for _ in range(size)], dtype=torch.long)
    batch, length = len(group_ids), draw(st.integers(0, 5))
    floats = st.floats(-20, 20, allow_nan=False, width=32)
    rewards = torch.tensor(draw(st.lists(floats, min_size=batch, max_size=batch)), dtype=torch.float32)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)),
                        dtype=torch.bool).reshape(batch, length)
    return rewards, group_ids, mask


def all_inputs(mask):
    shape = mask.shape
    old_logprobs, teacher_logprobs = -5 * torch.rand(shape), -5 * torch.rand(shape)
    return dict(values=torch.randn(shape), old_logprobs=old_logprobs, teacher_logprobs=teacher_logprobs)


@settings(max_examples=60, deadline=None)
@given(batches(), st.booleans(), st.booleans())
def test_every_estimator_is_zero_off_the_action_mask_and_finite(batch, whiten, with_kl):
    rewards, group_ids, mask = batch
    for name, estimator in ESTIMATORS.items():
        kl = torch.rand(mask.shape) if with_kl and name not in GROUP_ESTIMATORS else None
        advantages, returns = estimator(rewards, group_ids, own(group_ids), mask, plan(whiten=whiten), kl_penalty=kl,
                                        **all_inputs(mask))
        assert advantages.shape == mask.shape, name
        assert torch.isfinite(advantages).all(), name
        assert (advantages[~mask] == 0).all(), name
        assert (returns is not None) == (name == "gae"), name
        if returns is not None:
            assert torch.isfinite(returns).all() and (returns[~mask] == 0).all()


@settings(max_examples=60, deadline=None)
@given(batches(min_group=2), st.booleans(), st.data())  # a single-member rloo group keeps its reward
def test_group_baselines_give_zero_advantage_when_a_group_agrees(batch, whiten, data):
    _, group_ids, mask = batch
    per_group = data.draw(st.lists(st.floats(-5, 5, width=32), min_size=4, max_size=4))
    rewards = torch.tensor(per_group)[group_ids]
    for estimator in GROUP_BASELINES:
        advantages, _ = estimator(rewards, group_ids, own(group_ids), mask, plan(whiten=whiten))
        torch.testing.assert_close(advantages, torch.zeros_like(advantages), atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(batches(), st.floats(-5, 5, width=32))
def test_whitening_equal_advantages_gives_zeros(batch, reward):
    _, group_ids, mask = batch
    rewards = torch.full(group_ids.shape, reward)
    advantages, _ = reinforce_pp(rewards, group_ids, own(group_ids), mask, plan(whiten=True))  # γ = 1: every token gets r
    assert (advantages == 0).all()


@settings(max_examples=60, deadline=None)
@given(batches(min_group=2))
def test_rloo_is_n_over_n_minus_1_times_the_mean_baseline(batch):
    rewards, group_ids, mask = batch
    sizes = torch.bincount(group_ids)[group_ids].float() if len(group_ids) else torch.zeros(0)
    leave_one_out, _ = rloo(rewards, group_ids, own(group_ids), mask, plan())
    mean_baseline, _ = dr_grpo(rewards, group_ids, own(group_ids), mask, plan())
    expected = (sizes / (sizes - 1))[:, None] * mean_baseline
    torch.testing.assert_close(leave_one_out, expected, atol=1e-4, rtol=1e-5)


def test_degenerate_batches_give_zeros_not_nan():
    for batch, length in [(0, 0), (0, 4), (3, 0), (3, 4)]:
        mask = torch.zeros(batch, length, dtype=torch.bool)  # no action tokens at all
        rewards, group_ids = torch.ones(batch), torch.zeros(batch, dtype=torch.long)
        for name, estimator in ESTIMATORS.items():
            kl = None if name in GROUP_ESTIMATORS else torch.ones(batch, length)
            advantages, _ = estimator(rewards, group_ids, own(group_ids), mask, plan(whiten=True), kl_penalty=kl,
                                      **all_inputs(mask))
            assert advantages.shape == (batch, length) and (advantages == 0).all(), name


@settings(max_examples=80, deadline=None)
@given(batches(), st.booleans(), st.booleans(), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.data())
def test_splitting_a_rollout_into_segments_never_changes_an_advantage(batch, whiten, with_kl, gamma, lam, data):
    """A compacted rollout is several rows (segments) of the batch; every estimator must give each action
    token the advantage it gets when the rollout is one row."""
    rewards, group_ids, mask = batch
    inputs = all_inputs(mask) | {"kl_penalty": torch.rand(mask.shape)}
    # Split each rollout's row at random action-token boundaries: segment j keeps the row's tokens but only
    # the actions of its own slice, so its actions follow the previous segment's in order.
    rows, split_mask = [], []
    for row in range(len(rewards)):
        actions = torch.nonzero(mask[row]).flatten().tolist()
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(actions) - 1)), max_size=3))) if len(actions) > 1 else []
        for start, end in zip([0, *cuts], [*cuts, len(actions)]):
            segment_mask = torch.zeros_like(mask[row])
            segment_mask[actions[start:end]] = True
            rows.append(row)
            split_mask.append(segment_mask)
    rows = torch.tensor(rows, dtype=torch.long)
    split_mask = torch.stack(split_mask) if split_mask else mask[:0]
    cfg = plan(whiten=whiten, gamma=gamma, lam=lam)
    for name, estimator in ESTIMATORS.items():
        kl = {} if name in GROUP_ESTIMATORS or not with_kl else {"kl_penalty": inputs["kl_penalty"]}
        others = {k: v for k, v in inputs.items() if k != "kl_penalty"}
        whole, _ = estimator(rewards, group_ids, own(group_ids), mask, cfg, **others, **kl)
        split, _ = estimator(rewards[rows], group_ids[rows], rows, split_mask, cfg,
                             **{k: v[rows] for k, v in others.items()}, **{k: v[rows] for k, v in kl.items()})
        # segments have disjoint action tokens: adding their rows back up restores the rollout's row
        per_token = torch.zeros_like(whole).index_add_(0, rows, split)
        torch.testing.assert_close(per_token, whole, atol=1e-6, rtol=1e-6, msg=name)


def test_group_statistics_count_rollouts_not_segments():
    """Two rollouts of one group, the first compacted into two segments: the group has two members."""
    rewards = torch.tensor([1.0, 1.0, 0.0])
    mask = torch.tensor([[True, False], [False, True], [True, True]])
    advantages, _ = grpo(rewards, torch.tensor([0, 0, 0]), torch.tensor([5, 5, 9]), mask, plan())
    # mean 0.5, sample std over two rollouts 0.7071: ±0.7071 on every action token of each rollout
    expected = torch.tensor([[0.7071, 0.0], [0.0, 0.7071], [-0.7071, -0.7071]])
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=0)


def test_segments_of_one_rollout_must_agree_on_reward_and_group():
    mask = torch.ones(2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="one rollout has one reward and one group"):
        grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 3]), mask, plan())


# Dynamic filtering


def test_dynamic_filter_drops_zero_spread_groups_by_default():
    cfg = DynamicFilterPlan(enabled=True)
    assert cfg.criterion == "zero_spread"
    assert filter_group([1, 1, 1, 1], 4, cfg) == "zero_spread"
    assert filter_group([0.3, 0.3, 0.3, 0.3], 4, cfg) == "zero_spread"  # equal rewards, not only 0 or 1
    assert filter_group([1, 0, 1, 1], 4, cfg) is None
    assert filter_group([1, 0], 4, cfg) == "incomplete"
    assert filter_group([1, 1], 4, DynamicFilterPlan(enabled=False)) == "incomplete"
    assert filter_group([1, 1, 1, 1], 4, DynamicFilterPlan(enabled=False)) is None


def test_dynamic_filter_mean_bounds():
    cfg = DynamicFilterPlan(enabled=True, criterion="mean_bounds", low=0.0, high=1.0)
    assert filter_group([0, 0, 0, 0], 4, cfg) == "mean_too_low"
    assert filter_group([1, 1, 1, 1], 4, cfg) == "mean_too_high"
    assert filter_group([0, 1, 0, 0], 4, cfg) is None
    assert filter_group([0.2, 0.2, 0.2, 0.2], 4, cfg) is None  # zero spread, but inside the bounds


def test_dynamic_filter_rejects_bad_input():
    with pytest.raises(ValueError, match="more than rollout.samples_per_prompt=2"):
        filter_group([1, 0, 1], 2, DynamicFilterPlan())
    with pytest.raises(ValueError, match="non-finite"):
        filter_group([1, float("nan")], 2, DynamicFilterPlan())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), max_size=3), st.booleans())
def test_dynamic_filter_keeps_exactly_the_complete_groups_with_spread(scores, enabled):
    kept = filter_group(scores, 3, DynamicFilterPlan(enabled=enabled)) is None
    assert kept == (len(scores) == 3 and (not enabled or max(scores) > min(scores)))
