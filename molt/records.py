"""Reading recorded runs back: the exact plan of a run to reproduce it (`load_plan`), and several runs side by
side (`compare_runs`). Runs are recorded by molt/tracking.py, in MLflow and in the run directory."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

import mlflow
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from mlflow import MlflowClient
from mlflow.entities import Run
from omegaconf import OmegaConf

from molt.plan import CONF_DIR, Plan, to_plan
from molt.tracking import environment

DEFAULT_METRICS = ("rollout/reward_mean", "rollout/response_length", "timing/step")


class RecordError(ValueError):
    """A run that cannot be found, read or relaunched as asked."""


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
