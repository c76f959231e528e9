"""Local fleet: reference engines and islands of other engine kinds, as subprocesses on loopback.

Each reference engine is ``orchestrate serve --board … --port 0 --parent-stdin``: it binds a free
port, writes one JSON line ``{"url": …}`` to stdout when it serves, logs to
``<run dir>/logs/engine-<i>.log``, and exits when its stdin closes — so engines never outlive the
orchestrator, even when it is killed. Islands (``[[fleet.islands]]``: vLLM, llama.cpp, each
behind a sidecar) are started beside them by :mod:`orchestrator.fleet.islands`. Everything starts
concurrently; the fleet is yielded once every endpoint serves, as a :class:`LocalFleet`: one
:class:`~orchestrator.fleet.children.LocalIsland` per endpoint and, per endpoint id, how to start
it again — what the supervisor (:mod:`orchestrator.fleet.supervisor`) needs to replace one that
dies (:func:`fleet_supervisor`). A replacement is started exactly as the first one (same
endpoint id, same log, appended to), so it starts on the board's newest version. On exit every
child gets SIGTERM, then SIGKILL of what is left of its process group, and is reaped
(:class:`~orchestrator.fleet.children.Children`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import structlog

from orchestrator.config import FleetConfig, IslandConfig
from orchestrator.fleet.children import Children, LocalIsland, read_ready, sprawl_command
from orchestrator.fleet.islands import LoraServing, island_ids, start_island
from orchestrator.fleet.supervisor import Launch, RestartPolicy, Supervisor
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef, EventSink
from policies.serve.options import ServeOptions

log = structlog.get_logger(__name__)


@dataclass
class LocalFleet:
    """The started fleet: its islands (reference engines first, then the other kinds in config
    order) and the
    launcher of each endpoint id."""

    islands: list[LocalIsland]
    launchers: dict[str, Launch]

    @property
    def refs(self) -> list[EndpointRef]:
        return [r.ref for r in self.islands]


def fleet_supervisor(
    pool: Pool, cfg: FleetConfig, launchers: Mapping[str, Launch], *, events: EventSink
) -> Supervisor:
    """The supervisor of the endpoints of ``launchers`` in ``pool``, with the ``fleet.restart*``
    limits (``fleet.restart = false``: none, so what it tends is deregistered when it dies)."""
    policy = RestartPolicy(
        max_restarts=cfg.max_restarts if cfg.restart else 0,
        backoff_s=cfg.restart_backoff_s,
        backoff_max_s=cfg.restart_backoff_max_s,
    )
    return Supervisor(pool, launchers, policy, unhealthy_s=cfg.unhealthy_s, events=events)


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
    lora: LoraServing | None = None,
) -> AsyncIterator[LocalFleet]:
    """Start ``n`` engines and the ``islands`` serving ``board_url``/``run``; yield them once
    every one serves. Island ``<id>`` works in ``<island_dir>/<id>`` (default
    ``<log_dir>/../islands``). ``lora``: every engine and island serves LoRA versions; unset
    for full versions."""
    island_dir = island_dir or log_dir.parent / "islands"
    ids = island_ids(islands)
    async with Children(log_dir) as children:

        async def engine(i: int) -> LocalIsland:
            options = ServeOptions.model_validate(
                {
                    "board": board_url,
                    "run": run,
                    "port": 0,
                    "device": device,
                    "poll_interval": poll_interval_s,
                    "parent_stdin": True,
                    "log_format": "json",
                    **(lora.serve_options() if lora is not None else {}),
                }
            )
            argv, env = sprawl_command(options)
            child = await children.spawn(f"engine-{i}", argv, env=env)
            try:
                url = await read_ready(child, startup_timeout_s, "fleet.startup_timeout_s")
            except BaseException:
                await children.stop(child)
                raise
            log.info("engine_started", engine=child.name, url=url, pid=child.proc.pid)
            return LocalIsland(EndpointRef(id=child.name, url=url), [child], children)

        async def island(j: int) -> LocalIsland:
            return await start_island(
                j,
                islands[j],
                children,
                island_id=ids[j],
                board_url=board_url,
                run=run,
                island_dir=island_dir / ids[j],
                poll_interval_s=poll_interval_s,
                lora=lora,
            )

        launchers: list[Callable[[], Awaitable[LocalIsland]]]
        launchers = [partial(engine, i) for i in range(n)]
        launchers += [partial(island, j) for j in range(len(islands))]
        launched: list[LocalIsland | None] = [None] * len(launchers)

        async def start(k: int) -> None:
            launched[k] = await launchers[k]()

        async with anyio.create_task_group() as tg:
            for k in range(len(launchers)):
                tg.start_soon(start, k)
        started = [r for r in launched if r is not None]
        yield LocalFleet(
            started, {r.ref.id: launch for r, launch in zip(started, launchers, strict=True)}
        )
