"""The loopback chat server: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages endpoints in
front of the Generator that record the exact token trace of every request (token-in/token-out capture) for
`ChatAgent` rollouts. The three APIs' wire formats are molt/chat_protocols.py; this module serves them.

One server per runner, bound to 127.0.0.1 on an ephemeral port. Each rollout gets a session with an
unguessable id in its base URL, `http://127.0.0.1:<port>/s/<session>`, which works unchanged as the
`base_url` of both stock clients (the OpenAI SDK appends /chat/completions or /responses, the Anthropic
SDK /v1/messages). Routes:

    POST /s/<session>/v1/chat/completions   OpenAI chat completions (also /s/<session>/chat/completions)
    POST /s/<session>/v1/responses          OpenAI responses (also /s/<session>/responses)
    POST /s/<session>/v1/messages           Anthropic messages
    GET  /health

All three APIs are read into one chat format (OpenAI chat messages, normalized by molt.data) and answered
by one function, `_complete`. Requests are rendered with the chat template here (and only here) and
accumulated by `molt.data.Conversation`: earlier turns keep the model's sampled ids, only new messages are
rendered, and a request that does not extend the previous one opens a new segment. Repeating the last
request returns the same answer without generating. Tool calls are read from the model's text in the Qwen
format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Streaming (`stream: true`) is served after generation: the reply is complete, its stop sequence cut and its
tool calls parsed before the first event, then it goes out in the API's own events. Stop sequences stop the
engine; every sampled id stays in the trace (and in the model's context on the next turn), the text returned
is cut before the stop sequence. Sampling follows rollout.temperature / top_p / top_k. Parameters are
honoured, ignored (IGNORED: bookkeeping of the hosted APIs) or refused with a 400 that says why (NEUTRAL:
accepted only at the value that leaves sampling as it is).

Every bad request gets a 4xx naming what is wrong, in its API's error format: 400, 404 (unknown or finished
session), 413 (a body over MAX_BODY_BYTES), 429 (more than MAX_REQUESTS_PER_SESSION requests at once on one
session).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from molt.chat_protocols import (CONSTRAINED, PARAMS, ChatRequest, RequestError, Turn, error_body, read_request,
                                 stream_events, write_response)
from molt.data import Conversation, DataError, message_images, parse_tool_calls
from molt.generator import request_seed
from molt.plan import Plan

MAX_BODY_BYTES = 4 * 1024 * 1024
# Bounds on what agents can hold open: sessions (one per rollout in flight; more means a leak) and requests
# in progress per session (they run one at a time; more waiting ones would only hold bodies in memory).
MAX_SESSIONS = 4096
MAX_REQUESTS_PER_SESSION = 4
# Bookkeeping of the hosted APIs: none of it changes what the model samples or what the agent gets back.
# `store`: a rollout's responses are kept for previous_response_id until the rollout ends, whatever it says.
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
           "safety_identifier"}
SAMPLING = "it changes the distribution the engine samples from, which the trainer's log-probabilities must match"
# Accepted at these values only (the first is the default), each with the reason any other value is refused.
NEUTRAL = {
    "n": ((1,), "one request samples one reply; a prompt's several samples are its group's rollouts "
                "(rollout.samples_per_prompt), so send one request per sample"),
    "frequency_penalty": ((0, 0.0), SAMPLING), "presence_penalty": ((0, 0.0), SAMPLING),
    "logit_bias": (({},), SAMPLING),
    "seed": ((None,), "each request's seed is set by the run (rollout.seed_requests)"),
    "response_format": (({"type": "text"},), "structured output " + CONSTRAINED),
    "parallel_tool_calls": ((True,), "allowing one call only " + CONSTRAINED),
    "logprobs": ((False,), "log-probabilities go to the trace for the trainer, not to the agent"),
    "top_logprobs": ((0,), "log-probabilities go to the trace for the trainer, not to the agent"),
    "modalities": ((["text"],), "the model writes text only"),
    "reasoning_effort": ((None,), "the served model has no reasoning mode"),
    "reasoning": (({},), "the served model has no reasoning mode"),
    "thinking": (({"type": "disabled"},), "the served model has no thinking mode"),
    "include": (([],), "the server has no reasoning content or log-probabilities to include"),
    "truncation": (("disabled",), "the server never drops earlier turns: a context overflow is a 400 and "
                                  "marks the rollout truncated"),
    "text": (({"format": {"type": "text"}},), "structured output " + CONSTRAINED),
}


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
    # Responses API: each answered response's conversation (without its instructions), for previous_response_id.
    responses: dict[str, list[dict]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of a session at a time


class ChatServer:
    """Serves from `start()` until `stop()`. `processor`: molt.data.load_processor(plan), None for a text-only model."""

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
        for path, api in (("chat/completions", "openai"), ("responses", "responses"), ("messages", "anthropic")):
            handler = functools.partial(self._serve, api=api)
            app.router.add_post(f"/s/{{session}}/v1/{path}", handler)
            if api != "anthropic":  # the OpenAI SDK's base_url may or may not end in /v1
                app.router.add_post(f"/s/{{session}}/{path}", handler)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # loopback only: agents run on this machine
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

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

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            with self._admit(request) as session:
                body = await self._body(request)
                chat = read_request(api, body, self._check_params(body, *PARAMS[api]), session.responses)
                turn = await self._complete(session, (api, body), chat)
        except (DataError, RequestError) as e:  # DataError: a malformed message or tool schema
            status = e.status if isinstance(e, RequestError) else 400
            return web.json_response(error_body(api, status, str(e)), status=status)
        response = write_response(api, turn, body, self.plan)
        if api == "responses":  # its conversation, without its instructions, for a later previous_response_id
            session.responses[response["id"]] = turn.messages[bool(body.get("instructions")):] + [turn.reply]
        if not body.get("stream"):
            return web.json_response(response)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for event in stream_events(api, response, body):
            await stream.write(event.encode())
        await stream.write_eof()
        return stream

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

    def _check_params(self, body: dict, accepted: set[str], max_tokens_key: str) -> Optional[int]:
        """Checks the three APIs share; returns the requested max_tokens (None = the per-turn budget)."""
        for name in sorted(set(body) - accepted - IGNORED):
            if name not in NEUTRAL:
                raise RequestError(400, f"unsupported parameter {name!r}; this server accepts "
                                        f"{sorted(accepted | IGNORED | set(NEUTRAL))}")
            values, reason = NEUTRAL[name]
            if body[name] is not None and body[name] not in values:
                raise RequestError(400, f"{name}={body[name]!r} is not supported: {reason}; omit {name}")
        if body.get("model") != self.model_name:
            raise RequestError(
                400, f"model {body.get('model')!r} is not served here; use ctx.model_name={self.model_name!r}"
            )
        if not isinstance(body.get("stream") or False, bool):
            raise RequestError(400, f"stream={body['stream']!r} must be true or false")
        rollout = self.plan.rollout
        for name, value in (("temperature", rollout.temperature), ("top_p", rollout.top_p), ("top_k", rollout.top_k)):
            if body.get(name) is not None and body[name] != value:
                raise RequestError(
                    400, f"{name}={body[name]} differs from the policy's rollout.{name}={value}; omit {name}"
                )
        key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise RequestError(400, f"{key}={max_tokens!r} must be a positive integer")
        return max_tokens

    async def _complete(self, session: Session, request: Any, chat: ChatRequest) -> Turn:
        """Generate the reply to `chat` and add it to the session's trace (or repeat the last reply)."""
        rollout, agent = self.plan.rollout, self.plan.agent
        messages, tools = chat.messages, chat.tools
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
                max_tokens=min(chat.max_tokens or agent.max_tokens_per_turn, agent.max_tokens_per_turn, room),
                temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                session_id=session.rollout_id, seed=request_seed(self.plan, session.rollout_id, session.turns),
                images=message_images(messages), stop=chat.stop,
                routes_from=session.conversation.routes_known(prompt_ids),
            )
            if session.closed:
                raise RequestError(404, "the session finished while this request was generating")
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            # The engine stopped on the token completing a stop sequence: the text ends before it, as the APIs
            # specify; all sampled ids stay in the trace, and the next turn's prompt continues from them.
            found = [(text.index(s), s) for s in chat.stop if s in text]
            cut, stop_sequence = min(found) if found else (len(text), None)
            text = text[:cut]
            content, tool_calls = parse_tool_calls(text) if tools and chat.read_tool_calls else (text, [])
            reply = {"role": "assistant", "content": content}
            if tool_calls:
                reply["tool_calls"] = [{**call, "id": f"call_{secrets.token_hex(8)}"} for call in tool_calls]
            session.conversation.add_turn(messages, tools, prompt_ids, sample, reply)
            session.turns += 1
            session.last_request = request
            session.last_turn = Turn(secrets.token_hex(12), int(time.time()), messages, reply, sample,
                                     len(prompt_ids), stop_sequence)
            return session.last_turn
