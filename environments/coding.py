"""Write a Python function that passes hidden unit tests; all code runs in the sandbox.

Tasks: ``prompt``, ``entry_point`` and hidden ``tests`` (JSON ``[[[args...], expected], ...]``).
The model may try code with ``run_python``, then answers with the function in a ```python block.
Reward ``passed`` (1.0): the fraction of hidden tests passed. The answer runs in its own sandboxed
process that gets only the inputs and prints its outputs; expected values never leave this
process, so the answer cannot read or fake them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from environments.base import EnvConfig, Environment, EpisodeState, Message, reward, tool
from sandbox import SandboxConfig, SandboxPool

_FAMILIES: list[tuple[str, str, Callable[[int, int], int]]] = [
    ("add_k", "returns x + {k}", lambda x, k: x + k),
    ("scale_k", "returns x * {k}", lambda x, k: x * k),
    ("mod_k", "returns x % {k} (Python's modulo)", lambda x, k: x % k),
    ("clamp_k", "returns x clamped to the range [-{k}, {k}]", lambda x, k: max(-k, min(k, x))),
]
_CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_HARNESS = """import importlib, json, sys
cases, out, sys.stdout = json.loads(sys.stdin.read()), sys.stdout, sys.stderr
fn, results = getattr(importlib.import_module("solution"), sys.argv[1]), []
for args in cases:
    try:
        results.append({"value": fn(*args)})
    except Exception as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
out.write("\\n" + json.dumps(results, default=repr) + "\\n")
"""


class CodeConfig(EnvConfig):
    num_tests: int = Field(default=8, ge=1, le=100)
    """Hidden tests per generated task."""
    sandbox: SandboxConfig = SandboxConfig(wall_seconds=10, cpu_seconds=5, memory_mb=512)
    """Where ``run_python`` and the hidden tests run."""


class Code(Environment):
    Config = CodeConfig
    name = "code"
    task_columns = ("prompt", "entry_point", "tests")
    config: CodeConfig

    def __init__(self, config: CodeConfig) -> None:
        super().__init__(config)
        self.sandbox = SandboxPool(config.sandbox)

    def generate_tasks(self) -> list[dict[str, Any]]:
        rng, rows = random.Random(self.config.seed), []
        for i in range(self.config.num_tasks):
            name, text, f = rng.choice(_FAMILIES)
            k = rng.randint(2, 9)
            xs = rng.sample(range(-99, 100), self.config.num_tests + 2)
            cases = [[[x], f(x, k)] for x in xs]
            shown = ", ".join(f"{name}({x}) == {f(x, k)}" for x in xs[:2])
            prompt = f"Write a Python function {name}(x: int) -> int that {text.format(k=k)}."
            prompt, tests = f"{prompt} Examples: {shown}.", json.dumps(cases[2:])
            rows.append({"id": f"code-{i}", "prompt": prompt, "entry_point": name, "tests": tests})
        return rows

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        hint = "You may test code with run_python. Answer with the function in a ```python block."
        return [{"role": "user", "content": f"{task['prompt']} {hint}"}]

    @tool
    async def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox; returns its exit status, stdout and stderr."""
        r = await self.sandbox.run_python(code)
        status = r.killed_reason or f"exit {r.exit_code}"
        return f"{status}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"

    @reward(weight=1.0)
    async def passed(self, state: EpisodeState) -> float:
        blocks = _CODE.findall(state.final_answer or "")
        cases = json.loads(state.task["tests"])
        if not blocks or not cases:
            return 0.0
        inputs, files = json.dumps([a for a, _ in cases]).encode(), {"solution.py": blocks[-1]}
        entry = [state.task["entry_point"]]
        run = await self.sandbox.run_python(_HARNESS, args=entry, files=files, stdin=inputs)
        try:
            results = json.loads(run.stdout.rstrip().rsplit("\n", 1)[-1])
        except ValueError:  # the answer did not import or killed the harness
            results = []
        state.data["hidden_results"] = results = results if isinstance(results, list) else []
        got = [r.get("value") if isinstance(r, dict) else None for r in results]
        return sum(1 for g, (_, w) in zip(got, cases, strict=False) if g == w) / len(cases)
