"""The Ray scaler's state machine with scripted islands, on trio's mock clock: islands added get
new ids, join the pool and are supervised; removal takes the newest first, out of rotation at
once, waits for the calls in flight (up to ``fleet.ray.drain_timeout_s``), then stops them; a
start that fails is an event, not a loop; the admin API scales it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from trio.testing import MockClock

from orchestrator.config import RayFleetConfig
from orchestrator.errors import FleetError, SprawlError
from orchestrator.fleet.cli import _call
from orchestrator.fleet.ray_launch import connect
from orchestrator.fleet.ray_scale import Scaler
from orchestrator.fleet.supervisor import RestartPolicy, Supervisor
from orchestrator.loop.admin import serve_admin
from orchestrator.loop.pool import Pool
from tests.support.fakes import ScriptedTransport
from tests.support.islands import Events, Fleet
from tests.support.waiting import elapse

pytestmark = pytest.mark.anyio
IDS = [f"ray-{i}" for i in range(6)]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


@asynccontextmanager
async def _scaler(
    n: int, drain_timeout_s: float = 5.0
) -> AsyncIterator[tuple[Scaler, Fleet, Events]]:
    events = Events()
    pool = Pool(ScriptedTransport({i: 0 for i in IDS}), version_wait_s=30.0, poll_interval_s=1.0)
    fleet = Fleet(pool)
    first = [fleet.island(f"ray-{i}") for i in range(n)]
    for r in first:
        pool.add(r.ref)
    await pool.refresh_all()
    supervisor = Supervisor(
        pool,
        {r.ref.id: fleet.launcher(r.ref.id) for r in first},
        RestartPolicy(max_restarts=2, backoff_s=1.0, backoff_max_s=1.0),
        unhealthy_s=5.0,
        events=events,
    )
    scaler = Scaler(
        pool,
        supervisor,
        [r.ref.id for r in first],
        fleet.launcher,
        drain_timeout_s=drain_timeout_s,
        events=events,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(supervisor.run, first)  # the scaler adds islands to a running supervisor
        tg.start_soon(scaler.run)
        yield scaler, fleet, events
        tg.cancel_scope.cancel()


def _stopped(fleet: Fleet, island: str) -> bool:
    return fleet.current[island].stopped


def _states(scaler: Scaler) -> list[tuple[str, str]]:
    return [(i["id"], i["state"]) for i in scaler.describe()["islands"]]


async def test_islands_added_get_new_ids_join_the_pool_and_are_supervised() -> None:
    async with _scaler(1) as (scaler, fleet, events):
        assert scaler.scale(3)["target"] == 3
        await elapse(1)
        assert _states(scaler) == [("ray-0", "serving"), ("ray-1", "serving"), ("ray-2", "serving")]
        assert [e for e in ("ray-1", "ray-2") if fleet.in_rotation(e)] == ["ray-1", "ray-2"]
        fleet.current["ray-2"].die()  # an added island is supervised like the first ones
        await elapse(0.5)
        assert _states(scaler)[2] == ("ray-2", "restarting")
        await elapse(2)
        assert fleet.in_rotation("ray-2")
        assert fleet.launches["ray-2"] == 2
    assert events.kinds() == [
        "island_added", "island_added", "island_died", "island_restarted"
    ]  # fmt: skip


async def test_removal_takes_the_newest_first_and_drains_before_it_stops() -> None:
    async with _scaler(3) as (scaler, fleet, events):
        ep = scaler.pool.endpoints["ray-2"]
        ep.outstanding = 1  # a call in flight there
        scaler.scale(1)
        await elapse(0.5)
        # both out of rotation at once; ray-1 (idle) is stopped, ray-2 waits for its call
        assert not fleet.in_rotation("ray-1")
        assert not fleet.in_rotation("ray-2")
        assert _stopped(fleet, "ray-1")
        assert not _stopped(fleet, "ray-2")
        assert _states(scaler) == [("ray-0", "serving"), ("ray-2", "draining")]
        ep.outstanding = 0
        await elapse(0.5)
        assert _stopped(fleet, "ray-2")
        assert _states(scaler) == [("ray-0", "serving")]
        fleet.current["ray-2"].die()  # a removed island is not restarted
        await elapse(5)
        assert fleet.launches["ray-2"] == 1
        removed = [f for _, k, f in events.seen if k == "island_removed"]
        assert sorted((f["endpoint"], f["drained"]) for f in removed) == [
            ("ray-1", True), ("ray-2", True)
        ]  # fmt: skip


async def test_a_call_that_outlasts_the_drain_timeout_is_left_to_fail_over() -> None:
    async with _scaler(2, drain_timeout_s=3.0) as (scaler, fleet, events):
        scaler.pool.endpoints["ray-1"].outstanding = 1  # never finishes
        scaler.scale(1)
        await elapse(2.5)
        assert not _stopped(fleet, "ray-1")
        await elapse(1)
        assert _stopped(fleet, "ray-1")
        [removed] = [f for _, k, f in events.seen if k == "island_removed"]
        assert removed == {"endpoint": "ray-1", "drained": False}


async def test_an_island_that_cannot_start_is_an_event_and_is_not_retried() -> None:
    async with _scaler(1) as (scaler, fleet, events):
        fleet.fail["ray-1"] = 1
        scaler.scale(2)
        await elapse(5)
        assert _states(scaler) == [("ray-0", "serving")]
        assert fleet.launches.get("ray-1", 0) == 0  # the launch raised before an island
        [failed] = [f for _, k, f in events.seen if k == "island_start_failed"]
        assert failed["endpoint"] == "ray-1"
        assert "exited before it was ready" in failed["error"]
        scaler.scale(2)  # asking again tries a new island
        await elapse(1)
        assert _states(scaler) == [("ray-0", "serving"), ("ray-2", "serving")]


async def test_an_island_removed_while_it_restarts_is_not_started_again() -> None:
    async with _scaler(2) as (scaler, fleet, _):
        fleet.current["ray-1"].die()
        await elapse(0.5)  # within its 1 s backoff
        scaler.scale(1)
        await elapse(5)
        assert fleet.launches["ray-1"] == 1
        assert _states(scaler) == [("ray-0", "serving")]


def _args(
    url: str, action: str, islands: int | None = None, wait: bool = False
) -> argparse.Namespace:
    return argparse.Namespace(
        orchestrator=url, token=None, action=action, islands=islands, wait=wait, wait_s=20.0
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_admin_api_scales_the_islands(tmp_path: Path) -> None:
    async with _scaler(1) as (scaler, _, _), anyio.create_task_group() as tg:
        url = await tg.start(
            lambda task_status: serve_admin(
                scaler.pool,
                host="127.0.0.1",
                port=0,
                token=None,
                admin_file=tmp_path / "admin.json",
                islands=scaler,
                task_status=task_status,
            )
        )
        asked = await _call(_args(str(tmp_path), "scale", 2))
        assert asked["target"] == 2
        state = await _call(_args(str(tmp_path), "up", 2, wait=True))  # until both serve
        assert [i["state"] for i in state["islands"]] == ["serving", "serving"]
        assert (await _call(_args(str(tmp_path), "down", 0)))["target"] == 0
        with pytest.raises(SprawlError, match=r"HTTP 400: islands: Input should be greater"):
            await _call(_args(str(tmp_path), "scale", -1))
        tg.cancel_scope.cancel()
    assert url.startswith("http://127.0.0.1:")


def test_without_ray_installed_the_run_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(FleetError, match=r"fleet\.ray needs the ray package: pip install"):
        connect(RayFleetConfig(), "run")
