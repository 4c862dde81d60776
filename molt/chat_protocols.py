"""The wire formats of the three chat APIs that the loopback chat server (molt/chat_server.py) speaks: OpenAI
Chat Completions, OpenAI Responses and Anthropic Messages. `read_request` reads a request of any of them into
the one `ChatRequest` (OpenAI chat messages, normalized by molt.data); `write_response` writes an answered
request, a `Turn`, as the API's response body, `stream_events` that body as the API's server-sent events
(text and tool arguments in pieces of STREAM_PIECE characters), and `error_body` a refusal as the API's error.

What a request says that cannot be served is refused with a RequestError that says why. Nothing in a request
is fetched or opened: images are read from data URLs (OpenAI `image_url`, Responses `input_image`) and
base64 blocks (Anthropic `image`) only, and only for a multimodal model; URL content is refused, never read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from molt.data import normalize_messages, normalize_tools
from molt.plan import Plan
from molt.trace import Sample

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
STREAM_PIECE = 16  # characters of text or tool arguments per streamed delta
ANTHROPIC_ERRORS = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}  # error types by status
# Each API's parameters its request is read from, and its name for the reply's token limit (the rest of the
# chat server's IGNORED and NEUTRAL aside get a 400).
PARAMS = {
    "openai": ({"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
                "top_p", "stream", "stream_options", "stop"}, "max_completion_tokens"),
    "anthropic": ({"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p",
                   "top_k", "stream", "stop_sequences"}, "max_tokens"),
    "responses": ({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                   "top_p", "stream", "stream_options", "previous_response_id"}, "max_output_tokens"),
}
CONSTRAINED = ("it needs constrained sampling, which changes the distribution the engine samples from without the "
               "importance correction seeing it")
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


def read_request(api: str, body: dict, max_tokens: Optional[int], responses: dict[str, list[dict]]) -> ChatRequest:
    """`body`, a request of `api` whose parameters the server has checked, as the one ChatRequest. `responses`:
    the rollout's answered Responses-API conversations by response id, for previous_response_id."""
    if api == "openai":
        return _openai_request(body, max_tokens)
    if api == "anthropic":
        return _anthropic_request(body, max_tokens)
    return _responses_request(body, max_tokens, responses)


def write_response(api: str, turn: Turn, body: dict, plan: Plan) -> dict:
    """The response body of `api` that answers the request `body` with `turn`."""
    if api == "openai":
        return _openai_response(turn, plan.model.name)
    if api == "anthropic":
        return _anthropic_response(turn, plan.model.name)
    return _responses_response(turn, body, plan)


def stream_events(api: str, response: dict, body: dict) -> list[str]:
    """`response` (write_response's body) as the server-sent events of `api`'s stream."""
    if api == "openai":
        return _openai_events(response, body)
    if api == "anthropic":
        return _anthropic_events(response)
    return _responses_events(response)


def error_body(api: str, status: int, message: str) -> dict:
    if api == "anthropic":
        kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def _openai_request(body: dict, max_tokens: Optional[int]) -> ChatRequest:
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


def _anthropic_request(body: dict, max_tokens: Optional[int]) -> ChatRequest:
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


def _responses_request(body: dict, max_tokens: Optional[int], responses: dict[str, list[dict]]) -> ChatRequest:
    choice = _tool_choice(body.get("tool_choice"), ("auto", "none"))
    instructions = body.get("instructions")
    if not isinstance(instructions or "", str):
        raise RequestError(400, "instructions must be a string")
    system = normalize_messages([{"role": "system", "content": instructions}], "request") if instructions else []
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or previous not in responses):
        raise RequestError(400, f"previous_response_id={str(previous)[:64]!r} is not a response of this "
                                "rollout; send the id of an earlier response on this base_url")
    history = responses[previous] if previous else []  # normalized; its instructions not carried over
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


def _openai_response(turn: Turn, model_name: str) -> dict:
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
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": turn.prompt_tokens + completion_tokens},
    }


def _anthropic_response(turn: Turn, model_name: str) -> dict:
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
        "model": model_name,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": turn.stop_sequence,
        "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.sample.token_ids)},
    }


def _responses_response(turn: Turn, body: dict, plan: Plan) -> dict:
    output = []
    if turn.reply["content"]:
        output.append({"type": "message", "id": f"msg_{turn.id}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": turn.reply["content"], "annotations": []}]})
    output += [{"type": "function_call", "id": f"fc_{turn.id}_{i}", "call_id": c["id"],
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"]),
                "status": "completed"} for i, c in enumerate(turn.reply.get("tool_calls", []))]
    cut_off = turn.sample.finish_reason == "length" and not turn.reply.get("tool_calls")
    completion_tokens = len(turn.sample.token_ids)
    rollout = plan.rollout
    return {
        "id": f"resp_{turn.id}", "object": "response", "created_at": turn.created, "model": plan.model.name,
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
