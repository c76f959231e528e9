"""The codec's thread pool: an encode's sections run ahead of its queued scans."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from policies.codec.workers import Pool


def _blocked_pool() -> tuple[Pool, threading.Event]:
    """A one-thread pool whose thread is held until the returned event is set."""
    pool, release, started = Pool(1, "test"), threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    pool.submit(hold)
    assert started.wait(10)
    return pool, release


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


def test_jobs_queued_by_then_run_before_submitted_ones_and_each_kind_in_order() -> None:
    pool, release = _blocked_pool()
    ran: list[str] = []
    jobs = [pool.submit(ran.append, f"scan {i}") for i in range(3)]
    jobs += [pool.then([_done()], lambda _, i=i: ran.append(f"section {i}")) for i in range(2)]
    release.set()
    for job in jobs:
        job.result(10)
    assert ran == ["section 0", "section 1", "scan 0", "scan 1", "scan 2"]


def test_a_failing_job_hands_its_error_to_the_caller_and_the_pool_goes_on() -> None:
    pool = Pool(1, "test")
    failed = pool.submit(int, "not a number")
    with pytest.raises(ValueError, match="not a number"):
        failed.result(10)
    assert pool.submit(int, "7").result(10) == 7


def test_a_cancelled_job_does_not_run() -> None:
    pool, release = _blocked_pool()
    ran: list[int] = []
    job = pool.submit(ran.append, 1)
    assert job.cancel()
    after = pool.submit(ran.append, 2)
    release.set()
    after.result(10)
    assert ran == [2]


def test_then_runs_on_every_result_in_order_once_the_last_is_done() -> None:
    pool, release = _blocked_pool()
    inputs = [pool.submit(int, str(i)) for i in range(3)]
    joined = pool.then(inputs, lambda results: results)
    assert not joined.done()
    release.set()
    assert joined.result(10) == [0, 1, 2]


def test_then_is_queued_ahead_of_queued_jobs() -> None:
    pool, release = _blocked_pool()
    ran: list[str] = []
    scan = pool.submit(ran.append, "scan 0")
    later = [pool.submit(ran.append, f"scan {i}") for i in (1, 2)]
    section = pool.then([scan], lambda _: ran.append("section 0"))
    release.set()
    section.result(10)
    for job in later:
        job.result(10)
    assert ran == ["scan 0", "section 0", "scan 1", "scan 2"]


def test_then_hands_an_inputs_error_on_without_running() -> None:
    pool = Pool(2, "test")
    ran: list[object] = []
    joined = pool.then([pool.submit(int, "1"), pool.submit(int, "x")], ran.append)
    with pytest.raises(ValueError, match="'x'"):
        joined.result(10)
    assert ran == []
