"""The loopback chat server under fuzzed, hostile and concurrent requests, and what Molt exposes.

Most requests here never reach an engine: the fuzzed server runs with no generator and agent.max_turns=0,
so a request that parses completely is rendered with the chat template and then refused with a 400. The
concurrency test runs a real vLLM-CPU engine behind the server and checks each session's token trace.
Credentials in the plan or the Hydra overrides are redacted before they reach a real SQLite MLflow store.
"""

from __future__ import annotations

import asyncio
import json
import socket
import string
import threading
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow import MlflowClient
from transformers import AutoTokenizer

from molt import chat_server
from molt.agents import calculator
from molt.chat_server import MAX_BODY_BYTES, MAX_REQUESTS_PER_SESSION, ChatServer
from molt.data import DataError, load_dataset, normalize_messages, render_prompt
from molt.generator import Generator
from molt.plan import AgentPlan, DataPlan, ModelPlan, Plan, RolloutPlan
from molt.tiny import build_tiny
from molt.trace import check_token_identity
from molt.tracking import REDACTED, Tracker, redact

HELLO = [{"role": "user", "content": "What is 3 + 4?"}]
OPENAI, ANTHROPIC, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny("dense", str(tmp_path_factory.mktemp("models") / "dense"))


@pytest.fixture(scope="module")
def server(loop, model_path):
    """No engine, and no model call allowed: every request is refused before it could generate."""
    plan = Plan(model=ModelPlan(path=model_path), rollout=RolloutPlan(max_model_len=512), agent=AgentPlan(max_turns=0))
    server = ChatServer(None, AutoTokenizer.from_pretrained(model_path), plan)
    loop.run_until_complete(server.start())
    yield server
    loop.run_until_complete(server.stop())


@pytest.fixture(scope="module")
def client(loop):
    client = httpx.AsyncClient(timeout=60)
    yield client
    loop.run_until_complete(client.aclose())


def drop(server, session) -> None:
    """close_session for the engine-free server (there is no generator to tell)."""
    session.closed = True
    server.sessions.pop(session.id, None)


def post(loop, client, url: str, body) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = loop.run_until_complete(client.post(url, content=content, headers={"content-type": "application/json"}))
    return response.status_code, response.json()


def error_message(api: str, answer: dict) -> str:
    """The message of an error in the API's own format (what the stock SDKs read)."""
    if api == ANTHROPIC:
        assert answer["type"] == "error" and isinstance(answer["error"]["type"], str)
        return answer["error"]["message"]
    return answer["error"]["message"]


# ---- fuzzed bodies ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` three times in four, else any JSON: most bodies get past the first checks to the deep ones."""
    return st.sampled_from([valid, valid, valid, json_values]).flatmap(lambda strategy: strategy)


texts = st.text(max_size=40)
openai_tool_call = st.fixed_dictionaries({
    "id": mostly(texts), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": mostly(texts), "arguments": mostly(texts | st.just('{"x": 1}'))}),
})
openai_message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant", "tool"])),
     "content": mostly(texts | st.lists(st.fixed_dictionaries({"type": mostly(st.just("text")), "text": mostly(texts)}),
                                        max_size=3))},
    optional={"tool_calls": mostly(st.lists(openai_tool_call, max_size=2)), "tool_call_id": json_values},
)
openai_tool = mostly(st.fixed_dictionaries({
    "type": mostly(st.just("function")),
    "function": st.fixed_dictionaries({"name": mostly(texts)}, optional={"description": mostly(texts),
                                                                         "parameters": json_values}),
}))
openai_body = st.fixed_dictionaries(
    {"model": mostly(st.just("tiny")), "messages": mostly(st.lists(openai_message, min_size=1, max_size=4))},
    optional={"tools": mostly(st.lists(openai_tool, max_size=2)), "max_tokens": mostly(st.integers(1, 64)),
              "temperature": mostly(st.just(1.0)), "tool_choice": mostly(st.just("auto"))},
)
anthropic_block = mostly(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(texts)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": mostly(texts), "name": mostly(texts),
                           "input": mostly(st.dictionaries(st.text(max_size=5), json_values, max_size=3))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": mostly(texts),
                           "content": mostly(texts | st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": mostly(texts)}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("image"), "source": json_values}),
))
anthropic_message = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "assistant"])),
    "content": mostly(texts | st.lists(anthropic_block, max_size=3)),
})
anthropic_tool = mostly(st.fixed_dictionaries({"name": mostly(texts), "input_schema": json_values},
                                              optional={"description": mostly(texts)}))
anthropic_body = st.fixed_dictionaries(
    {"model": mostly(st.just("tiny")), "messages": mostly(st.lists(anthropic_message, min_size=1, max_size=4))},
    optional={"max_tokens": mostly(st.integers(1, 64)), "system": mostly(texts),
              "tools": mostly(st.lists(anthropic_tool, max_size=2)), "tool_choice": mostly(st.just({"type": "auto"}))},
)
responses_item = mostly(st.one_of(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "developer", "system", "assistant"])),
                           "content": mostly(texts | st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]), "text": mostly(texts)}),
                               max_size=2))}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": mostly(texts), "name": mostly(texts),
                           "arguments": mostly(texts | st.just('{"x": 1}'))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": mostly(texts), "output": mostly(texts)}),
    st.fixed_dictionaries({"type": texts}),
))
responses_body = st.fixed_dictionaries(
    {"model": mostly(st.just("tiny")), "input": mostly(texts | st.lists(responses_item, min_size=1, max_size=4))},
    optional={"instructions": mostly(texts), "stream": mostly(st.booleans()), "previous_response_id": mostly(texts),
              "tools": mostly(st.lists(mostly(st.fixed_dictionaries({"type": st.just("function"), "name": mostly(texts),
                                                                     "parameters": json_values})), max_size=2)),
              "tool_choice": mostly(st.sampled_from(["auto", "none"])),
              "max_output_tokens": mostly(st.integers(1, 64))},
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_refused(loop, client, server, api: str, body) -> None:
    """`body` gets a 4xx with a message in the API's error format, and nothing is recorded."""
    session = server.open_session("fuzz", "fuzz")
    try:
        status, answer = post(loop, client, session.base_url + api, body)
        assert status in (400, 413), (status, answer)
        assert error_message(api, answer)
        assert not session.conversation.segments and session.turns == 0
    finally:
        drop(server, session)


@FUZZ
@given(body=mostly(openai_body))
def test_fuzzed_openai_bodies_get_a_4xx_with_a_message(loop, client, server, body):
    check_refused(loop, client, server, OPENAI, body)


@FUZZ
@given(body=mostly(anthropic_body))
def test_fuzzed_anthropic_bodies_get_a_4xx_with_a_message(loop, client, server, body):
    check_refused(loop, client, server, ANTHROPIC, body)


@FUZZ
@given(body=mostly(responses_body))
def test_fuzzed_responses_bodies_get_a_4xx_with_a_message(loop, client, server, body):
    check_refused(loop, client, server, RESPONSES, body)


@FUZZ
@given(body=st.binary(max_size=200))
def test_fuzzed_bytes_get_a_4xx_with_a_message(loop, client, server, body):
    check_refused(loop, client, server, OPENAI, body)


BAD_BYTES = [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),  # not UTF-8
    (b"[" * 100_000, "not valid JSON"),  # nested too deeply
    (b'{"model": ' + b"1" * 5000 + b"}", "not valid JSON"),  # an integer too long to convert
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]}).encode(),
     "not valid unicode"),
    (json.dumps({"model": "tiny", "messages": HELLO, "tools": 5}).encode(), "'tools' must be a list"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
     "messages[0].content[0].text must be a string"),
    (json.dumps({"model": "tiny", "messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}).encode(),
     ("messages[0].tool_calls must be a list", "agent.max_turns=0")),  # Anthropic has no tool_calls field
    (b" " * (MAX_BODY_BYTES + 1), f"over {MAX_BODY_BYTES} bytes"),
]


# The bodies that are not chat bodies, and Responses bodies with the same faults.
RESPONSES_BAD_BYTES = [(body, message) for body, message in BAD_BYTES if b'"messages"' not in body] + [
    (json.dumps({"model": "tiny", "input": [{"role": "user", "content": "a\ud800"}]}).encode(), "not valid unicode"),
    (json.dumps({"model": "tiny", "input": "hi", "tools": 5}).encode(), "'tools' must be a list"),
    (json.dumps({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
     .encode(), "content[0].text must be a string"),
    (json.dumps({"model": "tiny", "input": [{"type": "item_reference", "id": "msg_1"}]}).encode(),
     "input[0]: a 'item_reference' item is not supported"),
    (json.dumps({"model": "tiny", "input": "hi", "stream": "yes"}).encode(), "stream='yes' must be true or false"),
]


@pytest.mark.parametrize("api, body, message", [(api, body, message) for api in (OPENAI, ANTHROPIC)
                                                for body, message in BAD_BYTES]
                         + [(RESPONSES, body, message) for body, message in RESPONSES_BAD_BYTES])
def test_malformed_and_oversized_bodies_name_the_problem(loop, client, server, api, body, message):
    if isinstance(message, tuple):  # the OpenAI and the Anthropic reading differ
        message = message[api == ANTHROPIC]
    session = server.open_session("bad", "bad")
    status, answer = post(loop, client, session.base_url + api, body)
    assert 400 <= status < 500 and message in error_message(api, answer), answer
    if status == 413 and api == ANTHROPIC:
        assert answer["error"]["type"] == "request_too_large"
    drop(server, session)


def test_the_server_keeps_serving_other_sessions_after_bad_requests(loop, client, server):
    first, second = server.open_session("a", "g"), server.open_session("b", "g")
    for body in (b"{", b"[" * 10_000, {"model": "tiny", "messages": 5}, b"x" * (MAX_BODY_BYTES + 1)):
        assert post(loop, client, first.base_url + OPENAI, body)[0] in (400, 413)
    status, answer = post(loop, client, second.base_url + OPENAI, {"model": "tiny", "messages": HELLO})
    assert status == 400 and "agent.max_turns=0" in answer["error"]["message"]  # parsed, rendered, then refused
    health = loop.run_until_complete(client.get(f"http://127.0.0.1:{server.port}/health"))
    assert health.json() == {"status": "ok"}
    drop(server, first)
    drop(server, second)


# ---- bounds ----------------------------------------------------------------------------------------------


def test_requests_waiting_on_one_session_are_bounded(loop, client, server):
    """A session answers one request at a time; past MAX_REQUESTS_PER_SESSION in progress it answers 429."""
    session = server.open_session("busy", "g")
    body = {"model": "tiny", "messages": HELLO}

    async def flood():
        await session.lock.acquire()  # as if a request were generating
        sends = [asyncio.create_task(client.post(session.base_url + OPENAI, json=body))
                 for _ in range(MAX_REQUESTS_PER_SESSION + 3)]
        while session.requests < MAX_REQUESTS_PER_SESSION or sum(task.done() for task in sends) < 3:
            await asyncio.sleep(0.01)
        refused = [task.result() for task in sends if task.done()]
        session.lock.release()
        return refused, await asyncio.gather(*sends)

    refused, answers = loop.run_until_complete(asyncio.wait_for(flood(), 60))
    assert [r.status_code for r in refused] == [429] * 3
    assert "in progress" in refused[0].json()["error"]["message"]
    waited = [r for r in answers if r.status_code != 429]
    assert len(waited) == MAX_REQUESTS_PER_SESSION
    assert all(r.status_code == 400 and "agent.max_turns=0" in r.json()["error"]["message"] for r in waited)
    assert session.requests == 0
    drop(server, session)


def test_open_sessions_are_bounded(server, monkeypatch):
    monkeypatch.setattr(chat_server, "MAX_SESSIONS", len(server.sessions) + 2)
    sessions = [server.open_session(f"r{i}", "g") for i in range(2)]
    with pytest.raises(RuntimeError, match=r"chat sessions are open \(MAX_SESSIONS=\d+\); close each finished"):
        server.open_session("one too many", "g")
    drop(server, sessions.pop())
    sessions.append(server.open_session("again", "g"))
    for session in sessions:
        drop(server, session)


# ---- what a request can reach ----------------------------------------------------------------------------


def test_the_server_listens_on_loopback_only(server):
    assert [host for host, _ in server._runner.addresses] == ["127.0.0.1"]
    others = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for address in others:  # the same port on this machine's other addresses refuses connections
        with pytest.raises(OSError):
            socket.create_connection((address, server.port), timeout=2).close()


def test_session_ids_are_unguessable_and_admit_only_their_own_session(loop, client, server):
    sessions = [server.open_session(f"rollout-{i}", "g") for i in range(200)]
    ids = [s.id for s in sessions]
    assert len(set(ids)) == len(ids)
    alphabet = set(string.ascii_letters + string.digits + "-_")
    assert all(len(i) >= 22 and set(i) <= alphabet for i in ids)  # 16 random bytes, URL-safe base64
    assert not any(s.rollout_id in s.id for s in sessions)
    assert len({i[:4] for i in ids}) > 150  # no shared structure: prefixes spread like random ones
    target = sessions[0]
    body = {"model": "tiny", "messages": HELLO}
    for wrong in (target.id[:-1], target.id + "x", target.id.swapcase(), target.rollout_id, "%2e%2e"):
        status, answer = post(loop, client, f"http://127.0.0.1:{server.port}/s/{wrong}{OPENAI}", body)
        assert status == 404 and "unknown or finished session" in answer["error"]["message"], wrong
    traversal = f"http://127.0.0.1:{server.port}/s/../{target.id}{OPENAI}"
    assert loop.run_until_complete(client.post(traversal, json=body)).status_code == 404
    drop(server, target)
    assert post(loop, client, target.base_url + OPENAI, body)[0] == 404  # a finished session is gone
    for session in sessions[1:]:
        drop(server, session)


class Listener:
    """A TCP server on loopback that counts the connections anyone makes to it."""

    def __init__(self):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.connections = 0
        self.running = True
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while self.running:
            try:
                connection, _ = self.socket.accept()
                self.connections += 1
                connection.close()
            except OSError:
                pass

    def close(self):
        self.running = False
        self.thread.join()
        self.socket.close()


def test_nothing_in_a_request_or_a_row_is_fetched_or_read(loop, client, server, model_path, tmp_path):
    listener = Listener()
    url = f"http://127.0.0.1:{listener.port}/cat.png"
    openai_parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "file", "file": {"file_id": "file:///etc/passwd"}},
        {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}},
    ]
    anthropic_blocks = [
        {"type": "image", "source": {"type": "url", "url": url}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "document", "source": {"type": "url", "url": "file:///etc/passwd"}},
        {"type": "tool_result", "tool_use_id": "1",
         "content": [{"type": "image", "source": {"type": "url", "url": url}}]},
    ]
    session = server.open_session("fetch", "g")
    for part in openai_parts:
        body = {"model": "tiny", "messages": [{"role": "user", "content": [part]}]}
        status, answer = post(loop, client, session.base_url + OPENAI, body)
        message = answer["error"]["message"]
        assert status == 400 and ("must be a data URL" in message or "must be a text part" in message), part
    for block in anthropic_blocks:
        body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}
        status, answer = post(loop, client, session.base_url + ANTHROPIC, body)
        assert status == 400, block
    # a schema reference and template syntax are text for the model, nothing more
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": url}}}]
    body = {"model": "tiny", "messages": HELLO, "tools": tools}
    status, answer = post(loop, client, session.base_url + OPENAI, body)
    assert status == 400 and "agent.max_turns=0" in answer["error"]["message"]
    drop(server, session)

    rows = tmp_path / "rows.jsonl"
    image = {"type": "image_url", "image_url": {"url": url}}
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": [image]}]}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with pytest.raises(DataError, match="row 1: messages.0..content.0.: image_url.url must be a data URL"):
        load_dataset(Plan(data=DataPlan(train_path=str(rows))), calculator, tokenizer, "train", size=0)
    listener.close()
    assert listener.connections == 0

    injected = "{{ cycler.__init__.__globals__.os.popen('id').read() }} {% include '/etc/passwd' %}"
    prompt = render_prompt(tokenizer, normalize_messages([{"role": "user", "content": injected}], "t"), None)
    assert injected in tokenizer.decode(prompt)  # rendered as the literal text it is


# ---- concurrent requests on a real engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_server(local_ray, loop, model_path):
    # seeded requests: a rollout id's first turn samples the same reply again (test_stop_sequences_...)
    plan = Plan(model=ModelPlan(path=model_path), rollout=RolloutPlan(max_model_len=256, seed_requests=True),
                agent=AgentPlan(max_turns=50, max_tokens_per_turn=8))
    generator = loop.run_until_complete(Generator.start(plan))
    server = ChatServer(generator, AutoTokenizer.from_pretrained(model_path), plan)
    loop.run_until_complete(server.start())
    yield server
    loop.run_until_complete(server.stop())
    loop.run_until_complete(generator.shutdown())


def request(kind: str, question: str, reply: str = "") -> dict:
    messages = [{"role": "user", "content": question}]
    if kind == "bad":
        return {"model": "tiny", "messages": [{"role": "robot", "content": question}]}
    if kind == "extend":  # the next turn of the conversation whose first answer was `reply`
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Are you sure?"}]
    if kind.startswith("max_tokens"):
        return {"model": "tiny", "messages": messages, "max_tokens": int(kind.split("=")[1])}
    return {"model": "tiny", "messages": messages}


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(["same", "extend", "extend", "bad", "max_tokens=3"]), min_size=2, max_size=7))
def test_concurrent_requests_never_corrupt_a_session_trace(loop, client, engine_server, kinds):
    """After a first answer, requests sent at once to one session (and two to a neighbour) are answered one
    at a time: each answer is one engine call recorded exactly once, retries are not recorded again, each
    segment starts from a request's rendered prompt, and no session sees another's tokens."""
    server, tokenizer = engine_server, engine_server.tokenizer
    session, neighbour = server.open_session("mine", "g"), server.open_session("neighbour", "g")
    first = request("same", "What is 3 + 4?")
    answer = loop.run_until_complete(client.post(session.base_url + OPENAI, json=first))
    reply = answer.json()["choices"][0]["message"]["content"]
    sends = [(session, first, answer)]
    concurrent = [(session, request(kind, "What is 3 + 4?", reply)) for kind in kinds]
    concurrent += [(neighbour, request(kind, "What is 1 + 1?")) for kind in ("same", "max_tokens=2")]

    async def send_all():
        return await asyncio.gather(*(client.post(s.base_url + OPENAI, json=body) for s, body in concurrent))

    sends += [(s, body, a) for (s, body), a in zip(concurrent, loop.run_until_complete(send_all()))]
    server.close_session(session)
    server.close_session(neighbour)

    for target in (session, neighbour):
        mine = [(body, answer) for s, body, answer in sends if s is target]
        at_once = len(mine) - (target is session)
        for body, answer in mine:
            expected = 400 if body["messages"][0]["role"] == "robot" else 200
            assert answer.status_code == expected or (answer.status_code == 429 and at_once > MAX_REQUESTS_PER_SESSION)
        answered = [(body, answer.json()) for body, answer in mine if answer.status_code == 200]
        replies = {a["id"]: a["choices"][0]["message"]["content"] for _, a in answered}  # a retry repeats an id
        prompts = [render_prompt(tokenizer, normalize_messages(body["messages"], "t"), None) for body, _ in answered]
        segments = target.conversation.segments
        outputs = [output for segment in segments for output in segment.engine_outputs]
        assert len(outputs) == len(replies), "one recorded engine call per answer"
        decoded = sorted(tokenizer.decode(output, skip_special_tokens=True) for output in outputs)
        assert decoded == sorted(replies.values())
        for segment in segments:
            check_token_identity(segment)
            assert segment.rollout_id == target.rollout_id
            assert segment.token_ids[: segment.action_mask.index(True)] in prompts


def sse(response: httpx.Response) -> list[dict]:
    """The data of each server-sent event, [DONE] left out."""
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.slow
def test_stop_sequences_cut_the_text_and_keep_every_sampled_token(loop, client, engine_server):
    """The engine stops at a stop sequence: the agent gets the text before it (streamed here), the trace keeps
    every sampled id, and the next turn, whose prompt holds the cut text, continues from those ids: one
    segment, each sampled token trained once, no token the engine did not sample."""
    server, tokenizer = engine_server, engine_server.tokenizer
    free = server.open_session("stop", "g")
    answer = post(loop, client, free.base_url + OPENAI, {"model": "tiny", "messages": HELLO})[1]
    ids = free.conversation.segments[0].engine_outputs[0]
    server.close_session(free)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert answer["choices"][0]["message"]["content"] == text
    # a stop sequence the same (seeded) sample meets after its first token: the text of a later token
    stop = next(piece for k in range(1, len(ids))
                if (piece := tokenizer.decode(ids[: k + 1], skip_special_tokens=True)[
                    len(tokenizer.decode(ids[:k], skip_special_tokens=True)):]).strip())
    needed = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))

    session = server.open_session("stop", "g")  # the same rollout id: the same seed
    body = {"model": "tiny", "max_tokens": 8, "messages": HELLO, "stop_sequences": [stop], "stream": True}
    events = sse(loop.run_until_complete(client.post(session.base_url + ANTHROPIC, json=body)))
    streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    final = next(e for e in events if e["type"] == "message_delta")
    assert streamed == text[: text.index(stop)]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    [segment] = session.conversation.segments
    assert segment.engine_outputs == [ids[:needed]], "the engine stopped on the token completing the stop sequence"

    follow_up = {"model": "tiny", "messages": HELLO + [{"role": "assistant", "content": streamed},
                                                       {"role": "user", "content": "Go on."}], "stop": [stop, "\n"]}
    status, answer = post(loop, client, session.base_url + OPENAI, follow_up)
    server.close_session(session)
    assert status == 200
    [segment] = session.conversation.segments  # the cut text did not break the token trace
    first_prompt = segment.token_ids[: segment.action_mask.index(True)]
    second_start = len(first_prompt) + needed
    assert segment.token_ids[:second_start] == first_prompt + ids[:needed]  # all sampled ids, as context now
    assert segment.action_mask[second_start:].count(True) == len(segment.engine_outputs[1])  # trained once
    check_token_identity(segment)
    reply = tokenizer.decode(segment.engine_outputs[1], skip_special_tokens=True)
    cut = min([reply.index(s) for s in (stop, "\n") if s in reply], default=len(reply))
    assert answer["choices"][0]["message"]["content"] == reply[:cut]


@pytest.mark.slow
def test_responses_continue_within_their_rollout_only(loop, client, engine_server):
    """previous_response_id continues a rollout's conversation (streamed or not, one segment); another rollout
    cannot name it: a 400 in the API's format, and neither trace changes."""
    server = engine_server
    mine, other = server.open_session("responses", "g"), server.open_session("other", "g")
    body = {"model": "tiny", "input": [{"role": "developer", "content": "Answer briefly."},
                                       {"role": "user", "content": "What is 3 + 4?"}], "stream": True}
    events = sse(loop.run_until_complete(client.post(mine.base_url + RESPONSES, json=body)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                              "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    first = events[-1]["response"]["id"]
    status, answer = post(loop, client, mine.base_url + RESPONSES,
                          {"model": "tiny", "input": "Are you sure?", "previous_response_id": first})
    assert status == 200 and answer["previous_response_id"] == first
    [segment] = mine.conversation.segments
    trace = list(segment.token_ids)
    assert len(segment.engine_outputs) == 2
    for session in (other, mine):
        for resume in (first, answer["id"]):
            status, refused = post(loop, client, session.base_url + RESPONSES, {
                "model": "tiny", "input": "Again", "previous_response_id": resume + ("" if session is other else "x")})
            assert status == 400 and "is not a response of this rollout" in refused["error"]["message"]
    assert not other.conversation.segments and segment.token_ids == trace and len(mine.conversation.segments) == 1
    server.close_session(mine)
    server.close_session(other)


# ---- no credentials in MLflow ----------------------------------------------------------------------------


def test_redact_masks_credential_keys_only():
    tree = {"hf_token": "a", "OPENAI_API_KEY": "b", "x-api-key": "c", "client_secret": "d", "db_password": "e",
            "Authorization": "f", "max_tokens_per_turn": 16, "tokenizer": "t", "keys": ["k"],
            "nested": [{"access_key": "g"}], "overrides": "seed=1,+rollout.engine_args.hf_token=h,note=x"}
    assert redact(tree) == {
        "hf_token": REDACTED, "OPENAI_API_KEY": REDACTED, "x-api-key": REDACTED, "client_secret": REDACTED,
        "db_password": REDACTED, "Authorization": REDACTED, "max_tokens_per_turn": 16, "tokenizer": "t",
        "keys": ["k"], "nested": [{"access_key": REDACTED}],
        "overrides": f"seed=1,+rollout.engine_args.hf_token={REDACTED},note=x"}


def test_credentials_never_reach_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps its artifacts under ./mlruns
    store = f"sqlite:///{tmp_path}/mlflow.db"
    plan = Plan()
    plan.logger.mlflow.tracking_uri = store
    plan.rollout.engine_args = {"hf_token": "hf_SECRET1", "max_num_seqs": 8}
    plan.logger.mlflow.tags = {"api_key": "sk-SECRET2", "team": "rl"}
    run_dir = tmp_path / "run"
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    override = "+rollout.engine_args.hf_token=hf_SECRET1"
    (hydra / "overrides.yaml").write_text(f"- {override}\n- seed=1\n")
    (hydra / "config.yaml").write_text("rollout:\n  engine_args:\n    hf_token: hf_SECRET1\nseed: 1\n")
    (hydra / "hydra.yaml").write_text(f"hydra:\n  job:\n    override_dirname: {override},seed=1\n"
                                      f"  overrides:\n    task:\n    - {override}\n")
    tracker = Tracker(plan, str(run_dir))
    tracker.finish()

    client = MlflowClient(store)
    run = client.get_run(tracker.run_id)
    assert run.data.params["rollout.engine_args.hf_token"] == REDACTED
    assert run.data.params["rollout.engine_args.max_num_seqs"] == "8"
    assert run.data.tags["api_key"] == REDACTED and run.data.tags["team"] == "rl"
    assert not [v for v in {**run.data.params, **run.data.tags}.values() if "SECRET" in v]
    downloaded = Path(client.download_artifacts(tracker.run_id, "", str(tmp_path / "artifacts")))
    files = {p.relative_to(downloaded).as_posix(): p.read_text() for p in downloaded.rglob("*") if p.is_file()}
    assert {"plan.json", "plan.yaml", "hydra/overrides.yaml", "hydra/config.yaml", "hydra/hydra.yaml"} <= set(files)
    assert not [name for name, text in files.items() if "SECRET" in text]
    assert f"+rollout.engine_args.hf_token={REDACTED}" in files["hydra/overrides.yaml"]
    assert "seed=1" in files["hydra/overrides.yaml"]
    # the run directory keeps the plan as it was, so `molt-reproduce <run dir>` can relaunch it
    assert json.loads((run_dir / "plan.json").read_text())["rollout"]["engine_args"]["hf_token"] == "hf_SECRET1"
