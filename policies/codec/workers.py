"""The codec's worker threads: one pool per process, shared by every encode and apply.

:func:`workers` returns the process's :class:`Pool`: one thread per core the process may run on
(its affinity). An apply decompresses, applies and verifies its sections there; an encode scans
for changes there, and writes and compresses each tensor's section there too, queued by the
thread that finishes the tensor's scan ahead of any queued scan (:meth:`Pool.then`). A section
is what the encode's pipeline waits on, and the scans queued behind it keep every thread busy
meanwhile; a thread of its own for sections
either idled (where a scan thread is bound by a core's own memory reads, two scan threads read
nearly twice as fast as one) or took turns with the scan threads on the same cores.

A streamed publish encodes a version as dozens of chunk patches and a replica applies as many; a
pool started per patch cost a thread start and new per-thread scan buffers
(:func:`policies.codec.ops.start_changes`) each time, and two patches encoded at once ran two
pools on the same cores.

Guarantees: the codec's jobs never wait on other jobs of the pool (a job that needs others'
results is queued once they are done, :meth:`Pool.then`), so callers sharing it cannot
deadlock; jobs queued first run before the others, each kind in the order it was queued; a
forked child gets a pool of its own (pools are kept per process id: a pool's threads do not
survive a fork). The threads are daemons that idle on the queue: a process exits without
shutting the pool down.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

_FIRST, _QUEUED = 0, 1


class Pool(Executor):
    """A fixed set of threads taking jobs queued first (:meth:`submit_first`), then the others,
    each kind in the order it was queued."""

    def __init__(self, threads: int, name: str) -> None:
        self._jobs: queue.PriorityQueue[tuple[int, int, Callable[[], None]]] = queue.PriorityQueue()
        self._order = itertools.count()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` behind every job already queued."""
        future: Future[R] = Future()
        self._put(_QUEUED, future, lambda: fn(*args, **kwargs))
        return future

    def submit_first(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Queue ``fn(*args, **kwargs)`` ahead of the jobs queued with :meth:`submit`."""
        future: Future[R] = Future()
        self._put(_FIRST, future, lambda: fn(*args, **kwargs))
        return future

    def then(self, inputs: Sequence[Future[T]], fn: Callable[[list[T]], R]) -> Future[R]:
        """``fn`` of the results of ``inputs``, queued first once the last of them is done.

        The thread that completes the last input queues it: no waiting caller has to wake up
        between the jobs of a pipeline. An error of an input is the returned future's (``fn``
        does not run); so is ``fn``'s.
        """
        future: Future[R] = Future()
        left = len(inputs)
        lock = threading.Lock()

        def done(_: Future[T]) -> None:
            nonlocal left
            with lock:
                left -= 1
                if left:
                    return
            failed = next((f for f in inputs if f.cancelled() or f.exception()), None)
            if failed is None:
                self._put(_FIRST, future, lambda: fn([f.result() for f in inputs]))
            elif future.set_running_or_notify_cancel():
                future.set_exception(CancelledError() if failed.cancelled() else failed.exception())

        if not inputs:
            self._put(_FIRST, future, lambda: fn([]))
        for f in inputs:
            f.add_done_callback(done)
        return future

    def _put(self, priority: int, future: Future[R], call: Callable[[], R]) -> None:
        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = call()
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._jobs.put((priority, next(self._order), run))

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
