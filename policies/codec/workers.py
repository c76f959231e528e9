"""The codec's worker threads: one set per process, shared by every encode and apply.

:func:`workers` returns the ``scan`` pool (one thread per core: the change scans, the sections
applied, the full tensors compressed) or the ``write`` thread (an encode's sections written and
compressed while the next tensors are scanned). A streamed publish encodes a version as dozens of
chunk patches and a replica applies as many; a pool started per patch cost a thread start and
new per-thread scan buffers (:func:`policies.codec.ops.start_changes`) each time, and two
patches encoded at once ran two pools on the same cores.

Guarantees: the codec's jobs never wait on other jobs of these pools, so callers sharing them
cannot deadlock; a forked child gets pools of its own (they are kept per process id: a pool's
threads do not survive a fork).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

Kind = Literal["scan", "write"]

_lock = threading.Lock()
_pools: dict[tuple[int, Kind], ThreadPoolExecutor] = {}


def workers(kind: Kind) -> ThreadPoolExecutor:
    """This process's ``kind`` pool, started on first use."""
    key = (os.getpid(), kind)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            size = 1 if kind == "write" else os.cpu_count() or 1
            pool = _pools[key] = ThreadPoolExecutor(size, thread_name_prefix=f"codec-{kind}")
        return pool
