"""A ChatAgent using the stock anthropic SDK: one question, one answer, graded like the default task."""

from __future__ import annotations

from anthropic import AsyncAnthropic

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import arithmetic

dataset = arithmetic.dataset


class AnthropicChatAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.base_url, api_key=ctx.api_key)
        response = await client.messages.create(model=ctx.model_name, max_tokens=64, messages=ctx.row["messages"])
        answer = "".join(block.text for block in response.content if block.type == "text")
        return arithmetic.grade(answer, ctx.row["label"])


AgentRunner = AnthropicChatAgent
