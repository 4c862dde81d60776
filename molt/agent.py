"""The agent contract, and the two rollout drivers that turn one dataset row into token-exact trajectories.

An RL run names one module (`agent.path`) that exports `AgentRunner`, in one of two forms:

- `Env` (Gymnasium-aligned, `agent.form=env`): the framework generates, tokenizes and calls
  `await env.step(action, turn)` after each model action. A returned observation becomes the next turn's
  messages (rendered with the chat template, appended as context that is never trained) and generation
  continues; the episode ends when `step` returns no observation, or terminated / truncated.
- `ChatAgent` (`agent.form=chat`): `await agent.run(ctx)` talks to the policy through a stock `openai` or
  `anthropic` async client at `ctx.base_url`; the loopback chat server (molt/chat_server.py) records the
  token trace. Sync client code must run in a thread (`asyncio.to_thread`): the server shares the loop.

Both return `Result`. A rollout whose agent raises or runs over agent.timeout_s raises `RolloutFailed`
with the reason; the caller counts it against agent.max_failure_fraction and carries on.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from molt.data import Conversation, DataError, message_images, normalize_messages, normalize_tools
from molt.generator import request_seed
from molt.plan import Plan
from molt.trace import Trajectory


@dataclass
class Result:
    """What `Env.step` and `ChatAgent.run` return.

    reward: this step's reward; a rollout's reward is the sum over its steps.
    observation: the next user/tool message(s), a string (one user message) or a list of chat messages;
        None ends the episode.
    info: numbers logged as metrics (a later step's keys override an earlier step's).
    images: images (PIL) shown with the observation, before its text (in its last message); they need a
        multimodal model (model.multimodal=true).
    """

    reward: float = 0.0
    observation: str | list[dict] | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    images: list = field(default_factory=list)


class Env:
    """One instance per rollout, built from its dataset row; the framework drives generation."""

    def __init__(self, row: dict):
        self.row = row

    async def step(self, action: str, turn: int) -> Result:
        """Judge the model's `action` (its decoded reply) on turn `turn` (0-based)."""
        raise NotImplementedError


@dataclass
class ChatContext:
    base_url: str  # the loopback server for this rollout only; works as base_url of both SDKs' clients
    api_key: str  # a placeholder the SDKs insist on; the unguessable session id in base_url admits the agent
    model_name: str
    row: dict


class ChatAgent:
    """One instance per rollout; `run` solves `ctx.row` with a stock SDK client against `ctx.base_url`."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


class RolloutFailed(Exception):
    """The agent raised, returned something that is not a Result, or ran out of time; `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


FORMS = {"env": Env, "chat": ChatAgent}


def load_agent(path: str, form: str):
    """Import the agent module (dotted name or .py file) and check that its AgentRunner has `form`."""
    if form not in FORMS:
        raise ValueError(f"agent.form={form!r}: use 'env' or 'chat'")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"agent.path={path}: no such file")
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise ValueError(f"agent.path={path} exports no AgentRunner; add `AgentRunner = <your Env or ChatAgent class>`")
    forms = [name for name, base in FORMS.items() if isinstance(runner, type) and issubclass(runner, base)]
    if form not in forms:
        hint = f"set agent.form={forms[0]}" if forms else "subclass molt.agent.Env or molt.agent.ChatAgent"
        raise TypeError(f"agent.path={path}: AgentRunner is not a {FORMS[form].__name__} (agent.form={form}); {hint}")
    return module


async def run_env_rollout(env_cls: type[Env], row: dict, generator, tokenizer, plan: Plan, rollout_id: str,
                          group_id: str, processor=None) -> list[Trajectory]:
    """Play one episode of `env_cls` on `row` (from `load_dataset`, so it carries `prompt_ids`);
    agent.timeout_s bounds the whole episode, generation included. `processor`: molt.data.load_processor."""
    if "prompt_ids" not in row:
        raise ValueError("an Env's row needs 'prompt_ids': take rows from molt.data.load_dataset, which renders them")
    try:
        return await asyncio.wait_for(
            _env_episode(env_cls, row, generator, tokenizer, plan, rollout_id, group_id, processor),
            plan.agent.timeout_s,
        )
    except TimeoutError:
        raise RolloutFailed(f"ran over agent.timeout_s={plan.agent.timeout_s}: rollout {rollout_id}") from None
    finally:
        generator.end_session(rollout_id)


async def _env_episode(env_cls, row, generator, tokenizer, plan, rollout_id, group_id, processor) -> list[Trajectory]:
    rollout, agent = plan.rollout, plan.agent
    messages, tools = normalize_messages(row["messages"], "row"), normalize_tools(row.get("tools"), "row")
    prompt_ids = row["prompt_ids"]
    conversation = Conversation(tokenizer, rollout_id, group_id, plan.data.apply_chat_template, processor)
    try:
        env = env_cls(row)
    except Exception as e:
        raise RolloutFailed(f"{env_cls.__name__}(row) raised {type(e).__name__}: {e}") from e
    reward, info, truncated = 0.0, {}, False
    for turn in range(agent.max_turns):
        room = rollout.max_model_len - len(prompt_ids)
        if room <= 0:
            truncated = True  # the conversation filled the context
            break
        sample = await generator.generate(
            prompt_ids, max_tokens=min(agent.max_tokens_per_turn, room), temperature=rollout.temperature,
            top_p=rollout.top_p, top_k=rollout.top_k, session_id=rollout_id,
            seed=request_seed(plan, rollout_id, turn), images=message_images(messages),
            routes_from=conversation.routes_known(prompt_ids),
        )
        action = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        conversation.add_turn(messages, tools, prompt_ids, sample, {"role": "assistant", "content": action})
        try:
            result = await env.step(action, turn)
        except Exception as e:
            raise RolloutFailed(f"{env_cls.__name__}.step raised {type(e).__name__}: {e}") from e
        _check_result(result, f"{env_cls.__name__}.step")
        reward += float(result.reward)
        info.update(result.info)
        if result.terminated or result.truncated or result.observation is None:
            truncated = result.truncated
            break
        observation = result.observation
        if isinstance(observation, str):
            observation = [{"role": "user", "content": observation}]
        if result.images:  # shown before the text of the observation's last message
            if not (isinstance(observation, list) and observation and isinstance(observation[-1], dict)):
                raise RolloutFailed(f"{env_cls.__name__}.step returned images without an observation message")
            content = observation[-1].get("content")
            parts = [{"type": "image", "image": image} for image in result.images]
            parts += content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            observation = [*observation[:-1], {**observation[-1], "content": parts}]
        try:
            messages = conversation.messages + normalize_messages(observation, f"{env_cls.__name__}.step observation")
            prompt_ids = conversation.prompt_for(messages, tools)
        except DataError as e:
            raise RolloutFailed(str(e)) from None
    else:
        truncated = True  # agent.max_turns ran out while the env still had an observation
    return _finish(conversation.segments, reward, info, truncated)


async def run_chat_rollout(agent_cls: type[ChatAgent], row: dict, server, plan: Plan, rollout_id: str,
                           group_id: str) -> list[Trajectory]:
    """Run `agent_cls` on `row` against `server` (a started ChatServer); one trajectory per segment."""
    session = server.open_session(rollout_id, group_id)
    ctx = ChatContext(base_url=session.base_url, api_key="molt", model_name=server.model_name, row=row)
    try:
        result = await asyncio.wait_for(agent_cls().run(ctx), plan.agent.timeout_s)
    except TimeoutError:
        raise RolloutFailed(f"ran over agent.timeout_s={plan.agent.timeout_s}: rollout {rollout_id}") from None
    except Exception as e:
        raise RolloutFailed(f"{agent_cls.__name__}.run raised {type(e).__name__}: {e}") from e
    finally:
        server.close_session(session)
    _check_result(result, f"{agent_cls.__name__}.run")
    if result.images:
        raise RolloutFailed(f"{agent_cls.__name__}.run returned images; a ChatAgent sends images in its requests")
    if not session.conversation.segments:
        raise RolloutFailed(f"{agent_cls.__name__}.run made no model request at ctx.base_url")
    return _finish(session.conversation.segments, float(result.reward), result.info,
                   result.truncated or session.truncated)


def _check_result(result: Any, where: str) -> None:
    # Reasons read "<kind>: <detail>": the loop counts failed rollouts by the part before the colon.
    if not isinstance(result, Result):
        raise RolloutFailed(f"{where} returned {type(result).__name__}, not a molt.agent.Result")
    if not isinstance(result.reward, (int, float)):
        raise RolloutFailed(f"{where} returned a reward that is not a number: {result.reward!r}")
    if not math.isfinite(result.reward):  # one NaN reward would make every advantage of its batch NaN
        raise RolloutFailed(f"{where} returned a non-finite reward: {result.reward!r}")
    if not isinstance(result.info, dict):
        raise RolloutFailed(f"{where} returned info that is not a dict: {type(result.info).__name__}")
    if not isinstance(result.images, list):
        raise RolloutFailed(f"{where} returned images that are not a list: {type(result.images).__name__}")


def _finish(segments: list[Trajectory], reward: float, info: dict, truncated: bool) -> list[Trajectory]:
    """Every segment of a rollout carries its one reward."""
    for segment in segments:
        segment.reward, segment.info, segment.truncated = reward, dict(info), truncated
    return segments
