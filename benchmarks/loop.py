"""The training loop's speed and memory on CPU, measured side by side in one invocation (issue 8).

    .venv/bin/python benchmarks/loop.py schedules [--setting default|long] [--steps 20] [--repeats 1]
                                                  [--schedules sync,async,partial_rollout] [--candidate DIR]
    .venv/bin/python benchmarks/loop.py refit [--refits 10] [--models dense,moe,20m]
    .venv/bin/python benchmarks/loop.py startup [--repeats 2]

schedules: `molt-run` (fresh process each) under schedule=sync, async and partial_rollout; right after each
sync run, the bare vLLM AsyncLLM on that run's step batches with the same engine and sampling settings (loop
efficiency: the sync loop's generation rate / the bare engine's), then the bare engine and molt's Generator
taking turns on them (the Generator's ratio: both engines up, the machine in the same state). Prints trained
tokens/s, wall time per step and its stage breakdown, the async/sync ratios, loop/bare generation tokens/s,
the share of step time outside generation and actor compute, and the peak memory of each run's process tree.
`--setting long` uses the untrained tiny model, whose answers run to agent.max_tokens_per_turn=64.
`--candidate DIR` runs every schedule also with the molt sources of DIR (a modified copy of the repository),
interleaved, and prints candidate/current ratios: how a proposed change to the loop is measured.
refit: seconds per refit (trainer rank 0 gathers and broadcasts over the refit group, molt/refit.py),
the bytes moved, and rank 0's extra memory, for the tiny dense and MoE models and the ~20M model.
startup: where the time from launch to the first optimizer step goes, and engine + trainer started together.

Absolute times drift on a shared machine; compare the columns of one invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
CACHE = os.environ.get("MOLT_CACHE", os.path.expanduser("~/.cache/molt"))
SKIP = 2  # steps left out of steady-state numbers: engine warm-up, and async's head start at step 1
GIB = 2**30
# Reading a run's PSS (smaps_rollup of every process) costs ~0.09 s of CPU here: done every 0.5 s it took ~18 % of
# a core from the run it measured. RSS and CPU times are cheap and read at every sample.
PSS_EVERY_S = 5.0

# Every run: its own new local Ray (without "local" ray.init joins any cluster a `ray start` or a test's
# ray.cluster_utils.Cluster left registered in /tmp/ray), console logging, no HF export (after the last step).
COMMON = ["ray_address=local", "logger=console", "checkpoint.export_hf=false"]
SETTINGS = {
    "default": [],
    # Untrained weights rarely sample the end token, so answers run to max_tokens_per_turn.
    "long": ["model.warm_start_steps=0", f"model.path={CACHE}/tiny-dense-random", "agent.max_tokens_per_turn=64",
             "trainer.groups_per_step=8"],
}
SCHEDULES = ["sync", "async", "partial_rollout"]
# The stages of a step the loop times one after another (its timing/* metrics); the rest is the driver's.
STEP_TIMINGS = ("gen_wait", "collate", "logprobs", "advantage", "train", "refit")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")


# ---- one molt-run, watched from outside ----

def run_molt(overrides: list[str], run_dir: str, code: str = ROOT) -> dict:
    """Run `molt-run` with `overrides` into run_dir, with the molt sources in `code` (another checkout or a
    modified copy: a candidate change measured side by side); returns its steps.jsonl rows, the wall time of
    each step (from the console line printed after it), launch -> first step, peak memory and CPU use."""
    command = [os.path.join(ROOT, ".venv", "bin", "molt-run"), *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    launched = time.perf_counter()
    proc = subprocess.Popen(command, cwd=code, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=code_env(code), start_new_session=True)
    step_ends, output = [], []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if STEP_LINE.match(line):
                step_ends.append(time.perf_counter() - launched)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = {"rss": 0.0, "pss": 0.0, "largest": 0.0, "largest_name": ""}
    cpu_samples = []  # (seconds since launch, {pid: (name, CPU seconds)})
    names: dict[int, str] = {}
    try:
        while proc.poll() is None:
            cpu_samples.append((time.perf_counter() - launched, sample_memory(proc.pid, peak, names)))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:  # interrupted: stop the run and everything it started
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=10)
    wall = time.perf_counter() - launched
    if proc.returncode != 0:
        sys.exit(f"molt-run {' '.join(overrides)} failed (exit {proc.returncode}):\n{''.join(output[-40:])}")
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    return {"steps": steps, "step_ends": step_ends, "first_step_s": step_ends[0], "wall_s": wall,
            "cpu_samples": cpu_samples, **peak}


def cores_used(cpu_samples: list, start: float, end: float) -> dict[str, float]:
    """CPU cores each kind of process kept busy between two times (seconds since launch)."""
    # Samples inside the window: right after the last step the run starts shutting its processes down.
    (t0, first), (t1, last) = [s for s in cpu_samples if s[0] >= start][0], [s for s in cpu_samples if s[0] <= end][-1]
    cores: dict[str, float] = {}
    for pid, (name, seconds) in last.items():
        cores[name] = cores.get(name, 0.0) + (seconds - first.get(pid, (name, 0.0))[1]) / (t1 - t0)
    return cores


def sample_memory(pid: int, peak: dict, names: dict[int, str]) -> dict[int, tuple[str, float]]:
    """Update peak with the process tree's summed RSS, PSS (at most every PSS_EVERY_S) and its largest process
    (GiB); returns each process's name (Ray workers without their current method) and CPU seconds so far.
    `names` keeps the ray::/VLLM:: name a process had once: a Ray worker's title is not always readable."""
    read_pss = time.monotonic() - peak.get("pss_read_at", -PSS_EVERY_S) >= PSS_EVERY_S
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    rss = pss = 0.0
    cpu = {}
    for p in processes:
        try:
            info = p.memory_full_info() if read_pss else p.memory_info()
            args, times = p.cmdline() or [p.name()], p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid == pid:
            name = "molt-run (driver)"
        elif args[0].startswith(("ray::", "VLLM::")):
            name = names[p.pid] = args[0].split(".")[0]  # Ray names its workers ray::Class.method_running_now
        else:  # Ray's helper processes by their script, binaries by their name
            name = names.get(p.pid) or os.path.basename(next((a for a in args[1:] if a.endswith(".py")), args[0]))
        cpu[p.pid] = (name, times.user + times.system)
        rss, pss = rss + info.rss / GIB, pss + (info.pss / GIB if read_pss else 0.0)
        if info.rss / GIB > peak["largest"]:
            peak["largest"], peak["largest_name"] = info.rss / GIB, name
    peak["rss"] = max(peak["rss"], rss)
    if read_pss:
        peak["pss"], peak["pss_read_at"] = max(peak["pss"], pss), time.monotonic()
    return cpu


def steady(run: dict) -> dict:
    """Steady-state numbers of one run (steps SKIP..end). Stage times are means, so that they add up to the
    wall time per step, which is measured between the console lines of steps SKIP-1 and the last."""
    steps, ends = run["steps"][SKIP:], run["step_ends"]
    step_wall = (ends[-1] - ends[SKIP - 1]) / len(steps)

    def mean(key: str) -> float:
        return statistics.mean(s.get(key, 0.0) for s in steps)  # 0: a metric the measured code does not log

    stages = {
        "gen_wait": mean("timing/gen_wait") - mean("timing/refit_load_wait"),
        "collate (the trace into tensors)": mean("timing/collate"),
        "logprobs": mean("timing/logprobs"),
        "train forward": mean("time/forward_s"),
        "train backward": mean("time/backward_s"),
        "train optimizer (clip, step)": mean("time/optimizer_s"),
        "train rest (Ray call, metrics all-reduce)": mean("timing/train") - mean("time/forward_s")
        - mean("time/backward_s") - mean("time/optimizer_s"),
        "advantage": mean("timing/advantage"),
        # In "wait" mode the pause lets in-flight requests finish on the old weights: generation the step waits for.
        "refit drain (generation the refit waits for)": mean("timing/refit_drain"),
        "refit (pause, weight transfer, resume)": mean("timing/refit") - mean("timing/refit_drain"),
        # The engines load the weights after the transfer while the next step goes on: in sync it waits for them.
        "refit load the next step's gen_wait waited for": mean("timing/refit_load_wait"),
        "driver rest of step (metrics)": mean("timing/step") - sum(mean(f"timing/{k}") for k in STEP_TIMINGS),
        "between steps (logging, pool refill)": step_wall - mean("timing/step"),
    }
    compute = ("gen_wait", "refit drain (generation the refit waits for)", "logprobs", "train forward",
               "train backward", "train optimizer (clip, step)")
    overhead = {k: v for k, v in stages.items() if k not in compute}
    generated = [s["rollout/response_length"] * s["rollout/samples"] for s in steps]
    # generation the step waited for, without the engines' refit load; async often waits for none
    waits = [s["timing/gen_wait"] - s.get("timing/refit_load_wait", 0.0) for s in steps]
    gen_rates = [g / wait for g, wait in zip(generated, waits) if wait > 0]
    return {
        "step_s": step_wall,
        "trained_tok_s": sum(s["train/tokens"] for s in steps) / (step_wall * len(steps)),
        "gen_phase_tok_s": statistics.median(gen_rates) if gen_rates else float("nan"),
        "response_len": mean("rollout/response_length"),
        "reward_last": statistics.mean(s["rollout/reward_mean"] for s in steps[-5:]),
        "stages": stages,
        "overhead_share": sum(overhead.values()) / step_wall,
        "largest_overhead": max(overhead, key=overhead.get),
        "first_step_s": run["first_step_s"],
        "rss_gib": run["rss"], "pss_gib": run["pss"], "largest_gib": run["largest"],
        "largest_name": run["largest_name"],
        "cores": cores_used(run["cpu_samples"], ends[SKIP - 1], ends[-1]),
    }


# ---- the bare engine on the same prompts ----

def code_env(code: str) -> dict:
    """The environment that makes Python (and Ray's workers) import molt from `code`."""
    return os.environ if code == ROOT else {**os.environ, "PYTHONPATH": os.path.abspath(code)}


def bare_engine(run_dir: str, code: str = ROOT, generator: bool = True) -> dict[str, float]:
    """Median generated tokens/s on the steady steps' prompts of the run in run_dir (fresh process) of a bare
    AsyncLLM ("bare") and, with `generator`, of molt's Generator ("generator"), one step's requests at a time."""
    command = [PYTHON, os.path.abspath(__file__), "bare", run_dir, *([] if generator else ["--no-generator"])]
    out = subprocess.run(command, cwd=code, capture_output=True, text=True, env=code_env(code), start_new_session=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("BARE ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"bare engine on {run_dir} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {name: statistics.median(rates) for name, rates in json.loads(lines[-1][5:]).items()}


def run_plan(run_dir: str):
    """The plan of a molt-run in run_dir, composed again from its recorded overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from molt.plan import CONF_DIR
    from molt.plan import to_plan

    overrides = OmegaConf.load(os.path.join(run_dir, ".hydra", "overrides.yaml"))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_plan(compose("config", overrides=list(overrides)))


async def bare_main(run_dir: str, with_generator: bool) -> None:
    from transformers import AutoTokenizer

    from molt.agent import load_agent
    from molt.data import load_dataset
    from molt.generator import start_engine
    from molt.pool import RolloutPool

    plan = run_plan(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(plan.model.path)
    agent = load_agent(plan.agent.path, plan.agent.form)
    rows = load_dataset(plan, agent, tokenizer, "train", size=plan.trainer.steps * plan.trainer.groups_per_step)
    pool = RolloutPool(plan, rows, run_rollout=None)  # only for its prompt order
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        batches = [[pool.row(g)["prompt_ids"] for g in json.loads(line)["groups"]] for line in f]

    llm = start_engine(plan.model.path, plan.rollout, "cpu", plan.seed)  # as the loop's RolloutEngine does
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    r = plan.rollout

    def max_tokens(prompt_ids: list[int]) -> int:
        return min(plan.agent.max_tokens_per_turn, r.max_model_len - len(prompt_ids))  # as molt/agent.py asks

    async def one(prompt_ids: list[int], request_id: str) -> int:
        params = SamplingParams(max_tokens=max_tokens(prompt_ids), temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                skip_clone=True)
        async for output in llm.generate(tokens_input(prompt_ids), params, request_id):  # as RolloutEngine
            pass
        return len(output.outputs[0].token_ids)

    async def bare_batch(prompts: list[list[int]], name: str) -> float:
        await llm.reset_prefix_cache()  # as the loop's refit does before each batch
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, f"{name}-{i}-{k}") for i, p in enumerate(prompts)
                                        for k in range(r.samples_per_prompt)))
        return sum(tokens) / (time.perf_counter() - started)

    generator = None
    if with_generator:  # the same batches through molt's Generator: the engine in a Ray actor, requests batched
        import ray

        from molt.generator import Generator

        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        generator = await Generator.start(plan)

    async def generator_batch(prompts: list[list[int]], name: str) -> float:
        await generator.pause()  # clears the prefix cache, as a refit does
        await generator.resume()
        started = time.perf_counter()
        samples = await asyncio.gather(*(
            generator.generate(p, max_tokens=max_tokens(p), temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
            for p in prompts for _ in range(r.samples_per_prompt)))
        return sum(len(s.token_ids) for s in samples) / (time.perf_counter() - started)

    # Both engines stay up and take each step's batch in turn, the first one alternating: this machine's speed
    # drifts within minutes, and a ratio of rates read minutes apart measured the drift.
    ways = {"bare": bare_batch, **({"generator": generator_batch} if generator else {})}
    rates = {way: [] for way in ways}
    try:
        for way, batch in ways.items():
            await batch(batches[0], f"warmup-{way}")
        for i, prompts in enumerate(batches[SKIP:]):
            for way in (list(ways) if i % 2 == 0 else list(reversed(ways))):
                rates[way].append(await ways[way](prompts, f"step{i}"))
    finally:
        llm.shutdown()
        llm = None
        if generator:
            await generator.shutdown()
            ray.shutdown()
        gc.collect()  # let the AsyncLLM go now, not during interpreter exit
    print("BARE " + json.dumps(rates), flush=True)


# ---- side by side ----

def compare(configs: dict[str, tuple[list[str], str]], steps: int, repeats: int, root: str,
            bare_after: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Run each config (label -> (overrides, molt source dir)) `repeats` times, interleaved; returns the steady-state
    summaries by label. The runs of the labels in bare_after are followed at once by the bare engine on their
    prompts ("bare": loop efficiency compares rates read a minute, not a whole invocation, apart), then by the
    Generator beside it ("generator_vs_bare")."""
    runs = {label: [] for label in configs}
    for rep in range(repeats):
        for label, (overrides, code) in configs.items():
            run_dir = os.path.join(root, f"{re.sub(r'[^a-z0-9]+', '_', label)}-{rep}")
            run = steady(run_molt([f"trainer.steps={steps}", *overrides], run_dir, code)) | {"run_dir": run_dir}
            if label in bare_after:
                run["bare"] = bare_engine(run_dir, code, generator=False)["bare"]  # alone: no Ray, no second engine
                beside = bare_engine(run_dir, code)
                run["generator_vs_bare"] = beside["generator"] / beside["bare"]
            runs[label].append(run)
            print(f"  rep {rep} {label}: {run['step_s']:.2f} s/step", flush=True)
    return runs


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def print_table(runs: dict[str, list[dict]]) -> None:
    labels = list(runs)
    width = max(16, *(len(label) + 2 for label in labels))
    print(f"{'':44}" + "".join(f"{label:>{width}}" for label in labels))
    rows = [("wall s/step", "step_s", ".2f"), ("trained (= generated) tokens/s", "trained_tok_s", ".0f"),
            ("response length", "response_len", ".1f"), ("reward (last 5 steps)", "reward_last", ".3f"),
            ("overhead share of step", "overhead_share", ".1%"), ("launch -> first step (s)", "first_step_s", ".1f"),
            ("peak RSS, all processes (GiB)", "rss_gib", ".2f"), ("peak PSS, all processes (GiB)", "pss_gib", ".2f"),
            ("peak RSS, largest process (GiB)", "largest_gib", ".2f")]
    for name, key, fmt in rows:
        print(f"{name:44}" + "".join(f"{median_of(runs[label], key):>{width}{fmt}}" for label in labels))
    print("stage means per step (s), median over repetitions:")
    for stage in runs[labels[0]][0]["stages"]:
        print(f"  {stage:42}" + "".join(
            f"{statistics.median(r['stages'][stage] for r in runs[label]):>{width}.3f}" for label in labels))
    print("largest overhead item: " + ", ".join(f"{label}: {runs[label][0]['largest_overhead']}" for label in labels))
    print("largest process: " + ", ".join(f"{label}: {runs[label][0]['largest_name']}" for label in labels))
    print(f"CPU cores busy during the steady steps, by process (median over repetitions; {os.cpu_count()} cores):")
    names = {name for label in labels for r in runs[label] for name in r["cores"]}
    busy = {name: [statistics.median(r["cores"].get(name, 0.0) for r in runs[label]) for label in labels]
            for name in names}
    for name in sorted(busy, key=lambda n: max(busy[n]), reverse=True)[:8]:
        print(f"  {name:42}" + "".join(f"{value:>{width}.2f}" for value in busy[name]))
    print(f"  {'all':42}" + "".join(f"{sum(b[i] for b in busy.values()):>{width}.2f}" for i in range(len(labels))))


def compare_schedules(args) -> None:
    root = tempfile.mkdtemp(prefix="molt-bench-loop-")
    codes = {"": ROOT, " (candidate)": args.candidate} if args.candidate else {"": ROOT}
    schedules = args.schedules.split(",")
    if schedules[0] != "sync" or not set(schedules) <= set(SCHEDULES):
        sys.exit(f"--schedules {args.schedules}: start with sync, then any of {', '.join(SCHEDULES[1:])}")
    configs = {f"{schedule}{suffix}": ([f"schedule={schedule}", *SETTINGS[args.setting]], code)
               for schedule in schedules for suffix, code in codes.items()}
    runs = compare(configs, args.steps, args.repeats, root, bare_after=tuple(f"sync{suffix}" for suffix in codes))

    print(f"\nsetting={args.setting}, {args.steps} steps per run (steady state: steps {SKIP}..), medians of "
          f"{args.repeats} repetition(s); load average {os.getloadavg()[0]:.1f}")
    print_table(runs)
    for suffix in codes:
        sync = runs[f"sync{suffix}"]
        for schedule in schedules[1:]:
            other = runs[f"{schedule}{suffix}"]
            print(f"{schedule}{suffix} / sync{suffix}: trained tokens/s x"
                  f"{median_of(other, 'trained_tok_s') / median_of(sync, 'trained_tok_s'):.2f}, "
                  f"wall per step x{median_of(other, 'step_s') / median_of(sync, 'step_s'):.2f}")
        bare = median_of(sync, "bare")
        gen_phase = median_of(sync, "gen_phase_tok_s")
        efficiency = sorted(r["gen_phase_tok_s"] / r["bare"] for r in sync)  # each run against its own bare engine
        generator_vs_bare = sorted(r["generator_vs_bare"] for r in sync)
        print(f"generated tokens/s on the sync run's prompts, one step's requests at a time{suffix}: bare AsyncLLM "
              f"{bare:.0f}, the sync loop while it waits for the batch {gen_phase:.0f}: loop efficiency "
              f"{statistics.median(efficiency):.2f} (runs {' '.join(f'{e:.2f}' for e in efficiency)}); molt Generator "
              f"x{statistics.median(generator_vs_bare):.2f} of the bare engine beside it (runs "
              f"{' '.join(f'{g:.2f}' for g in generator_vs_bare)})")
        for schedule in schedules[1:]:
            rate = median_of(runs[f"{schedule}{suffix}"], "trained_tok_s")
            print(f"  {schedule}{suffix}: generated tokens/s over whole steps {rate:.0f}, / bare {rate / bare:.2f}")
    if args.candidate:
        for schedule in schedules:
            print(f"candidate / current, {schedule}: trained tokens/s x"
                  f"{median_of(runs[f'{schedule} (candidate)'], 'trained_tok_s') / median_of(runs[schedule], 'trained_tok_s'):.2f}")
    print(f"run directories: {root}")


# ---- refit ----

async def refit_main(refits: int, models: list[str]) -> None:
    import ray

    from molt.generator import Generator
    from molt.plan import ModelPlan, Plan
    from molt.tiny import build_tiny
    from molt.trainer import Trainer

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    print(f"{'':8}{'MB':>8}{'connect s':>11}{'refit s':>9}{'pause':>7}{'send':>8}{'load':>8}{'GB/s':>7}"
          f"{'rank 0 +MB':>12}  (median of {refits} refits, as molt/step.py's refit: pause, send = gather +"
          " broadcast, then the engines' load and resume, which a run's next step overlaps; no requests in flight)")
    try:
        for name in models:
            if name == "20m":
                from trl_peer import model_path  # builds it once

                model = ModelPlan(path=model_path("20m"), tiny=None)
            else:
                model = ModelPlan(path=build_tiny(name, os.path.join(CACHE, f"tiny-{name}")), tiny=name,
                                  moe=name == "moe")
            plan = Plan(model=model)
            generator = await Generator.start(plan)
            trainer = Trainer(plan)
            try:
                rank0 = psutil.Process(ray.get(trainer.workers[0].__ray_call__.remote(lambda self: os.getpid())))
                start = time.perf_counter()
                group = trainer.refit_offer()
                await generator.connect_refit(group, lambda g: asyncio.to_thread(trainer.join_refit, g))
                connect_s = time.perf_counter() - start
                seconds, parts, extra = [], {"pause": [], "send": [], "load": []}, []
                for version in range(1, refits + 1):
                    before, peak = rank0.memory_info().rss, [0]
                    done = threading.Event()

                    def watch() -> None:  # rank 0's resident memory, every 5 ms
                        while not done.wait(0.005):
                            peak[0] = max(peak[0], rank0.memory_info().rss)

                    watcher = threading.Thread(target=watch)
                    watcher.start()
                    start = time.perf_counter()
                    await generator.pause()
                    paused = time.perf_counter()
                    generator.receive(version)
                    await generator.send_weights(lambda: asyncio.to_thread(trainer.send_weights))
                    sent = time.perf_counter()
                    await generator.loaded()
                    loaded = time.perf_counter()
                    seconds.append(loaded - start)
                    parts["pause"].append(paused - start)
                    parts["send"].append(sent - paused)
                    parts["load"].append(loaded - sent)
                    done.set()
                    watcher.join()
                    extra.append(max(0, peak[0] - before) / 1e6)
            finally:
                trainer.shutdown()
                await generator.shutdown()
            megabytes, median = sum(group.sizes()) / 1e6, statistics.median(seconds)
            pause, send, load = (statistics.median(parts[p]) for p in ("pause", "send", "load"))
            print(f"{name:8}{megabytes:>8.1f}{connect_s:>11.2f}{median:>9.3f}{pause:>7.3f}{send:>8.3f}{load:>8.3f}"
                  f"{megabytes / 1e3 / median:>7.2f}{statistics.median(extra):>12.1f}", flush=True)
        print("connect = the refit group formed once (rendezvous, metadata); refit = the loop's refit; rank 0 +MB ="
              " its peak resident memory during a refit above that before it (the bucket is allocated when the"
              " group forms)")
    finally:
        ray.shutdown()


# ---- startup ----

def startup(args) -> None:
    results = {"loop": [], "one after the other": []}
    for rep in range(args.repeats):
        for mode in results:
            out = subprocess.run([PYTHON, os.path.abspath(__file__), "startup-child", mode], cwd=ROOT,
                                 capture_output=True, text=True, start_new_session=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("STARTUP ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"startup {mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            results[mode].append(json.loads(lines[-1][8:]))
            print(f"  rep {rep} {mode}: {results[mode][-1]}", flush=True)
    print(f"\nlaunch -> first optimizer step (one step of the default recipe), medians of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for stage in results["loop"][0]:
        print(f"  {stage:44}{statistics.median(r[stage] for r in results['loop']):8.1f} s")
    print("the engine, then the trainer ranks (the loop starts them side by side):")
    for stage in results["one after the other"][0]:
        print(f"  {stage:44}{statistics.median(r[stage] for r in results['one after the other']):8.1f} s")


def startup_child(mode: str) -> None:
    """One fresh process: the stages from process start to the end of the first optimizer step (loop), or
    the engine and then the trainer ranks, one after the other."""
    launched = psutil.Process().create_time()
    stages = {}

    def mark(name: str, since: float) -> float:
        now = time.time()
        stages[name] = now - since
        return now

    import molt.loop
    import ray

    from molt.generator import Generator
    from molt.trainer import Trainer

    t = mark("python start + imports (torch, ray, transformers)", launched)
    run_dir = tempfile.mkdtemp(prefix="molt-bench-startup-")
    os.makedirs(os.path.join(run_dir, ".hydra"))
    with open(os.path.join(run_dir, ".hydra", "overrides.yaml"), "w") as f:
        f.write("".join(f"- {o}\n" for o in [*COMMON, "trainer.steps=1"]))
    plan = run_plan(run_dir)
    if mode == "one after the other":
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        t = mark("ray.init", t)
        generator = asyncio.run(Generator.start(plan))
        t = mark("engine start (Generator.start)", t)
        trainer = Trainer(plan)
        mark("trainer ranks start (Trainer)", t)
        trainer.shutdown()
        asyncio.run(generator.shutdown())
        ray.shutdown()
        print("STARTUP " + json.dumps(stages), flush=True)
        return

    def timed(owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        if asyncio.iscoroutinefunction(original):
            async def wrapper(*args, **kwargs):
                start = time.time()
                try:
                    return await original(*args, **kwargs)
                finally:
                    stages[name] = stages.get(name, 0.0) + time.time() - start
        else:
            def wrapper(*args, **kwargs):
                start = time.time()
                try:
                    return original(*args, **kwargs)
                finally:
                    stages[name] = stages.get(name, 0.0) + time.time() - start
        setattr(owner, attribute, wrapper)

    timed(ray, "init", "ray.init")
    timed(molt.loop, "build_tiny", "tiny model (cached)")
    timed(molt.loop, "load_dataset", "dataset + tokenizer")
    timed(molt.loop.AutoTokenizer, "from_pretrained", "dataset + tokenizer")
    timed(molt.loop, "reserve", "placement group (reserve)")
    timed(Generator, "start", "engine start (Generator.start)")
    timed(molt.loop, "Trainer", "trainer ranks start (Trainer), beside it")
    timed(molt.loop, "Tracker", "tracker")
    started = time.time()
    molt.loop.train(plan, run_dir)
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        step = json.loads(f.readline())
    for key in STEP_TIMINGS:
        stages[f"step 0: {key}"] = step[f"timing/{key}"]
    # the ranks start while the engine does: the shorter of the two overlaps the longer
    side_by_side = min(stages["engine start (Generator.start)"], stages["trainer ranks start (Trainer), beside it"])
    accounted = sum(v for k, v in stages.items() if not k.startswith("python")) - side_by_side
    stages["rest of train() before the first step ends"] = step["timing/first_step_since_launch"] - accounted
    stages["launch -> first step (total)"] = started - launched + step["timing/first_step_since_launch"]
    print("STARTUP " + json.dumps(stages), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("schedules", help="sync vs async vs partial rollout, bare engine, overhead, memory")
    p.add_argument("--setting", choices=sorted(SETTINGS), default="default")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, sync first")
    p.add_argument("--candidate", help="a modified copy of the repository: every schedule runs with both")
    p = commands.add_parser("refit", help="seconds per refit, bytes and rank 0's memory, dense, MoE and 20M")
    p.add_argument("--refits", type=int, default=10)
    p.add_argument("--models", default="dense,moe,20m")
    p = commands.add_parser("startup", help="launch -> first optimizer step, and where it goes")
    p.add_argument("--repeats", type=int, default=2)
    p = commands.add_parser("bare")  # internal: the bare engine for one run directory
    p.add_argument("run_dir")
    p.add_argument("--no-generator", action="store_true")
    p = commands.add_parser("startup-child")  # internal: one instrumented start
    p.add_argument("mode", choices=["loop", "one after the other"])
    args = parser.parse_args()

    if args.command == "schedules":
        compare_schedules(args)
    elif args.command == "refit":
        asyncio.run(refit_main(args.refits, args.models.split(",")))
    elif args.command == "startup":
        startup(args)
    elif args.command == "bare":
        asyncio.run(bare_main(args.run_dir, not args.no_generator))
    else:
        startup_child(args.mode)


if __name__ == "__main__":
    main()
