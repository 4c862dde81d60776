"""A vision task for model=tiny_vl: name the colour of a plain image, then of a second one.

A row's user message shows the first image (an image_url part with a PNG data URL). After the model's
answer the Env shows the second image with its observation (`Result.images`) and asks again; the reward is
the fraction of the two colours named. The ChatAgent forms (colors_openai.py, colors_anthropic.py) ask
about the first image only.
"""

from __future__ import annotations

import random

from PIL import Image

from molt.agent import Env, Result
from molt.data import image_data_url

COLORS = {"red": (220, 20, 20), "green": (20, 180, 20), "blue": (20, 40, 220)}
QUESTION = "What color is this image? Answer red, green or blue."


def image(color: str) -> Image.Image:
    return Image.new("RGB", (32, 32), COLORS[color])


def dataset(split: str, size: int, seed: int) -> list[dict]:
    """`size` rows; label: the colours of the first and the second image."""
    rng = random.Random(f"colors-{split}-{seed}")
    rows = []
    for _ in range(size):
        first, second = rng.choice(list(COLORS)), rng.choice(list(COLORS))
        content = [{"type": "image_url", "image_url": {"url": image_data_url(image(first))}},
                   {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": content}], "label": [first, second]})
    return rows


def named(answer: str, color: str) -> bool:
    return color in answer.lower()


class ColorsEnv(Env):
    async def step(self, action: str, turn: int) -> Result:
        first, second = self.row["label"]
        if turn == 0:
            correct = named(action, first)
            return Result(reward=0.5 * correct, observation="And this one?", images=[image(second)],
                          info={"first_correct": correct})
        correct = named(action, second)
        return Result(reward=0.5 * correct, terminated=True, info={"second_correct": correct})


AgentRunner = ColorsEnv
