"""Islands on Ray, supervised: placing an
:class:`~orchestrator.fleet.ray_island.IslandActor` and watching it.

:func:`connect` joins the cluster of ``fleet.ray.address`` once per process. :func:`launcher`
gives the :data:`~orchestrator.fleet.supervisor.Launch` of one island id: it places a new actor
with the island's resources (``fleet.ray.resources``; Ray's own restarts off, the supervisor
replaces), starts its engine and returns a :class:`RayIsland` once it serves, or raises
:class:`~orchestrator.errors.FleetError` naming the island, the resources it asked for and the
cause (the actor's error, or no placement within ``fleet.ray.startup_timeout_s``); an actor that
did not come up is killed. Actors are named ``<island id>.<8 hex digits>`` in the run's
namespace (``fleet.ray.namespace``; ``ray list actors``). :meth:`RayIsland.down` returns when
the actor dies (killed, its node lost) or reports a process of the island gone or ``/health``
failing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from orchestrator.config import RayFleetConfig
from orchestrator.errors import FleetError
from orchestrator.fleet.islands import LoraServing
from orchestrator.fleet.ray_island import IslandActor, IslandSpec, Secrets
from orchestrator.fleet.supervisor import Down, Launch
from orchestrator.types import EndpointRef

log = structlog.get_logger(__name__)
HEALTH_TIMEOUT_S = 10.0
"""A health call the actor does not answer in this long counts as the island down."""


def connect(fleet: RayFleetConfig, run: str) -> str:
    """Join (or, for ``local``, start) the Ray cluster; the namespace of the run's actors."""
    try:
        import ray
    except ImportError:
        raise FleetError("fleet.ray needs the ray package: pip install 'sprawl[ray]'") from None

    namespace = fleet.namespace or f"sprawl-{run}"
    if not ray.is_initialized():
        address = None if fleet.address == "local" else fleet.address
        try:
            ray.init(
                address=address,
                namespace=namespace,
                log_to_driver=False,
                include_dashboard=False if address is None else None,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FleetError(f"fleet.ray.address = {fleet.address!r}: {exc}") from None
    return namespace


@dataclass
class RayIsland:
    """A serving island: its endpoint and its actor."""

    ref: EndpointRef
    actor: Any
    interval_s: float

    async def down(self) -> Down:
        from ray.exceptions import RayError

        while True:
            try:
                with anyio.fail_after(HEALTH_TIMEOUT_S):
                    health = await self.actor.health.remote()
            except TimeoutError:
                return Down(f"{self.ref.id}: its actor did not answer for {HEALTH_TIMEOUT_S}s")
            except RayError as exc:
                return Down(f"{self.ref.id}: its actor died ({type(exc).__name__})")
            if not health["alive"]:
                return Down(f"{self.ref.id}: {health['reason']}", health["exit_code"])
            await anyio.sleep(self.interval_s)

    async def stop(self) -> None:
        await _kill(self.actor, graceful=True)


async def _kill(actor: Any, *, graceful: bool) -> None:
    import ray
    from ray.exceptions import RayError

    if graceful:
        try:
            with anyio.move_on_after(15):
                await actor.stop.remote()
        except RayError:
            pass  # already gone
    await anyio.to_thread.run_sync(ray.kill, actor)


def launcher(
    fleet: RayFleetConfig,
    island_id: str,
    *,
    board_url: str,
    run: str,
    device: str,
    poll_interval_s: float,
    placed: Callable[[Any], None] = lambda actor: None,
    lora: LoraServing | None = None,
) -> Callable[[], Awaitable[RayIsland]]:
    """Start island ``island_id`` (a new actor each call, handed to ``placed`` as soon as it is
    created) and return it once it serves (``lora``: serving LoRA versions)."""
    spec = IslandSpec(
        id=island_id,
        board_url=board_url,
        run=run,
        poll_interval_s=poll_interval_s,
        device=device,
        work_dir=str(Path(fleet.work_dir) / run / island_id),
        startup_timeout_s=fleet.startup_timeout_s,
        island=fleet.engine,
        lora=lora,
    )
    creds = Secrets({k: os.environ[k] for k in fleet.env if k in os.environ})
    res = fleet.resources
    asked = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, **res.custom}

    async def launch() -> RayIsland:
        import ray
        from ray.exceptions import RayError

        actor_class: Any = ray.remote(IslandActor)
        actor = actor_class.options(
            name=f"{island_id}.{uuid.uuid4().hex[:8]}",
            num_cpus=res.num_cpus,
            num_gpus=res.num_gpus,
            resources=res.custom or None,
            max_restarts=0,
            max_concurrency=8,
        ).remote(spec, creds)
        placed(actor)
        try:
            with anyio.fail_after(fleet.startup_timeout_s):
                url, token = await actor.start.remote()
        except BaseException as exc:  # it did not come up: nothing of it stays
            with anyio.CancelScope(shield=True):
                await _kill(actor, graceful=False)
            if isinstance(exc, TimeoutError):
                raise FleetError(
                    f"{island_id} was not serving after {fleet.startup_timeout_s}s "
                    f"(fleet.ray.startup_timeout_s): no node may have the resources it asks "
                    f"for ({asked}, fleet.ray.resources), or see its logs under "
                    f"{spec.work_dir}/logs"
                ) from None
            if isinstance(exc, RayError):
                cause = getattr(exc, "cause", None) or exc  # a task error's own exception
                raise FleetError(f"{island_id} on Ray did not start: {cause}") from None
            raise
        log.info("ray_island_serving", island=island_id, url=url)
        return RayIsland(
            EndpointRef(id=island_id, url=url, token=token), actor, fleet.health_interval_s
        )

    return launch


@dataclass
class RayFleet:
    """The run's islands on Ray: those that served first, and every actor ever placed (all
    killed when the run ends, whatever state they are in)."""

    fleet: RayFleetConfig
    board_url: str
    run: str
    device: str
    poll_interval_s: float
    lora: LoraServing | None = None
    islands: list[RayIsland] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)

    def launcher(self, island_id: str) -> Callable[[], Awaitable[RayIsland]]:
        """Start island ``island_id`` (a new actor each call), tracked for the end of the run."""
        return launcher(
            self.fleet,
            island_id,
            board_url=self.board_url,
            run=self.run,
            device=self.device,
            poll_interval_s=self.poll_interval_s,
            placed=self.actors.append,
            lora=self.lora,
        )

    @property
    def launchers(self) -> dict[str, Launch]:
        return {r.ref.id: self.launcher(r.ref.id) for r in self.islands}


@asynccontextmanager
async def ray_fleet(
    fleet: RayFleetConfig,
    *,
    board_url: str,
    run: str,
    device: str,
    poll_interval_s: float,
    lora: LoraServing | None = None,
) -> AsyncIterator[RayFleet]:
    """Start ``fleet.islands`` islands (``ray-<i>``) concurrently, serving LoRA versions with
    ``lora``; yield them once every one serves; kill every actor started meanwhile
    (replacements too) on exit."""
    await anyio.to_thread.run_sync(connect, fleet, run)
    out = RayFleet(fleet, board_url, run, device, poll_interval_s, lora)
    try:
        ids = [f"ray-{i}" for i in range(fleet.islands)]
        started: dict[str, RayIsland] = {}

        async def one(island_id: str) -> None:
            started[island_id] = await out.launcher(island_id)()

        async with anyio.create_task_group() as tg:
            for i in ids:
                tg.start_soon(one, i)
        out.islands = [started[i] for i in ids]
        yield out
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for actor in out.actors:
                    tg.start_soon(partial(_kill, actor, graceful=True))
