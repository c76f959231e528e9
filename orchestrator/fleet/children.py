"""The local fleet's child processes: started, awaited until ready, stopped and reaped together.

Every child is started in a session of its own (so it leads a process group), with a pipe on its
stdin that the orchestrator never writes to, and its stderr (stdout too, when it has no ready
line) appended to ``<log dir>/<name>.log``. A child started with ``--parent-stdin`` (or under
:mod:`orchestrator.fleet.guard`) exits when that pipe closes, so no child outlives the
orchestrator, even when it is killed.

:class:`Children` guarantees, on exit, whatever raised: each child gets SIGTERM and its grace
period, then whatever is left of its process group gets SIGKILL, and every child is reaped —
concurrently, and shielded from cancellation. :meth:`Children.stop` does the same for some
children now (an island the supervisor replaces); they are forgotten, so their process group ids
are never signalled again.

Every child that runs a sprawl serving command is started from its options model
(:func:`sprawl_command`: ``orchestrate serve`` or ``orchestrate sidecar``, the flags generated
from :mod:`policies.serve.options`, its secrets in the environment, never in argv), so the local
fleet, its islands and Ray islands build one command line in one way.

A :class:`LocalIsland` is the children of one endpoint (a reference engine; an island's sidecar
and engine) as the supervisor (:mod:`orchestrator.fleet.supervisor`) sees it: down when any of
them exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import anyio
import structlog
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from orchestrator.errors import FleetError
from orchestrator.fleet.supervisor import Down
from orchestrator.types import EndpointRef
from policies.serve.options import ServeOptions, SidecarOptions
from policies.wire.flags import secret_env, to_argv

log = structlog.get_logger(__name__)


def sprawl_command(
    options: ServeOptions | SidecarOptions,
) -> tuple[list[str], dict[str, str] | None]:
    """The argv that runs ``options``' command with this interpreter, and the environment it
    runs in (this process's, with the options' secrets; None when there are none: inherited)."""
    argv = [sys.executable, "-m", "orchestrator.cli", options.COMMAND, *to_argv(options)]
    secrets = secret_env(options)
    return argv, {**os.environ, **secrets} if secrets else None


@dataclass(frozen=True)
class Child:
    """One started child process."""

    name: str
    proc: Process
    log_path: Path
    grace_s: float
    """Seconds between SIGTERM and SIGKILL of its process group on stop."""
    log_file: BinaryIO = field(repr=False, compare=False)
    """Its open ``log_path`` (closed when it is stopped)."""


class Children:
    """An async context manager owning every child it :meth:`spawn`\\ s."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Child] = []

    async def __aenter__(self) -> Children:
        await anyio.Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(*self.started)

    async def stop(self, *children: Child) -> None:
        """Stop and reap ``children`` concurrently (shielded), close their logs, forget them."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for child in children:
                    tg.start_soon(_stop, child)
        for child in children:
            child.log_file.close()
            if child in self.started:
                self.started.remove(child)

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
        log_file = log_path.open("ab")
        try:
            proc = await anyio.open_process(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if ready_line else log_file,
                stderr=log_file,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            log_file.close()
            raise
        child = Child(name, proc, log_path, grace_s, log_file)
        self.started.append(child)
        return child


@dataclass
class LocalIsland:
    """The children serving one endpoint (see the module docstring)."""

    ref: EndpointRef
    children: list[Child]
    owner: Children

    async def down(self) -> Down:
        """The first child to exit, with its exit code."""
        result: list[Down] = []
        async with anyio.create_task_group() as tg:

            async def one(child: Child) -> None:
                code = await child.proc.wait()
                result.append(Down(f"{child.name} {_exit(code)}; see {child.log_path}", code))
                tg.cancel_scope.cancel()

            for child in self.children:
                tg.start_soon(one, child)
        return result[0]

    async def stop(self) -> None:
        await self.owner.stop(*self.children)


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


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
