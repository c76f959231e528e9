"""Local fleet: reference engines and islands of other engine kinds, as subprocesses on loopback.

Each reference engine is ``orchestrate serve --board … --port 0 --parent-stdin``: it binds a free
port, writes one JSON line ``{"url": …}`` to stdout when it serves, logs to
``<run dir>/logs/engine-<i>.log``, and exits when its stdin closes — so engines never outlive the
orchestrator, even when it is killed. Islands (``[[fleet.islands]]``: vLLM, llama.cpp, each
behind a sidecar) are started beside them by :mod:`orchestrator.loop.islands`. Everything starts
concurrently; the fleet is yielded once every endpoint serves. On exit every child gets SIGTERM,
then SIGKILL of what is left of its process group, and is reaped
(:class:`~orchestrator.loop.children.Children`).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import structlog

from orchestrator.config import IslandConfig
from orchestrator.loop.children import Children, read_ready
from orchestrator.loop.islands import island_ids, start_island
from orchestrator.types import EndpointRef

log = structlog.get_logger(__name__)


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
    islands: Sequence[IslandConfig] = (),
    island_dir: Path | None = None,
) -> AsyncIterator[list[EndpointRef]]:
    """Start ``n`` engines and the ``islands`` serving ``board_url``/``run``; yield them as pool
    endpoints (engines first, then islands in config order). Island ``<id>`` works in
    ``<island_dir>/<id>`` (default ``<log_dir>/../islands``)."""
    island_dir = island_dir or log_dir.parent / "islands"
    ids = island_ids(islands)
    async with Children(log_dir) as children:
        endpoints: list[EndpointRef | None] = [None] * (n + len(islands))

        async def engine(i: int) -> None:
            argv = [
                sys.executable, "-m", "orchestrator.cli", "serve", "--board", board_url,
                "--run", run, "--port", "0", "--device", device,
                "--poll-interval", str(poll_interval_s), "--parent-stdin", "--log-format", "json",
            ]  # fmt: skip
            child = await children.spawn(f"engine-{i}", argv)
            url = await read_ready(child, startup_timeout_s, "fleet.startup_timeout_s")
            endpoints[i] = EndpointRef(id=child.name, url=url)
            log.info("engine_started", engine=child.name, url=url, pid=child.proc.pid)

        async def island(j: int) -> None:
            endpoints[n + j] = await start_island(
                j,
                islands[j],
                children,
                island_id=ids[j],
                board_url=board_url,
                run=run,
                island_dir=island_dir / ids[j],
                poll_interval_s=poll_interval_s,
            )

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(engine, i)
            for j in range(len(islands)):
                tg.start_soon(island, j)
        yield [e for e in endpoints if e is not None]
