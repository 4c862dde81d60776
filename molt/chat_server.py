"""The loopback chat server: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages endpoints in
front of the Generator that record the exact token trace of every request (token-in/token-out capture) for
`ChatAgent` rollouts.

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
tool calls parsed before the first event, then it goes out in the API's own events with text and tool
arguments in pieces of STREAM_PIECE characters. Stop sequences stop the engine; every sampled id stays in
the trace (and in the model's context on the next turn), the text returned is cut before the stop sequence.
Sampling follows rollout.temperature / top_p / top_k. Parameters are honoured, ignored (IGNORED: bookkeeping
of the hosted APIs) or refused with a 400 that says why (NEUTRAL: accepted only at the value that leaves
sampling as it is).

Every bad request gets a 4xx naming what is wrong: 400, 404 (unknown or finished session), 413 (a body
over MAX_BODY_BYTES), 429 (more than MAX_REQUESTS_PER_SESSION requests at once on one session). Nothing in
a request is fetched or opened: images are read from data URLs (OpenAI `image_url`, Responses
`input_image`) and base64 blocks (Anthropic `image`) only, and only for a multimodal model; URL content is
refused, never read.
"""

from __future__ import annotations

import asyncio
import functools
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
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
STREAM_PIECE = 16  # characters of text or tool arguments per streamed delta
ANTHROPIC_ERRORS = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}  # error types by status
# Parameters each API's request is read from (the rest of IGNORED and NEUTRAL aside get a 400).
OPENAI_PARAMS = {"model", "messages", "tools", "tool_choice", "max_tokens",
                 "max_completion_tokens", "temperature", "top_p", "stream", "stream_options", "stop"}
ANTHROPIC_PARAMS = {"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p",
                    "top_k", "stream", "stop_sequences"}
RESPONSES_PARAMS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                    "top_p", "stream", "stream_options", "previous_response_id"}
# Bookkeeping of the hosted APIs: none of it changes what the model samples or what the agent gets back.
# `store`: a rollout's responses are kept for previous_response_id until the rollout ends, whatever it says.
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
           "safety_identifier"}
SAMPLING = "it changes the distribution the engine samples from, which the trainer's log-probabilities must match"
CONSTRAINED = ("it needs constrained sampling, which changes the distribution the engine samples from without the "
               "importance correction seeing it")
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
TOOL_CHOICE = ("forcing a tool call " + CONSTRAINED + "; use 'auto' (the model decides) or 'none' (tools described, "
               "no call read from the reply)")


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class ChatRequest:
    """A request of any of the three APIs, read into the one chat format."""

    messages: list[dict]  # normalized (molt.data)
    tools: Optional[list[dict]]
    max_tokens: Optional[int]  # None = the per-turn budget
    stop: list[str] = field(default_factory=list)
    read_tool_calls: bool = True  # False for tool_choice none: the reply is all text


@dataclass
class Turn:
    """One answered request: what a retry of the same request gets back."""

    id: str
    created: int  # unix time
    messages: list[dict]  # the request's messages, normalized
    reply: dict  # the assistant message, normalized (molt.data)
    sample: Sample
    prompt_tokens: int
    stop_sequence: Optional[str] = None  # the stop sequence the reply was cut at


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

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            with self._admit(request) as session:
                body = await self._body(request)
                if api == "openai":
                    chat = self._openai_request(body)
                elif api == "anthropic":
                    chat = self._anthropic_request(body)
                else:
                    chat = self._responses_request(session, body)
                turn = await self._complete(session, (api, body), chat)
                if api == "responses":
                    session.responses[f"resp_{turn.id}"] = turn.messages[bool(body.get("instructions")):] + [turn.reply]
        except (DataError, RequestError) as e:  # DataError: a malformed message or tool schema
            status = e.status if isinstance(e, RequestError) else 400
            if api == "anthropic":
                kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error")
                return web.json_response({"type": "error", "error": {"type": kind, "message": str(e)}}, status=status)
            error = {"message": str(e), "type": "invalid_request_error", "param": None, "code": None}
            return web.json_response({"error": error}, status=status)
        if api == "openai":
            answer = self._openai_response(turn)
            events = _openai_events(answer, body) if body.get("stream") else None
        elif api == "anthropic":
            answer = self._anthropic_response(turn)
            events = _anthropic_events(answer) if body.get("stream") else None
        else:
            answer = self._responses_response(turn, body)
            events = _responses_events(answer) if body.get("stream") else None
        if events is None:
            return web.json_response(answer)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for event in events:
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

    def _openai_request(self, body: dict) -> ChatRequest:
        max_tokens = self._check_params(body, OPENAI_PARAMS, "max_completion_tokens")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise RequestError(400, "stream_options must be an object such as {'include_usage': true}")
        stop = body.get("stop")
        stop = _stop_sequences([stop] if isinstance(stop, str) else stop, "stop")
        messages = body.get("messages")
        if isinstance(messages, list):  # newer clients send the system prompt as "developer"
            messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                        for m in messages]
        choice = _tool_choice(body.get("tool_choice"), ("auto", "none"))
        return ChatRequest(normalize_messages(messages, "request"), normalize_tools(body.get("tools"), "request"),
                           max_tokens, stop, choice != "none")

    def _anthropic_request(self, body: dict) -> ChatRequest:
        max_tokens = self._check_params(body, ANTHROPIC_PARAMS, "max_tokens")
        stop = _stop_sequences(body.get("stop_sequences"), "stop_sequences")
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            raise RequestError(400, "tool_choice.disable_parallel_tool_use=true is not supported: allowing one call "
                                    "only " + CONSTRAINED + "; omit it")
        _tool_choice(choice.get("type") if isinstance(choice, dict) else choice, ("auto", "none"))
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
        return ChatRequest(normalize_messages(messages, "request"), normalize_tools(tools, "request"), max_tokens,
                           stop, not (isinstance(choice, dict) and choice.get("type") == "none"))

    def _responses_request(self, session: Session, body: dict) -> ChatRequest:
        max_tokens = self._check_params(body, RESPONSES_PARAMS, "max_output_tokens")
        choice = _tool_choice(body.get("tool_choice"), ("auto", "none"))
        instructions = body.get("instructions")
        if not isinstance(instructions or "", str):
            raise RequestError(400, "instructions must be a string")
        system = normalize_messages([{"role": "system", "content": instructions}], "request") if instructions else []
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or previous not in session.responses):
            raise RequestError(400, f"previous_response_id={str(previous)[:64]!r} is not a response of this "
                                    "rollout; send the id of an earlier response on this base_url")
        history = session.responses[previous] if previous else []  # normalized; its instructions not carried over
        new = normalize_messages(_from_responses_input(body.get("input")), "request: input")
        if not isinstance(body.get("tools") or [], list):
            raise RequestError(400, "'tools' must be a list of tools")
        tools = []
        for i, tool in enumerate(body.get("tools") or []):
            if not (isinstance(tool, dict) and tool.get("type") == "function"):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise RequestError(400, f"request: tools[{i}] is a {kind!r} tool; only function tools are served "
                                        "(hosted tools such as web search run nowhere here)")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        return ChatRequest(system + history + new, normalize_tools(tools, "request"), max_tokens, [], choice != "none")

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

    def _openai_response(self, turn: Turn) -> dict:
        calls = turn.reply.get("tool_calls", [])
        message = {"role": "assistant", "content": turn.reply["content"] or (None if calls else "")}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in calls
            ]
        finish = "tool_calls" if calls else "stop" if turn.stop_sequence else turn.sample.finish_reason
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
        stop = ("tool_use" if calls else "stop_sequence" if turn.stop_sequence
                else "max_tokens" if turn.sample.finish_reason == "length" else "end_turn")
        return {
            "id": f"msg_{turn.id}",
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": turn.stop_sequence,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.sample.token_ids)},
        }

    def _responses_response(self, turn: Turn, body: dict) -> dict:
        output = []
        if turn.reply["content"]:
            output.append({"type": "message", "id": f"msg_{turn.id}", "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": turn.reply["content"], "annotations": []}]})
        output += [{"type": "function_call", "id": f"fc_{turn.id}_{i}", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"]),
                    "status": "completed"} for i, c in enumerate(turn.reply.get("tool_calls", []))]
        cut_off = turn.sample.finish_reason == "length" and not turn.reply.get("tool_calls")
        completion_tokens = len(turn.sample.token_ids)
        rollout = self.plan.rollout
        return {
            "id": f"resp_{turn.id}", "object": "response", "created_at": turn.created, "model": self.model_name,
            "status": "incomplete" if cut_off else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut_off else None,
            "error": None, "output": output, "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": True,
            "temperature": rollout.temperature, "top_p": rollout.top_p,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": True,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": completion_tokens,
                      "total_tokens": turn.prompt_tokens + completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }


def _pieces(text: str) -> list[str]:
    return [text[i : i + STREAM_PIECE] for i in range(0, len(text), STREAM_PIECE)]


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def _openai_events(answer: dict, body: dict) -> list[str]:
    """The chat.completion.chunk events of `answer` (server-sent events), ending in [DONE]."""
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    choice, message = answer["choices"][0], answer["choices"][0]["message"]
    deltas = [{"role": "assistant", "content": ""}]
    deltas += [{"content": piece} for piece in _pieces(message["content"] or "")]
    for i, call in enumerate(message.get("tool_calls", [])):
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": i, "function": {"arguments": piece}}]}
                   for piece in _pieces(call["function"]["arguments"])]
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]}
              for delta in deltas]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                                        "logprobs": None}]})
    if usage:  # every chunk says usage: null, then one chunk without choices carries it
        chunks = [{**chunk, "usage": None} for chunk in chunks]
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


def _anthropic_events(message: dict) -> list[str]:
    """The Messages stream of `message`: message_start, each content block's start / deltas / stop,
    message_delta (stop reason, output tokens), message_stop."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    events = [_event("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            empty = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
        else:
            empty = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _pieces(json.dumps(block["input"]))]
        events.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": empty}))
        events += [_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                   for delta in deltas]
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(_event("message_delta", {"type": "message_delta", "delta": delta,
                                           "usage": {"output_tokens": message["usage"]["output_tokens"]}}))
    return events + [_event("message_stop", {"type": "message_stop"})]


def _responses_events(response: dict) -> list[str]:
    """The Responses stream of `response`: created, in_progress, each output item added / its deltas / done,
    then completed (or incomplete); every event numbered."""
    events = []

    def emit(kind: str, **data) -> None:
        events.append(_event(kind, {"type": kind, "sequence_number": len(events), **data}))

    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            for piece in _pieces(part["text"]):
                emit("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "arguments": ""})
            for piece in _pieces(item["arguments"]):
                emit("response.function_call_arguments.delta", **at, delta=piece)
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{response['status']}", response=response)
    return events


def _stop_sequences(stop: Any, name: str) -> list[str]:
    if stop is None:
        return []
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, f"{name} must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    return stop


def _tool_choice(choice: Any, accepted: tuple[str, ...]) -> str:
    """The tool_choice mode ('auto' when absent); a forced call is refused with the reason."""
    choice = "auto" if choice is None else choice
    if choice not in accepted:
        raise RequestError(400, f"tool_choice={choice!r} is not supported: {TOOL_CHOICE}")
    return choice


def _from_responses_input(items: Any) -> list[dict]:
    """Responses `input` -> OpenAI-format messages: message items keep their role ("developer" becomes
    "system"), function_call items become tool calls of an assistant message (joined with the assistant
    message before them: one reply), function_call_output items tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(400, "'input' must be a string or a non-empty list of input items")
    messages = []
    for i, item in enumerate(items):
        where = f"request: input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _responses_content(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(400, f"{where}: a function_call item needs a string call_id")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
            messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _responses_content(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
            raise RequestError(400, f"{where}: a {kind!r} item is not supported; send message, function_call and "
                                    "function_call_output items (a message needs role user, system, developer "
                                    "or assistant)")
    return messages


def _responses_content(content: Any, where: str) -> Any:
    """Responses content parts -> chat content parts (input_text / output_text -> text, input_image -> image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise RequestError(400, f"{where}.content[{j}]: a {kind!r} part is not supported; send input_text, "
                                    "output_text or input_image parts (images as data URLs; nothing is fetched)")
    return parts


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
