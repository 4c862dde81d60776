"""Loss terms against hand-computed examples, and the properties the trainer relies on: importance
weights are the identity on-policy, and the global token mean makes the gradient independent of how the
batch is split across ranks and micro-batches."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.losses import (AGGREGATIONS, KL_BOUND, POLICY_LOSSES, adaptive_kl_coef, aggregate, entropy,
                         importance_metrics, importance_weights, kl_penalty, mismatch_metrics, policy_loss,
                         staleness_mask, token_mean, token_weights, value_loss)
from molt.losses import IS_LEVELS as LEVELS
from molt.losses import IS_MODES as MODES
from molt.plan import ImportanceSamplingPlan, LossPlan

# KL


def test_kl_estimators_hand_example():
    logprobs, ref = torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-1.5, -1.0, -1.0])  # Δ = 0.5, -1, 0
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"),
                               torch.tensor([math.exp(-0.5) - 0.5, math.exp(1) - 2, 0.0]))


def test_kl_bounds_extremes_and_non_finite_values():
    logprobs = torch.tensor([-60.0, float("-inf"), float("nan"), 0.0, -3.0])
    ref = torch.tensor([-1.0, -1.0, -1.0, float("-inf"), -1.0])  # Δ = -59, -inf, nan, +inf, -2
    k1, k3 = kl_penalty(logprobs, ref, "k1"), kl_penalty(logprobs, ref, "k3")
    torch.testing.assert_close(k1, torch.tensor([-10.0, -10.0, 0.0, 10.0, -2.0]))
    torch.testing.assert_close(k3, torch.tensor([10.0, 10.0, 0.0, 10.0, math.exp(2) - 3]))


def test_k3_is_bounded_with_zero_gradient_beyond_the_bound():
    """At Δ = −10 the unbounded k3 is ~22,000 with a gradient of ~−22,000: one token would swamp the batch."""
    logprobs = torch.tensor([-11.0, -2.0], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([-1.0, -1.0]), "k3")  # Δ = −10, −1
    assert kl[0].item() == KL_BOUND
    kl.sum().backward()
    assert logprobs.grad[0] == 0.0
    assert logprobs.grad[1] == pytest.approx(1 - math.e, rel=1e-5)  # inside the bound: d k3/dΔ = 1 − exp(−Δ)


def expected_kl_gradient(estimator: str, theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """E_{a~π}[∇θ k(log π(a) − log π_ref(a))], exactly: every action weighted by its (constant) probability,
    the gradient flowing through log π as in the trainer's loss term."""
    logprobs = torch.log_softmax(theta, -1)
    per_action = kl_penalty(logprobs, ref_logprobs, estimator)
    (gradient,) = torch.autograd.grad((logprobs.exp().detach() * per_action).sum(), theta)
    return gradient


def test_kl_estimator_gradients_estimate_the_documented_direction():
    """On a 6-action softmax: k1's expected gradient is 0, k2's is ∇KL(π || π_ref), k3's ∇KL(π_ref || π)."""
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.log_softmax(torch.randn(6, generator=generator, dtype=torch.float64), -1)

    def analytic(direction: str) -> torch.Tensor:
        logprobs = torch.log_softmax(theta, -1)
        if direction == "forward":  # KL(π || π_ref)
            kl = (logprobs.exp() * (logprobs - ref_logprobs)).sum()
        else:  # KL(π_ref || π)
            kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum()
        return torch.autograd.grad(kl, theta)[0]

    torch.testing.assert_close(expected_kl_gradient("k1", theta, ref_logprobs), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(expected_kl_gradient("k2", theta, ref_logprobs), analytic("forward"))
    torch.testing.assert_close(expected_kl_gradient("k3", theta, ref_logprobs), analytic("reverse"))
    assert not torch.allclose(analytic("forward"), analytic("reverse"))  # the check can tell them apart


def test_kl_gradient_is_finite_for_extremes():
    logprobs = torch.tensor([-60.0, -1.0, 0.0], requires_grad=True)
    kl_penalty(logprobs, torch.tensor([-1.0, -1.2, -80.0]), "k3").sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[1] == pytest.approx(1 - math.exp(-0.2), rel=1e-5)  # d k3/dΔ = 1 − exp(−Δ)


def test_unknown_kl_estimator_names_the_key():
    with pytest.raises(ValueError, match="loss.kl_estimator='k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=2, max_size=2))
def test_kl_is_finite_and_k2_k3_are_non_negative(pair):
    logprobs, ref = torch.tensor(pair[:1]), torch.tensor(pair[1:])
    for estimator in ("k1", "k2", "k3"):
        kl = kl_penalty(logprobs, ref, estimator)
        assert torch.isfinite(kl).all()
        if estimator != "k1":
            assert (kl >= 0).all()


# Importance sampling

# Row 0: three tokens with w = 1, 3, 1/4. Row 1: two tokens with w = 3, 3, then a padding token.
IS_MASK = torch.tensor([[True, True, True], [True, True, False]])
IS_LOG_W = torch.tensor([[0.0, math.log(3), -math.log(4)], [math.log(3), math.log(3), 7.0]])
GEO0 = 0.75 ** (1 / 3)
IS_EXPECTED = {  # on the mask, low = 0.5, high = 2; filtered (tokens, sequences) out of (5, 2)
    ("token", "mask"): ([1, 0, 0, 0, 0], 4, 2),
    ("token", "clip"): ([1, 2, 0.5, 2, 2], 4, 2),
    ("token", "trunc"): ([1, 2, 0.25, 2, 2], 3, 2),
    ("seq", "mask"): ([0.75, 0.75, 0.75, 0, 0], 2, 1),  # products 0.75 and 9
    ("seq", "clip"): ([0.75, 0.75, 0.75, 2, 2], 2, 1),
    ("seq", "trunc"): ([0.75, 0.75, 0.75, 2, 2], 2, 1),
    ("geo", "mask"): ([GEO0, GEO0, GEO0, 0, 0], 2, 1),  # geometric means 0.75^(1/3) and 3
    ("geo", "clip"): ([GEO0, GEO0, GEO0, 2, 2], 2, 1),
    ("geo", "trunc"): ([GEO0, GEO0, GEO0, 2, 2], 2, 1),
}


@pytest.mark.parametrize("level,mode", IS_EXPECTED)
def test_importance_weights_hand_example(level, mode):
    expected, filtered_tokens, filtered_seqs = IS_EXPECTED[level, mode]
    rollout = torch.full((2, 3), -2.0)
    cfg = ImportanceSamplingPlan(level=level, mode=mode, low=0.5, high=2.0, seq_gate=None)
    weights, counts = importance_weights(rollout + IS_LOG_W, rollout, IS_MASK, cfg)
    metrics = importance_metrics(counts)
    torch.testing.assert_close(weights[IS_MASK], torch.tensor(expected, dtype=torch.float32))
    assert metrics["is/filtered_token_frac"] == pytest.approx(filtered_tokens / 5)
    assert metrics["is/filtered_seq_frac"] == pytest.approx(filtered_seqs / 2)


def test_importance_weights_are_stop_gradient_and_gate_nan_tokens():
    old = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.tensor([[0.0, float("nan")]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights, _ = importance_weights(old, rollout, mask, ImportanceSamplingPlan(seq_gate=None))
    assert not weights.requires_grad
    assert weights.tolist() == [[1.0, 0.0]]
    gated, _ = importance_weights(old, rollout, mask, ImportanceSamplingPlan())  # and the gate drops its sequence
    assert gated.tolist() == [[0.0, 0.0]]


def test_stale_tokens_leave_the_loss_mask():
    versions = torch.tensor([[3, 2, 1], [3, 3, -1]])
    loss_mask = staleness_mask(IS_MASK, versions, current_version=3, max_staleness=1)
    assert loss_mask.tolist() == [[True, True, False], [True, True, False]]
    assert torch.equal(staleness_mask(IS_MASK, versions, current_version=3, max_staleness=None), IS_MASK)


def test_disabled_importance_sampling_gives_ones():
    cfg = ImportanceSamplingPlan(enabled=False)
    weights, counts = importance_weights(IS_LOG_W, torch.zeros(2, 3), IS_MASK, cfg)
    assert (weights == 1).all() and importance_metrics(counts) == {}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_importance_metrics_do_not_depend_on_how_the_rows_are_split(batch, length, data):
    """The ranks and micro-batches each count their rows; the summed counts give the whole batch's metrics."""
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)),
                        dtype=torch.bool).reshape(batch, length)
    log_w = torch.tensor(data.draw(st.lists(st.floats(-3, 3), min_size=batch * length, max_size=batch * length)))
    rollout = torch.full((batch, length), -2.0)
    old = rollout + log_w.reshape(batch, length)
    cfg = ImportanceSamplingPlan(level=data.draw(st.sampled_from(LEVELS)), mode=data.draw(st.sampled_from(MODES)))
    cut = data.draw(st.integers(0, batch))
    whole = importance_metrics(importance_weights(old, rollout, mask, cfg)[1])
    parts = [importance_weights(old[rows], rollout[rows], mask[rows], cfg)[1] for rows in (slice(0, cut), slice(cut, None))]
    summed = importance_metrics({name: parts[0][name] + parts[1][name] for name in parts[0]})
    assert summed == pytest.approx(whole, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4), st.integers(0, 6), st.floats(0.01, 1.0), st.floats(1.0, 10.0), st.data())
def test_importance_correction_is_identity_on_policy(batch, length, low, high, data):
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)),
                        dtype=torch.bool).reshape(batch, length)
    logprobs = -torch.rand(batch, length) * 10
    for level in LEVELS:
        for mode in MODES:
            cfg = ImportanceSamplingPlan(level=level, mode=mode, low=low, high=high)
            weights, counts = importance_weights(logprobs, logprobs.clone(), mask, cfg)
            metrics = importance_metrics(counts)
            assert (weights[mask] == 1).all(), (level, mode)
            assert metrics["is/filtered_token_frac"] == 0 and metrics["is/filtered_seq_frac"] == 0
            assert metrics["is/gated_seq_frac"] == 0


def test_one_wild_token_gates_its_sequence_and_only_that_sequence():
    """Per-token weights (mask mode) times the sequence gate on the geometric-mean weight."""
    log_w = torch.zeros(3, 4)
    log_w[0, 1] = 8.0  # a wild token: geometric mean exp(8/4) = 7.4 > 2, the whole row goes
    log_w[1] = torch.tensor([0.3, -0.3, 0.9, 0.0])  # token 2 (w = 2.46) is masked, the row's mean is inside
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False
    rollout = torch.full((3, 4), -2.0)
    weights, counts = importance_weights(rollout + log_w, rollout, mask, ImportanceSamplingPlan())
    metrics = importance_metrics(counts)
    assert (weights[0] == 0).all()
    torch.testing.assert_close(weights[1], torch.tensor([math.exp(0.3), math.exp(-0.3), 0.0, 1.0]))
    torch.testing.assert_close(weights[2, :2], torch.ones(2))
    assert metrics["is/gated_seq_frac"] == pytest.approx(1 / 3)
    assert metrics["is/gated_token_frac"] == pytest.approx(4 / 10)


def test_gated_sequences_stay_in_the_token_mean_denominator():
    mask = torch.ones(2, 3, dtype=torch.bool)
    rollout = torch.full((2, 3), -1.0)
    old = rollout.clone()
    old[0, 0] += 10.0  # gates row 0
    is_weights, _ = importance_weights(old, rollout, mask, ImportanceSamplingPlan())
    per_token, _ = policy_loss(rollout.clone(), rollout, torch.ones(2, 3), mask, LossPlan(), is_weights=is_weights)
    weights = token_weights(mask, torch.tensor([0, 1]), "token_mean", max_rollout_tokens=3)
    assert aggregate(per_token, weights).item() == pytest.approx(-3 / 6)  # row 1's −1 per token over 6 tokens


def test_mismatch_metrics_hand_example():
    mask = torch.tensor([[True, True, False]])
    rollout = torch.tensor([[-1.0, -2.0, 50.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0]])  # Δ = 0.5, -1 on the mask
    metrics = mismatch_metrics(rollout, old, mask)
    assert metrics["mismatch/abs_mean"] == pytest.approx(0.75)
    assert metrics["mismatch/abs_max"] == pytest.approx(1.0)
    assert metrics["mismatch/k3"] == pytest.approx(((math.exp(-0.5) - 0.5) + (math.exp(1) - 2)) / 2, rel=1e-5)
    assert mismatch_metrics(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool)) == {
        "mismatch/abs_mean": 0.0, "mismatch/abs_max": 0.0, "mismatch/k3": 0.0}


# Policy losses


def run_loss(ratios, advantages, mask=None, is_weights=None, **cfg):
    """Per-token loss and d(sum of loss)/d log π for given ratios π/π_old (old log-probs are -1)."""
    ratios, advantages = torch.tensor([ratios]), torch.tensor([advantages])
    mask = torch.ones_like(ratios, dtype=torch.bool) if mask is None else torch.tensor([mask])
    old = torch.full_like(ratios, -1.0)
    logprobs = (old + ratios.log()).requires_grad_()
    loss, metrics = policy_loss(logprobs, old, advantages, mask, LossPlan(**cfg), is_weights=is_weights)
    loss.sum().backward()
    return loss.detach()[0], logprobs.grad[0], metrics


def test_ppo_hand_example():
    loss, grad, metrics = run_loss([1.5, 0.5, 1.1, 0.7], [1.0, 1.0, -1.0, -1.0])
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.1, 0.8]))
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, 1.1, 0.0]))  # −ρA where not clipped
    assert metrics["loss/clip_frac"] == 0.5
    assert metrics["loss/ratio_mean"] == pytest.approx(0.95)
    assert metrics["loss/ratio_max"] == pytest.approx(1.5)


def test_ppo_asymmetric_and_dual_clip():
    loss, grad, _ = run_loss([1.5, 5.0, 5.0], [1.0, -1.0, 1.0], clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # Upper clip at 1.28 for A > 0; ρ=5 with A=−1 would cost 5, the dual clip bounds it at 3·|A|.
    torch.testing.assert_close(loss, torch.tensor([-1.28, 3.0, -1.28]))
    torch.testing.assert_close(grad, torch.zeros(3))


def test_gspo_uses_the_sequence_ratio_with_per_token_gradients():
    # Token log-ratios ln 2 and 0: the sequence ratio is sqrt(2), clipped to 1.2 for A > 0.
    loss, grad, metrics = run_loss([2.0, 1.0, 9.0], [1.0, 1.0, 1.0], mask=[True, True, False], name="gspo")
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.2, 0.0]))
    torch.testing.assert_close(grad, torch.zeros(3))
    assert metrics["loss/clip_frac"] == 1.0
    # Log-ratios 0.1 and -0.1: the sequence ratio is 1, and each token's gradient is −1·A_t on its own log π.
    loss, grad, _ = run_loss([math.exp(0.1), math.exp(-0.1), 9.0], [1.0, -2.0, 5.0], mask=[True, True, False],
                             name="gspo")
    torch.testing.assert_close(loss, torch.tensor([-1.0, 2.0, 0.0]))
    torch.testing.assert_close(grad, torch.tensor([-1.0, 2.0, 0.0]))


def test_cispo_caps_the_stop_gradient_weight_and_keeps_every_gradient():
    loss, grad, metrics = run_loss([1.5, 10.0], [1.0, -2.0], name="cispo", cispo_max_weight=5.0)
    logprobs = torch.tensor([math.log(1.5) - 1, math.log(10.0) - 1])
    torch.testing.assert_close(loss, torch.tensor([-1.5, 10.0]) * logprobs)
    torch.testing.assert_close(grad, torch.tensor([-1.5, 10.0]))
    assert metrics["loss/clip_frac"] == 0.5


def test_policy_loss_applies_importance_weights_and_mask():
    weights = torch.tensor([[0.5, 0.0, 2.0]])
    loss, grad, _ = run_loss([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], mask=[True, True, False], is_weights=weights)
    torch.testing.assert_close(loss, torch.tensor([-0.5, 0.0, 0.0]))
    torch.testing.assert_close(grad, torch.tensor([-0.5, 0.0, 0.0]))


def test_policy_loss_rejects_mismatched_shapes():  # an unknown loss.name is the validator's (test_validator.py)
    with pytest.raises(ValueError, match="share one"):
        mask = torch.ones(1, 2, dtype=torch.bool)
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), mask, LossPlan())


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_losses_stay_finite_on_degenerate_inputs(name):
    for batch, length in [(0, 0), (2, 0), (2, 3)]:
        mask = torch.zeros(batch, length, dtype=torch.bool)
        logprobs = torch.zeros(batch, length, requires_grad=True)
        loss, metrics = policy_loss(logprobs, torch.zeros(batch, length), torch.ones(batch, length), mask,
                                    LossPlan(name=name))
        token_mean(loss, mask, 0).backward()
        assert (loss == 0).all() and all(math.isfinite(v) for v in metrics.values())
        assert (logprobs.grad == 0).all()
    # Extreme log-ratios are clamped: finite loss and gradient.
    logprobs = torch.tensor([[-1e4, 0.0, -50.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1e4, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _ = policy_loss(logprobs, old, torch.tensor([[1.0, -1.0, 2.0]]), mask, LossPlan(name=name))
    token_mean(loss, mask, 3).backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()


def test_value_loss_hand_example():
    values, old_values = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.5, 0.5, 0.0])
    returns, mask = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([True, True, False])
    loss = value_loss(values, old_values, returns, mask, clip=0.2)
    # token 0: max((1−2)², (0.7−2)²)/2; token 1: max(0², 0.3²)/2
    torch.testing.assert_close(loss, torch.tensor([0.845, 0.045, 0.0]))


def test_entropy_hand_example_with_temperature_and_masked_logits():
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy(torch.tensor([0.0, math.log(3)])).item() == pytest.approx(expected, rel=1e-5)
    logits = torch.tensor([[0.0, 2 * math.log(3), float("-inf")]], requires_grad=True)
    value = entropy(logits, temperature=2.0)
    value.sum().backward()
    assert value.item() == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(logits.grad).all()
    assert entropy(torch.zeros(2, 3, 8)).shape == (2, 3)
    assert entropy(torch.zeros(8)).item() == pytest.approx(math.log(8))


def test_token_mean_uses_the_given_global_count():
    per_token = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])  # a NaN off the mask must not leak
    mask = torch.tensor([[True, False], [True, False]])
    assert token_mean(per_token, mask, 8).item() == pytest.approx(0.5)
    assert token_mean(per_token, mask, torch.tensor(4)).item() == pytest.approx(1.0)
    assert token_mean(per_token, torch.zeros_like(mask), 0).item() == 0.0


def test_adaptive_kl_coef_moves_toward_target():
    cfg = LossPlan(kl_target=0.1, kl_horizon=1000)
    # KL 5x the target: the error is capped at +20 %, scaled by 100 of 1000 horizon samples.
    assert adaptive_kl_coef(0.1, 0.5, 100, cfg) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    assert adaptive_kl_coef(0.1, 0.09, 100, cfg) == pytest.approx(0.1 * (1 - 0.1 * 0.1))
    assert adaptive_kl_coef(0.1, 5.0, 100, LossPlan()) == 0.1  # no target: fixed coefficient


# Aggregation, and the gradient's independence of the rank / micro-batch split.


def test_aggregation_hand_example():
    """Rollout 0 is compacted into rows 0 and 1 (2 + 1 loss tokens); rollout 1 is row 2 (1 loss token)."""
    mask = torch.tensor([[True, True, False], [False, True, False], [True, False, False]])
    rollouts = torch.tensor([4, 4, 7])
    per_token = torch.tensor([[1.0, 2.0, 99.0], [0.0, 3.0, 99.0], [8.0, 99.0, 99.0]])

    def loss(aggregation):
        return aggregate(per_token, token_weights(mask, rollouts, aggregation, max_rollout_tokens=4)).item()

    assert loss("token_mean") == pytest.approx((1 + 2 + 3 + 8) / 4)
    assert loss("seq_mean_token_mean") == pytest.approx(((1 + 2 + 3) / 3 + 8 / 1) / 2)
    assert loss("seq_mean_token_sum") == pytest.approx(((1 + 2 + 3) / 4 + 8 / 4) / 2)


def test_gspo_recipe_weighs_every_sequence_equally():
    """With the sequence mean a long answer's tokens together weigh as much as a short answer's."""
    from runs import compose_plan

    assert compose_plan("loss=gspo").loss.aggregation == "seq_mean_token_mean"
    mask = torch.tensor([[True] * 8, [True, False, False, False, False, False, False, False]])
    weights = token_weights(mask, torch.tensor([0, 1]), "seq_mean_token_mean", max_rollout_tokens=8)
    assert weights[0].sum().item() == pytest.approx(0.5) and weights[1].sum().item() == pytest.approx(0.5)


def test_ppo_ratio_is_one_in_the_first_epoch_however_stale_the_tokens():
    """π_old is the trainer's weights before the step, so with one epoch the clip never acts; a stale token's
    gap to the engine's policy shows in its importance weight instead. In a second epoch the clip acts."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    current = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    stale_rollout = current.detach() + torch.tensor([[0.0, 0.4, -0.4, 0.1]])  # sampled by older weights
    advantages = torch.ones(1, 4)
    is_weights, _ = importance_weights(current.detach(), stale_rollout, mask, ImportanceSamplingPlan())
    _, first_epoch = policy_loss(current, current.detach(), advantages, mask, LossPlan(), is_weights)
    assert first_epoch["loss/clip_frac"] == 0 and first_epoch["loss/ratio_mean"] == pytest.approx(1.0)
    assert not torch.allclose(is_weights, torch.ones(1, 4))
    moved = current.detach() + torch.tensor([[0.5, 0.0, 0.0, 0.0]])  # the weights after the first epoch's step
    _, second_epoch = policy_loss(moved, current.detach(), advantages, mask, LossPlan(), is_weights)
    assert second_epoch["loss/clip_frac"] == pytest.approx(1 / 4)


def step_loss(weight, features, tokens, old, ref, advantages, rollout, mask, loss_weights, cfg):
    """The trainer's per-micro-batch objective: policy + KL + entropy terms, aggregated with the step's weights."""
    logits = features @ weight
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    is_weights, _ = importance_weights(old, rollout, mask, cfg.importance_sampling)
    per_token, _ = policy_loss(logprobs, old, advantages, mask, cfg, is_weights=is_weights)
    kl = kl_penalty(logprobs, ref, cfg.kl_estimator)
    return (aggregate(per_token, loss_weights) + cfg.kl_coef * aggregate(kl, loss_weights)
            - cfg.entropy_coef * aggregate(entropy(logits), loss_weights))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.integers(1, 3), st.sampled_from(list(POLICY_LOSSES)),
       st.sampled_from(LEVELS), st.sampled_from(MODES), st.sampled_from(AGGREGATIONS), st.integers(0, 2**31 - 1))
def test_gradient_is_invariant_to_rank_and_micro_batch_split(batch, ranks, micro_batches, name, level, mode,
                                                             aggregation, seed):
    generator = torch.Generator().manual_seed(seed)
    length, dim, vocab = 5, 4, 6
    features = torch.randn(batch, length, dim, generator=generator)
    tokens = torch.randint(vocab, (batch, length), generator=generator)
    old, ref, rollout = (-torch.rand(batch, length, generator=generator) * 3 for _ in range(3))
    advantages = torch.randn(batch, length, generator=generator)
    mask = torch.rand(batch, length, generator=generator) < 0.7
    rollout_ids = torch.randint(0, 2, (batch,), generator=generator).cumsum(0)  # some rollouts span rows
    weight = torch.randn(dim, vocab, generator=generator, requires_grad=True)
    cfg = LossPlan(name=name, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, dual_clip=3.0,
                   aggregation=aggregation, importance_sampling=ImportanceSamplingPlan(level=level, mode=mode))
    loss_weights = token_weights(mask, rollout_ids, aggregation, max_rollout_tokens=2 * length)  # whole step
    rows = (features, tokens, old, ref, advantages, rollout, mask, loss_weights)

    (full,) = torch.autograd.grad(step_loss(weight, *rows, cfg), weight)
    summed = torch.zeros_like(weight)  # gradients summed over micro-batches and ranks, never averaged
    for rank_rows in torch.arange(batch).tensor_split(ranks):
        for micro_rows in rank_rows.tensor_split(micro_batches):
            loss = step_loss(weight, *(x[micro_rows] for x in rows), cfg)
            summed += torch.autograd.grad(loss, weight)[0]
    torch.testing.assert_close(summed, full, atol=1e-6, rtol=1e-5)
