"""Waiting for what a test means, never for a guess at how long it takes.

A test that sleeps, then asserts, guesses how long the work takes: too short and it fails on a
busy machine, too long and it is slow; and a sleep followed by "nothing changed" passes whether
or not the thing would have happened. A test waits instead on:

- an event the code sets or a future it completes (``anyio.Event``, ``threading.Event``,
  ``Future.result(timeout)``), ``tg.start`` for a service that must be ready, or a log entry
  (:class:`tests.support.logs.Logged`);
- the exact state, polled under a deadline: :func:`until` (async) and :func:`until_sync`
  (threads, subprocesses) are the tests' one poll loop;
- on trio's ``MockClock`` (virtual time), a span of the component's own clock: :func:`elapse`.
  There a sleep is no guess: the clock jumps only once every task is blocked, so after
  ``elapse(5)`` each timer due within the 5 s has fired, in order, and every task has run until
  it waits again (a poll every second has polled five times).

A sleep that is behaviour (a fake's latency, a publisher's pace) is named with its reason in
``tests/test_no_sleeps.py``, which fails on any other sleep under ``tests/``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import trio
from trio.testing import MockClock

T = TypeVar("T")


async def until(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    timeout_s: float = 20.0,
    every_s: float = 0.02,
) -> T:
    """``check()`` (awaited when it is a coroutine) once it is truthy, tried every ``every_s``;
    an ``AssertionError`` naming ``what`` when it is not within ``timeout_s`` (a ``check``
    that hangs counts against it too). An ``AssertionError`` that ``check`` raises (e.g. the
    process it waits on died) ends the wait at once."""
    got: T | None = None
    with anyio.move_on_after(timeout_s):
        while True:
            answer = check()
            got = await answer if inspect.isawaitable(answer) else answer
            if got:
                return got
            await anyio.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {got!r})")


def until_sync(
    check: Callable[[], T], what: str, *, timeout_s: float = 20.0, every_s: float = 0.02
) -> T:
    """:func:`until` for a thread: blocks the caller, so never call it on an event loop."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {got!r})")
        time.sleep(every_s)
    return got


async def elapse(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass: every task runs until it blocks, and every timer
    due meanwhile fires, in order. Refuses a real clock, where this would be a guess."""
    try:
        clock = trio.lowlevel.current_clock()
    except RuntimeError:  # not under trio: asyncio's clock is the real one
        clock = None
    if not isinstance(clock, MockClock):
        raise AssertionError(
            "elapse() is for virtual time: run the test on trio with "
            "MockClock(autojump_threshold=0), or wait for the state it means with until()"
        )
    await anyio.sleep(seconds)
