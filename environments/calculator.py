"""Calculator arithmetic, the demo's task: call ``calculator`` if useful, then answer the number.

Rewards: ``correct`` (1.0) when the final answer's last number equals the result; ``numeric``
(0.1) when the final answer contains a number at all (a format signal a random model can find).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from datasets import Dataset
from pydantic import Field

from environments.base import EnvConfig, Environment, EpisodeState, Message, reward, tool

_OPS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorConfig(EnvConfig):
    max_operand: int = Field(default=99, ge=2)
    """Largest operand in generated problems (operands are drawn from 2..max_operand)."""
    ops: str = Field(default="+-*", pattern=r"^[+\-*]+$")
    """The operators generated problems draw from: any of ``+``, ``-``, ``*``."""


def evaluate(expression: str) -> float:
    """Evaluate + - * / over numbers and parentheses; anything else raises ValueError."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.operand)))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return ev(ast.parse(expression, mode="eval").body)


class Calculator(Environment):
    Config = CalculatorConfig
    name = "calculator"
    config: CalculatorConfig

    def generate_tasks(self) -> Dataset:
        rng = random.Random(self.config.seed)
        rows = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(2, self.config.max_operand), rng.randint(2, self.config.max_operand)
            op = rng.choice(self.config.ops)
            rows.append(
                {
                    "id": f"calc-{i}",
                    "question": f"What is {a} {op} {b}?",
                    "answer": evaluate(f"{a} {op} {b}"),
                }
            )
        return Dataset.from_list(rows)

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        return [
            {
                "role": "user",
                "content": f"{task['question']} Use the calculator tool, "
                "then answer with the number.",
            }
        ]

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        value = evaluate(expression)
        return str(int(value)) if value.is_integer() else f"{value:.6g}"

    @reward(weight=1.0)
    def correct(self, state: EpisodeState) -> float:
        numbers = _NUMBER.findall(state.final_answer or "")
        return float(bool(numbers) and abs(float(numbers[-1]) - state.task["answer"]) < 1e-6)

    @reward(weight=0.1)
    def numeric(self, state: EpisodeState) -> float:
        return float(bool(_NUMBER.search(state.final_answer or "")))
