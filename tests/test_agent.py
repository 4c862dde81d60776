"""The agent contract on the real vLLM-CPU engine: Env single- and multi-turn, ChatAgents through the stock
openai and anthropic SDKs (multi-turn, with tool calls), identical engine inputs for both forms on one
row, compaction segments, retries, failures; plus pure-logic tests of the token accumulation.

The engine serves the tiny model after a few seconds of supervised fine-tuning on one conversation,
so that greedy decoding really calls the calculator for QUESTION and then answers 7: the tool round trip
is the model's own, through the real engine.
"""

import asyncio
import json
import re
import types
from dataclasses import dataclass

import anthropic
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.agent import ChatAgent, Env, Result, RolloutFailed, load_agent, run_chat_rollout, run_env_rollout
from molt.agents import anthropic_chat, arithmetic, calculator, colors, openai_chat
from molt.agents.calculator import TOOLS
from molt.chat_server import ChatServer
from molt.data import Conversation, DataError, image_data_url, load_dataset, normalize_messages, render_prompt
from molt.generator import Generator
from molt.plan import AgentPlan, DataPlan, ModelPlan, Plan, RolloutPlan
from molt.tiny import build_tiny
from molt.trace import Sample, check_token_identity

QUESTION = "What is 3 + 4?"
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
TOOL_RESULT_TURN = "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
TOOL_ROW = {"messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS, "label": 7}


def teach_tool_use(base: str, out: str) -> str:
    """Fine-tune `base` until greedy decoding answers QUESTION with TOOL_CALL and the tool's "7" with "7"."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    call = encode(TOOL_CALL + "<|im_end|>")
    examples = [(encode(prompt), call), (encode(prompt) + call + encode(TOOL_RESULT_TURN), encode("7<|im_end|>"))]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(300):
        loss, greedy_ok = 0.0, True
        for prompt_ids, target in examples:
            ids = torch.tensor([prompt_ids + target])
            labels = ids.clone()
            labels[0, : len(prompt_ids)] = -100
            output = model(input_ids=ids, labels=labels)
            loss = loss + output.loss
            greedy_ok &= output.logits[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist() == target
        if greedy_ok and loss.item() < 0.05:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    assert greedy_ok, "fine-tuning did not teach the tool call"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_plan(path: str, **agent) -> Plan:
    return Plan(
        model=ModelPlan(path=path),
        rollout=RolloutPlan(max_model_len=512, top_k=1),  # greedy: the fine-tuned answers are reproducible
        agent=AgentPlan(**{"max_turns": 3, "max_tokens_per_turn": 48, "timeout_s": 120.0, **agent}),
        data=DataPlan(max_prompt_tokens=400),
    )


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@dataclass
class Engine:
    """The fine-tuned tiny model on one real engine, with a started chat server in front of it."""

    loop: asyncio.AbstractEventLoop
    plan: Plan
    generator: Generator
    tokenizer: object
    server: ChatServer

    def env(self, env_cls, row, plan=None, rollout_id="env"):
        plan = plan or self.plan
        coroutine = run_env_rollout(env_cls, row, self.generator, self.tokenizer, plan, rollout_id, "group")
        return self.loop.run_until_complete(coroutine)

    def chat(self, agent_cls, row, plan=None, rollout_id="chat"):
        coroutine = run_chat_rollout(agent_cls, row, self.server, plan or self.plan, rollout_id, "group")
        return self.loop.run_until_complete(coroutine)

    def env_row(self, row, tmp_path):
        """`row` as the dataset delivers it to an Env: through a JSONL file and load_dataset."""
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps(row) + "\n")
        plan = make_plan(self.plan.model.path)
        plan.data.train_path = str(path)
        return load_dataset(plan, calculator, self.tokenizer, "train", size=1)[0]


@pytest.fixture(scope="module")
def engine(local_ray, loop, tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    path = teach_tool_use(build_tiny("dense", str(models / "base")), str(models / "tool_user"))
    plan = make_plan(path)
    generator = loop.run_until_complete(Generator.start(plan))
    tokenizer = AutoTokenizer.from_pretrained(path)
    server = ChatServer(generator, tokenizer, plan)
    loop.run_until_complete(server.start())
    yield Engine(loop, plan, generator, tokenizer, server)
    loop.run_until_complete(server.stop())
    loop.run_until_complete(generator.shutdown())


def actions(segment, tokenizer) -> list[str]:
    return [tokenizer.decode(ids) for ids in segment.engine_outputs]


def prompt_of(segment) -> list[int]:
    """The ids of the segment's first engine request."""
    return segment.token_ids[: segment.action_mask.index(True)]


@pytest.mark.slow
def test_env_single_turn_default_task(engine):
    plan = make_plan(engine.plan.model.path, max_turns=1, max_tokens_per_turn=8)
    row = load_dataset(plan, arithmetic, engine.tokenizer, "train", size=2)[0]
    [segment] = engine.env(arithmetic.AgentRunner, row, plan)
    assert prompt_of(segment) == row["prompt_ids"]
    assert len(segment.engine_outputs) == 1 and 1 <= segment.num_actions <= 8
    answer = engine.tokenizer.decode(segment.engine_outputs[0], skip_special_tokens=True)
    assert segment.reward == arithmetic.grade(answer, row["label"]).reward
    assert segment.info["correct"] == (segment.reward == 1.0)
    assert all(v == 0 for v, a in zip(segment.versions, segment.action_mask) if a)


@pytest.mark.slow
def test_env_multi_turn_tool_call(engine, tmp_path):
    row = engine.env_row(TOOL_ROW, tmp_path)
    [segment] = engine.env(calculator.AgentRunner, row)
    assert actions(segment, engine.tokenizer) == [TOOL_CALL + "<|im_end|>", "7<|im_end|>"]
    assert segment.reward == 1.0 and segment.info == {"correct": True, "tool_calls": 1}
    assert not segment.truncated
    # The tool result is context between the two actions, rendered by the chat template.
    first_action_end = segment.action_mask.index(True) + len(segment.engine_outputs[0])
    between = segment.token_ids[first_action_end : len(segment.token_ids) - len(segment.engine_outputs[1])]
    assert engine.tokenizer.decode(between) == TOOL_RESULT_TURN
    assert not any(segment.action_mask[first_action_end : first_action_end + len(between)])
    check_token_identity(segment)


@pytest.mark.slow
def test_openai_agent_sends_the_env_token_ids(engine, tmp_path):
    """Same row, both forms: identical engine inputs on every turn, so identical token traces."""
    [env_segment] = engine.env(calculator.AgentRunner, engine.env_row(TOOL_ROW, tmp_path))
    [chat_segment] = engine.chat(openai_chat.AgentRunner, {k: v for k, v in TOOL_ROW.items() if k != "tools"})
    assert prompt_of(chat_segment) == prompt_of(env_segment)
    assert chat_segment.token_ids == env_segment.token_ids
    assert chat_segment.action_mask == env_segment.action_mask
    assert chat_segment.engine_outputs == env_segment.engine_outputs
    assert chat_segment.reward == 1.0 and chat_segment.info == {"correct": True, "tool_calls": 1}
    assert chat_segment.rollout_id == "chat" and chat_segment.segment == 0


class AnthropicToolAgent(ChatAgent):
    """The calculator round trip through the stock anthropic SDK (tool_use / tool_result blocks)."""

    async def run(self, ctx):
        client = anthropic.AsyncAnthropic(base_url=ctx.base_url, api_key=ctx.api_key)
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in TOOLS]
        messages = list(ctx.row["messages"])
        first = await client.messages.create(model=ctx.model_name, max_tokens=64, messages=messages, tools=tools)
        assert first.stop_reason == "tool_use"
        [call] = [block for block in first.content if block.type == "tool_use"]
        output = str(calculator.calculate(call.input["expression"]))
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": output}]}]
        final = await client.messages.create(model=ctx.model_name, max_tokens=64, messages=messages, tools=tools)
        return arithmetic.grade(final.content[0].text, ctx.row["label"])


@pytest.mark.slow
def test_anthropic_agent_tool_round_trip(engine, tmp_path):
    [env_segment] = engine.env(calculator.AgentRunner, engine.env_row(TOOL_ROW, tmp_path))
    [segment] = engine.chat(AnthropicToolAgent, {"messages": TOOL_ROW["messages"], "label": 7})
    assert actions(segment, engine.tokenizer) == [TOOL_CALL + "<|im_end|>", "7<|im_end|>"]
    assert segment.token_ids == env_segment.token_ids
    assert segment.reward == 1.0


@pytest.mark.slow
def test_anthropic_example_sends_the_dataset_prompt(engine):
    """Rows without tools, four rollouts at once: the chat server renders each row as the dataset does for
    an Env, and concurrent sessions keep their traces apart."""
    plan = make_plan(engine.plan.model.path)
    rows = load_dataset(plan, arithmetic, engine.tokenizer, "train", size=4)

    async def rollouts():
        return await asyncio.gather(*(
            run_chat_rollout(anthropic_chat.AgentRunner, {k: v for k, v in row.items() if k != "prompt_ids"},
                             engine.server, plan, f"chat-{i}", "group")
            for i, row in enumerate(rows)
        ))

    results = engine.loop.run_until_complete(rollouts())
    for i, (row, [segment]) in enumerate(zip(rows, results)):
        assert segment.rollout_id == f"chat-{i}" and prompt_of(segment) == row["prompt_ids"]
        assert len(segment.engine_outputs) == 1 and segment.reward in (0.0, 1.0) and "correct" in segment.info


class CompactingAgent(ChatAgent):
    """Two turns of one conversation, then a rewritten (summarised) history."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        ask = lambda messages: client.chat.completions.create(model=ctx.model_name, messages=messages)  # noqa: E731
        messages = list(ctx.row["messages"])
        first = await ask(messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Are you sure?"}]
        await ask(messages)
        await ask([{"role": "system", "content": "Summary: the user asked for 3 + 4."},
                   {"role": "user", "content": "Answer now."}])
        return Result(reward=0.5, info={"compacted": 1})


@pytest.mark.slow
def test_compaction_opens_a_new_segment(engine):
    segments = engine.chat(CompactingAgent, {"messages": [{"role": "user", "content": QUESTION}]})
    assert [s.segment for s in segments] == [0, 1]
    assert {s.rollout_id for s in segments} == {"chat"} and {s.reward for s in segments} == {0.5}
    assert [len(s.engine_outputs) for s in segments] == [2, 1]
    compacted = normalize_messages([{"role": "system", "content": "Summary: the user asked for 3 + 4."},
                                    {"role": "user", "content": "Answer now."}], "test")
    assert prompt_of(segments[1]) == render_prompt(engine.tokenizer, compacted, None)
    # The second turn of segment 0 continued from the exact ids of the first.
    first_turn = prompt_of(segments[0]) + segments[0].engine_outputs[0]
    assert segments[0].token_ids[: len(first_turn)] == first_turn


class RetryingAgent(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        request = dict(model=ctx.model_name, messages=ctx.row["messages"], max_tokens=4)
        first, again = await client.chat.completions.create(**request), await client.chat.completions.create(**request)
        assert first.model_dump() == again.model_dump()
        return Result(reward=1.0)


@pytest.mark.slow
def test_identical_retry_is_idempotent(engine):
    [segment] = engine.chat(RetryingAgent, {"messages": [{"role": "user", "content": QUESTION}]})
    assert len(segment.engine_outputs) == 1 and segment.num_actions <= 4


class OverlongAgent(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.row["messages"], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="context overflow"):
            await client.chat.completions.create(
                model=ctx.model_name, messages=[{"role": "user", "content": "7 " * 600}])
        return Result(reward=1.0)


@pytest.mark.slow
def test_context_overflow_is_a_400_and_marks_truncation(engine):
    [segment] = engine.chat(OverlongAgent, {"messages": [{"role": "user", "content": QUESTION}]})
    assert segment.truncated and len(segment.engine_outputs) == 1


class AskForever(ChatAgent):
    base_urls = []

    async def run(self, ctx):
        self.base_urls.append(ctx.base_url)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        for attempt in range(10):
            messages = ctx.row["messages"] + [{"role": "user", "content": f"Attempt {attempt}"}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=1)


@pytest.mark.slow
def test_turn_budget_and_session_end(engine):
    with pytest.raises(RolloutFailed, match="BadRequestError.*agent.max_turns=3"):
        engine.chat(AskForever, {"messages": [{"role": "user", "content": QUESTION}]})
    # The rollout is over: its URL is gone.
    client = openai.AsyncOpenAI(base_url=AskForever.base_urls[-1], api_key="molt", max_retries=0)
    request = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="unknown or finished session"):
        engine.loop.run_until_complete(request)


class EchoEnv(Env):
    """Never done: answers every action with another question."""

    async def step(self, action, turn):
        return Result(reward=0.25, observation=f"Turn {turn} done. Again?", info={"turn": turn})


@pytest.mark.slow
def test_env_runs_out_of_turns(engine):
    messages = [{"role": "user", "content": QUESTION}]
    row = {"messages": messages, "prompt_ids": render_prompt(engine.tokenizer, messages, None)}
    [segment] = engine.env(EchoEnv, row, make_plan(engine.plan.model.path, max_turns=3, max_tokens_per_turn=4))
    assert len(segment.engine_outputs) == 3 and segment.truncated
    assert segment.reward == 0.75 and segment.info == {"turn": 2}
    assert "Turn 1 done. Again?" in engine.tokenizer.decode(segment.token_ids)


class RaisingEnv(Env):
    async def step(self, action, turn):
        raise KeyError("label")


class RaisingAgent(ChatAgent):
    async def run(self, ctx):
        raise RuntimeError("tool crashed")


class SlowAgent(ChatAgent):
    async def run(self, ctx):
        await asyncio.sleep(5)


class WrongReturnAgent(ChatAgent):
    async def run(self, ctx):
        return 1.0


@pytest.mark.slow
def test_agent_failures_are_reported_not_raised(engine):
    row = {"messages": [{"role": "user", "content": QUESTION}]}
    env_row = {**row, "prompt_ids": render_prompt(engine.tokenizer, normalize_messages(row["messages"], "t"), None)}
    with pytest.raises(RolloutFailed, match=r"RaisingEnv.step raised KeyError: 'label'"):
        engine.env(RaisingEnv, env_row)
    with pytest.raises(RolloutFailed, match="RaisingAgent.run raised RuntimeError: tool crashed"):
        engine.chat(RaisingAgent, row)
    with pytest.raises(RolloutFailed, match="ran over agent.timeout_s=0.2"):
        engine.chat(SlowAgent, row, make_plan(engine.plan.model.path, timeout_s=0.2))
    with pytest.raises(RolloutFailed, match="returned float, not a molt.agent.Result"):
        engine.chat(WrongReturnAgent, row)


# Pure logic: the token accumulation with hand-made samples, and loading agents.


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny("dense", str(tmp_path_factory.mktemp("tok") / "dense")))


def sample(tokenizer, text, finish="stop"):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Sample(ids, [-0.5] * len(ids), [3] * len(ids), finish)


def test_conversation_reuses_sampled_ids_and_renders_only_new_messages(tokenizer):
    conversation = Conversation(tokenizer, "r", "g")
    messages = [{"role": "user", "content": QUESTION}]
    prompt = conversation.prompt_for(messages, None)
    # The sampled ids are not what re-tokenizing the reply's text gives: they must survive as they are.
    odd = Sample([tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id], [-0.1, -0.2], [0, 0], "stop")
    conversation.add_turn(messages, None, prompt, odd, {"role": "assistant", "content": "7"})
    messages = conversation.messages + [{"role": "user", "content": "Sure?"}]
    second = conversation.prompt_for(messages, None)
    assert second[: len(prompt) + 2] == prompt + odd.token_ids
    assert tokenizer.decode(second[len(prompt) + 2 :]) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    conversation.add_turn(messages, None, second, sample(tokenizer, "Yes"), {"role": "assistant", "content": "Yes"})
    [segment] = conversation.segments
    assert segment.engine_outputs == [odd.token_ids, tokenizer.encode("Yes", add_special_tokens=False)]


def test_conversation_closes_a_cut_off_reply_and_segments_on_rewrites(tokenizer):
    conversation = Conversation(tokenizer, "r", "g")
    messages = [{"role": "user", "content": QUESTION}]
    prompt = conversation.prompt_for(messages, None)
    cut = sample(tokenizer, "The answer", finish="length")
    conversation.add_turn(messages, None, prompt, cut, {"role": "assistant", "content": "The answer"})
    messages = conversation.messages + [{"role": "user", "content": "Go on"}]
    second = conversation.prompt_for(messages, None)
    assert tokenizer.decode(second[len(prompt) + len(cut.token_ids):]).startswith("<|im_end|>\n<|im_start|>user")
    seven = {"role": "assistant", "content": "7"}
    conversation.add_turn(messages, None, second, sample(tokenizer, "7<|im_end|>"), seven)
    # Dropping the first turn (compaction) starts segment 1 from a fresh rendering.
    compacted = [{"role": "user", "content": "Go on"}]
    third = conversation.prompt_for(compacted, None)
    assert third == render_prompt(tokenizer, compacted, None)
    conversation.add_turn(compacted, None, third, sample(tokenizer, "7<|im_end|>"), seven)
    assert [len(s.engine_outputs) for s in conversation.segments] == [2, 1]
    # Changing the tools also re-renders the whole conversation.
    extended = conversation.messages + [{"role": "user", "content": "More"}]
    assert conversation.prompt_for(extended, TOOLS) == render_prompt(tokenizer, extended, TOOLS)


def test_conversation_without_chat_template_appends_raw_text(tokenizer):
    """data.apply_chat_template=false (base models): contents are tokenized as they are."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    conversation = Conversation(tokenizer, "r", "g", chat_template=False)
    messages = [{"role": "user", "content": "3 + 4 ="}]
    prompt = conversation.prompt_for(messages, None)
    assert prompt == encode("3 + 4 =")
    conversation.add_turn(messages, None, prompt, sample(tokenizer, " 7"), {"role": "assistant", "content": " 7"})
    more = conversation.messages + [{"role": "user", "content": "\n5 + 1 ="}]
    assert conversation.prompt_for(more, None) == prompt + encode(" 7") + encode("\n5 + 1 =")


def test_load_agent_checks_the_form(tmp_path):
    assert load_agent("molt.agents.arithmetic", "env").AgentRunner is arithmetic.AgentRunner
    with pytest.raises(TypeError, match="AgentRunner is not a ChatAgent .*set agent.form=env"):
        load_agent("molt.agents.calculator", "chat")
    path = tmp_path / "my_agent.py"
    path.write_text("from molt.agent import ChatAgent\nclass AgentRunner(ChatAgent):\n    pass\n")
    assert issubclass(load_agent(str(path), "chat").AgentRunner, ChatAgent)
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="exports no AgentRunner"):
        load_agent(str(tmp_path / "empty.py"), "env")
    with pytest.raises(ValueError, match="agent.form='gym'"):
        load_agent("molt.agents.arithmetic", "gym")


def test_default_task_and_calculator():
    rows = arithmetic.dataset("train", 50, seed=1)
    assert rows == arithmetic.dataset("train", 50, seed=1) != arithmetic.dataset("eval", 50, seed=1)
    assert all(0 <= row["label"] <= 18 for row in rows)
    assert arithmetic.grade("It is 12, not 13", 12).reward == 1.0
    assert arithmetic.grade("13", 12).info == {"correct": False}
    assert calculator.calculate("3 + 4 * (2 - 5)") == -9
    with pytest.raises(ValueError, match="unsupported expression"):
        calculator.calculate("__import__('os')")
    env = calculator.AgentRunner({**calculator.dataset("train", 1, 0)[0], "label": 7})
    result = asyncio.run(env.step(TOOL_CALL, 0))
    assert result.observation == [{"role": "tool", "content": "7"}] and not result.terminated
    result = asyncio.run(env.step("7", 1))
    assert result.reward == 1.0 and result.info == {"correct": True, "tool_calls": 1}


def write_rows(tmp_path, *lines) -> Plan:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return Plan(data=DataPlan(train_path=str(path), max_prompt_tokens=64))


GOOD = {"messages": [{"role": "user", "content": QUESTION}], "label": 7}
PNG = image_data_url(colors.image("red"))


@pytest.mark.parametrize("bad, message", [
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "row 2: messages[0].content[0] must be a text part"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool": []}, "row 2: unknown field 'tool'"),
    ({"messages": []}, "row 2: 'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "row 2: messages[0].role is None"),
    ({**GOOD, "tools": [{"type": "function"}]}, "row 2: tools[0] must look like"),
    ({**GOOD, "images": ["cat.png"]}, "row 2: unknown field 'images'"),  # images are content parts
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]},
     "row 2: field 'messages' has images, but model=tiny is not multimodal"),
    ({"messages": [{"role": "user", "content": "7 " * 100}]},
     "row 2: field 'messages' renders to 208 prompt tokens, over data.max_prompt_tokens=64"),
    ("{oops", "row 2: not valid JSON"),
])
def test_bad_rows_name_the_row_and_field(tokenizer, tmp_path, bad, message):
    plan = write_rows(tmp_path, GOOD, bad)
    with pytest.raises(DataError, match=re.escape(message)):
        load_dataset(plan, calculator, tokenizer, "train", size=0)
    if bad != "{oops":
        plan.data.bad_rows = "skip"
        assert [row["label"] for row in load_dataset(plan, calculator, tokenizer, "train", size=0)] == [7]


def test_rows_render_once_for_an_env_and_not_for_a_chat_agent(tokenizer, tmp_path):
    plan = write_rows(tmp_path, GOOD, {**GOOD, "tools": TOOLS})
    plan.data.max_prompt_tokens = 400
    env_rows = load_dataset(plan, calculator, tokenizer, "train", size=0)
    assert env_rows[0]["prompt_ids"] == tokenizer.apply_chat_template(GOOD["messages"], add_generation_prompt=True,
                                                                      return_dict=False)
    assert env_rows[1]["prompt_ids"] == render_prompt(tokenizer, GOOD["messages"], TOOLS)
    plan.agent.form = "chat"
    assert load_dataset(plan, calculator, tokenizer, "train", size=0) == [GOOD, {**GOOD, "tools": TOOLS}]
    built_in = load_dataset(Plan(), arithmetic, tokenizer, "train", size=3)
    assert len(built_in) == 3 and all(len(row["prompt_ids"]) <= 64 for row in built_in)
    with pytest.raises(DataError, match="data.train_path is not set and agent module .* has no dataset"):
        load_dataset(Plan(), types.ModuleType("no_dataset"), tokenizer, "train", size=3)
