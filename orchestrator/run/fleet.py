"""The run's fleet, opened and closed in one place.

:func:`open_fleet` opens, in this order, the HTTP session of the request lane, the local
engines and islands (:func:`~orchestrator.fleet.local.local_fleet`) and the islands on Ray
(``[fleet.ray]``), and yields a :class:`RunFleet` once every one of them serves: the pool
routing over them and the remote endpoints (``fleet.endpoints``), and what tends them while the
run goes on (the supervisor, the Ray islands' scaler). On exit, whatever the cause, they close in
the reverse order: every Ray actor ever placed is killed, every local engine and island is
stopped and reaped, then the session closes. With ``trainer.lora`` every engine and island
serves LoRA versions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from orchestrator.config import Config
from orchestrator.fleet.islands import LoraServing
from orchestrator.fleet.local import LocalFleet, fleet_supervisor, local_fleet
from orchestrator.fleet.ray_scale import Scaler
from orchestrator.fleet.supervisor import Island
from orchestrator.loop.client import HttpTransport
from orchestrator.loop.pool import Pool
from orchestrator.types import EventSink

if TYPE_CHECKING:
    from orchestrator.fleet.ray_launch import RayFleet


@dataclass
class RunFleet:
    """The open fleet: the pool over every endpoint, and the tasks that tend the fleet."""

    pool: Pool
    supervise: list[Callable[[], Coroutine[Any, Any, None]]]
    """Run beside the loop: the supervisor (restarts; adds and retires Ray islands) and the
    scaler, those the config asks for."""
    scaler: Scaler | None
    """The Ray islands' scaler (``orchestrate fleet scale`` through the admin API), or None."""


@asynccontextmanager
async def open_fleet(cfg: Config, model_dir: Path, events: EventSink) -> AsyncIterator[RunFleet]:
    """The fleet of ``cfg`` serving the run's board, every endpoint in the pool (module
    docstring); ``model_dir`` is the base of LoRA versions."""
    lora = _lora_serving(cfg, model_dir)
    async with (
        aiohttp.ClientSession() as session,
        local_fleet(
            cfg.fleet.local_engines,
            board_url=cfg.board_url,
            run=cfg.run.name,
            device=cfg.fleet.device,
            log_dir=cfg.run_dir / "logs",
            poll_interval_s=cfg.board.poll_interval_s,
            startup_timeout_s=cfg.fleet.startup_timeout_s,
            islands=cfg.fleet.islands,
            island_dir=cfg.run_dir / "islands",
            lora=lora,
        ) as local,
        _ray_islands(cfg, lora) as rays,
    ):
        transport = HttpTransport(
            session, connect_s=cfg.timeouts.connect_s, call_s=cfg.timeouts.call_s
        )
        pool = Pool(
            transport,
            version_wait_s=cfg.timeouts.version_wait_s,
            poll_interval_s=cfg.board.poll_interval_s,
            max_inflight=cfg.fleet.max_inflight_per_endpoint,
            breaker_failures=cfg.fleet.breaker_failures,
            breaker_cooldown_s=cfg.fleet.breaker_cooldown_s,
            events=events,
        )
        on_ray = rays.islands if rays is not None else []
        for ref in local.refs + [r.ref for r in on_ray] + cfg.fleet.endpoint_refs():
            pool.add(ref)
        yield _tended(cfg, pool, local, rays, events)


def _tended(
    cfg: Config, pool: Pool, local: LocalFleet, rays: RayFleet | None, events: EventSink
) -> RunFleet:
    """The fleet with its supervisor and scaler, as the config asks."""
    on_ray = rays.islands if rays is not None else []
    # fleet.restart = false: a dead local engine stays in the pool, out of rotation;
    # Ray islands are always tended (the scaler adds and retires them), not restarted
    tended: list[Island] = [*(local.islands if cfg.fleet.restart else []), *on_ray]
    launchers = {**local.launchers, **(rays.launchers if rays is not None else {})}
    supervise: list[Callable[[], Coroutine[Any, Any, None]]] = []
    scaler = None
    if tended or rays is not None:
        supervisor = fleet_supervisor(pool, cfg.fleet, launchers, events=events)
        supervise.append(partial(supervisor.run, tended))
    if rays is not None and cfg.fleet.ray is not None:
        scaler = Scaler(
            pool,
            supervisor,
            [r.ref.id for r in on_ray],
            rays.launcher,
            drain_timeout_s=cfg.fleet.ray.drain_timeout_s,
            events=events,
        )
        supervise.append(scaler.run)
    return RunFleet(pool, supervise, scaler)


def _lora_serving(cfg: Config, model_dir: Path) -> LoraServing | None:
    """How the run's engines serve its LoRA versions (``trainer.lora``), or None."""
    if cfg.trainer.lora is None:
        return None
    return LoraServing(
        base_model=model_dir, max_adapters=cfg.fleet.max_adapters, rank=cfg.trainer.lora.rank
    )


@asynccontextmanager
async def _ray_islands(cfg: Config, lora: LoraServing | None) -> AsyncIterator[RayFleet | None]:
    """The run's Ray islands (``[fleet.ray]``), or None."""
    if cfg.fleet.ray is None:
        yield None
        return
    from orchestrator.fleet.ray_launch import ray_fleet

    async with ray_fleet(
        cfg.fleet.ray,
        board_url=cfg.board_url,
        run=cfg.run.name,
        device=cfg.fleet.device,
        poll_interval_s=cfg.board.poll_interval_s,
        lora=lora,
    ) as rays:
        yield rays
