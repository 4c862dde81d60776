"""Experiment management against real MLflow stores: a SQLite file, a closed port, a real `mlflow server`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from molt.plan import Plan, PlanError, to_plan
from molt.records import RecordError, compare_runs, find_runs, load_plan
from molt.tracking import Tracker, mlflow_name

BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def make_plan(store: str, experiment: str = "molt", **overrides) -> Plan:
    plan = to_plan(overrides)
    plan.logger.mlflow.tracking_uri = store
    plan.logger.mlflow.experiment = experiment
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_name_keeps_legal_names_and_replaces_the_rest():
    assert mlflow_name("timing/gen_wait") == "timing/gen_wait"
    assert mlflow_name("eval/pass@1") == "eval/pass_1"
    assert mlflow_name("/a//b/./c/") == "a/b/c"
    assert mlflow_name("reward (mean): x") == "reward _mean_: x"


def test_params_metrics_tags_and_artifacts_land_in_the_store(tmp_path, store):
    plan = make_plan(store)
    plan.logger.mlflow.tags = {"team": "rl"}
    plan.rollout.engine_args = {"note": "x" * 7000}  # longer than MLflow's 6000-character param limit
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- seed=3\n")
    checkpoint = tmp_path / "hf_export"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")

    tracker = Tracker(plan, str(run_dir))
    for step in range(3):
        tracker.log_metrics({"rollout/reward_mean": 0.1 * step, "eval/pass@1": 0.5, "timing/step": 2.0}, step)
    tracker.log_metrics({"rollout/reward_mean": "high"}, step=3)  # not a number: dropped and counted
    tracker.log_artifact_path(str(checkpoint))
    tracker.finish("FAILED", error="Traceback: boom")

    client = MlflowClient(store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "Traceback: boom"
    assert run.info.experiment_id == client.get_experiment_by_name("molt").experiment_id
    assert run.data.params["trainer.lr"] == "0.0001"
    assert run.data.params["loss.importance_sampling.level"] == "token"
    assert run.data.params["rollout.engine_args.note"] == "x" * 6000
    assert {t: run.data.tags[t] for t in ("estimator", "model", "parallel", "schedule", "agent", "device", "team")} == {
        "estimator": "reinforce_pp", "model": "tiny", "parallel": "cpu", "schedule": "async",
        "agent": "arithmetic", "device": "cpu", "team": "rl"}
    assert "sweep_id" not in run.data.tags and "recipe" not in run.data.tags  # not a sweep, no recipe
    assert run.data.tags["path.hf_export"] == str(checkpoint)

    history = client.get_metric_history(tracker.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [m.step for m in client.get_metric_history(tracker.run_id, "eval/pass_1")] == [0, 1, 2]
    assert tracker.dropped == 1

    artifacts = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"plan.yaml", "plan.json", "environment.json", "hydra", "agent", "hf_export", "error.txt"} <= artifacts
    assert [a.path for a in client.list_artifacts(tracker.run_id, "agent")] == ["agent/arithmetic.py"]
    assert [a.path for a in client.list_artifacts(tracker.run_id, "hydra")] == ["hydra/overrides.yaml"]
    saved = json.loads(Path(client.download_artifacts(tracker.run_id, "plan.json", str(tmp_path))).read_text())
    assert saved["rollout"]["engine_args"]["note"] == "x" * 7000  # the full value survives in the artifact
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["torch"] and env["mlflow"] and env["molt"] == "0.1.0" and isinstance(env["git_dirty"], bool)
    assert run.data.tags["mlflow.source.git.commit"] == env["git_commit"]


def test_tracker_with_mlflow_disabled_only_writes_the_run_record(tmp_path):
    plan = to_plan({"logger": {"mlflow": {"enabled": False}}})
    tracker = Tracker(plan, str(tmp_path / "run"))
    tracker.log_metrics({"rollout/reward_mean": 1.0}, step=0)
    tracker.finish()
    assert tracker.run_id is None and tracker.dropped == 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["environment.json", "plan.json", "plan.yaml"]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_unreachable_server_costs_a_warning_and_a_counter_not_the_run(tmp_path, capsys):
    plan = make_plan(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    tracker = Tracker(plan, str(tmp_path / "run"))
    assert tracker.run_id is None
    for step in range(3):
        tracker.log_metrics({"rollout/reward_mean": 1.0, "timing/step": 2.0}, step)
    tracker.log_artifact_path(str(tmp_path / "run"))
    tracker.finish()
    assert tracker.dropped == 6
    err = capsys.readouterr().err
    assert "cannot start an MLflow run at http://127.0.0.1" in err and "training continues" in err
    assert "6 metric values were not recorded" in err


def start_mlflow_server(port: int, root: Path) -> subprocess.Popen:
    """A real `mlflow server` on loopback in its own process group; returns once /health answers."""
    log = open(root / "server.log", "ab")
    server = subprocess.Popen(
        [BIN / "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/server.db", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=log, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no background job workers
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    stop_mlflow_server(server)
    pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")


def stop_mlflow_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    """Starts and stops real servers on one port; whatever is still running is killed at teardown."""
    port, started = free_port(), []

    def start() -> subprocess.Popen:
        started.append(start_mlflow_server(port, tmp_path))
        return started[-1]

    yield f"http://127.0.0.1:{port}", start
    for server in started:
        stop_mlflow_server(server)


@pytest.mark.slow
def test_logging_over_http_to_a_real_server_survives_its_restart(tmp_path, mlflow_server, capsys):
    url, start = mlflow_server
    server = start()
    tracker = Tracker(make_plan(url), str(tmp_path / "run"))
    assert tracker.run_id is not None
    tracker.log_metrics({"rollout/reward_mean": 0.0}, step=0)
    tracker.log_metrics({"rollout/reward_mean": 0.1}, step=1)

    stop_mlflow_server(server)
    tracker.log_metrics({"rollout/reward_mean": 0.2}, step=2)  # kept and retried, never raised
    tracker.log_metrics({"rollout/reward_mean": 0.3}, step=3)
    assert "retried" in capsys.readouterr().err

    start()
    tracker.log_metrics({"rollout/reward_mean": 0.4}, step=4)
    tracker.finish()
    assert tracker.dropped == 0
    client = MlflowClient(url)
    history = client.get_metric_history(tracker.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert "plan.json" in {a.path for a in client.list_artifacts(tracker.run_id)}  # proxied artifact upload
    assert (tmp_path / "artifacts").is_dir()


SWEEP_APP = textwrap.dedent("""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from molt.cli import CONF_DIR
    from molt.plan import to_plan
    from molt.tracking import Tracker

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
    def job(cfg):  # what molt.loop.train does with its tracker, without the training
        plan = to_plan(cfg)
        tracker = Tracker(plan, HydraConfig.get().runtime.output_dir)
        try:
            if plan.seed == 13:
                raise RuntimeError("seed 13 fails on purpose")
            tracker.log_metrics({"rollout/reward_mean": float(plan.seed)}, step=0)
        except Exception as e:
            tracker.finish("FAILED", error=repr(e))
            raise
        tracker.finish()

    job()
""")


def test_a_sweep_shares_one_sweep_id_and_a_failed_job_does_not_stop_the_others(tmp_path):
    (tmp_path / "sweep_app.py").write_text(SWEEP_APP)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    done = subprocess.run(
        [sys.executable, "sweep_app.py", "-m", "estimator=grpo,rloo", "seed=13,1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MLFLOW_TRACKING_URI": store})
    assert done.returncode != 0 and "seed 13 fails on purpose" in done.stderr  # Hydra reports it at the end

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("molt").experiment_id])
    [sweep_id] = {run.data.tags["sweep_id"] for run in runs}  # Hydra's sweep dir: multirun/<date>/<time>
    assert sorted(p.name for p in (tmp_path / sweep_id).iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    status = {run.info.run_name: run.info.status for run in runs}
    assert status == {"estimator=grpo,seed=13": "FAILED", "estimator=grpo,seed=1": "FINISHED",
                      "estimator=rloo,seed=13": "FAILED", "estimator=rloo,seed=1": "FINISHED"}
    assert all("on purpose" in run.data.tags["error"] for run in runs if run.info.status == "FAILED")
    assert {run.data.tags["estimator"] for run in runs} == {"grpo", "rloo"}
    assert len(find_runs(client, [sweep_id])) == 4  # molt-compare <sweep id>


def logged_run(store: str, experiment: str, rewards: list[float], sweep: str | None = None, **plan) -> str:
    plan = make_plan(store, experiment, **plan)
    if sweep:
        plan.logger.mlflow.tags["sweep_id"] = sweep
    tracker = Tracker(plan, "run")
    for step, reward in enumerate(rewards):
        tracker.log_metrics({"rollout/reward_mean": reward, "rollout/response_length": 10.0 + step}, step)
    tracker.finish()
    return tracker.run_id


def test_compare_prints_differing_params_and_plots_the_requested_runs(tmp_path, store):
    grpo = logged_run(store, "cmp", [0.1, 0.3, 0.2], estimator={"name": "grpo"}, seed=1)
    rloo = logged_run(store, "cmp", [0.0, 0.5, 0.6], estimator={"name": "rloo"}, seed=2)
    other = logged_run(store, "cmp", [0.9], estimator={"name": "rloo"}, seed=3)

    done = subprocess.run([BIN / "molt-compare", grpo, rloo, "--out", "plots", "--tracking-uri", store],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert ["run", "id", grpo, rloo] in rows and ["status", "FINISHED", "FINISHED"] in rows
    assert ["estimator.name", "grpo", "rloo"] in rows and ["seed", "1", "2"] in rows
    assert ["rollout/reward_mean", "final", "0.2", "0.6"] in rows
    assert ["rollout/reward_mean", "best", "0.3", "0.6"] in rows
    assert ["timing/step", "final", "-", "-"] in rows  # a default metric neither run logged
    assert "trainer.lr" not in done.stdout and other not in done.stdout  # equal params, unrequested runs

    png = tmp_path / "plots" / "compare.png"
    assert png.stat().st_size > 0 and done.stdout.strip().endswith(f"plot: {Path('plots') / 'compare.png'}")
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100
        assert image.text["Description"].splitlines() == ["estimator.name=grpo, seed=1", "estimator.name=rloo, seed=2"]


def test_compare_finds_runs_by_experiment_and_by_sweep_id(store):
    first = logged_run(store, "by-name", [0.1], sweep="s1", seed=1)
    second = logged_run(store, "by-name", [0.2], sweep="s1", seed=2)
    third = logged_run(store, "by-name", [0.3], seed=3)
    client = MlflowClient(store)
    assert [r.info.run_id for r in find_runs(client, ["by-name"])] == [first, second, third]
    assert [r.info.run_id for r in find_runs(client, ["s1"])] == [first, second]
    with pytest.raises(RecordError, match="'nope' is not a run id, an experiment name or a sweep id"):
        find_runs(client, ["nope"])
    table, plot = compare_runs(["s1"], ["no/such_metric"], tracking_uri=store)
    assert plot is None and "no/such_metric final" in table


def test_reproduce_recreates_the_saved_plan_from_the_run_or_its_directory(tmp_path, store):
    plan = make_plan(store, "repro", estimator={"name": "rloo", "whiten": False}, seed=7,
                     trainer={"lr": 3e-6, "betas": [0.8, 0.95]}, rollout={"engine_args": {"max_num_seqs": 8}})
    tracker = Tracker(plan, str(tmp_path / "run"))
    tracker.finish()

    assert load_plan(tracker.run_id, tracking_uri=store) == plan
    assert load_plan(str(tmp_path / "run")) == plan
    changed = load_plan(tracker.run_id, ["trainer.steps=3", "loss.kl_target=0.1"], tracking_uri=store)
    assert (changed.trainer.steps, changed.loss.kl_target, changed.seed) == (3, 0.1, 7)
    with pytest.raises(RecordError, match="'debug=smoke' selects a config group"):
        load_plan(str(tmp_path / "run"), ["debug=smoke"])
    with pytest.raises(PlanError, match="trainer.stepz"):
        load_plan(str(tmp_path / "run"), ["trainer.stepz=3"])
    with pytest.raises(RecordError, match="neither a directory nor a run id"):
        load_plan("0" * 32, tracking_uri=store)


def test_reproduce_refuses_a_changed_schema_without_force_and_warns_on_versions(tmp_path, capsys):
    run_dir = tmp_path / "run"
    Tracker(to_plan({"logger": {"mlflow": {"enabled": False}}, "seed": 5}), str(run_dir)).finish()
    saved = json.loads((run_dir / "plan.json").read_text())
    saved["trainer"]["old_knob"] = 1  # a key this molt no longer has
    del saved["loss"]["kl_horizon"]  # a key added since the run
    (run_dir / "plan.json").write_text(json.dumps(saved))
    env = json.loads((run_dir / "environment.json").read_text())
    (run_dir / "environment.json").write_text(json.dumps(env | {"torch": "1.0.0"}))

    done = subprocess.run([BIN / "molt-reproduce", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "--force" in done.stderr
    assert "trainer.old_knob: no longer in the plan schema" in done.stderr
    assert "loss.kl_horizon: new in the plan schema" in done.stderr

    plan = load_plan(str(run_dir), force=True)
    assert plan.seed == 5 and plan.loss.kl_horizon == Plan().loss.kl_horizon
    err = capsys.readouterr().err
    assert "current defaults used for loss.kl_horizon" in err
    assert f"torch was 1.0.0 in that run, is {env['torch']} now" in err


@pytest.mark.slow
def test_reproduce_relaunches_a_real_run_with_the_same_plan_and_first_step_metrics(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    # ray_address=local: a fresh Ray even when another process on this machine runs one
    # schedule=sync: an async step trains on whichever groups finish first, which timing decides;
    # seeded requests: the engine's shared generator depends on how requests fall into its batches
    first = subprocess.run([BIN / "molt-run", "debug=smoke", "schedule=sync", "rollout.seed_requests=true",
                            "logger.mlflow.enabled=true", "ray_address=local", "hydra.run.dir=run1"], capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    [source] = client.search_runs([client.get_experiment_by_name("molt").experiment_id])

    again = subprocess.run([BIN / "molt-reproduce", source.info.run_id], capture_output=True, text=True,
                           timeout=900, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    [copy] = client.search_runs([source.info.experiment_id], f"tags.`molt.reproduced_from` = '{source.info.run_id}'")
    assert copy.info.run_id != source.info.run_id and copy.info.status == "FINISHED"

    reproduced = load_plan(copy.info.run_id)
    assert reproduced.logger.mlflow.tags.pop("molt.reproduced_from") == source.info.run_id
    assert reproduced == load_plan(source.info.run_id)

    def first_step(run) -> dict[str, float]:  # wall-clock metrics differ between any two runs
        names = [n for n in run.data.metrics if not n.startswith(("timing/", "time/", "throughput/"))]
        return {n: [m.value for m in client.get_metric_history(run.info.run_id, n) if m.step == 0][0] for n in names}

    expected = first_step(source)
    assert "rollout/reward_mean" in expected and "train/entropy" in expected
    assert first_step(copy) == pytest.approx(expected, rel=1e-5, abs=1e-6)
