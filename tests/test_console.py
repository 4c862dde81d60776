"""What a run prints: Molt's lines only (start-up timings, steps, summary); the libraries' logs go to
<run dir>/libraries.log (molt/console.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt.console import starting
from runs import kill_tree, run_molt

# A line of Molt's own: start-up, warnings and summary ("molt: "), a step or an eval.
OWN = ("molt: ", "step ", "eval ")


@pytest.mark.slow
def test_a_run_prints_its_own_lines_and_files_the_libraries_logs(tmp_path, monkeypatch):
    # A ChatAgent (one httpx INFO line per request) and MLflow on a fresh store (its INFO lines): with the
    # import-time warnings of torchao and torch, Ray's and vLLM's lines, every source of noise in one run.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run = run_molt(tmp_path / "run", "debug=smoke", "agent=openai_chat", "logger.mlflow.enabled=true",
                   "checkpoint.export_hf=false")
    try:
        output, _ = run.communicate(timeout=300)
    finally:
        kill_tree(run.pid)
    assert run.returncode == 0, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith(OWN)] == [], output
    for part in ("Ray", "1 rollout engine", "1 policy rank"):
        assert any(line.startswith(f"molt: {part} started in ") for line in lines), output
    assert sum(line.startswith("step ") for line in lines) == 2, output
    assert lines[-1].startswith("molt: 2 steps in "), output

    log = Path(tmp_path, "run", "libraries.log").read_text()
    for source in ("mlflow.store.db.utils: Creating initial MLflow database tables", "ray._private.worker: Started",
                   "HTTP Request: POST"):
        assert source in log, log[-3000:]


def test_starting_says_how_long_a_part_took_and_nothing_when_it_fails(capsys):
    with starting("rollout engine", 2):
        pass
    assert capsys.readouterr().err.splitlines()[1].startswith("molt: 2 rollout engines started in ")
    with pytest.raises(RuntimeError), starting("Ray"):
        raise RuntimeError("no cluster")
    assert capsys.readouterr().err == "molt: starting Ray\n"
