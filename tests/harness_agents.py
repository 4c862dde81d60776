"""ChatAgents written with real agent harnesses, as their users write them, pointed at ctx.base_url: the
OpenAI Agents SDK with its default Responses model (streamed) and with its chat-completions model,
LangChain's ChatOpenAI(streaming=True) with a bound tool, and the Anthropic SDK's messages.stream. Each
offers the calculator and answers the row's question; the row's label names the harness, and `dataset`
cycles through them, so one training run trains all four side by side."""

from __future__ import annotations

import json

from agents import (Agent, FunctionTool, MaxTurnsExceeded, ModelBehaviorError, OpenAIChatCompletionsModel,
                    OpenAIResponsesModel, RunConfig, Runner)
from anthropic import AsyncAnthropic
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import arithmetic
from molt.agents.calculator import TOOLS, calculate

HARNESSES = ("agents_responses", "agents_chat", "langchain", "anthropic_stream")
CALCULATOR = TOOLS[0]["function"]
MAX_TURNS = 3


def dataset(split: str, size: int, seed: int) -> list[dict]:
    """The question the test model was taught to use the calculator on (tests/test_agent.py)."""
    return [{"messages": [{"role": "user", "content": "What is 3 + 4?"}],
             "label": {"answer": 7, "harness": HARNESSES[i % len(HARNESSES)]}} for i in range(size)]


def run_calculator(arguments: dict) -> str:
    try:
        return str(calculate(str(arguments.get("expression", ""))))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


class HarnessAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        harness = ctx.row["label"]["harness"]
        self.tool_calls = 0
        answer = await getattr(self, harness)(ctx, ctx.row["messages"][0]["content"])
        result = arithmetic.grade(answer, ctx.row["label"]["answer"])
        result.info.update({"tool_calls": self.tool_calls, f"harness/{harness}": 1.0})
        return result

    def calculator(self, arguments: dict) -> str:
        self.tool_calls += 1
        return run_calculator(arguments)

    async def agents(self, model, question: str, streamed: bool) -> str:
        async def invoke(_, arguments: str) -> str:
            return self.calculator(json.loads(arguments))

        tool = FunctionTool(name=CALCULATOR["name"], description=CALCULATOR["description"],
                            params_json_schema=CALCULATOR["parameters"], on_invoke_tool=invoke,
                            strict_json_schema=False)
        agent = Agent(name="calculator", model=model, tools=[tool])
        config = RunConfig(tracing_disabled=True)  # the SDK would export traces to OpenAI's servers
        try:
            if streamed:
                result = Runner.run_streamed(agent, question, max_turns=MAX_TURNS, run_config=config)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(agent, question, max_turns=MAX_TURNS, run_config=config)
        except (MaxTurnsExceeded, ModelBehaviorError):  # e.g. a call to a tool it was not offered: reward 0
            return ""
        return str(result.final_output or "")

    async def agents_responses(self, ctx: ChatContext, question: str) -> str:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        return await self.agents(OpenAIResponsesModel(ctx.model_name, client), question, streamed=True)

    async def agents_chat(self, ctx: ChatContext, question: str) -> str:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        return await self.agents(OpenAIChatCompletionsModel(ctx.model_name, client), question, streamed=False)

    async def langchain(self, ctx: ChatContext, question: str) -> str:
        llm = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key, streaming=True)
        llm = llm.bind_tools(TOOLS)
        messages = [HumanMessage(question)]
        for _ in range(MAX_TURNS):
            reply = await llm.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            messages += [ToolMessage(self.calculator(call["args"]), tool_call_id=call["id"])
                         for call in reply.tool_calls]
        return reply.text

    async def anthropic_stream(self, ctx: ChatContext, question: str) -> str:
        client = AsyncAnthropic(base_url=ctx.base_url, api_key=ctx.api_key)
        tools = [{"name": CALCULATOR["name"], "description": CALCULATOR["description"],
                  "input_schema": CALCULATOR["parameters"]}]
        messages = [{"role": "user", "content": question}]
        for _ in range(MAX_TURNS):
            async with client.messages.stream(model=ctx.model_name, max_tokens=64, messages=messages,
                                              tools=tools) as stream:
                message = await stream.get_final_message()
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                              for block in message.content]})
            calls = [block for block in message.content if block.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": self.calculator(call.input)}
                for call in calls]})
        return "".join(block.text for block in message.content if block.type == "text")


AgentRunner = HarnessAgent
