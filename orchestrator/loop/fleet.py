"""Local fleet: reference engines launched as subprocesses on loopback.

Each engine is ``orchestrate serve --board … --port 0 --parent-stdin``: it binds a free port,
writes one JSON line ``{"url": …}`` to stdout when it serves, logs to
``<run dir>/logs/engine-<i>.log``, and exits when its stdin closes — so engines never outlive the
orchestrator, even when it is killed. On exit the fleet sends SIGTERM, waits, then SIGKILLs any
engine still alive, and reaps every child.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import structlog
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from orchestrator.errors import FleetError
from orchestrator.types import EndpointRef

log = structlog.get_logger(__name__)


async def _read_ready(proc: Process, timeout_s: float, log_path: Path) -> str:
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
                        f"engine wrote an unexpected ready line {line!r}; see {log_path}"
                    ) from None
        raise FleetError(
            f"engine exited before it was ready (code {await proc.wait()}); see {log_path}"
        )
    raise FleetError(
        f"engine not ready after {timeout_s}s (fleet.startup_timeout_s); see {log_path}"
    )


async def _stop(proc: Process, name: str) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(10):
            await proc.wait()
    if proc.returncode is None:
        log.warning("engine_killed", engine=name)
        proc.kill()
        await proc.wait()
    await proc.aclose()


async def _stop_all(procs: list[tuple[str, Process, Path]]) -> None:
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for name, proc, _ in procs:
                tg.start_soon(_stop, proc, name)


@asynccontextmanager
async def local_fleet(
    n: int,
    *,
    board_url: str,
    run: str,
    device: str,
    log_dir: Path,
    poll_interval_s: float,
    startup_timeout_s: float,
) -> AsyncIterator[list[EndpointRef]]:
    """Start ``n`` engines serving ``board_url``/``run``; yield them as pool endpoints."""
    await anyio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    async with AsyncExitStack() as stack:
        procs: list[tuple[str, Process, Path]] = []
        stack.push_async_callback(_stop_all, procs)
        for i in range(n):
            name = f"engine-{i}"
            log_path = log_dir / f"{name}.log"
            log_file = stack.enter_context(log_path.open("ab"))
            proc = await anyio.open_process(
                [
                    sys.executable,
                    "-m",
                    "orchestrator.cli",
                    "serve",
                    "--board",
                    board_url,
                    "--run",
                    run,
                    "--port",
                    "0",
                    "--device",
                    device,
                    "--poll-interval",
                    str(poll_interval_s),
                    "--parent-stdin",
                    "--log-format",
                    "json",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
            )
            procs.append((name, proc, log_path))
        endpoints: list[EndpointRef | None] = [None] * n

        async def ready(i: int) -> None:
            name, proc, log_path = procs[i]
            url = await _read_ready(proc, startup_timeout_s, log_path)
            endpoints[i] = EndpointRef(id=name, url=url)
            log.info("engine_started", engine=name, url=url, pid=proc.pid)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(ready, i)
        yield [e for e in endpoints if e is not None]
