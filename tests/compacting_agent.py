"""A ChatAgent that compacts its context, for the loop's per-rollout statistics test (tests/test_loop.py).

It asks the default arithmetic question, then replaces the conversation with a summary and asks again:
the chat server seals the first segment and opens a second, so each rollout is two rows of the batch.
The final answer is graded like the default task, so rewards differ within a group.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from molt.agent import ChatAgent, ChatContext, Result
from molt.agents import arithmetic

dataset = arithmetic.dataset


class CompactingAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        question = ctx.row["messages"][-1]["content"]
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.row["messages"])
        summary = [{"role": "system", "content": "Summary: an arithmetic question."},
                   {"role": "user", "content": question}]
        answer = await client.chat.completions.create(model=ctx.model_name, messages=summary)
        return arithmetic.grade(answer.choices[0].message.content or "", ctx.row["label"])


AgentRunner = CompactingAgent
