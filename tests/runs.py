"""Helpers shared by the tests that compose plans and run the whole loop: compose a plan, start `molt-run` as a
process of its own, kill it with everything under it, and read back what it trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
from hydra import compose, initialize_config_dir

from molt import checkpoint
from molt.plan import CONF_DIR, Plan, to_plan
from molt.validate import validate

ROOT = Path(__file__).resolve().parent.parent


def compose_plan(*overrides: str) -> Plan:
    """The typed plan `molt-run` would build from these overrides, not validated."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_plan(compose(config_name="config", overrides=list(overrides)))


def valid_plan(*overrides: str) -> Plan:
    plan = compose_plan(*overrides)
    assert validate(plan) == []
    return plan


def steps_log(run_dir) -> list[dict]:
    """The last record of each step in run_dir/steps.jsonl (a resumed run rewrites the steps it repeats)."""
    records = {}
    for line in Path(run_dir, "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def run_molt(run_dir, *overrides: str) -> subprocess.Popen:
    """molt-run in its own process group with its own local Ray (not the test session's)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(
        [sys.executable, "-c", "from molt.cli import run; run()", *overrides, "ray_address=local",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (Ray puts its workers in sessions of their own, so killing the
    process group is not enough)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def check_prompt_stream(run_dir, steps: int, groups_per_step: int) -> None:
    """Each logged step trained distinct groups; every group issued so far was trained or is pending in the
    newest checkpoint (groups finish in any order): none skipped, none trained twice."""
    records = steps_log(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    trained = [index for r in records for index in r["groups"]]
    assert len(trained) == len(set(trained)) == steps * groups_per_step, "no prompt group trained twice"
    pool = json.loads(Path(checkpoint.latest(str(Path(run_dir, "checkpoints"))), "extra.json").read_text())["pool"]
    assert sorted(trained + pool["reissue"]) == list(range(pool["next_index"])), "no prompt group skipped"
