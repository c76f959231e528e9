"""The codec's worker threads: one set per process, shared by every encode and apply.

:func:`workers` returns one of three pools:

- ``apply``: one thread per core the process may run on (its affinity); the sections of a
  patch decompressed, applied and verified.
- ``scan``: one thread per core but one (at least one); an encode's change scans and the full
  tensors it compresses. The core left over is the ``write`` thread's.
- ``write``: one thread; an encode's sections written and compressed while the next tensors are
  scanned. With a core of its own it never waits behind a scan: the scan is bound by memory
  (one thread reads most of what two can on a 2-core host), the section by compute, so the two
  overlap where three threads on two cores took turns.

A streamed publish encodes a version as dozens of chunk patches and a replica applies as many; a
pool started per patch cost a thread start and new per-thread scan buffers
(:func:`policies.codec.ops.start_changes`) each time, and two patches encoded at once ran two
pools on the same cores.

Guarantees: the codec's jobs never wait on other jobs of these pools, so callers sharing them
cannot deadlock; a forked child gets pools of its own (they are kept per process id: a pool's
threads do not survive a fork).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

Kind = Literal["apply", "scan", "write"]

_lock = threading.Lock()
_pools: dict[tuple[int, Kind], ThreadPoolExecutor] = {}


def _cores() -> int:
    """The cores this process may run on (its affinity: a rank pinned to one core has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _size(kind: Kind) -> int:
    cores = _cores()
    return {"apply": cores, "scan": max(1, cores - 1), "write": 1}[kind]


def workers(kind: Kind) -> ThreadPoolExecutor:
    """This process's ``kind`` pool, started on first use."""
    key = (os.getpid(), kind)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(_size(kind), thread_name_prefix=f"codec-{kind}")
        return pool
