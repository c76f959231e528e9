"""The calculator environment under a scripted policy, and bad model output as observations."""

from __future__ import annotations

import json

import pytest

from environments.base import EpisodeState
from environments.calculator import Calculator, CalculatorConfig, evaluate
from environments.errors import EnvironmentLoadError
from environments.loader import load_environment
from policies.wire.toolcalls import parse_assistant

pytestmark = pytest.mark.anyio


def _call(expr: object) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return f"<tool_call>\n{args}\n</tool_call>"


async def test_scripted_episode_gets_full_reward() -> None:
    env = Calculator(CalculatorConfig(num_tasks=3, seed=1))
    task = env.tasks()[0]
    state = EpisodeState(task=task, messages=env.initial_messages(task))
    a, op, b = task["question"].removeprefix("What is ").removesuffix("?").split()
    reply = await env.respond(state, parse_assistant(_call(f"{a}{op}{b}")))
    assert not reply.done
    assert reply.messages[0]["role"] == "tool"
    result = reply.messages[0]["content"]
    assert float(result) == task["answer"]
    reply = await env.respond(state, parse_assistant(f"The answer is {result}."))
    assert reply.done
    scores = await env.score(state)
    assert scores == {"correct": 1.0, "numeric": 1.0}
    assert env.total_reward(scores) == pytest.approx(1.1)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "error"),
        ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "unknown tool"),
        (_call(5), "bad argument expression"),
        (_call("__import__('os')"), "ValueError"),
    ],
)
async def test_bad_model_output_becomes_an_observation(text: str, needle: str) -> None:
    env = Calculator(CalculatorConfig())
    task = env.tasks()[0]
    state = EpisodeState(task=task, messages=[])
    reply = await env.respond(state, parse_assistant(text))
    assert not reply.done
    assert needle in reply.messages[0]["content"]


def test_evaluate_refuses_non_arithmetic() -> None:
    assert evaluate("(2 + 3) * -4") == -20
    with pytest.raises(ValueError, match="unsupported"):
        evaluate("a + 1")


def test_loader_names_the_config_key() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"environment\.cls"):
        load_environment("environments.calculator", {})
    with pytest.raises(EnvironmentLoadError, match=r"environment\.cls"):
        load_environment("environments.nope:X", {})
    with pytest.raises(EnvironmentLoadError, match=r"environment\.args\.max_operandz"):
        load_environment("environments.calculator:Calculator", {"max_operandz": 3})


def test_tool_schema_comes_from_type_hints_and_docstring() -> None:
    (schema,) = Calculator(CalculatorConfig()).tool_schemas()
    fn = schema["function"]
    assert fn["name"] == "calculator"
    assert fn["description"].startswith("Evaluate an arithmetic expression")
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]


def test_problems_draw_from_the_configured_operators_and_range() -> None:
    env = load_environment(
        "environments.calculator:Calculator", {"num_tasks": 40, "max_operand": 9, "ops": "+"}
    )
    for task in env.tasks():
        a, op, b = str(task["question"]).removeprefix("What is ").removesuffix("?").split()
        assert op == "+"
        assert 2 <= int(a) <= 9
        assert 2 <= int(b) <= 9
        assert task["answer"] == int(a) + int(b)
    with pytest.raises(EnvironmentLoadError, match=r"environment\.args\.ops"):
        load_environment("environments.calculator:Calculator", {"ops": "/"})
