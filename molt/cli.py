"""Command-line entry points: `molt-run` (Hydra), `molt-reproduce`, `molt-compare`.

`molt-run` composes conf/ (plus experiments/ as the `experiment` group), converts the result into the
typed plan, validates it, and only then imports the heavy stack and launches the loop.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from molt.plan import PlanError, plan_to_yaml, to_plan
from molt.validate import validate

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    try:
        plan = to_plan(cfg)
    except PlanError as e:
        sys.exit(f"molt: {e}")
    problems = validate(plan)
    if plan.dry_run:
        print(plan_to_yaml(plan))
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        sys.exit(f"molt: the plan has {len(problems)} unsupported setting(s); nothing was started:\n{listing}")
    if plan.dry_run:
        print("molt: plan is valid (dry run: nothing started)")
        return
    from molt.loop import train  # Ray, vLLM and torch load only for a real launch

    train(plan, run_dir=HydraConfig.get().runtime.output_dir)


def run() -> None:
    _run()


def reproduce() -> None:
    sys.exit("molt-reproduce: not implemented yet (see the experiment-management issue)")


def compare() -> None:
    sys.exit("molt-compare: not implemented yet (see the experiment-management issue)")
