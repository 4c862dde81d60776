"""The loopback chat server: OpenAI and Anthropic chat endpoints in front of the Generator that record
the exact token trace of every request (token-in/token-out capture) for `ChatAgent` rollouts.

One server per runner, bound to 127.0.0.1 on an ephemeral port. Each rollout gets a session with an
unguessable id in its base URL, `http://127.0.0.1:<port>/s/<session>`, which works unchanged as the
`base_url` of both stock clients (the OpenAI SDK appends /chat/completions, the Anthropic SDK
/v1/messages). Routes:

    POST /s/<session>/v1/chat/completions   OpenAI chat completions (also /s/<session>/chat/completions)
    POST /s/<session>/v1/messages           Anthropic messages
    GET  /health

Non-streaming only. Requests are rendered with the chat template here (and only here) and accumulated
by `molt.data.Conversation`: earlier turns keep the model's sampled ids, only new messages are rendered,
and a request that does not extend the previous one opens a new segment. Repeating the last request
returns the same answer without generating. Tool calls are read from the model's text in the Qwen format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Sampling follows rollout.temperature / top_p /
top_k; a request asking for other values, or for parameters the server does not honour, gets a 400.

Every bad request gets a 4xx naming what is wrong: 400, 404 (unknown or finished session), 413 (a body
over MAX_BODY_BYTES), 429 (more than MAX_REQUESTS_PER_SESSION requests at once on one session). Nothing in
a request is fetched or opened: images are read from data URLs (OpenAI `image_url`) and base64 blocks
(Anthropic `image`) only, and only for a multimodal model; URL content is refused, never read.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from molt.data import Conversation, DataError, message_images, normalize_messages, normalize_tools, parse_tool_calls
from molt.generator import request_seed
from molt.plan import Plan
from molt.trace import Sample

MAX_BODY_BYTES = 4 * 1024 * 1024
# Bounds on what agents can hold open: sessions (one per rollout in flight; more means a leak) and requests
# in progress per session (they run one at a time; more waiting ones would only hold bodies in memory).
MAX_SESSIONS = 4096
MAX_REQUESTS_PER_SESSION = 4
ANTHROPIC_ERRORS = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}  # error types by status
# Parameters accepted (the rest get a 400). Sampling values must equal the plan's (_check_params).
OPENAI_PARAMS = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens",
                 "max_completion_tokens", "temperature", "top_p", "n", "stream", "user", "metadata", "store"}
ANTHROPIC_PARAMS = {"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p",
                    "top_k", "stream", "metadata"}


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Turn:
    """One answered request: what a retry of the same request gets back."""

    id: str
    created: int  # unix time
    reply: dict  # the assistant message, normalized (molt.data)
    sample: Sample
    prompt_tokens: int


@dataclass
class Session:
    id: str
    base_url: str
    rollout_id: str
    conversation: Conversation
    turns: int = 0
    requests: int = 0  # requests in progress, at most MAX_REQUESTS_PER_SESSION
    truncated: bool = False  # a request hit agent.max_turns or rollout.max_model_len
    closed: bool = False
    last_request: Any = None
    last_turn: Optional[Turn] = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of a session at a time


class ChatServer:
    """`async with ChatServer(generator, tokenizer, plan, processor) as server:` serves until the block ends.
    `processor`: molt.data.load_processor(plan), None for a text-only model."""

    def __init__(self, generator, tokenizer, plan: Plan, processor=None):
        self.generator = generator
        self.tokenizer = tokenizer
        self.processor = processor
        self.plan = plan
        self.model_name = plan.model.name
        self.sessions: dict[str, Session] = {}
        self.port: Optional[int] = None
        self._runner: Optional[web.AppRunner] = None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_post("/s/{session}/v1/chat/completions", self._openai)
        app.router.add_post("/s/{session}/chat/completions", self._openai)
        app.router.add_post("/s/{session}/v1/messages", self._anthropic)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # loopback only: agents run on this machine
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> "ChatServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def open_session(self, rollout_id: str, group_id: str) -> Session:
        if len(self.sessions) >= MAX_SESSIONS:
            raise RuntimeError(f"{len(self.sessions)} chat sessions are open (MAX_SESSIONS={MAX_SESSIONS}); "
                               "close each finished rollout's session with close_session")
        session_id = secrets.token_urlsafe(16)  # 128 random bits: the URL is the only credential
        conversation = Conversation(self.tokenizer, rollout_id, group_id, processor=self.processor)
        session = Session(session_id, f"http://127.0.0.1:{self.port}/s/{session_id}", rollout_id, conversation)
        self.sessions[session_id] = session
        return session

    def close_session(self, session: Session) -> None:
        """End a session: its URL answers 404 from now on and its trace is final."""
        session.closed = True
        self.sessions.pop(session.id, None)
        self.generator.end_session(session.rollout_id)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _openai(self, request: web.Request) -> web.Response:
        try:
            with self._admit(request) as session:
                body = await self._body(request)
                messages, tools, max_tokens = self._openai_request(body)
                turn = await self._complete(session, ("openai", body), messages, tools, max_tokens)
        except (DataError, RequestError) as e:  # DataError: a malformed message or tool schema
            status = e.status if isinstance(e, RequestError) else 400
            error = {"message": str(e), "type": "invalid_request_error", "param": None, "code": None}
            return web.json_response({"error": error}, status=status)
        return web.json_response(self._openai_response(turn))

    async def _anthropic(self, request: web.Request) -> web.Response:
        try:
            with self._admit(request) as session:
                body = await self._body(request)
                messages, tools, max_tokens = self._anthropic_request(body)
                turn = await self._complete(session, ("anthropic", body), messages, tools, max_tokens)
        except (DataError, RequestError) as e:
            status = e.status if isinstance(e, RequestError) else 400
            kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error")
            return web.json_response({"type": "error", "error": {"type": kind, "message": str(e)}}, status=status)
        return web.json_response(self._anthropic_response(turn))

    @contextmanager
    def _admit(self, request: web.Request) -> Iterator[Session]:
        """The request's session, with the request counted in its `requests` until it is answered."""
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            raise RequestError(404, "unknown or finished session: use the base_url of a running rollout")
        if session.requests >= MAX_REQUESTS_PER_SESSION:
            raise RequestError(429, f"{session.requests} requests of this session are in progress; a session "
                                    "answers one request at a time, send the next when one is answered")
        session.requests += 1
        try:
            yield session
        finally:
            session.requests -= 1

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes") from None
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply, a huge integer
            raise RequestError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def _check_params(self, body: dict, accepted: set[str]) -> Optional[int]:
        """Checks both APIs share; returns the requested max_tokens (None = the per-turn budget)."""
        unknown = sorted(set(body) - accepted)
        if unknown:
            raise RequestError(400, f"unsupported parameter {unknown[0]!r}; this server accepts {sorted(accepted)}")
        if body.get("model") != self.model_name:
            raise RequestError(
                400, f"model {body.get('model')!r} is not served here; use ctx.model_name={self.model_name!r}"
            )
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported; send non-streaming requests")
        rollout = self.plan.rollout
        for name, value in (("temperature", rollout.temperature), ("top_p", rollout.top_p), ("top_k", rollout.top_k)):
            if body.get(name) is not None and body[name] != value:
                raise RequestError(
                    400, f"{name}={body[name]} differs from the policy's rollout.{name}={value}; omit {name}"
                )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError(400, f"max_tokens={max_tokens!r} must be a positive integer")
        return max_tokens

    def _openai_request(self, body: dict) -> tuple[list[dict], Optional[list[dict]], Optional[int]]:
        max_tokens = self._check_params(body, OPENAI_PARAMS)
        if body.get("n", 1) != 1:
            raise RequestError(400, f"n={body['n']} is not supported; send one request per sample")
        if body.get("tool_choice", "auto") != "auto":
            raise RequestError(400, f"tool_choice={body['tool_choice']!r} is not supported; use 'auto'")
        messages = normalize_messages(body.get("messages"), "request")
        return messages, normalize_tools(body.get("tools"), "request"), max_tokens

    def _anthropic_request(self, body: dict) -> tuple[list[dict], Optional[list[dict]], Optional[int]]:
        max_tokens = self._check_params(body, ANTHROPIC_PARAMS)
        if body.get("tool_choice", {"type": "auto"}) != {"type": "auto"}:
            raise RequestError(400, f"tool_choice={body['tool_choice']!r} is not supported; use {{'type': 'auto'}}")
        system = body.get("system")
        messages = [{"role": "system", "content": system}] if system else []
        if not isinstance(body.get("messages"), list):
            raise RequestError(400, "'messages' must be a list of messages")
        for i, message in enumerate(body["messages"]):
            messages += _from_anthropic(message, f"request: messages[{i}]")
        if not isinstance(body.get("tools") or [], list):
            raise RequestError(400, "'tools' must be a list of tools")
        tools = []
        for i, tool in enumerate(body.get("tools") or []):
            if not isinstance(tool, dict) or "input_schema" not in tool:
                raise RequestError(400, f"request: tools[{i}] must be a custom tool with 'name' and 'input_schema'")
            function = {"name": tool.get("name"), "description": tool.get("description"),
                        "parameters": tool["input_schema"]}
            tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        return normalize_messages(messages, "request"), normalize_tools(tools, "request"), max_tokens

    async def _complete(self, session: Session, request: Any, messages: list[dict], tools: Optional[list[dict]],
                        max_tokens: Optional[int]) -> Turn:
        """Generate the reply to `messages` and add it to the session's trace (or repeat the last reply)."""
        rollout, agent = self.plan.rollout, self.plan.agent
        async with session.lock:
            if request == session.last_request:
                return session.last_turn  # a retry: same answer, nothing generated or recorded
            prompt_ids = session.conversation.prompt_for(messages, tools)
            room = rollout.max_model_len - len(prompt_ids)
            if room <= 0:
                session.truncated = True
                raise RequestError(
                    400, f"context overflow: the conversation is {len(prompt_ids)} tokens and "
                         f"rollout.max_model_len={rollout.max_model_len} leaves no room to generate"
                )
            if session.turns >= agent.max_turns:
                session.truncated = True
                raise RequestError(400, f"this rollout has used all agent.max_turns={agent.max_turns} model calls")
            sample = await self.generator.generate(
                prompt_ids,
                max_tokens=min(max_tokens or agent.max_tokens_per_turn, agent.max_tokens_per_turn, room),
                temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                session_id=session.rollout_id, seed=request_seed(self.plan, session.rollout_id, session.turns),
                images=message_images(messages),
            )
            if session.closed:
                raise RequestError(404, "the session finished while this request was generating")
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            content, tool_calls = parse_tool_calls(text) if tools else (text, [])  # no tools offered: all text
            reply = {"role": "assistant", "content": content}
            if tool_calls:
                reply["tool_calls"] = [{**call, "id": f"call_{secrets.token_hex(8)}"} for call in tool_calls]
            session.conversation.add_turn(messages, tools, prompt_ids, sample, reply)
            session.turns += 1
            session.last_request = request
            session.last_turn = Turn(secrets.token_hex(12), int(time.time()), reply, sample, len(prompt_ids))
            return session.last_turn

    def _openai_response(self, turn: Turn) -> dict:
        calls = turn.reply.get("tool_calls", [])
        message = {"role": "assistant", "content": turn.reply["content"] or (None if calls else "")}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in calls
            ]
        finish = "tool_calls" if calls else turn.sample.finish_reason
        completion_tokens = len(turn.sample.token_ids)
        return {
            "id": f"chatcmpl-{turn.id}",
            "object": "chat.completion",
            "created": turn.created,
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": turn.prompt_tokens + completion_tokens},
        }

    def _anthropic_response(self, turn: Turn) -> dict:
        calls = turn.reply.get("tool_calls", [])
        content = [{"type": "text", "text": turn.reply["content"]}] if turn.reply["content"] else []
        content += [
            {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": c["function"]["arguments"]}
            for c in calls
        ]
        stop = "tool_use" if calls else "max_tokens" if turn.sample.finish_reason == "length" else "end_turn"
        return {
            "id": f"msg_{turn.id}",
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.sample.token_ids)},
        }


def _from_anthropic(message: Any, where: str) -> list[dict]:
    """One Anthropic message -> OpenAI-format messages: tool_use blocks become tool calls, each
    tool_result block a tool message (placed before the user's text, as the results answer the calls),
    base64 image blocks image_url parts with a data URL."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise RequestError(400, f"{where} must be an object with role 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content must be a string or a list of content blocks")
    parts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text", ""), str):
                raise RequestError(400, f"{where}.content[{j}].text must be a string")
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image" and role == "user":
            source = block.get("source")
            if not (isinstance(source, dict) and source.get("type") == "base64"
                    and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str)):
                raise RequestError(400, f"{where}.content[{j}]: an image block needs a base64 source; nothing is fetched")
            url = f"data:{source['media_type']};base64,{source['data']}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": block.get("content")})
        else:
            raise RequestError(400, f"{where}.content[{j}]: a {kind!r} block in a {role} message is not supported")
    if role == "assistant":
        return [{"role": "assistant", "content": parts, "tool_calls": calls}]
    return results + ([{"role": "user", "content": parts}] if parts else [])
