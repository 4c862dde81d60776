"""An Env whose rows say how it misbehaves, for the fault tests (tests/test_faults.py).

The built-in dataset is 15 arithmetic questions; rows 0, 3, 6, 9 and 12 carry a fault: the env raises,
returns a malformed Result, hangs, or returns a non-finite reward. The other rows are graded like the
default task. A JSONL file can choose faults per row the same way: {"label": {"answer": 7, "fault": "raise"}}.
"""

from __future__ import annotations

import asyncio
import math

from molt.agent import Env, Result
from molt.agents.arithmetic import grade

FAULTS = {0: "raise", 3: "malformed", 6: "hang", 9: "inf", 12: "nan"}


def dataset(split: str, size: int, seed: int) -> list[dict]:
    rows = []
    for i in range(15):
        a, b = i % 5, i // 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "label": {"answer": a + b, "fault": FAULTS.get(i)}})
    return rows


class FaultyEnv(Env):
    async def step(self, action: str, turn: int) -> Result:
        fault = self.row["label"]["fault"]
        if fault == "raise":
            raise RuntimeError("injected fault")
        if fault == "malformed":
            return {"reward": 1.0}
        if fault == "hang":
            await asyncio.Event().wait()  # never set: only agent.timeout_s ends it
        if fault in ("inf", "nan"):
            return Result(reward=math.inf if fault == "inf" else math.nan, terminated=True)
        return grade(action, self.row["label"]["answer"])


AgentRunner = FaultyEnv
