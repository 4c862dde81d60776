"""The colours task (molt/agents/colors.py) as a ChatAgent on the stock openai SDK: the row's message,
image_url part included, goes to the loopback server as it is."""

from __future__ import annotations

from openai import AsyncOpenAI

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import colors

dataset = colors.dataset


class OpenAIColorsAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        response = await client.chat.completions.create(model=ctx.model_name, messages=ctx.row["messages"])
        correct = colors.named(response.choices[0].message.content or "", ctx.row["label"][0])
        return Result(reward=float(correct), terminated=True, info={"correct": correct})


AgentRunner = OpenAIColorsAgent
