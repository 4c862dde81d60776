"""The chat server's boundary: bad input gets a 400 naming what is wrong (in each API's error format, as
the stock SDKs read it), unknown sessions a 404, oversized bodies a 413, and the server listens on
127.0.0.1 only. Requests rejected here never reach an engine, so the server runs without one; the
requests that generate are tested on the real engine in test_agent.py.
"""

import json
import socket

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from molt.chat_server import ChatServer
from molt.data import parse_tool_calls
from molt.plan import ModelPlan, Plan, RolloutPlan
from molt.tiny import build_tiny

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
    ({"model": "tiny", "messages": HELLO, "stream": True}, "stream=true is not supported"),
    ({"model": "tiny", "messages": HELLO, "n": 2}, "n=2 is not supported"),
    ({"model": "tiny", "messages": HELLO, "temperature": 0.5},
     "temperature=0.5 differs from the policy's rollout.temperature=1.0"),
    ({"model": "tiny", "messages": HELLO, "logprobs": True}, "unsupported parameter 'logprobs'"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 0}, "max_tokens=0 must be a positive integer"),
    ({"model": "tiny", "messages": HELLO, "tool_choice": "required"}, "tool_choice='required' is not supported"),
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
    ({"model": "tiny", "max_tokens": 8, "messages": HELLO, "stop_sequences": ["\n"]},
     "unsupported parameter 'stop_sequences'"),
]


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
    with pytest.raises(openai.BadRequestError, match="unsupported parameter 'seed'"):
        loop.run_until_complete(client.chat.completions.create(model="tiny", messages=HELLO, seed=1))
    client = anthropic.AsyncAnthropic(base_url=session.base_url, api_key="molt", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="unsupported parameter 'stop_sequences'"):
        request = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, stop_sequences=["."])
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
