"""The pool's routing, waiting, failover and breaker — deterministic, on trio's mock clock."""

from __future__ import annotations

import contextlib

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from orchestrator.errors import EndpointError
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef
from policies.wire.lane import GenerateRequest, VersionBounds
from tests.support.fakes import ScriptedTransport
from tests.support.waiting import elapse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def _pool(t: ScriptedTransport, **kw: float) -> Pool:
    pool = Pool(t, version_wait_s=kw.pop("wait", 30.0), poll_interval_s=1.0, max_inflight=2, **kw)  # type: ignore[arg-type]
    for name in t.versions:
        pool.add(EndpointRef(id=name, url=f"http://{name}"))
    return pool


def bounded_request(
    lo: int | None = None, hi: int | None = None, prompt: int = 5
) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=list(range(1, prompt + 1)),
        max_tokens=4,
        policy_version=VersionBounds(min=lo, max=hi),
    )


@settings(max_examples=30, deadline=None)
@given(
    versions=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    bounds=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=12),
)
def test_routing_never_leaves_the_bounds(
    versions: list[int], bounds: list[tuple[int, int]]
) -> None:
    async def main() -> None:
        t = ScriptedTransport({f"e{i}": v for i, v in enumerate(versions)})
        pool = _pool(t, wait=5.0)
        await pool.refresh_all()
        async with anyio.create_task_group() as tg:
            for lo, width in bounds:
                tg.start_soon(_try, pool, bounded_request(lo, lo + width))
        for name, req, resp in t.served:
            assert req.policy_version.admits(resp.policy_version.start), name
        for name, req in t.calls:  # never even *sent* outside the bounds
            assert req.policy_version.admits(t.versions[name] or 0)

    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


async def _try(pool: Pool, req: GenerateRequest) -> None:
    with contextlib.suppress(EndpointError):  # unsatisfiable bounds time out; that is fine here
        await pool.generate(req)


async def test_waits_for_a_version_without_polling_then_serves() -> None:
    t = ScriptedTransport({"a": 0, "b": 0})
    pool = _pool(t)
    await pool.refresh_all()
    got: list[int] = []

    async def call() -> None:
        resp, _, _ = await pool.generate(bounded_request(1))
        got.append(resp.policy_version.start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await elapse(5)
        assert got == []  # waiting,
        assert t.calls == []  # and nothing was sent
        t.versions["b"] = 1
        await pool.refresh_all()
    assert got == [1]
    assert [name for name, _ in t.calls] == ["b"]


async def test_the_smallest_context_an_endpoint_reports_bounds_every_call() -> None:
    t = ScriptedTransport({"a": 0, "b": 0, "c": 0}, contexts={"a": 4096, "b": 1024})
    pool = _pool(t)
    assert pool.max_context() is None  # nothing reported yet
    await pool.refresh_all()
    assert pool.max_context() == 1024  # c reports none, so it does not bound
    pool.remove("b")
    assert pool.max_context() == 4096


async def test_wait_gives_up_naming_the_key() -> None:
    t = ScriptedTransport({"a": 0})
    pool = _pool(t, wait=3.0)
    await pool.refresh_all()
    with pytest.raises(EndpointError, match=r"timeouts\.version_wait_s"):
        await pool.generate(bounded_request(2))


async def test_failover_resends_the_same_prefix_elsewhere() -> None:
    t = ScriptedTransport({"a": 0, "b": 0})
    pool = _pool(t)
    await pool.refresh_all()
    t.fail_after["a"] = 0  # a dies on its next call
    req = bounded_request(0, prompt=9)
    _, ep, attempts = await pool.generate(req, affinity="a")
    assert (ep.id, attempts) == ("b", 2)
    (_, first), (_, second) = t.calls
    assert first.prompt_token_ids == second.prompt_token_ids == req.prompt_token_ids
    assert len(t.served) == 1  # nothing duplicated
    assert not pool.endpoints["a"].healthy


async def test_second_failure_raises_for_the_episode_to_record() -> None:
    t = ScriptedTransport({"a": 0, "b": 0}, fail_after={"a": 0, "b": 0})
    pool = _pool(t)
    await pool.refresh_all()
    with pytest.raises(EndpointError, match="connection reset"):
        await pool.generate(bounded_request(0))
    assert len(t.calls) == 2


async def test_oldest_episode_is_served_first() -> None:
    t = ScriptedTransport({"a": 0}, latency={"a": 1.0})
    pool = _pool(t)
    pool.endpoints["a"].max_inflight = 1
    pool.endpoints["a"].limit = 1.0
    await pool.refresh_all()
    order: list[float] = []

    async def call(priority: float) -> None:
        await pool.generate(bounded_request(0), priority=priority)
        order.append(priority)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 50.0)  # takes the only slot
        await elapse(0.1)
        for p in (30.0, 10.0, 20.0):  # queue up, newest first
            tg.start_soon(call, p)
            await elapse(0.01)
    assert order == [50.0, 10.0, 20.0, 30.0]


async def test_breaker_opens_after_repeated_failures_and_recovers() -> None:
    t = ScriptedTransport({"a": 0, "b": 0})
    pool = _pool(t, breaker_failures=2, breaker_cooldown_s=60.0)
    await pool.refresh_all()
    t.broken.add("a")  # health checks pass, calls fail (an engine answering 500s)
    for _ in range(2):
        await pool.generate(bounded_request(0), affinity="a")
        await pool.refresh_all()
    assert pool.endpoints["a"].healthy
    t.broken.clear()
    await pool.generate(bounded_request(0), affinity="a")
    assert t.calls[-1][0] == "b"  # open: healthy, but not routed to until the cooldown ends
    await elapse(61)
    await pool.generate(bounded_request(0), affinity="a")
    assert t.calls[-1][0] == "a"  # half-open probe succeeded
    assert pool.endpoints["a"].failures == 0


async def test_removed_endpoint_gets_no_new_calls() -> None:
    t = ScriptedTransport({"a": 0, "b": 0})
    pool = _pool(t)
    await pool.refresh_all()
    pool.remove("a")
    for _ in range(3):
        await pool.generate(bounded_request(0), affinity="a")
    assert {name for name, _ in t.calls} == {"b"}
