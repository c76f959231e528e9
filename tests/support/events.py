"""A scripted pool run that writes a real event log."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import anyio
from trio.testing import MockClock

from orchestrator.errors import EndpointError
from orchestrator.loop.pool import Pool
from orchestrator.observe.metrics import Tee
from orchestrator.record.events import EventLog
from orchestrator.types import (
    EndpointRef,
    EventSink,
)
from policies.wire.lane import GenerateRequest, VersionBounds
from tests.support.fakes import ScriptedTransport
from tests.support.waiting import elapse


def bounded_request(lo: int | None, hi: int | None = None) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_tokens=4, policy_version=VersionBounds(min=lo, max=hi)
    )


def pool_run(directory: Path, also: EventSink | None = None) -> ScriptedTransport:
    """Calls with mixed bounds through a fleet where versions move, one endpoint dies, one lies."""
    t = ScriptedTransport(
        {"a": 1, "b": 1, "c": 1, "d": 0},
        latency={"a": 0.02, "b": 0.05, "c": 0.03, "d": 0.01},
        fail_after={"c": 4},
    )

    async def main() -> None:
        log = EventLog(directory, flush_every=7)
        pool = Pool(
            t,  # type: ignore[arg-type]
            version_wait_s=30.0,
            poll_interval_s=1.0,
            max_inflight=2,
            events=Tee(log, also) if also is not None else log,
        )
        for name in t.versions:
            pool.add(EndpointRef(id=name, url=f"http://{name}", weight=2.0 if name == "a" else 1.0))
        await pool.refresh_all()
        rng = random.Random(0)

        async def call(i: int) -> None:
            await elapse(rng.random() * 0.2)
            lo = rng.choice([None, 0, 1, 1, 2])
            with contextlib.suppress(EndpointError):
                await pool.generate(
                    bounded_request(lo), affinity=rng.choice([None, "a", "b"]), priority=i
                )

        async def fleet_moves() -> None:
            await elapse(0.1)
            t.versions["d"] = None  # d stops serving without telling the pool → 409s
            await elapse(0.1)
            t.versions["a"] = t.versions["b"] = 2  # a new version lands
            await pool.refresh_all()

        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet_moves)
            for i in range(40):
                tg.start_soon(call, i)
        pool.events.close()

    run_in_virtual_time(main)
    return t


def run_in_virtual_time(fn: Any) -> None:
    anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
