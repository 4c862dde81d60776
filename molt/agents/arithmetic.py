"""The default task: single-turn questions like "What is 3 + 4?", graded exactly.

The reward is 1.0 when the first integer in the answer equals the label, else 0.0.
"""

from __future__ import annotations

import random
import re

from molt.agent import Env, Result

# Operands 0..4: 25 distinct questions, each seen often enough in a short CPU run for RL to fix it.
MAX_OPERAND = 4


def dataset(split: str, size: int, seed: int) -> list[dict]:
    """`size` questions on operands 0..MAX_OPERAND; each split draws from its own seeded generator."""
    rng = random.Random(f"arithmetic-{split}-{seed}")
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": a + b})
    return rows


def grade(answer: str, label: int) -> Result:
    number = re.search(r"-?\d+", answer)
    correct = number is not None and int(number.group()) == int(label)
    return Result(reward=float(correct), terminated=True, info={"correct": correct})


class ArithmeticEnv(Env):
    async def step(self, action: str, turn: int) -> Result:
        return grade(action, self.row["label"])


AgentRunner = ArithmeticEnv
