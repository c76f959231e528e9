"""Scaling the run's Ray islands while it goes on (``orchestrate fleet up|scale|down``).

:class:`Scaler` holds the number of islands the run should have and reconciles the fleet
towards it, one change at a time (:meth:`Scaler.run`, beside the loop):

- **up**: new islands get the next ids (``ray-<i>``, never reused), start concurrently, and join
  the pool and the supervisor once they serve (an island that cannot start is an
  ``island_start_failed`` event and is tried again at the next change, not in a loop);
- **down**: the newest islands go first (those not serving before those that do). Each is
  drained: taken out of rotation at once (no new calls), its calls in flight get up to
  ``fleet.ray.drain_timeout_s`` to finish — after that the rest fail over with their token
  prefix, as for any failed call — then the supervisor stops tending it and its actor is killed.

Every change is an event (``island_added``, ``island_start_failed``, ``island_draining``,
``island_removed`` with ``drained``) in the run's event log and metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import structlog

from orchestrator.errors import FleetError
from orchestrator.fleet.supervisor import Launch, Supervisor
from orchestrator.loop.pool import Pool
from orchestrator.types import EventSink

log = structlog.get_logger(__name__)


class Scaler:
    """The run's Ray islands and their target count (module docstring)."""

    def __init__(
        self,
        pool: Pool,
        supervisor: Supervisor,
        members: list[str],
        make_launch: Callable[[str], Launch],
        *,
        drain_timeout_s: float,
        events: EventSink,
    ) -> None:
        self.pool = pool
        self.supervisor = supervisor
        self.members = list(members)
        """Island ids, oldest first: serving, starting again after a death, or given up."""
        self.target = len(members)
        self.make_launch = make_launch
        self.drain_timeout_s = drain_timeout_s
        self.events = events
        self.starting: set[str] = set()
        self.draining: set[str] = set()
        self._next = max((int(m.removeprefix("ray-")) for m in members), default=-1) + 1
        self._changed = anyio.Event()

    def scale(self, target: int) -> dict[str, Any]:
        """Ask for ``target`` islands; the change happens in :meth:`run`. What it will do."""
        if target < 0:
            raise ValueError(f"islands: {target} is negative")
        self.target = target
        self._changed.set()
        return self.describe()

    def describe(self) -> dict[str, Any]:
        """``{"target", "islands": [{"id", "state"}]}``; states: ``starting``, ``serving``,
        ``restarting`` (after a death), ``gave_up`` (restarts spent), ``draining``."""
        return {
            "target": self.target,
            "islands": [{"id": i, "state": self._state(i)} for i in self.members],
        }

    def _state(self, island: str) -> str:
        if island in self.draining:
            return "draining"
        if island in self.starting:
            return "starting"
        if island in self.supervisor.gave_up:
            return "gave_up"
        ep = self.pool.endpoints.get(island)
        return "serving" if ep is not None and not ep.removed else "restarting"

    async def run(self) -> None:
        """Reconcile towards the target until cancelled."""
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            live = [m for m in self.members if m not in self.draining]
            if self.target > len(live):
                await self._add(self.target - len(live))
            elif self.target < len(live):
                await self._remove(len(live) - self.target)

    async def _add(self, n: int) -> None:
        ids = [f"ray-{self._next + k}" for k in range(n)]
        self._next += n
        self.members += ids
        self.starting.update(ids)
        async with anyio.create_task_group() as tg:
            for island in ids:
                tg.start_soon(self._start, island)

    async def _start(self, island: str) -> None:
        launch = self.make_launch(island)
        try:
            started = await launch()
        except FleetError as exc:
            self.members.remove(island)
            self.events.emit("island_start_failed", endpoint=island, error=str(exc))
            log.error("island_start_failed", island=island, error=str(exc))
            return
        finally:
            self.starting.discard(island)
        self.pool.add(started.ref)
        self.supervisor.add(island, launch, started)
        self.events.emit("island_added", endpoint=island, url=started.ref.url)
        log.info("island_added", island=island, url=started.ref.url)

    async def _remove(self, n: int) -> None:
        order = sorted(
            (m for m in self.members if m not in self.draining),
            key=lambda m: (self._state(m) == "serving", -int(m.removeprefix("ray-"))),
        )  # not serving first, then the newest
        async with anyio.create_task_group() as tg:
            for island in order[:n]:
                tg.start_soon(self._drain, island)

    async def _drain(self, island: str) -> None:
        self.draining.add(island)
        self.events.emit("island_draining", endpoint=island)
        ep = self.pool.endpoints.get(island)
        if ep is not None and not ep.removed:
            self.pool.remove(island)  # no new calls from here on
        drained = True
        with anyio.move_on_after(self.drain_timeout_s) as waited:
            while ep is not None and ep.outstanding > 0:  # noqa: ASYNC110 (no event for it)
                await anyio.sleep(0.1)
        if waited.cancelled_caught:
            drained = False
        retired = await self.supervisor.retire(island)
        if retired is not None:
            await retired.stop()
        self.members.remove(island)
        self.draining.discard(island)
        self.events.emit("island_removed", endpoint=island, drained=drained)
        log.info("island_removed", island=island, drained=drained)
