"""Faults on CPU with the real engine, actor ranks and Ray: failing agents, a dead engine, a trainer rank
killed during a refit, interrupted checkpoints, an unreachable tracking server, an unwritable checkpoint
directory; and bad dataset rows (pure, no engine)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import socket
import subprocess
import time
from contextlib import redirect_stderr
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoTokenizer

from molt import checkpoint
from molt.agent import Result, RolloutFailed, _check_result
from molt.data import DataError, load_dataset
from molt.generator import Generator
from molt.loop import train
from molt.plan import DataPlan, Plan
from molt.pool import RolloutPool
from molt.step import refit
from molt.tiny import build_tiny
from molt.trainer import RankDied, Trainer

import faulty_agent
from runs import check_prompt_stream, kill_tree, run_molt, steps_log, valid_plan

ROOT = Path(__file__).resolve().parent.parent
FAULTY_AGENT = str(Path(__file__).with_name("faulty_agent.py"))
SHORT = ["trainer.steps=3", "trainer.groups_per_step=4", "rollout.samples_per_prompt=2",
         "trainer.micro_batch_size=8", "checkpoint.export_hf=false"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


# ---- failing agents, and an unreachable tracking server, in one run ----------------------------------

FAILED_REASONS = {  # inf and nan rewards share the last reason
    "FaultyEnv.step raised RuntimeError",
    "FaultyEnv.step returned dict, not a molt.agent.Result",
    "FaultyEnv.step returned a non-finite reward",
}


@pytest.fixture(scope="module")
def faulty_run(local_ray, tmp_path_factory):
    """Three steps of the faulty agent (a third of its rows fail) logging to an MLflow server that is down.
    max_failure_fraction=0.75: the loop judges the fraction over at least one step's worth of rollouts, and
    in this small run the first groups to finish may all be faulty ones. The run usually ends before its
    hanging rollouts time out: test_too_many_failed_rollouts_stop_the_run counts those."""
    run_dir = tmp_path_factory.mktemp("faulty_run")
    port = closed_port()
    plan = valid_plan(*SHORT, f"agent.path={FAULTY_AGENT}", "agent.name=faulty", "agent.timeout_s=4",
                     "agent.max_failure_fraction=0.75", "logger=mlflow",
                     f"logger.mlflow.tracking_uri=http://127.0.0.1:{port}")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        summary = train(plan, str(run_dir))
    return plan, summary, run_dir, stderr.getvalue(), port


@pytest.mark.slow
def test_failed_rollouts_are_counted_by_reason_and_never_trained(faulty_run):
    plan, summary, run_dir, stderr, _ = faulty_run
    assert summary["steps"] == 3, stderr
    # every kind of fault is counted under its reason, each as whole groups of 2 rollouts
    timed_out = "ran over agent.timeout_s=4.0"
    assert FAILED_REASONS <= set(summary["rollouts_failed"]) <= FAILED_REASONS | {timed_out}, summary["rollouts_failed"]
    assert all(n % 2 == 0 for n in summary["rollouts_failed"].values())
    records = steps_log(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["pool/rollouts_failed"] > 0
    # no faulty row was trained on, every batch is full, and nothing non-finite reached the update
    rows = faulty_agent.dataset("train", 0, plan.seed)
    pool = RolloutPool(plan, rows, run_rollout=None)
    trained = [pool.row(index) for r in records for index in r["groups"]]
    assert all(row["label"]["fault"] is None for row in trained)
    assert all(r["rollout/samples"] == 8 for r in records)
    for key in ("rollout/reward_mean", "loss/policy", "train/grad_norm"):
        assert all(math.isfinite(r[key]) for r in records), key


@pytest.mark.slow
def test_unreachable_tracking_server_does_not_stop_training(faulty_run):
    _, summary, run_dir, stderr, port = faulty_run
    assert summary["steps"] == 3
    assert f"cannot start an MLflow run at http://127.0.0.1:{port}" in stderr
    assert "training continues without tracking" in stderr
    assert Path(run_dir, "plan.json").exists()  # the run directory keeps its own record


@pytest.mark.slow
def test_too_many_failed_rollouts_stop_the_run(local_ray, tmp_path):
    """Every rollout hangs: each is ended by agent.timeout_s and counted, and the run stops instead of waiting."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + 1?"}],
                                        "label": {"answer": a + 1, "fault": "hang"}}) + "\n" for a in range(4)))
    plan = valid_plan(*SHORT, f"agent.path={FAULTY_AGENT}", "agent.name=faulty", f"data.train_path={rows}",
                     "agent.timeout_s=1", "logger=console")
    message = (r"rollouts failed \(over agent.max_failure_fraction=0.5\); reasons: "
               r"\{'ran over agent.timeout_s=1.0': \d+\}")
    with pytest.raises(RuntimeError, match=message):
        train(plan, str(tmp_path / "run"))
    assert not Path(tmp_path, "run", "steps.jsonl").exists(), "no step trained on nothing"


@pytest.mark.parametrize("result, reason", [
    (Result(reward=math.nan), "FaultyEnv.step returned a non-finite reward: nan"),
    (Result(reward=-math.inf), "FaultyEnv.step returned a non-finite reward: -inf"),
    (Result(reward="1.0"), "FaultyEnv.step returned a reward that is not a number: '1.0'"),
    (Result(reward=1.0, info=["correct"]), "FaultyEnv.step returned info that is not a dict: list"),
    ({"reward": 1.0}, "FaultyEnv.step returned dict, not a molt.agent.Result"),
])
def test_malformed_results_are_failed_rollouts_with_a_reason(result, reason):
    with pytest.raises(RolloutFailed) as failed:
        _check_result(result, "FaultyEnv.step")
    assert failed.value.reason == reason


# ---- a dead engine; interrupted checkpoints ------------------------------------------------------------


def finish(process: subprocess.Popen, timeout: float) -> str:
    """The process's output once it exits; a process still running after `timeout` is killed and fails the test."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"the run did not stop within {timeout} s:\n{output[-3000:]}")
    return output


@pytest.fixture
def started():
    """Processes a test starts; whatever of them is left at its end is killed, descendants included."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            kill_tree(process.pid)


def engine_processes(root_pid: int) -> list[psutil.Process]:
    """The rollout engine actor processes under `root_pid`, with their children (vLLM's engine core)."""
    found = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            if process.cmdline()[:1] and process.cmdline()[0].startswith("ray::RolloutEngine"):
                found += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


ENGINE_RUN = ["trainer.groups_per_step=2", "rollout.samples_per_prompt=2", "trainer.micro_batch_size=4",
              "checkpoint.every=0", "checkpoint.export_hf=false", "logger=console"]


def kill_engine_after_first_step(run_dir, started, overrides) -> tuple[str, str, dict]:
    """Start a run, SIGKILL its engine (actor and vLLM engine core) once the first step is logged, and
    check that the run stops with an error naming the engine after writing a checkpoint. Returns the
    run's output, the checkpoint and its extra.json."""
    first = run_molt(run_dir, *overrides)
    started.append(first)
    log, deadline = Path(run_dir, "steps.jsonl"), time.time() + 420
    while not (log.exists() and log.read_text().strip()):
        if first.poll() is not None or time.time() > deadline:
            pytest.fail(f"no optimizer step within 7 minutes:\n{finish(first, 1)[-3000:]}")
        time.sleep(0.1)
    engine = engine_processes(first.pid)
    assert engine, "no RolloutEngine actor process found under the run"
    for process in engine:
        process.kill()
    output = finish(first, timeout=240)
    assert first.returncode != 0, output[-3000:]
    assert "a rollout engine died" in output and "wrote a checkpoint" in output, output[-3000:]
    saved = checkpoint.latest(str(Path(run_dir, "checkpoints")))
    assert saved is not None, f"no checkpoint written when the engine died:\n{output[-3000:]}"
    return output, saved, json.loads(Path(saved, "extra.json").read_text())


@pytest.mark.slow
def test_dead_engine_stops_the_run_with_a_checkpoint_and_the_run_resumes(tmp_path, started):
    """Documented choice: a dead engine stops the run after a checkpoint; rerunning in the directory resumes.
    The async steps here take ~0.1 s (16 of them leave time to kill mid-run) and the engine mostly dies
    during a weight update. The resume also meets an interrupted checkpoint write (a leftover .tmp-
    directory and a step directory without its completion marker), which it must ignore."""
    overrides = ["trainer.steps=16", *ENGINE_RUN]
    _, saved, extra = kill_engine_after_first_step(tmp_path, started, overrides)
    step = extra["step"]
    assert step >= 1
    check_prompt_stream(tmp_path, step, groups_per_step=2)

    unfinished = Path(tmp_path, "checkpoints", f"step_{step + 1:08d}")
    unfinished.mkdir()
    (unfinished / "half_written.distcp").write_bytes(b"\0" * 64)
    leftover = Path(tmp_path, "checkpoints", f".tmp-step_{step + 2:08d}")
    leftover.mkdir()
    (leftover / "extra.json").write_text(json.dumps({"step": step + 2, "pool": {"next_index": 0, "reissue": []}}))
    assert checkpoint.latest(str(tmp_path / "checkpoints")) == saved

    second = run_molt(tmp_path, *overrides)
    started.append(second)
    output = finish(second, timeout=600)
    assert second.returncode == 0, output[-3000:]
    assert f"resumed from {saved} at step {step}" in output
    check_prompt_stream(tmp_path, 16, groups_per_step=2)


@pytest.mark.slow
def test_engine_dying_mid_generation_stops_the_run_with_every_group_accounted_for(tmp_path, started):
    """Sync schedule and the untrained model's long answers: a step is mostly generation, so the engine
    dies while the pool waits for rollouts. The checkpoint holds every group that was not trained."""
    overrides = ["trainer.steps=8", *ENGINE_RUN, "schedule=sync", "rollout.max_model_len=1024",
                 "agent.max_tokens_per_turn=512", "model.warm_start_steps=0",
                 "model.path=${oc.env:HOME}/.cache/molt/tiny-dense"]
    _, _, extra = kill_engine_after_first_step(tmp_path, started, overrides)
    assert extra["step"] >= 1 and extra["pool"]["reissue"], "the groups in flight are re-issued on resume"
    check_prompt_stream(tmp_path, extra["step"], groups_per_step=2)


@pytest.mark.slow
def test_trainer_rank_killed_during_a_refit_is_a_clear_error_and_its_checkpoint_survives(local_ray, loop, tmp_path):
    """Trainer rank 0 is SIGKILLed while the engines wait in the broadcast for its tensors: the refit fails
    within seconds naming the rank's call (not after rollout.refit_timeout_s), and the checkpoint written
    before it loads into a fresh trainer bit for bit."""
    path = build_tiny("dense", str(tmp_path / "dense"))
    plan = valid_plan(f"model.path={path}", "model.warm_start_steps=0", "rollout.refit_timeout_s=300")
    generator = loop.run_until_complete(Generator.start(plan))
    trainer = Trainer(plan)
    try:
        loop.run_until_complete(refit(generator, trainer, version=0, keep_requests=False))  # forms the group
        saved = trainer.save(str(tmp_path / "checkpoints"), {"step": 0})
        weights = trainer.state_dict()
        (rank,) = [p for p in psutil.Process().children(recursive=True)
                   if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::PolicyWorker")]

        async def refit_and_kill_rank() -> float:
            rank.suspend()  # the engines enter their receive and wait on the rank's broadcast
            refitting = asyncio.ensure_future(refit(generator, trainer, version=1, keep_requests=False))
            await asyncio.sleep(2)
            assert not refitting.done()
            rank.kill()
            killed = time.monotonic()
            with pytest.raises(RankDied, match="a trainer rank died in send_weights"):
                await refitting
            return time.monotonic() - killed

        assert loop.run_until_complete(refit_and_kill_rank()) < 30, "the engines waited for the refit timeout"
        assert checkpoint.latest(str(tmp_path / "checkpoints")) == saved
    finally:
        trainer.shutdown()
        loop.run_until_complete(generator.shutdown())
    fresh = Trainer(plan)
    try:
        assert fresh.load(saved) == {"step": 0}
        restored = fresh.state_dict()
        assert all(torch.equal(restored[name], tensor) for name, tensor in weights.items())
    finally:
        fresh.shutdown()


def test_latest_checkpoint_ignores_unfinished_writes(tmp_path):
    for name, complete in (("step_00000002", True), ("step_00000003", False), (".tmp-step_00000004", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "extra.json").write_text("{}")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_00000002")
    assert checkpoint.latest(str(tmp_path / "missing")) is None


# ---- an unwritable checkpoint directory ----------------------------------------------------------------


@pytest.mark.slow
def test_unwritable_checkpoint_dir_is_an_error_before_training(local_ray, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    checkpoints = blocker / "checkpoints"  # a path through a regular file: unwritable even for root
    plan = valid_plan("trainer.steps=1", "trainer.groups_per_step=2", "rollout.samples_per_prompt=2",
                     "trainer.micro_batch_size=4", f"checkpoint.dir={checkpoints}", "logger=console")
    started = time.perf_counter()
    with pytest.raises(Exception) as error:
        train(plan, str(tmp_path / "run"))
    assert str(checkpoints) in str(error.value) and "checkpoint.dir" in str(error.value), str(error.value)
    assert not Path(tmp_path, "run", "steps.jsonl").exists(), "the error came after training had started"
    assert time.perf_counter() - started < 20, "the check should come before the engines and actors start"


# ---- bad dataset rows (pure) -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny("dense", str(tmp_path_factory.mktemp("tok") / "dense")))


GOOD = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "label": 7}


def rows_file(tmp_path, *lines) -> Plan:
    """A JSONL file of `lines`: bytes and strings as they are, anything else as JSON."""
    content = b""
    for line in lines:
        line = line if isinstance(line, (bytes, str)) else json.dumps(line)
        content += (line if isinstance(line, bytes) else line.encode()) + b"\n"
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    return Plan(data=DataPlan(train_path=str(path), max_prompt_tokens=64))


BAD_ROWS = [
    ({"label": 7}, "row 2: 'messages' must be a non-empty list"),  # missing field
    ({"messages": "What is 3 + 4?"}, "row 2: 'messages' must be a non-empty list"),  # wrong type
    (["What is 3 + 4?"], "row 2: a row must be a JSON object"),
    ({**GOOD, "tools": {"name": "calculator"}}, "row 2: 'tools' must be a list"),
    ({"messages": [{"role": "user", "content": None}]}, "row 2: field 'messages': every message is empty"),
    ({"messages": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]},
     "row 2: field 'messages': every message is empty"),
    ({"messages": [{"role": "user", "content": "4 + 4 " * 40}]}, "row 2: field 'messages' renders to"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]},
     "row 2: messages[0].content[0]: the data URL is not a readable image"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     "row 2: messages[0].content[0]: image_url.url must be a data URL"),
    (b"\xff\xfe not utf-8", "row 2: not UTF-8 text"),
    ("[" * 100_000, "row 2: JSON nested too deeply"),
    ('{"messages": ' + "1" * 5000 + "}", "row 2: not valid JSON"),  # an integer too long to convert
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_bad_row_is_an_error_naming_row_and_field_or_skipped_and_counted(tokenizer, tmp_path, capsys, bad, message):
    plan = rows_file(tmp_path, GOOD, bad, GOOD)
    with pytest.raises(DataError, match=re.escape(message)):
        load_dataset(plan, faulty_agent, tokenizer, "train", size=0)
    plan.data.bad_rows = "skip"
    assert [row["label"] for row in load_dataset(plan, faulty_agent, tokenizer, "train", size=0)] == [7, 7]
    assert f"skipped 1 of 3 rows of {plan.data.train_path} (data.bad_rows=skip)" in capsys.readouterr().err


def test_row_numbers_are_line_numbers_and_a_file_of_bad_rows_is_an_error(tokenizer, tmp_path):
    plan = rows_file(tmp_path, GOOD, "", "   ", {"messages": []})
    with pytest.raises(DataError, match="row 4: 'messages' must be a non-empty list"):
        load_dataset(plan, faulty_agent, tokenizer, "train", size=0)
    plan = rows_file(tmp_path, "{oops", {"label": 1})
    plan.data.bad_rows = "skip"
    with pytest.raises(DataError, match="no usable rows for split 'train'"):
        load_dataset(plan, faulty_agent, tokenizer, "train", size=0)
    plan.data.train_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=f"cannot read dataset file {re.escape(plan.data.train_path)}"):
        load_dataset(plan, faulty_agent, tokenizer, "train", size=0)
