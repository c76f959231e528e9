"""The supervisor's state machine with scripted islands, on trio's mock clock: deregistered
before anything else, restarted after a doubling backoff, bounded, re-registered under its id,
counted in events and metrics, and the run stopped only when no endpoint is left."""

from __future__ import annotations

import anyio
import pytest
from trio.testing import MockClock

from orchestrator.config import load_config
from orchestrator.errors import ConfigError, FleetError
from orchestrator.fleet.supervisor import RestartPolicy, Supervisor
from orchestrator.loop.pool import Pool
from orchestrator.observe.metrics import RunMetrics, Tee
from tests.support.fakes import ScriptedTransport
from tests.support.islands import Events, Fleet
from tests.support.waiting import elapse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


async def _setup(
    endpoints: list[str], *, max_restarts: int = 3, dead: set[str] | None = None
) -> tuple[Pool, Fleet, Supervisor, Events, RunMetrics]:
    transport = ScriptedTransport({e: 0 for e in endpoints}, dead=dead or set())
    events, metrics = Events(), RunMetrics()
    pool = Pool(transport, version_wait_s=30.0, poll_interval_s=1.0)
    fleet = Fleet(pool)
    for e in endpoints:
        pool.add(fleet.island(e).ref)
    await pool.refresh_all()
    supervisor = Supervisor(
        pool,
        {e: fleet.launcher(e) for e in endpoints},
        RestartPolicy(max_restarts=max_restarts, backoff_s=1.0, backoff_max_s=3.0),
        unhealthy_s=5.0,
        events=Tee(events, metrics),
    )
    return pool, fleet, supervisor, events, metrics


def test_the_backoff_doubles_from_the_first_wait_up_to_the_cap() -> None:
    policy = RestartPolicy(max_restarts=6, backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


async def test_a_dead_engine_leaves_rotation_first_and_comes_back_under_its_id() -> None:
    pool, fleet, supervisor, events, metrics = await _setup(["engine-0", "engine-1"])
    first = fleet.current["engine-0"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run, list(fleet.current.values()))
        await elapse(10)
        t_death = anyio.current_time()
        first.die(-9)
        await elapse(0.5)  # the supervisor has seen the exit; the backoff is 1 s
        assert not fleet.in_rotation("engine-0")  # no new call goes there, before any restart
        assert fleet.in_rotation("engine-1")
        await elapse(5)
        tg.cancel_scope.cancel()

    # stopped (reaped) while already out of rotation, relaunched after the first backoff
    assert fleet.journal == [
        (t_death, "stop", "engine-0", False),
        (t_death + 1.0, "launch", "engine-0", False),
    ]
    ep = pool.endpoints["engine-0"]
    assert not ep.removed
    assert ep.ref.url == "http://engine-0/1"
    assert events.kinds() == ["island_died", "island_restarted"]
    died, restarted = events.seen[0][2], events.seen[1][2]
    assert died["exit_code"] == -9
    assert died["restarts"] == 0
    assert restarted == {
        "endpoint": "engine-0",
        "restart": 1,
        "url": "http://engine-0/1",
        "backoff_s": 1.0,
    }
    text = metrics.exposition().decode()
    assert 'sprawl_island_deaths_total{endpoint="engine-0"} 1.0' in text
    assert 'sprawl_island_restarts_total{endpoint="engine-0"} 1.0' in text


async def test_restarts_are_bounded_with_a_doubling_backoff_and_the_run_goes_on() -> None:
    _pool, fleet, supervisor, events, metrics = await _setup(["engine-0", "engine-1"])
    fleet.fail["engine-0"] = 10  # never comes up again
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run, list(fleet.current.values()))
        fleet.current["engine-0"].die(1)
        await elapse(60)
        assert fleet.in_rotation("engine-1")  # the other endpoint keeps serving
        tg.cancel_scope.cancel()

    launches = [t for t, what, e, _ in fleet.journal if what == "launch"]
    assert launches == [1.0, 3.0, 6.0]  # waits 1, 2, then 3 (the cap): 3 restarts, no more
    assert not fleet.in_rotation("engine-0")
    assert supervisor.gave_up == {"engine-0"}
    assert events.kinds() == ["island_died"] * 4 + ["island_gave_up"]
    assert [f["restarts"] for _, k, f in events.seen if k == "island_died"] == [0, 1, 2, 3]
    assert "restart 1 failed" in events.seen[1][2]["reason"]
    gave_up = events.seen[-1][2]
    assert gave_up["restarts"] == 3
    assert "fleet.max_restarts = 3" in gave_up["reason"]
    text = metrics.exposition().decode()
    assert 'sprawl_island_deaths_total{endpoint="engine-0"} 4.0' in text
    assert 'sprawl_island_give_ups_total{endpoint="engine-0"} 1.0' in text


async def test_the_run_fails_in_one_line_when_no_endpoint_is_left() -> None:
    _, fleet, supervisor, events, _ = await _setup(["engine-0"], max_restarts=1)
    fleet.fail["engine-0"] = 1
    fleet.current["engine-0"].die(1)
    with (
        anyio.fail_after(30),
        pytest.RaisesGroup(
            pytest.RaisesExc(
                FleetError, match=r"no rollout endpoint is left: engine-0 .*max_restarts"
            )
        ),
    ):
        await supervisor.run(list(fleet.current.values()))
    assert events.kinds() == ["island_died", "island_died", "island_gave_up"]


async def test_an_engine_whose_health_checks_keep_failing_is_replaced() -> None:
    pool, fleet, supervisor, events, _ = await _setup(["engine-0", "engine-1"])
    transport = pool.transport
    assert isinstance(transport, ScriptedTransport)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.watch)
        tg.start_soon(supervisor.run, list(fleet.current.values()))
        await elapse(0.5)
        transport.dead.add("engine-0")  # alive, answers nothing: checks at 1, 2, 3, 4 fail
        await elapse(4.0)
        transport.dead.discard("engine-0")  # answers again before unhealthy_s (5 s)
        await elapse(10)
        tg.cancel_scope.cancel()
    assert events.kinds() == []  # left alone
    assert fleet.in_rotation("engine-0")

    t0 = anyio.current_time()  # the first failed check
    pool, fleet, supervisor, events, _ = await _setup(["engine-0", "engine-1"], dead={"engine-0"})
    hung = fleet.current["engine-0"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.watch)
        tg.start_soon(supervisor.run, list(fleet.current.values()))
        await elapse(7.5)
        tg.cancel_scope.cancel()
    assert hung.stopped  # killed, though it never exited
    died = events.seen[0]
    assert died[1] == "island_died"
    assert died[2]["exit_code"] is None
    assert "fleet.unhealthy_s" in died[2]["reason"]
    assert died[0] - t0 == 5.0  # judged at the check 5 s after the first failed one
    assert fleet.launches["engine-0"] == 2  # relaunched after the backoff


async def test_an_endpoint_the_user_removed_is_restarted_but_left_out_of_rotation() -> None:
    pool, fleet, supervisor, events, _ = await _setup(["engine-0", "engine-1"], dead={"engine-0"})
    pool.remove("engine-0")  # e.g. DELETE /v1/fleet/engine-0
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.watch)
        tg.start_soon(supervisor.run, list(fleet.current.values()))
        await elapse(20)  # not probed while removed: never judged unhealthy
        assert events.kinds() == []
        fleet.current["engine-0"].die(0)
        await elapse(5)
        tg.cancel_scope.cancel()
    assert events.kinds() == ["island_died", "island_restarted"]
    assert not fleet.in_rotation("engine-0")


async def test_an_endpoint_added_again_keeps_its_count_of_calls_served() -> None:
    pool, fleet, _, _, _ = await _setup(["engine-0"])
    pool.endpoints["engine-0"].served[0] = 7  # calls its first island served
    pool.remove("engine-0")
    pool.add(fleet.island("engine-0").ref)
    ep = pool.endpoints["engine-0"]
    assert ep.served == {0: 7}
    assert not ep.healthy


def test_a_backoff_cap_below_the_first_wait_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"fleet\.restart_backoff_max_s \(0\.5\) is below"):
        load_config(None, {"fleet.restart_backoff_s": 2.0, "fleet.restart_backoff_max_s": 0.5})
