"""Command-line entry points: `molt-run` (Hydra), `molt-reproduce`, `molt-compare`.

`molt-run` composes conf/ (plus experiments/ as the `experiment` group), converts the result into the
typed plan, validates it and checks its inputs (agent module, data files, checkpoints), and only then
imports the heavy stack and launches the loop.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from molt.plan import CONF_DIR, Plan, PlanError, plan_to_yaml, to_plan
from molt.validate import check_inputs, validate


def _reject(message: str) -> None:
    """Stop this job with exit status 2 (a usage error, as argparse has it). In a sweep (-m) raise instead, so
    Hydra records the job as failed and runs the rest."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ValueError(message)
    print(message, file=sys.stderr)
    sys.exit(2)


def launch(plan: Plan, run_dir: str) -> dict:
    """Validate the plan and check its inputs (agent module, data files, checkpoints); unless plan.dry_run,
    then import the heavy stack and train. Returns the run summary ({} for a dry run). Raises PlanError,
    with every problem listed, when nothing was started."""
    problems = validate(plan) + check_inputs(plan)  # check_inputs imports the agent and reads the data files
    if plan.dry_run:
        print(plan_to_yaml(plan))
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise PlanError(f"the plan has {len(problems)} unsupported setting(s); nothing was started:\n{listing}")
    if plan.dry_run:
        print("molt: plan is valid (dry run: nothing started)")
        return {}
    from molt.console import route_library_logs

    route_library_logs(plan.logger.library_logs, run_dir)  # first: importing the stack logs already
    from molt.loop import train  # the engines' and trainers' code loads only for a real launch
    from molt.placement import PlacementError

    try:
        return train(plan, run_dir)
    except PlacementError as e:  # the cluster cannot hold the plan: checked before anything started
        raise PlanError(str(e)) from None


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    try:
        launch(to_plan(cfg), run_dir=HydraConfig.get().runtime.output_dir)
    except PlanError as e:
        _reject(f"molt: {e}")


def run() -> None:
    _run()


def reproduce() -> None:
    """Relaunch a recorded run's plan (plus overrides) as a new run tagged `molt.reproduced_from`."""
    import argparse

    from molt.records import RecordError, load_plan

    parser = argparse.ArgumentParser(prog="molt-reproduce", description="Relaunch the exact plan of a recorded run.")
    parser.add_argument("source", help="MLflow run id or molt-run output directory")
    parser.add_argument("overrides", nargs="*", help="plan keys to change, Hydra syntax: trainer.steps=2")
    parser.add_argument("--force", action="store_true", help="accept a plan written under a different schema")
    parser.add_argument("--tracking-uri", help="MLflow store holding the run (default: $MLFLOW_TRACKING_URI, "
                        "else sqlite:///mlflow.db)")
    args = parser.parse_args()
    try:
        plan = load_plan(args.source, args.overrides, args.force, args.tracking_uri)
        source = args.source
        plan.logger.mlflow.tags["molt.reproduced_from"] = os.path.abspath(source) if os.path.isdir(source) else source
        if args.tracking_uri:  # the new run goes to its source's store, unless the plan names one
            os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
        launch(plan, os.path.join("outputs", datetime.now().strftime("%Y-%m-%d/%H-%M-%S") + "-reproduce"))
    except (RecordError, PlanError) as e:
        sys.exit(f"molt-reproduce: {e}")


def compare() -> None:
    import argparse

    from molt.records import DEFAULT_METRICS, RecordError, compare_runs

    parser = argparse.ArgumentParser(prog="molt-compare", description="Tabulate and plot recorded runs.")
    parser.add_argument("runs", nargs="+", help="MLflow run ids, experiment names or sweep ids")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric names")
    parser.add_argument("--out", default=".", help="directory for compare.png")
    parser.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = parser.parse_args()
    try:
        table, plot = compare_runs(args.runs, args.metrics.split(","), args.out, args.tracking_uri)
    except RecordError as e:
        sys.exit(f"molt-compare: {e}")
    print(table)
    print(f"plot: {plot}" if plot else f"no plot: none of the runs logged {args.metrics}")
