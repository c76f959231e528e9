"""Environments that fail on purpose, for the chaos harness (``orchestrate chaos``).

Both are the demo's calculator with one thing added:

- :class:`Raising` raises from user code (``respond``) in a deterministic share of its tasks,
  as a buggy environment would;
- :class:`SandboxChecked` re-checks every final answer in the sandbox — a short program that
  works for ``check_s`` seconds, so that the harness can SIGKILL sandbox processes while they
  run. A sandbox run that did not exit 0 raises, so a crash is recorded on the trajectory.
"""

from __future__ import annotations

import zlib

from pydantic import Field

from environments.base import EpisodeState, Reply, reward
from environments.calculator import Calculator, CalculatorConfig
from policies.wire.toolcalls import ParsedAssistant
from sandbox import SandboxConfig, SandboxPool


class RaisingConfig(CalculatorConfig):
    raise_every: int = Field(default=3, ge=1)
    """One task in ``raise_every`` (by a hash of its id) raises in ``respond``."""


class Raising(Calculator):
    Config = RaisingConfig
    name = "calculator-raising"
    config: RaisingConfig

    async def respond(self, state: EpisodeState, reply: ParsedAssistant) -> Reply:
        task_id = str(state.task["id"])
        if zlib.crc32(task_id.encode()) % self.config.raise_every == 0:
            raise RuntimeError(f"injected environment failure on task {task_id}")
        return await super().respond(state, reply)


class SandboxCheckedConfig(CalculatorConfig):
    check_s: float = Field(default=0.5, gt=0, le=10)
    """How long each sandboxed check works before it answers."""
    sandbox: SandboxConfig = SandboxConfig(wall_seconds=10, cpu_seconds=5, memory_mb=256)
    """Where the checks run."""


class SandboxChecked(Calculator):
    Config = SandboxCheckedConfig
    name = "calculator-sandboxed"
    config: SandboxCheckedConfig

    def __init__(self, config: SandboxCheckedConfig) -> None:
        super().__init__(config)
        self.sandbox = SandboxPool(config.sandbox)

    @reward(weight=0.0)
    async def checked(self, state: EpisodeState) -> float:
        answer = repr(str(state.final_answer or ""))
        program = f"import time; time.sleep({self.config.check_s}); print(len({answer}))"
        run = await self.sandbox.run_python(program)
        if run.exit_code != 0:
            raise RuntimeError(
                f"sandbox check failed: exit {run.exit_code}, {run.killed_reason or 'no limit hit'}"
            )
        return 1.0
