"""The trainer on real Ray actors, gloo and the tiny HF checkpoints: log-probabilities against a plain HF
forward, the direction and invariance of an update, the state dict for refit, checkpoints and export."""

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.critic import Critic
from molt.placement import rank_threads
from molt.plan import Plan
from molt.tiny import build_tiny
from molt.trace import TrainBatch
from molt import checkpoint
from molt.ranks import lr_factor
from molt.refit import join, receive, wait_for_sender
from molt.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny(kind, str(root / kind)) for kind in ("dense", "moe")}


def make_plan(path, ranks=1, micro_batch_size=2, **trainer):
    plan = Plan()
    plan.model.path = path
    plan.parallel.actor_ranks = ranks
    plan.trainer.micro_batch_size = micro_batch_size
    plan.loss.importance_sampling.enabled = False  # the test batches carry no engine log-probs
    for key, value in trainer.items():
        assert hasattr(plan.trainer, key), f"trainer.{key} is not a TrainerPlan field"
        setattr(plan.trainer, key, value)
    return plan


def make_batch(rows=5, length=24, vocab=512, seed=0):
    """Right-padded rows of random tokens; every row's tokens from position 6 on are actions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    position = torch.arange(length)[None]
    attention = position < lengths[:, None]
    action = attention & (position >= 6)
    ids = torch.where(attention, torch.randint(0, vocab, (rows, length), generator=g), 0)
    return TrainBatch(token_ids=ids, attention_mask=attention, action_mask=action,
                      rollout_logprobs=torch.zeros(rows, length), versions=torch.where(action, 0, -1),
                      rewards=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long),
                      rollout_ids=torch.arange(rows))


def row_advantages(batch, signs):
    """Advantage +1 / -1 on every action token of each row."""
    return torch.tensor(signs, dtype=torch.float32)[:, None] * batch.action_mask


def hf_logprobs(model, batch, temperature):
    """Reference: each row alone, unpadded, through a plain HF float32 forward."""
    result = torch.zeros(batch.token_ids.shape)
    with torch.no_grad():
        for row, (ids, attention) in enumerate(zip(batch.token_ids, batch.attention_mask)):
            ids = ids[attention][None]
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
            result[row, 1 : ids.shape[1]] = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.where(batch.action_mask, result, 0.0)


def hf_model(path, state=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def test_lr_schedules():
    plan = Plan().trainer
    plan.warmup_steps, plan.lr_schedule = 2, "cosine"
    assert [lr_factor(s, plan, 12) for s in (0, 1, 2, 7)] == pytest.approx([0.5, 1.0, 1.0, 0.5])
    plan.lr_schedule = "linear"
    assert [lr_factor(s, plan, 12) for s in (2, 7, 12)] == pytest.approx([1.0, 0.5, 0.0])
    plan.lr_schedule = "constant"
    assert lr_factor(100, plan, 12) == 1.0


def test_a_missing_checkpoint_fails_early(tiny):  # (bad settings are the validator's: test_validator.py)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Trainer(make_plan(str(tiny["dense"]) + "-missing"))


def test_logprobs_and_update_direction(tiny):
    """Log-probabilities equal an HF forward at T=1 and T=0.7; one call is one optimizer step that raises
    positive-advantage tokens, lowers negative ones, and lowers the loss on the same batch."""
    plan = make_plan(tiny["dense"])
    trainer = Trainer(plan)
    batch = make_batch()
    reference = hf_model(tiny["dense"])
    try:
        assert trainer.threads == [rank_threads(plan)]  # set explicitly, not Ray's one thread for num_cpus=0.5
        # reniced below Ray's other workers (an engine's among them), so that they run first on a shared core
        rank_nice = ray.get(trainer.workers[0].__ray_call__.remote(lambda worker: os.getpriority(os.PRIO_PROCESS, 0)))
        worker_nice = ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
        assert rank_nice == min(19, worker_nice + plan.trainer.cpu_nice) > worker_nice
        for temperature in (1.0, 0.7):
            expected = hf_logprobs(reference, batch, temperature)
            torch.testing.assert_close(trainer.logprobs(batch, temperature), expected, rtol=0, atol=1e-5)

        old = trainer.logprobs(batch, 1.0)
        advantages = row_advantages(batch, [1, -1, 1, -1, 1])
        first, _ = trainer.train_step(batch, advantages, old, batch.action_mask)
        assert trainer.step == 1 and first["lr"] == pytest.approx(1e-4)
        assert first["tokens"] == int(batch.action_mask.sum())
        assert first["loss/policy"] == pytest.approx(-advantages.sum().item() / first["tokens"], abs=1e-6)

        change = trainer.logprobs(batch, 1.0) - old
        assert change[advantages > 0].mean() > 0 > change[advantages < 0].mean()
        second, _ = trainer.train_step(batch, advantages, old, batch.action_mask)
        assert trainer.step == 2 and second["loss/policy"] < first["loss/policy"]
        assert 0 < second["loss/clip_frac"] < 1 and second["grad_norm"] > 0
        assert second["time/forward_s"] > 0 and second["time/backward_s"] > 0 and second["time/optimizer_s"] > 0

        with pytest.raises(ValueError, match="advantages"):
            trainer.train_step(batch, advantages[:, :-1], old, batch.action_mask)
    finally:
        trainer.shutdown()


def test_old_logprobs_from_the_training_forward(tiny, tmp_path):
    """Without old_logprobs one epoch takes them from its own forward: they equal a separate `logprobs`
    pass and the step is the same as with them given. The importance weights are applied in the ranks:
    tokens whose engine log-probs are far off (weights outside [low, high], mode mask) give no gradient."""
    plan = make_plan(tiny["dense"], ranks=2, micro_batch_size=2)
    plan.loss.importance_sampling.enabled = True
    batch = make_batch(rows=5, seed=4)
    advantages = row_advantages(batch, [1, -1, 1, -1, 1])
    trainer = Trainer(plan)
    try:
        start, initial = trainer.save(str(tmp_path), {}), trainer.state_dict()
        old = trainer.logprobs(batch, 1.0)
        batch.rollout_logprobs = old.clone()  # the engine agreed with the actor: all weights 1
        given_metrics, returned = trainer.train_step(batch, advantages, old, batch.action_mask)
        assert returned is old
        given_state = trainer.state_dict()

        trainer.load(start)
        own_metrics, own_old = trainer.train_step(batch, advantages, None, batch.action_mask)
        torch.testing.assert_close(own_old, old, rtol=0, atol=1e-6)
        assert own_metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # every token's ratio is exactly 1
        for key in ("grad_norm", "loss/policy", "entropy"):
            assert own_metrics[key] == pytest.approx(given_metrics[key], rel=1e-5), key
        own_state = trainer.state_dict()
        for name in given_state:
            torch.testing.assert_close(own_state[name], given_state[name], rtol=0, atol=1e-6, msg=name)

        trainer.load(start)
        batch.rollout_logprobs = old - 5.0  # every weight e^5, above high=2: all masked
        metrics, _ = trainer.train_step(batch, advantages, None, batch.action_mask)
        assert metrics["grad_norm"] == 0.0 and metrics["loss/policy"] == 0.0
        assert all(torch.equal(v, initial[k]) for k, v in trainer.state_dict().items())

        trainer.plan.trainer.epochs_per_batch = 2  # the driver refuses before it calls the ranks
        with pytest.raises(ValueError, match="epochs_per_batch=2"):
            trainer.train_step(batch, advantages, None, batch.action_mask)
    finally:
        trainer.shutdown()


def test_two_ranks_equal_one_rank(tiny):
    """Global token mean: one rank with the whole batch in one micro-batch and two ranks with an odd batch,
    micro-batches of 1 row and gradient checkpointing take the same step; the gathered
    state dict has the HF names and gives the trainer's own log-probabilities in a plain HF model."""
    batch = make_batch(rows=5)
    advantages = row_advantages(batch, [1, -1, 1, 1, -1])
    reference = hf_model(tiny["dense"])
    old = hf_logprobs(reference, batch, 1.0)
    one = Trainer(make_plan(tiny["dense"], ranks=1, micro_batch_size=5))
    try:
        one_metrics, _ = one.train_step(batch, advantages, old, batch.action_mask)
        one_state = one.state_dict()
    finally:
        one.shutdown()
    two = Trainer(make_plan(tiny["dense"], ranks=2, micro_batch_size=1,
                            gradient_checkpointing=True))
    try:
        initial = two.state_dict()
        hf_state = reference.state_dict()
        assert {k: v.shape for k, v in initial.items()} == {k: v.shape for k, v in hf_state.items()}
        assert all(torch.equal(initial[k], hf_state[k]) for k in hf_state)

        two_metrics, _ = two.train_step(batch, advantages, old, batch.action_mask)
        for key in ("grad_norm", "loss/policy", "loss/total", "entropy", "loss/ratio_mean"):
            assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5), key
        two_state = two.state_dict()
        # Adam's first step moves a weight by lr·g/(|g|+eps): the few entries with |g| near eps magnify
        # summation-order differences to a few % of lr (1e-4); everything else agrees to ~1e-7.
        for name in one_state:
            torch.testing.assert_close(two_state[name], one_state[name], rtol=0, atol=5e-6, msg=name)
        assert not torch.equal(two_state["model.norm.weight"], initial["model.norm.weight"])

        updated = hf_model(tiny["dense"], two_state)
        torch.testing.assert_close(two.logprobs(batch, 1.0), hf_logprobs(updated, batch, 1.0), rtol=0, atol=1e-5)
    finally:
        two.shutdown()


def test_a_refit_queued_behind_a_train_step_sends_its_weights_or_aborts_when_it_fails(tiny):
    """train_step(refit_after=True) queues rank 0's send behind the step (the sync schedule's refit): this
    process, an engine's only worker, already waits for it and receives the stepped weights. Behind a step
    that fails on the rank (a token id outside the vocabulary) rank 0 sends nothing and aborts the refit,
    the waiting receiver is told so, and the next refit goes through."""
    trainer = Trainer(make_plan(tiny["dense"], micro_batch_size=5))
    batch = make_batch(rows=5)
    advantages = row_advantages(batch, [1, -1, 1, 1, -1])
    broken = dataclasses.replace(batch, token_ids=batch.token_ids.masked_fill(batch.action_mask, 10**6))
    group = dataclasses.replace(trainer.refit_offer(), world_size=2, backend="gloo")

    def received(peer) -> dict[str, torch.Tensor]:
        wait_for_sender(peer)
        return dict(receive(peer))

    try:
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(join, group, 1)
            trainer.join_refit(group)
            peer = joined.result()
            receiving = pool.submit(received, peer)
            trainer.train_step(batch, advantages, None, batch.action_mask, refit_after=True)
            trainer.send_weights()  # waits for the queued send
            stepped = trainer.state_dict()
            assert receiving.result(timeout=60).keys() <= stepped.keys()
            assert all(torch.equal(tensor, stepped[name]) for name, tensor in receiving.result().items())

            receiving = pool.submit(received, peer)
            with pytest.raises(ray.exceptions.RayTaskError, match="index out of range"):
                trainer.train_step(broken, advantages, None, batch.action_mask, refit_after=True)
            with pytest.raises(ray.exceptions.RayTaskError, match="the train step queued before this refit failed"):
                trainer.send_weights()
            with pytest.raises(RuntimeError, match="the sender aborted it"):
                receiving.result(timeout=60)

            receiving = pool.submit(received, peer)
            trainer.send_weights()
            assert all(torch.equal(tensor, stepped[name]) for name, tensor in receiving.result(timeout=60).items())
    finally:
        trainer.shutdown()


def test_checkpoint_resume_and_export(tiny, tmp_path):
    """save -> load in fresh ranks restores weights, optimizer, scheduler and `extra` exactly and the next
    step is identical; only the newest `keep` complete checkpoints count; the HF export reloads."""
    root = str(tmp_path / "checkpoints")
    plan = make_plan(tiny["dense"], ranks=2, lr_schedule="cosine", warmup_steps=1, steps=10)
    batch = make_batch(rows=4, seed=1)
    advantages = row_advantages(batch, [1, -1, -1, 1])
    old = hf_logprobs(hf_model(tiny["dense"]), batch, 1.0)

    first = Trainer(plan)
    try:
        for step in range(3):
            first.train_step(batch, advantages, old, batch.action_mask)
            saved = first.save(root, {"step": step + 1, "pool": {"next_prompt": 7 * (step + 1)}})
        assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]  # keep = 2
        saved_state = first.state_dict()
        expected_metrics, _ = first.train_step(batch, advantages, old, batch.action_mask)
        expected_state = first.state_dict()

        export = str(tmp_path / "export")
        first.export_hf(export)
        exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        torch.testing.assert_close(hf_logprobs(exported, batch, 1.0), first.logprobs(batch, 1.0),
                                   rtol=0, atol=1e-5)
        assert AutoTokenizer.from_pretrained(export).encode("1 + 2") == AutoTokenizer.from_pretrained(
            tiny["dense"]).encode("1 + 2")
    finally:
        first.shutdown()

    os.makedirs(os.path.join(root, "step_00000009"))  # written but never completed
    os.makedirs(os.path.join(root, ".tmp-step_00000010"))
    assert checkpoint.latest(root) == saved
    assert checkpoint.latest(str(tmp_path / "nothing")) is None

    resumed = Trainer(plan)
    try:
        assert resumed.load(checkpoint.latest(root)) == {"step": 3, "pool": {"next_prompt": 21}}
        assert resumed.step == 3
        state = resumed.state_dict()
        assert all(torch.equal(state[k], saved_state[k]) for k in saved_state)
        metrics, _ = resumed.train_step(batch, advantages, old, batch.action_mask)
        for key in ("grad_norm", "lr", "loss/policy", "loss/total"):
            assert metrics[key] == expected_metrics[key], key
        state = resumed.state_dict()
        assert all(torch.equal(state[k], expected_state[k]) for k in expected_state)
    finally:
        resumed.shutdown()
    with open(os.path.join(saved, "extra.json")) as f:
        assert json.load(f)["step"] == 3


def test_reference_model_and_kl_term(tiny):
    """A trainable=False group reproduces the policy's initial log-probabilities and cannot train; the KL
    term is zero against itself and enters the loss as kl_coef x KL."""
    plan = make_plan(tiny["dense"])
    plan.loss.kl_coef = 0.5
    batch = make_batch(rows=3, seed=2)
    reference = Trainer(plan, trainable=False)
    policy = Trainer(plan)
    try:
        ref_logprobs = reference.logprobs(batch, 1.0)
        old = policy.logprobs(batch, 1.0)
        assert torch.equal(ref_logprobs, old)
        advantages = row_advantages(batch, [1, -1, 1])
        metrics, _ = policy.train_step(batch, advantages, old, batch.action_mask, ref_logprobs=ref_logprobs)
        assert metrics["loss/kl"] == 0.0
        metrics, _ = policy.train_step(batch, advantages, old, batch.action_mask, ref_logprobs=ref_logprobs)
        assert metrics["loss/kl"] > 0
        assert metrics["loss/total"] == pytest.approx(metrics["loss/policy"] + 0.5 * metrics["loss/kl"], rel=1e-5)
        with pytest.raises(RuntimeError, match="reference"):
            reference.train_step(batch, advantages, old, batch.action_mask)
    finally:
        reference.shutdown()
        policy.shutdown()


def test_moe_logprobs_and_step(tiny):
    trainer = Trainer(make_plan(tiny["moe"]))
    batch = make_batch(rows=3, seed=3)
    try:
        initial = trainer.state_dict()
        expected = hf_logprobs(hf_model(tiny["moe"]), batch, 0.8)
        torch.testing.assert_close(trainer.logprobs(batch, 0.8), expected, rtol=0, atol=1e-5)

        old = trainer.logprobs(batch, 1.0)
        advantages = row_advantages(batch, [1, -1, 1])
        metrics, _ = trainer.train_step(batch, advantages, old, batch.action_mask)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        change = trainer.logprobs(batch, 1.0) - old
        assert change[advantages > 0].mean() > 0 > change[advantages < 0].mean()
        state = trainer.state_dict()
        assert state.keys() == initial.keys()
        experts = [k for k in state if "experts" in k]
        assert experts and any(not torch.equal(state[k], initial[k]) for k in experts)
    finally:
        trainer.shutdown()


def test_critic_values_and_value_loss(tiny):
    """V_t is the value of the state before token t; the clipped value loss pulls values toward returns."""
    plan = make_plan(tiny["dense"])
    plan.critic.lr = 2e-4
    plan.loss.value_clip = 10.0
    critic = Critic(plan)
    batch = make_batch(rows=3, seed=4)
    try:
        values = critic.values(batch)
        assert values.shape == batch.token_ids.shape and not values[~batch.action_mask].any()
        changed = make_batch(rows=3, seed=4)
        changed.token_ids[:, 10] = (changed.token_ids[:, 10] + 1) % 512
        moved = critic.values(changed)
        assert torch.equal(moved[:, :11], values[:, :11]) and not torch.equal(moved[:, 11:], values[:, 11:])

        returns = torch.where(batch.action_mask, 1.0, 0.0)
        losses = [critic.train_step(batch, returns, critic.values(batch), batch.action_mask)["loss"]
                  for _ in range(4)]
        assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5 * losses[0]
        assert critic.step == 4
    finally:
        critic.shutdown()
