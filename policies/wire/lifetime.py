"""A child process's lifetime tied to its parent: stdin at end of file, SIGINT / SIGTERM.

The local fleet starts every child with a pipe on its stdin and never writes to it; the pipe
closes when the orchestrator exits for any reason, SIGKILL included. A child that awaits
:func:`stdin_closed` (``--parent-stdin``) beside its work therefore never outlives the
orchestrator. :func:`cancel_on_signal` turns SIGINT / SIGTERM into a cancellation, so the
child's own cleanup (``finally`` blocks, context managers) runs instead of Python's default
exit. :func:`serve_until_stopped` is both, around a serving command: its ready line
(``{"url": …}`` on stdout, what the parent waits for) once it listens.

Not covered: a parent that keeps the pipe open while hung (the fleet's SIGTERM → SIGKILL covers
that one).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

log = structlog.get_logger(__name__)


async def stdin_closed() -> None:
    """Return when standard input reaches end of file (the parent process went away)."""
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    while True:
        await anyio.wait_readable(fd)
        try:
            if not os.read(fd, 65536):
                return
        except BlockingIOError:
            continue


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def serve_until_stopped(
    serve: Callable[[TaskStatus[int]], Coroutine[Any, Any, None]],
    *,
    host: str,
    https: bool,
    parent_stdin: bool,
) -> None:
    """Run ``serve`` (started with its bound port); print the ready line once it listens; stop
    at SIGINT or SIGTERM, or (``parent_stdin``) when the parent goes away."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        scheme = "https" if https else "http"
        sys.stdout.write(json.dumps({"url": f"{scheme}://{host}:{port}"}) + "\n")
        sys.stdout.flush()
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        if parent_stdin:
            await stdin_closed()
            log.info("parent_gone")
            tg.cancel_scope.cancel()
