"""Generated tokens/s through the Generator (Ray actor, router, Sample conversion) vs the bare vLLM
AsyncLLM in this process, on the same prompts and engine settings, one after the other in one run.
Also prints engine start and refit (pause, update_weights, resume) times.

    .venv/bin/python benchmarks/generator_throughput.py --kind dense --prompts 64 --max-tokens 32
"""

import argparse
import asyncio
import gc
import os
import time
import uuid

import ray
from safetensors.torch import load_file

from molt.generator import Generator, prepare_engine
from molt.plan import ModelPlan, Plan
from molt.tiny import build_tiny


async def bare_engine(plan: Plan, prompts: list[list[int]], max_tokens: int, repeats: int) -> tuple[float, float]:
    engine_args = prepare_engine(plan.model.path, plan.rollout, "cpu", plan.seed)
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    start_s = time.perf_counter() - started
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(prompt_ids: list[int]) -> int:
        async for output in llm.generate({"prompt_token_ids": prompt_ids}, params, uuid.uuid4().hex):
            pass
        return len(output.outputs[0].token_ids)

    async def batch() -> int:
        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    try:
        return start_s, await tokens_per_second(batch, repeats)
    finally:
        llm.shutdown()


async def through_generator(plan: Plan, prompts: list[list[int]], max_tokens: int, repeats: int):
    started = time.perf_counter()
    generator = await Generator.start(plan)
    start_s = time.perf_counter() - started

    async def batch() -> int:
        samples = await asyncio.gather(
            *(generator.generate(p, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1) for p in prompts)
        )
        return sum(len(s.token_ids) for s in samples)

    try:
        throughput = await tokens_per_second(batch, repeats)
        weights = load_file(os.path.join(plan.model.path, "model.safetensors"))
        refit_s = []
        for version in range(1, 4):
            started = time.perf_counter()
            await generator.pause()
            await generator.update_weights(weights, version)
            await generator.resume()
            refit_s.append(time.perf_counter() - started)
        return start_s, throughput, refit_s
    finally:
        await generator.shutdown()


async def tokens_per_second(batch, repeats: int) -> float:
    await batch()  # warm-up: the first batch pays one-off kernel setup
    started = time.perf_counter()
    tokens = sum([await batch() for _ in range(repeats)])
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["dense", "moe"], default="dense")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cache = os.environ.get("MOLT_CACHE", os.path.expanduser("~/.cache/molt"))
    path = build_tiny(args.kind, os.path.join(cache, f"tiny-{args.kind}"))
    plan = Plan(model=ModelPlan(path=path, tiny=args.kind, moe=args.kind == "moe"))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i % 10} + {i // 10}? Answer with the number."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(args.prompts)
    ]

    # One engine at a time: on a small CPU two engines would compete for the same cores.
    bare_start, bare = asyncio.run(bare_engine(plan, prompts, args.max_tokens, args.repeats))
    gc.collect()  # let the shut-down AsyncLLM go now, not during interpreter exit
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        gen_start, through, refit_s = asyncio.run(through_generator(plan, prompts, args.max_tokens, args.repeats))
    finally:
        ray.shutdown()

    print(f"\ntiny-{args.kind}: {args.prompts} prompts x {args.max_tokens} tokens, {args.repeats} timed batches")
    print(f"{'':24}{'bare AsyncLLM':>16}{'Generator':>16}")
    print(f"{'engine start (s)':24}{bare_start:16.1f}{gen_start:16.1f}")
    print(f"{'generated tokens/s':24}{bare:16.0f}{through:16.0f}")
    print(f"Generator / bare: {through / bare:.2f}")
    print("refit pause+update+resume (s): " + ", ".join(f"{s:.3f}" for s in refit_s))


if __name__ == "__main__":
    main()
