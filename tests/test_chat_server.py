"""The chat server's boundary: bad input gets a 400 naming what is wrong (in each API's error format, as
the stock SDKs read it), unknown sessions a 404, oversized bodies a 413, and the server listens on
127.0.0.1 only. Requests rejected here never reach an engine, so the server runs without one; the
requests that generate are tested on the real engine in test_agent.py.
"""

import json
import socket

import anthropic
import httpx
import httpx2
import openai
import pytest
from transformers import AutoTokenizer

from molt.chat_protocols import STREAM_PIECE, Turn, stream_events, write_response
from molt.chat_server import ChatServer
from molt.data import parse_tool_calls
from molt.plan import ModelPlan, Plan, RolloutPlan
from molt.tiny import build_tiny
from molt.trace import Sample

HELLO = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def server(loop, tmp_path_factory):
    path = build_tiny("dense", str(tmp_path_factory.mktemp("models") / "dense"))
    plan = Plan(model=ModelPlan(path=path), rollout=RolloutPlan(max_model_len=128))
    server = ChatServer(None, AutoTokenizer.from_pretrained(path), plan)
    loop.run_until_complete(server.start())
    yield server
    loop.run_until_complete(server.stop())


@pytest.fixture
def session(server):
    session = server.open_session("rollout", "group")
    yield session
    server.sessions.pop(session.id, None)


def post(loop, url: str, body) -> tuple[int, dict]:
    async def send():
        async with httpx.AsyncClient() as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(url, content=content, headers={"content-type": "application/json"})
            return response.status_code, response.json() if response.status_code != 413 else {}

    return loop.run_until_complete(send())


def test_health(server, loop):
    async def get():
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://127.0.0.1:{server.port}/health")).json()

    assert loop.run_until_complete(get()) == {"status": "ok"}


def test_unknown_session_is_404_in_both_formats(server, loop):
    base = f"http://127.0.0.1:{server.port}/s/not-a-session"
    status, body = post(loop, f"{base}/v1/chat/completions", {"model": "tiny", "messages": HELLO})
    assert status == 404 and "unknown or finished session" in body["error"]["message"]
    status, body = post(loop, f"{base}/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": HELLO})
    assert status == 404 and body["error"]["type"] == "not_found_error"


OPENAI_BAD = [
    (b"{not json", "not valid JSON"),
    ([HELLO], "must be a JSON object"),
    ({"model": "tiny"}, "'messages' must be a non-empty list"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role is 'robot'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 7}]}, "messages[0].content must be a string"),
    ({"model": "gpt-4o", "messages": HELLO}, "model 'gpt-4o' is not served here; use ctx.model_name='tiny'"),
    ({"model": "tiny", "messages": HELLO, "stream": "yes"}, "stream='yes' must be true or false"),
    ({"model": "tiny", "messages": HELLO, "stream": True, "stream_options": 5}, "stream_options must be an object"),
    ({"model": "tiny", "messages": HELLO, "n": 2}, "n=2 is not supported: one request samples one reply"),
    ({"model": "tiny", "messages": HELLO, "stop": ["a", ""]}, "stop must be a string or a list of at most 4"),
    ({"model": "tiny", "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "at most 4 non-empty strings"),
    ({"model": "tiny", "messages": HELLO, "response_format": {"type": "json_object"}},
     "structured output it needs constrained sampling"),
    ({"model": "tiny", "messages": HELLO, "parallel_tool_calls": False}, "allowing one call only it needs constrained"),
    ({"model": "tiny", "messages": HELLO, "presence_penalty": 0.5}, "it changes the distribution the engine samples"),
    ({"model": "tiny", "messages": HELLO, "temperature": 0.5},
     "temperature=0.5 differs from the policy's rollout.temperature=1.0"),
    ({"model": "tiny", "messages": HELLO, "logprobs": True}, "logprobs=True is not supported: log-probabilities go"),
    ({"model": "tiny", "messages": HELLO, "functions": []}, "unsupported parameter 'functions'"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 0}, "max_tokens=0 must be a positive integer"),
    ({"model": "tiny", "messages": HELLO, "tool_choice": "required"},
     "tool_choice='required' is not supported: forcing a tool call it needs constrained sampling"),
    ({"model": "tiny", "messages": HELLO, "tool_choice": {"type": "function", "function": {"name": "calculator"}}},
     "use 'auto' (the model decides) or 'none'"),
    ({"model": "tiny", "messages": HELLO, "tools": [{"name": "calculator"}]}, "tools[0] must look like"),
    ({"model": "tiny", "messages": HELLO + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "calculator", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "7 " * 200}]}, "context overflow: the conversation is"),
]


@pytest.mark.parametrize("body, message", OPENAI_BAD)
def test_openai_bad_requests_are_400_with_a_message(server, session, loop, body, message):
    status, answer = post(loop, f"{session.base_url}/v1/chat/completions", body)
    assert status == 400 and message in answer["error"]["message"]
    assert not session.conversation.segments  # nothing recorded


ANTHROPIC_BAD = [
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0]: an image block needs a base64 source; nothing is fetched"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]},
     "messages[0] must be an object with role 'user' or 'assistant'"),
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "any"}}, "tool_choice="),
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web"}]},
     "tools[0] must be a custom tool"),
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "stop_sequences": "\n"}, "stop_sequences must be"),
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 9}},
     "the served model has no thinking mode"),
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "auto",
                                                                           "disable_parallel_tool_use": True}},
     "disable_parallel_tool_use=true is not supported"),
]

RESPONSES_BAD = [
    ({"model": "tiny"}, "'input' must be a string or a non-empty list"),
    ({"model": "tiny", "input": [{"type": "reasoning", "summary": []}]},
     "input[0]: a 'reasoning' item is not supported"),
    ({"model": "tiny", "input": [{"role": "robot", "content": "hi"}]}, "input[0]: a 'message' item is not supported"),
    ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "content[0]: a 'input_file' part is not supported"),
    ({"model": "tiny", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "needs a string call_id"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}, "only function tools are served"),
    ({"model": "tiny", "input": "hi", "tool_choice": "required"}, "tool_choice='required' is not supported"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
     "structured output"),
    ({"model": "tiny", "input": "hi", "previous_response_id": "resp_123"}, "is not a response of this rollout"),
    ({"model": "tiny", "input": "hi", "truncation": "auto"}, "the server never drops earlier turns"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": -1}, "max_output_tokens=-1 must be a positive integer"),
    ({"model": "tiny", "input": "hi", "background": True}, "unsupported parameter 'background'"),
]


@pytest.mark.parametrize("body, message", RESPONSES_BAD)
def test_responses_bad_requests_are_400_with_a_message(server, session, loop, body, message):
    status, answer = post(loop, f"{session.base_url}/v1/responses", body)
    assert status == 400 and message in answer["error"]["message"]
    assert not session.conversation.segments


@pytest.mark.parametrize("body, message", ANTHROPIC_BAD)
def test_anthropic_bad_requests_are_400_with_a_message(server, session, loop, body, message):
    status, answer = post(loop, f"{session.base_url}/v1/messages", body)
    assert status == 400 and answer["type"] == "error" and message in answer["error"]["message"]


def test_context_overflow_marks_the_rollout_truncated(session, loop):
    overlong = [{"role": "user", "content": "7 " * 200}]
    post(loop, f"{session.base_url}/chat/completions", {"model": "tiny", "messages": overlong})
    assert session.truncated


def test_body_size_is_bounded(session, loop):
    status, _ = post(loop, f"{session.base_url}/v1/chat/completions", b"x" * (5 * 1024 * 1024))
    assert status == 413


def test_stock_sdks_surface_the_message(session, loop):
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="molt", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"seed=1 is not supported: .*\(rollout.seed_requests\)"):
        loop.run_until_complete(client.chat.completions.create(model="tiny", messages=HELLO, seed=1))
    with pytest.raises(openai.BadRequestError, match="not a response of this rollout"):
        loop.run_until_complete(client.responses.create(model="tiny", input="hi", previous_response_id="resp_1"))
    client = anthropic.AsyncAnthropic(base_url=session.base_url, api_key="molt", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice="):
        request = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, tool_choice={"type": "any"})
        loop.run_until_complete(request)


def test_bound_to_loopback_only(server, session):
    assert session.base_url.startswith(f"http://127.0.0.1:{server.port}/s/") and len(session.id) >= 20
    assert {host for host, _ in server._runner.addresses} == {"127.0.0.1"}
    # This machine's outward address (a UDP connect sends nothing) must not reach the port.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 1))
    outward = probe.getsockname()[0]
    probe.close()
    if outward.startswith("127."):
        pytest.skip("this machine has no non-loopback address to try")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outward, server.port), timeout=2)


def test_tool_calls_are_parsed_from_the_qwen_format():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
            '\n<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [c["function"]["arguments"]["expression"] for c in calls] == ["3 + 4", "1"]
    # Not a call: the block stays in the text, as the model wrote it.
    assert parse_tool_calls("<tool_call>{oops}</tool_call>") == ("<tool_call>{oops}</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call> 7')[1] == []


# ---- streamed replies, read by the SDKs' own stream parsers ----------------------------------------------

CALL_ARGUMENTS = {"expression": "(1 + 2) * 3 + 4 * 5"}  # longer than STREAM_PIECE: split across chunks


def sdk_client(sdk, events: list[str]):
    """A stock SDK client whose every request is answered with these server-sent events."""
    body = "".join(events).encode()
    assert len(json.dumps(CALL_ARGUMENTS)) > 2 * STREAM_PIECE
    http_lib = httpx if sdk is openai else httpx2  # the anthropic SDK runs on the httpx2 fork
    transport = http_lib.MockTransport(lambda request: http_lib.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    http = http_lib.AsyncClient(transport=transport)
    client_cls = openai.AsyncOpenAI if sdk is openai else anthropic.AsyncAnthropic
    return client_cls(base_url="http://127.0.0.1:1/s/x", api_key="molt", max_retries=0, http_client=http)


@pytest.fixture
def turn(server):
    """A reply with text and two tool calls, as _complete records it."""
    ids = server.tokenizer.encode("Let me compute this.", add_special_tokens=False)
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": CALL_ARGUMENTS}, "id": f"call_{i}"}
             for i in range(2)]
    reply = {"role": "assistant", "content": "Let me compute this, step by step.", "tool_calls": calls}
    return Turn("abc", 1, HELLO, reply, Sample(ids, [-0.5] * len(ids), [0] * len(ids), "stop"), 12)


def test_streamed_chat_completion_is_read_by_the_openai_sdk(server, loop, turn):
    body = {"stream_options": {"include_usage": True}}
    events = stream_events("openai", write_response("openai", turn, body, server.plan), body)
    argument_chunks = [e for e in events if '"arguments": "' in e and '"name"' not in e]
    assert len(argument_chunks) >= 4, "each call's arguments arrive in several chunks"
    client = sdk_client(openai, events)

    async def read():
        stream = await client.chat.completions.create(model="tiny", messages=HELLO, stream=True)
        chunks = [chunk async for chunk in stream]
        async with client.chat.completions.stream(model="tiny", messages=HELLO) as stream:
            async for _ in stream:
                pass
            return chunks, await stream.get_final_completion()

    chunks, final = loop.run_until_complete(read())
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 12  # include_usage: the last chunk
    message = final.choices[0].message
    assert message.content == turn.reply["content"] and final.choices[0].finish_reason == "tool_calls"
    assert [(c.id, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("call_0", CALL_ARGUMENTS), ("call_1", CALL_ARGUMENTS)]


def test_streamed_anthropic_message_is_read_by_the_anthropic_sdk(server, loop, turn):
    events = stream_events("anthropic", write_response("anthropic", turn, {}, server.plan), {})
    assert sum("input_json_delta" in e for e in events) >= 4
    client = sdk_client(anthropic, events)

    async def read():
        async with client.messages.stream(model="tiny", max_tokens=8, messages=HELLO) as stream:
            kinds = [event.type async for event in stream]
            return kinds, await stream.get_final_message()

    kinds, final = loop.run_until_complete(read())
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == turn.reply["content"] and final.stop_reason == "tool_use"
    assert [(b.id, b.input) for b in final.content[1:]] == [("call_0", CALL_ARGUMENTS), ("call_1", CALL_ARGUMENTS)]
    assert final.usage.output_tokens == len(turn.sample.token_ids)


def test_streamed_response_is_read_by_the_openai_sdk(server, loop, turn):
    body = {"tools": []}
    events = stream_events("responses", write_response("responses", turn, body, server.plan), body)
    assert sum("function_call_arguments.delta" in e for e in events) >= 4
    client = sdk_client(openai, events)

    async def read():
        async with client.responses.stream(model="tiny", input="hi") as stream:
            kinds = [event.type async for event in stream]
            return kinds, await stream.get_final_response()

    kinds, final = loop.run_until_complete(read())
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == turn.reply["content"] and final.id == "resp_abc"
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, json.loads(c.arguments)) for c in calls] == \
        [("call_0", CALL_ARGUMENTS), ("call_1", CALL_ARGUMENTS)]
