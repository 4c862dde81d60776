"""A multi-turn, tool-using Env: the model may call a calculator, reads the result, then answers.

The tool is offered through the row's `tools`, so the chat template lists it in the system turn. A reply
with a `<tool_call>` gets the tool's result back as the next (tool) message; a reply without one is the
answer, graded like the default task.
"""

from __future__ import annotations

import ast
import operator

from molt.agent import Env, Result
from molt.agents import arithmetic
from molt.data import parse_tool_calls

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 3 + 4 * 2.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}]

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
             ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def dataset(split: str, size: int, seed: int) -> list[dict]:
    return [{**row, "tools": TOOLS} for row in arithmetic.dataset(split, size, seed)]


def calculate(expression: str) -> int:
    """Integer arithmetic only (+ - * // %), so no model output can run code or take long."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression {ast.unparse(node)!r}")

    if len(expression) > 100:
        raise ValueError("expression longer than 100 characters")
    return value(ast.parse(expression, mode="eval").body)


class CalculatorEnv(Env):
    def __init__(self, row: dict):
        super().__init__(row)
        self.tool_calls = 0

    async def step(self, action: str, turn: int) -> Result:
        _, calls = parse_tool_calls(action)
        if not calls:
            result = arithmetic.grade(action, self.row["label"])
            result.info["tool_calls"] = self.tool_calls
            return result
        self.tool_calls += 1
        call = calls[0]["function"]
        try:
            if call["name"] != "calculator":
                raise ValueError(f"unknown tool {call['name']!r}")
            output = str(calculate(str(call["arguments"].get("expression", ""))))
        except (ValueError, SyntaxError, ZeroDivisionError) as e:
            output = f"error: {e}"
        return Result(observation=[{"role": "tool", "content": output}], info={"tool_calls": self.tool_calls})


AgentRunner = CalculatorEnv
