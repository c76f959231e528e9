"""The codec's worker threads: one pool per process, shared by every encode and apply.

:func:`workers` returns the process's :class:`Pool`: one thread per core the process may run on
(its affinity). An apply decompresses, applies and verifies its sections there; an encode scans
for changes there, and writes and compresses each tensor's section there too, ahead of any
queued scan (:meth:`Pool.submit_first`). A section is what the encode's pipeline waits on, and
the scans queued behind it keep every thread busy meanwhile; a thread of its own for sections
either idled (where a scan thread is bound by a core's own memory reads, two scan threads read
nearly twice as fast as one) or took turns with the scan threads on the same cores.

A streamed publish encodes a version as dozens of chunk patches and a replica applies as many; a
pool started per patch cost a thread start and new per-thread scan buffers
(:func:`policies.codec.ops.start_changes`) each time, and two patches encoded at once ran two
pools on the same cores.

Guarantees: the codec's jobs never wait on other jobs of the pool, so callers sharing it cannot
deadlock; jobs submitted first run first among those of the same kind; a forked child gets a pool
of its own (pools are kept per process id: a pool's threads do not survive a fork). The threads
are daemons that idle on the queue: a process exits without shutting the pool down.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_FIRST, _QUEUED = 0, 1


class Pool(Executor):
    """A fixed set of threads taking jobs by priority, then in order of submission."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.PriorityQueue[tuple[int, int, Callable[[], None]]] = queue.PriorityQueue()
        self._order = itertools.count()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` behind every job already queued."""
        return self._queue(_QUEUED, fn, *args, **kwargs)

    def submit_first(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` ahead of the jobs queued with :meth:`submit`."""
        return self._queue(_FIRST, fn, *args, **kwargs)

    def _queue(
        self, priority: int, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[R]:
        future: Future[R] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._jobs.put((priority, next(self._order), run))
        return future

    def _work(self) -> None:
        while True:
            self._jobs.get()[2]()


_lock = threading.Lock()
_pools: dict[int, Pool] = {}


def _cores() -> int:
    """The cores this process may run on (its affinity: a rank pinned to one core has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def workers() -> Pool:
    """This process's codec pool, started on first use."""
    pid = os.getpid()
    with _lock:
        pool = _pools.get(pid)
        if pool is None:
            pool = _pools[pid] = Pool(_cores(), "codec")
        return pool
