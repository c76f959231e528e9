"""The local fleet's child processes: started, awaited until ready, stopped and reaped together.

Every child is started in a session of its own (so it leads a process group), with a pipe on its
stdin that the orchestrator never writes to, and its stderr (stdout too, when it has no ready
line) appended to ``<log dir>/<name>.log``. A child started with ``--parent-stdin`` (or under
:mod:`orchestrator.loop.guard`) exits when that pipe closes, so no child outlives the
orchestrator, even when it is killed.

:class:`Children` guarantees, on exit, whatever raised: each child gets SIGTERM and its grace
period, then whatever is left of its process group gets SIGKILL, and every child is reaped —
concurrently, and shielded from cancellation.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio
import structlog
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from orchestrator.errors import FleetError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Child:
    """One started child process."""

    name: str
    proc: Process
    log_path: Path
    grace_s: float
    """Seconds between SIGTERM and SIGKILL of its process group on stop."""


class Children:
    """An async context manager owning every child it :meth:`spawn`\\ s."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Child] = []
        self._files = ExitStack()

    async def __aenter__(self) -> Children:
        await anyio.Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for child in self.started:
                    tg.start_soon(_stop, child)
        self._files.close()

    async def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready_line: bool = True,
        grace_s: float = 10.0,
    ) -> Child:
        """Start ``argv``; its stdout is a pipe for :func:`read_ready` when ``ready_line``, else
        it goes to the log with stderr."""
        log_path = self.log_dir / f"{name}.log"
        log_file = self._files.enter_context(log_path.open("ab"))
        proc = await anyio.open_process(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if ready_line else log_file,
            stderr=log_file,
            env=env,
            start_new_session=True,
        )
        child = Child(name, proc, log_path, grace_s)
        self.started.append(child)
        return child


async def read_ready(child: Child, timeout_s: float, key: str) -> str:
    """The URL of the child's ready line ``{"url": …}`` on stdout; ``key`` is the config key of
    the timeout, named when it runs out."""
    proc = child.proc
    assert proc.stdout is not None
    buf = ""
    with anyio.move_on_after(timeout_s):
        async for chunk in TextReceiveStream(proc.stdout):
            buf += chunk
            if "\n" in buf:
                line = buf.split("\n", 1)[0]
                try:
                    return str(json.loads(line)["url"])
                except (ValueError, KeyError):
                    raise FleetError(
                        f"{child.name} wrote an unexpected ready line {line!r}; "
                        f"see {child.log_path}"
                    ) from None
        raise FleetError(
            f"{child.name} exited before it was ready (code {await proc.wait()}); "
            f"see {child.log_path}"
        )
    raise FleetError(f"{child.name} not ready after {timeout_s}s ({key}); see {child.log_path}")


async def _stop(child: Child) -> None:
    proc = child.proc
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(child.grace_s):
            await proc.wait()
    if proc.returncode is None:
        log.warning("child_killed", child=child.name)
    # the whole group, leader or not: what a child that died early left behind goes too (a group
    # id is not reused while the group has members)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
    await proc.aclose()
