"""Scripted islands of supervised endpoints, and an event sink that keeps the fleet's events:
for the supervisor's and the Ray scaler's state-machine tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from orchestrator.errors import FleetError
from orchestrator.fleet.supervisor import Down, Island
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef, NullEvents


class Events(NullEvents):
    def __init__(self) -> None:
        self.seen: list[tuple[float, str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        if kind.startswith("island_"):
            self.seen.append((anyio.current_time(), kind, fields))

    def kinds(self) -> list[str]:
        return [k for _, k, _ in self.seen]


@dataclass
class Fleet:
    """Scripted islands: each launch of an endpoint either comes up (a new url) or fails; the
    journal records, with the time, every launch, every stop and whether the endpoint was in
    the pool's rotation when it was stopped."""

    pool: Pool
    fail: dict[str, int] = field(default_factory=dict)
    """Endpoint → how many of its next launches fail."""
    journal: list[tuple[float, str, str, bool]] = field(default_factory=list)
    current: dict[str, FakeIsland] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)

    def island(self, endpoint: str) -> FakeIsland:
        n = self.launches.get(endpoint, 0)
        self.launches[endpoint] = n + 1
        r = FakeIsland(EndpointRef(id=endpoint, url=f"http://{endpoint}/{n}"), self)
        self.current[endpoint] = r
        return r

    def launcher(self, endpoint: str) -> Any:
        async def launch() -> Island:
            self.journal.append((anyio.current_time(), "launch", endpoint, False))
            if self.fail.get(endpoint, 0) > 0:
                self.fail[endpoint] -= 1
                raise FleetError(f"{endpoint} exited before it was ready (code 1)")
            return self.island(endpoint)

        return launch

    def in_rotation(self, endpoint: str) -> bool:
        ep = self.pool.endpoints.get(endpoint)
        return ep is not None and not ep.removed


@dataclass
class FakeIsland:
    ref: EndpointRef
    fleet: Fleet
    exit: anyio.Event = field(default_factory=anyio.Event)
    code: int = 0
    stopped: bool = False

    async def down(self) -> Down:
        await self.exit.wait()
        return Down(f"{self.ref.id} exited with code {self.code}", self.code)

    async def stop(self) -> None:
        self.stopped = True
        self.fleet.journal.append(
            (anyio.current_time(), "stop", self.ref.id, self.fleet.in_rotation(self.ref.id))
        )

    def die(self, code: int = -9) -> None:
        self.code = code
        self.exit.set()
