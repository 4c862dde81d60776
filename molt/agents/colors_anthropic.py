"""The colours task (molt/agents/colors.py) as a ChatAgent on the stock anthropic SDK: the row's image
goes to the loopback server as a base64 image block."""

from __future__ import annotations

from anthropic import AsyncAnthropic

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import colors

dataset = colors.dataset


def _block(part: dict) -> dict:
    """An OpenAI content part of a colours row -> the Anthropic block."""
    if part["type"] == "text":
        return part
    media_type, data = part["image_url"]["url"].removeprefix("data:").split(";base64,")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


class AnthropicColorsAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = [{"role": m["role"], "content": [_block(part) for part in m["content"]]} for m in ctx.row["messages"]]
        response = await client.messages.create(model=ctx.model_name, max_tokens=16, messages=messages)
        answer = "".join(block.text for block in response.content if block.type == "text")
        correct = colors.named(answer, ctx.row["label"][0])
        return Result(reward=float(correct), terminated=True, info={"correct": correct})


AgentRunner = AnthropicColorsAgent
