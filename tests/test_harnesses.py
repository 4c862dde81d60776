"""Agents written with real agent harnesses train unchanged through the loop (tests/harness_agents.py): the
OpenAI Agents SDK on the streamed Responses API and on chat completions, LangChain's streaming ChatOpenAI
with a bound tool, and the Anthropic SDK's messages.stream, on the tiny model taught to call the
calculator (tests/test_agent.py). One short run trains all four side by side."""

from __future__ import annotations

import pytest

from molt import loop, trace
from molt.tiny import build_tiny
from molt.trace import check_token_identity
from runs import ROOT, steps_log, valid_plan
from test_agent import teach_tool_use

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def test_real_harnesses_train_unchanged(tmp_path, monkeypatch):
    models = tmp_path / "models"
    path = teach_tool_use(build_tiny("dense", str(models / "base")), str(models / "tool_user"))
    trained = []

    def audit(segment):  # collate's token-identity audit, and a record of what each step trains
        check_token_identity(segment)
        trained.append(segment)

    monkeypatch.setattr(trace, "check_token_identity", audit)
    plan = valid_plan(
        "agent=openai_chat", f"agent.path={ROOT / 'tests' / 'harness_agents.py'}", "agent.name=harnesses",
        "agent.max_turns=4", "agent.timeout_s=120", f"model.path={path}", "model.warm_start_steps=0",
        "schedule=sync", "trainer.steps=2", "trainer.groups_per_step=4", "rollout.samples_per_prompt=2",
        "trainer.micro_batch_size=8", "logger=console", "logger.eval_every=0", "checkpoint.export_hf=false",
    )
    summary = loop.train(plan, str(tmp_path / "run"))
    assert summary["rollouts_failed"] == {}, "every harness's requests were served"
    assert [r["step"] for r in steps_log(tmp_path / "run")] == [0, 1]
    assert len({segment.rollout_id for segment in trained}) == 16  # 2 steps x 4 groups (one per harness) x 2
    for segment in trained:  # trained tokens: exactly the engine's output ids, in order
        actions = [t for t, is_action in zip(segment.token_ids, segment.action_mask) if is_action]
        assert actions == [t for output in segment.engine_outputs for t in output]
    harnesses = {key for segment in trained for key in segment.info if key.startswith("harness/")}
    assert harnesses == {"harness/agents_responses", "harness/agents_chat", "harness/langchain",
                         "harness/anthropic_stream"}
    assert sum(segment.info["tool_calls"] for segment in trained) > 0, "the model called the calculator"
    # tool round trips continue the sampled ids: most rollouts are one segment of several engine calls
    assert any(len(segment.engine_outputs) > 1 for segment in trained)
