"""Supervision of the endpoints the orchestrator started: deregister the dead, restart, give up.

:class:`Supervisor` tends every endpoint it is given — a :class:`Island` (what runs now) and a
:data:`Launch` (how to start it again) — and guarantees, per endpoint:

- **deregistered at once**: when the island exits, or the pool's health checks have failed for
  ``unhealthy_s`` (judged as each check completes), the endpoint is removed from the pool
  *before* anything else happens, so no new call is routed to it (calls in flight fail over with
  their token prefix, as for any failed call: :mod:`orchestrator.loop.pool`); then the island
  is stopped and reaped (a hung one is killed);
- **bounded restarts with backoff**: restart ``n`` (1, 2, …) starts after
  :meth:`RestartPolicy.delay` ``(n)`` seconds (doubling from ``fleet.restart_backoff_s``, capped
  at ``fleet.restart_backoff_max_s``); an attempt that fails to come up counts too; after
  ``fleet.max_restarts`` attempts the endpoint stays deregistered and an error naming
  ``fleet.max_restarts`` is logged;
- **re-registered under the same id** once the new island serves (an island starts on the
  board's newest version, so it never serves an older one than it did before); an endpoint the
  user had removed (admin API) when it died is restarted but left out of rotation;
- **counted**: events ``island_died`` (``endpoint``, ``reason``, ``exit_code``, ``restarts``),
  ``island_restarted`` (``endpoint``, ``restart``, ``url``, ``backoff_s``) and
  ``island_gave_up`` (``endpoint``, ``restarts``, ``reason``) go to the run's event sink (event
  log and Prometheus metrics).

When an endpoint gives up and the pool has no live endpoint left and none is being restarted,
:meth:`Supervisor.run` raises :class:`~orchestrator.errors.FleetError`: the run stops with that
one line instead of waiting for endpoints that will not come.

The supervisor knows nothing of processes: an island is anything that can say when it went down
and be stopped (local subprocesses: :class:`~orchestrator.fleet.children.LocalIsland`). Not
covered: endpoints it did not start (``fleet.endpoints``, admin additions) are never restarted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from orchestrator.errors import FleetError
from orchestrator.loop.pool import Pool
from orchestrator.types import NULL_EVENTS, EndpointRef, EventSink

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Down:
    """Why an island stopped serving: a readable ``reason`` and its exit code (None: it did not
    exit by itself, or the launcher has no such notion)."""

    reason: str
    exit_code: int | None = None


class Island(Protocol):
    """One running instance of a supervised endpoint."""

    @property
    def ref(self) -> EndpointRef: ...

    async def down(self) -> Down:
        """Return when the island has stopped serving by itself (e.g. its process exited)."""
        ...

    async def stop(self) -> None:
        """Stop it and release everything it holds; safe to call when it already exited."""
        ...


Launch = Callable[[], Awaitable[Island]]
"""Start a new island of one endpoint; return once it serves (raise FleetError if it cannot)."""


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how soon a dead endpoint is restarted (the ``fleet.restart*`` keys)."""

    max_restarts: int
    backoff_s: float
    backoff_max_s: float

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart ``restart`` (1-based): ``backoff_s`` doubled each
        time, at most ``backoff_max_s``."""
        return min(self.backoff_s * 2.0 ** (restart - 1), self.backoff_max_s)


class Supervisor:
    """Tends the endpoints of ``launchers`` in ``pool`` (see the module docstring)."""

    def __init__(
        self,
        pool: Pool,
        launchers: Mapping[str, Launch],
        policy: RestartPolicy,
        *,
        unhealthy_s: float,
        events: EventSink = NULL_EVENTS,
    ) -> None:
        self.pool = pool
        self.launchers = dict(launchers)
        self.policy = policy
        self.unhealthy_s = unhealthy_s
        self.events = events
        self.restarts: dict[str, int] = {}
        """Restart attempts per endpoint so far."""
        self.gave_up: set[str] = set()
        self._restarting: set[str] = set()
        self._last: dict[str, Down] = {}
        self._tg: TaskGroup | None = None
        self._tending: dict[str, tuple[anyio.CancelScope, list[Island]]] = {}

    async def run(
        self,
        islands: Sequence[Island],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Tend ``islands`` (one per launcher, already registered) until cancelled, and those
        :meth:`add` ed meanwhile; raises FleetError once no endpoint is left to serve. Started
        with ``tg.start``, it returns once :meth:`add` may be called."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for island in islands:
                self._start_tending(island)
            task_status.started()
            await anyio.sleep_forever()

    def add(self, endpoint: str, launch: Launch, island: Island) -> None:
        """Tend one more endpoint from now on (its serving ``island``, already registered, and
        how to start it again); needs :meth:`run` going."""
        if self._tg is None:
            raise RuntimeError("Supervisor.add needs Supervisor.run going")
        self.launchers[endpoint] = launch
        self._start_tending(island)

    async def retire(self, endpoint: str) -> Island | None:
        """Stop tending ``endpoint`` (a restart in progress is abandoned); its island, for the
        caller to stop, or None when none runs (it was down, or gave up)."""
        scope, current = self._tending.pop(endpoint, (None, []))
        self.launchers.pop(endpoint, None)
        if scope is not None:
            scope.cancel()
        return current[0] if current else None

    def _start_tending(self, island: Island) -> None:
        assert self._tg is not None
        scope, current = anyio.CancelScope(), [island]
        self._tending[island.ref.id] = scope, current

        async def tend() -> None:
            with scope:
                await self._tend(current)

        self._tg.start_soon(tend)

    async def _tend(self, current: list[Island]) -> None:
        """Watch ``current[0]``, replacing it in ``current`` when it is restarted; an empty
        ``current`` while it is down."""
        island = current[0]
        endpoint = island.ref.id
        while True:
            down = await self._until_down(island)
            registered = self._deregister(endpoint)
            self._died(endpoint, down)
            self._restarting.add(endpoint)
            current.clear()
            try:
                await island.stop()
                restarted = await self._restart(endpoint)
            finally:
                self._restarting.discard(endpoint)
            if restarted is None:
                self._give_up(endpoint)
                return
            island = restarted
            current.append(island)
            if registered:
                self.pool.add(island.ref)

    async def _until_down(self, island: Island) -> Down:
        """The first of: the island going down by itself, or staying unhealthy too long."""
        result: list[Down] = []
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                result.append(await island.down())
                tg.cancel_scope.cancel()

            async def unhealthy() -> None:
                # judged only while it is in rotation: one the user removed is not probed
                endpoint = island.ref.id
                while not (
                    self._registered(endpoint)
                    and self.pool.unhealthy_for(endpoint) >= self.unhealthy_s
                ):
                    await self.pool.checked(endpoint)
                failed = self.pool.unhealthy_for(endpoint)
                result.append(Down(f"health checks failed for {failed:.1f}s (fleet.unhealthy_s)"))
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            tg.start_soon(unhealthy)
        return result[0]

    def _registered(self, endpoint: str) -> bool:
        ep = self.pool.endpoints.get(endpoint)
        return ep is not None and not ep.removed

    def _deregister(self, endpoint: str) -> bool:
        """Remove ``endpoint`` from the pool; whether it was registered."""
        if not self._registered(endpoint):
            return False
        self.pool.remove(endpoint)
        return True

    async def _restart(self, endpoint: str) -> Island | None:
        """A new serving island, or None once ``max_restarts`` attempts are spent."""
        while self.restarts.get(endpoint, 0) < self.policy.max_restarts:
            n = self.restarts[endpoint] = self.restarts.get(endpoint, 0) + 1
            backoff = self.policy.delay(n)
            log.info("island_restarting", endpoint=endpoint, restart=n, backoff_s=backoff)
            await anyio.sleep(backoff)
            try:
                island = await self.launchers[endpoint]()
            except FleetError as exc:
                self._died(endpoint, Down(f"restart {n} failed: {exc}"))
                continue
            self.events.emit(
                "island_restarted",
                endpoint=endpoint,
                restart=n,
                url=island.ref.url,
                backoff_s=backoff,
            )
            log.info("island_restarted", endpoint=endpoint, restart=n, url=island.ref.url)
            return island
        return None

    def _died(self, endpoint: str, down: Down) -> None:
        self._last[endpoint] = down
        restarts = self.restarts.get(endpoint, 0)
        self.events.emit(
            "island_died",
            endpoint=endpoint,
            reason=down.reason,
            exit_code=down.exit_code,
            restarts=restarts,
        )
        log.warning(
            "island_died",
            endpoint=endpoint,
            reason=down.reason,
            exit_code=down.exit_code,
            restarts=restarts,
        )

    def _give_up(self, endpoint: str) -> None:
        n = self.restarts.get(endpoint, 0)
        reason = (
            f"{endpoint} is out of rotation for the rest of the run: it went down {n + 1} times "
            f"(last: {self._last[endpoint].reason}) and fleet.max_restarts = "
            f"{self.policy.max_restarts} restarts are spent"
        )
        self.gave_up.add(endpoint)
        self.events.emit("island_gave_up", endpoint=endpoint, restarts=n, reason=reason)
        log.error("island_gave_up", endpoint=endpoint, restarts=n, error=reason)
        if not self.pool.live() and not self._restarting:
            gone = ", ".join(sorted(self.gave_up))
            raise FleetError(
                f"no rollout endpoint is left: {gone} died and used up their restarts "
                f"(fleet.max_restarts = {self.policy.max_restarts}); see the engine logs under "
                "<run dir>/logs"
            )
