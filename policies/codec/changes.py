"""Finding what changed between two tensors' units, chunk by chunk: the scan a section is
written from, run by the compiled kernel (:func:`policies.codec.kernels_scan.scan_changes`) in
jobs of about :data:`JOB_UNITS` units, in this thread or on a pool.

Guarantees: :func:`find_changes` and :func:`start_changes` return the same :class:`Changes` for
the same tensors (the parts of a pooled scan are joined in range order), every changed unit
classified under its chunk's mode (:data:`policies.codec.ops.SPARSE`, ``BITMASK``, ``DENSE``)
exactly once, the ``sum-128`` terms of the base words that changed summed
(:attr:`Changes.old_words`) and — when ``summing`` — the target's ``sum-128`` lanes summed as it
compared.
Scratch arrays are per thread and reused between jobs; the arrays returned are copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple

import numpy as np

from policies.codec.kernels import I64, U8, U64, UInt
from policies.codec.kernels_scan import scan_changes
from policies.codec.kernels_sum import finish_sum

JOB_UNITS = 1 << 22
"""Units a scan job covers (about: whole chunks); a tensor of at most this many is scanned by one
job."""


class Changes(NamedTuple):
    """The changes of ``b → t`` by chunk mode (what :func:`encode_section` stores)."""

    modes: U8
    spos: I64
    """Changed positions in sparse chunks; ``svals`` their (base, target) units as two rows."""
    svals: UInt
    bpos: I64
    """Changed positions in bitmask chunks; ``bvals`` their (base, target) units."""
    bvals: UInt
    dense_changed: int
    """Changed units in dense chunks (which store every unit)."""
    dense: UInt | None = None
    """Every unit of the dense chunks, in chunk order, as (base, target) rows, when the scan ran
    off the host (:mod:`policies.codec.scan`); ``None``: :func:`encode_section` reads them from
    the tensors."""
    target_sum: U64 | None = None
    """The two lanes of the target's ``sum-128`` checksum, summed by the compiled scan as it
    compared (:mod:`policies.codec.kernels_sum`); ``None`` when the scan ran off the host."""
    old_words: U64 | None = None
    """The two lanes of the ``sum-128`` terms of the base words that differ from the target's,
    each once: what a patch record's ``old_words`` vouches for (``None`` only in a
    :class:`Changes` made without a scan)."""

    @property
    def changed(self) -> int:
        return self.spos.size + self.bpos.size + self.dense_changed


_local = threading.local()


def _scratch(units: int, chunk: int, dtype: np.dtype[Any]) -> tuple[I64, UInt, I64, UInt]:
    """This thread's output arrays for scanning ``units`` units (capacities as
    :func:`policies.codec.kernels_scan.scan_changes` needs), reused from job to job: allocating
    them per job cost more than the scan at 1% density (page faults, and unmapping, which
    interrupts the other threads)."""
    key = (units, chunk, dtype)
    if getattr(_local, "key", None) != key:
        spos = np.empty(units // 8 + 1 + chunk, dtype=np.int64)
        bpos = np.empty(units // 2 + 1, dtype=np.int64)
        _local.key = key
        _local.arrays = (
            spos,
            np.empty((2, spos.size), dtype=dtype),
            bpos,
            np.empty((2, bpos.size), dtype=dtype),
        )
    arrays: tuple[I64, UInt, I64, UInt] = _local.arrays
    return arrays


Part = tuple[I64, UInt, I64, UInt, int, U64]
"""What one scan job of :func:`start_changes` finds (its range's ``spos, svals, bpos, bvals``,
dense changes, and the ``sum-128`` lanes of its target words and of its changed base words)."""


def find_changes(b: UInt, t: UInt, chunk: int, *, summing: bool = True) -> Changes:
    """Find and classify the changes of ``b → t`` in this thread (compiled; the ~4 Mi-unit
    ranges :func:`start_changes` queues on a pool, one after another); ``summing``: the
    target's ``sum-128`` too (:attr:`Changes.target_sum`)."""
    job, starts, assemble = _scan_jobs(b, t, chunk, summing)
    return assemble([job(c0) for c0 in starts])


def start_changes(
    b: UInt, t: UInt, pool: Executor, chunk: int, *, summing: bool = True
) -> tuple[list[Future[Part]], Callable[[list[Part]], Changes]]:
    """Queue the scan of ``b → t`` on ``pool`` now: its jobs (one per range of ~4 Mi units),
    and the call that joins their parts, in order, into the :class:`Changes`."""
    job, starts, assemble = _scan_jobs(b, t, chunk, summing)
    return [pool.submit(job, c0) for c0 in starts], assemble


def _scan_jobs(
    b: UInt, t: UInt, chunk: int, summing: bool
) -> tuple[Callable[[int], Part], range, Callable[[list[Part]], Changes]]:
    """The scan of ``b → t`` as a job per range of chunks (called with its first chunk), the
    ranges' first chunks, and the call that joins the jobs' parts into the :class:`Changes`
    (with the target's ``sum-128`` when ``summing``)."""
    n = b.size
    nchunks = -(-n // chunk)
    lanes = 8 // b.itemsize
    bw = b[: n // lanes * lanes].view(np.uint64)
    tw = t[: n // lanes * lanes].view(np.uint64)
    modes = np.empty(nchunks, dtype=np.uint8)
    step = max(1, JOB_UNITS // chunk)

    def job(c0: int) -> Part:
        c1 = min(c0 + step, nchunks)
        spos, svals, bpos, bvals = _scratch(step * chunk, chunk, b.dtype)
        acc = np.zeros(4, dtype=np.uint64)  # the target's lanes, the old words' lanes
        ns, nb, nd = scan_changes(
            b, t, bw, tw, c0, c1, chunk, modes, spos, svals, bpos, bvals, acc, summing
        )
        found = spos[:ns].copy(), svals[:, :ns].copy(), bpos[:nb].copy(), bvals[:, :nb].copy()
        return *found, nd, acc

    def assemble(parts: list[Part]) -> Changes:
        pos: list[I64] = [np.empty(0, dtype=np.int64)]
        vals: list[UInt] = [np.empty((2, 0), dtype=b.dtype)]
        lanes = sum((p[5] for p in parts), np.zeros(4, np.uint64))
        return Changes(
            modes=modes,
            spos=np.concatenate(pos + [p[0] for p in parts]),
            svals=np.concatenate(vals + [p[1] for p in parts], axis=1),
            bpos=np.concatenate(pos + [p[2] for p in parts]),
            bvals=np.concatenate(vals + [p[3] for p in parts], axis=1),
            dense_changed=sum(p[4] for p in parts),
            target_sum=finish_sum(t.view(np.uint8), tw.size, lanes[:2]) if summing else None,
            old_words=lanes[2:],
        )

    return job, range(0, nchunks, step), assemble
