"""The code environment under scripted policies; every program runs in the real sandbox."""

from __future__ import annotations

import json
import re

import pytest

from environments.coding import Code, CodeConfig
from environments.errors import EnvironmentLoadError
from environments.loader import load_environment
from environments.scripted import play
from sandbox import SandboxConfig, SandboxUnavailableError

pytestmark = pytest.mark.anyio

SANDBOX = SandboxConfig(wall_seconds=3, cpu_seconds=1, memory_mb=256)
TASK = {
    "id": "t",
    "prompt": "Write a Python function double(x: int) -> int that returns 2 * x.",
    "entry_point": "double",
    "tests": json.dumps([[[x], 2 * x] for x in (-3, 0, 4, 11)]),
}


@pytest.fixture(scope="module")
def env() -> Code:
    try:
        return Code(CodeConfig(sandbox=SANDBOX, num_tasks=4, num_tests=5))
    except SandboxUnavailableError as exc:  # only where bubblewrap cannot run at all
        pytest.skip(str(exc))


def _answer(body: str) -> str:
    return f"Here it is:\n```python\n{body}\n```"


def _run_python(code: str) -> str:
    call = {"name": "run_python", "arguments": {"code": code}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


async def test_try_then_answer_passes_every_hidden_test(env: Code) -> None:
    played = await play(
        env,
        TASK,
        [_run_python("def double(x):\n    return 2 * x\nprint(double(21))"),
         _answer("def double(x):\n    return x + x")],
    )  # fmt: skip
    assert played.replies[0].messages[0]["content"].startswith("exit 0\nstdout:\n42\n")
    assert played.rewards == {"passed": 1.0}
    assert played.state.data["hidden_results"] == [{"value": v} for v in (-6, 0, 8, 22)]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("def double(x):\n    return 2 * x if x > 5 else 0", 0.5),  # wrong for -3 and 4
        ("def double(x):\n    return 1 // x * 0 + 2 * x", 0.75),  # ZeroDivisionError on 0
        ("def double(x):\n    return str(2 * x)", 0.0),  # wrong type
        ("def triple(x):\n    return 3 * x", 0.0),  # wrong name
        ("import sys\nsys.exit(3)", 0.0),  # exits on import
        ('print(\'[{"value": -6}, {"value": 0}, {"value": 8}, {"value": 22}]\')', 0.0),
        ("def double(x):\n    while True: pass", 0.0),  # CPU limit
        ("def double(x)\n    return 2 * x", 0.0),  # syntax error
    ],
)
async def test_partial_and_hostile_answers(env: Code, body: str, expected: float) -> None:
    played = await play(env, TASK, [_answer(body)])
    assert played.rewards["passed"] == pytest.approx(expected)


async def test_answer_without_code_and_generated_tasks(env: Code) -> None:
    played = await play(env, TASK, ["I would double it."])
    assert played.rewards == {"passed": 0.0}
    tasks = env.tasks()
    assert len(tasks) == 4
    for task in tasks:
        cases = json.loads(task["tests"])
        assert len(cases) == 5
        assert task["entry_point"] in task["prompt"]


async def test_generated_task_is_solvable(env: Code) -> None:
    task = env.tasks()[0]
    solutions = {
        "add_k": "x + k",
        "scale_k": "x * k",
        "mod_k": "x % k",
        "clamp_k": "max(-k, min(k, x))",
    }
    name = task["entry_point"]
    k = abs(int(re.findall(r"-?\d+", task["prompt"].split(" that ")[1])[0]))
    body = f"def {name}(x):\n    k = {k}\n    return {solutions[name]}"
    played = await play(env, task, [_answer(body)])
    assert played.rewards == {"passed": 1.0}


def test_a_sandbox_that_cannot_start_is_a_clear_load_error() -> None:
    args = {"sandbox": {"bwrap_path": "/nonexistent/bwrap"}}
    with pytest.raises(EnvironmentLoadError, match=r"environment\.cls: .*SandboxUnavailableError"):
        load_environment("environments.coding:Code", args)
