"""The actor's part of a step, measured side by side on one Trainer in one invocation (issues 8, 19).

    .venv/bin/python benchmarks/trainer.py [--model tiny|20m] [--repeats 6] [--threads N]

efficiency: `train_step` against a bare PyTorch step on the same HF model, tokens, micro-batches and
optimizer (forward, log-softmax gather over the answer tokens, backward, grad clip, AdamW; no Ray, no FSDP,
in this process), both on --threads torch threads (default: all cores). Molt's step is broken down into
the ranks' forward and backward, the optimizer and collectives (the rest of the rank's time) and the Ray
transfer and driver work (the rest of the driver's time).

train: a separate old-log-prob pass and then `train_step` with those log-probs, against `train_step` taking
them from its own forward (what the loop does with one epoch and no reference model), alternating on the
same batch of random tokens shaped like the loop's (tiny: 128 rows of 40 tokens, 8 of them answer; 20m: 32
rows of 64 + 128).
The refit is measured by `benchmarks/loop.py refit` (it needs an engine to broadcast to).
One actor rank, nothing else running: the loop's numbers also carry the engine sharing the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
import torch
from transformers import AutoModelForCausalLM

from molt.plan import Plan
from molt.tiny import build_tiny
from molt.trace import TrainBatch
from molt.trainer import Trainer
from trl_peer import CACHE, model_path

SHAPES = {"tiny": (128, 32, 8), "20m": (32, 64, 128)}  # rows, prompt tokens, answer tokens


def random_batch(rows: int, prompt: int, answer: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    length = prompt + answer
    action = (torch.arange(length) >= prompt).expand(rows, length).clone()
    return TrainBatch(token_ids=torch.randint(0, 500, (rows, length), generator=g),
                      attention_mask=torch.ones(rows, length, dtype=torch.bool), action_mask=action,
                      rollout_logprobs=torch.zeros(rows, length), versions=torch.where(action, 0, -1),
                      rewards=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long),
                      rollout_ids=torch.arange(rows))


def bare_step(model, optimizer, batch: TrainBatch, advantages: torch.Tensor, micro_batch_size: int) -> None:
    """The same update with plain PyTorch: a policy-gradient token mean over the answer tokens."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tokens = int(batch.action_mask.sum())
    for rows in torch.arange(len(batch)).split(micro_batch_size):
        ids, mask = batch.token_ids[rows].to(model.device), batch.action_mask[rows].to(model.device)
        logits = model(input_ids=ids, attention_mask=batch.attention_mask[rows].to(model.device)).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(advantages[rows][:, 1:].to(model.device) * logprobs * mask[:, 1:]).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def compare(plan: Plan, batch: TrainBatch, repeats: int) -> None:
    """Print Molt's train_step against the bare PyTorch step, with the breakdown, and the two ways of getting
    the old log-probs, on plan.model.path (Ray must be running; on cuda the bare step uses this process's GPU)."""
    device = "cuda" if plan.parallel.device == "cuda" else "cpu"
    bare_model = AutoModelForCausalLM.from_pretrained(plan.model.path, dtype=getattr(torch, plan.model.dtype)).to(device)
    bare_optimizer = torch.optim.AdamW(bare_model.parameters(), lr=plan.trainer.lr)
    scores = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1))
    advantages = torch.where(batch.action_mask, scores, 0.0)
    trainer = Trainer(plan)
    try:
        batch.rollout_logprobs = trainer.logprobs(batch, 1.0)  # an engine that agrees: no token masked
        train = {"separate pass + train_step": [], "train_step alone": []}
        efficiency = {"bare PyTorch step": [], "train_step": []}
        parts = {"forward": [], "backward": [], "optimizer": [], "collectives, batch to device": [],
                 "Ray transfer + driver": []}
        for _ in range(repeats + 1):  # the first round warms up and is left out
            for mode, seconds in train.items():
                start = time.perf_counter()
                old = trainer.logprobs(batch, 1.0) if mode.startswith("separate") else None
                metrics, _ = trainer.train_step(batch, advantages, old, batch.action_mask)
                seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            bare_step(bare_model, bare_optimizer, batch, advantages, plan.trainer.micro_batch_size)
            efficiency["bare PyTorch step"].append(time.perf_counter() - start)
            efficiency["train_step"].append(seconds[-1])
            rank_s = metrics["time/rank_s"]
            parts["forward"].append(metrics["time/forward_s"])
            parts["backward"].append(metrics["time/backward_s"])
            parts["optimizer"].append(metrics["time/optimizer_s"])
            parts["collectives, batch to device"].append(
                rank_s - metrics["time/forward_s"] - metrics["time/backward_s"] - metrics["time/optimizer_s"])
            parts["Ray transfer + driver"].append(seconds[-1] - rank_s)
    finally:
        trainer.shutdown()
    print(f"  {plan.model.path} on {device}, batch {tuple(batch.token_ids.shape)}, medians of {repeats}:")
    print("  " + ", ".join(f"{name} {statistics.median(s[-repeats:]):.3f} s" for name, s in parts.items()))
    for results in (efficiency, train):
        medians = {name: statistics.median(seconds[-repeats:]) for name, seconds in results.items()}
        (before_name, before), (now_name, now) = medians.items()
        print(f"  {before_name} {before:.3f} s, {now_name} {now:.3f} s: x{before / now:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    plan = Plan()
    plan.model.path = (build_tiny("dense", os.path.join(CACHE, "tiny-dense-warm300"), 300) if args.model == "tiny"
                       else model_path("20m"))
    plan.trainer.micro_batch_size, plan.trainer.lr, plan.trainer.cpu_threads = 32, 1e-6, args.threads
    torch.set_num_threads(args.threads)
    print(f"model={args.model}, {args.threads} threads:")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        compare(plan, random_batch(*SHAPES[args.model]), args.repeats)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
