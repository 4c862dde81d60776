"""A ChatAgent using the stock openai SDK: it offers the model a calculator, runs the calls the model
makes, sends back the results, and grades the final answer like the default task."""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import arithmetic
from molt.agents.calculator import TOOLS, calculate

dataset = arithmetic.dataset


class OpenAIChatAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = list(ctx.row["messages"])
        tool_calls = 0
        while True:
            response = await client.chat.completions.create(model=ctx.model_name, messages=messages, tools=TOOLS)
            message = response.choices[0].message
            if not message.tool_calls or tool_calls >= 2:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                tool_calls += 1
                try:
                    output = str(calculate(json.loads(call.function.arguments).get("expression", "")))
                except (ValueError, SyntaxError, ZeroDivisionError) as e:
                    output = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        result = arithmetic.grade(message.content or "", ctx.row["label"])
        result.info["tool_calls"] = tool_calls
        return result


AgentRunner = OpenAIChatAgent
