"""Compiled (numba) reading of a patch section without its tensor: how an engine that holds its
weights elsewhere (fused, sliced, on an accelerator; :mod:`policies.serve.backends.engine_changes`)
learns what a section writes.

See :mod:`policies.codec.kernels` for how the kernels are compiled and cached, and
:mod:`policies.codec.kernels_apply` for the decoder that writes a section into a whole tensor;
these read the same layout, checked the same way
(:func:`~policies.codec.kernels_apply.checked_planes`).

Guarantees: :func:`read_section` returns a non-zero error code (nothing read past the section)
for a section that does not fit the tensor; :func:`read_changes` writes only its outputs.
"""

from __future__ import annotations

import numpy as np

from policies.codec.kernels import I64, U8, U64, ZERO, UInt, inverse, jit, sign_bit
from policies.codec.kernels_apply import checked_planes, varint
from policies.codec.kernels_sum import add_word_changes


@jit
def read_section(
    n: int,
    width: int,
    buf: U8,
    start: int,
    lens: I64,
    n_vals: int,
    n_bm: int,
    chunk: int,
    at: I64,
    z: U64,
) -> int:
    """The positions (into ``at``) and stored values (into ``z``, ``n_vals`` each) of an
    uncompressed section of a tensor of ``n`` units of ``width`` bytes, without the tensor, in
    the order the decoder writes them (sparse, bitmask, then dense chunks); 0 or an error code
    of :data:`~policies.codec.kernels_apply.ERRORS`, checked as the decoder checks."""
    err, pstart, off = checked_planes(n, width, buf, start, lens, n_vals, n_bm, chunk)
    if err:
        return err
    nchunks = (n + chunk - 1) // chunk
    cur = np.zeros(lens.size, dtype=np.int64)
    pos = -1
    j = 0
    for i in range(lens[0] if lens.size else 0):
        pos += varint(buf, pstart, cur, i) + 1
        at[j] = pos
        j += 1
    rank = 0
    for c in range(nchunks):
        if buf[start + c] == 2:
            row = off + rank * (chunk // 8)
            rank += 1
            for i in range(chunk // 8):
                byte = buf[row + i]
                for bit in range(8):
                    if byte >> bit & 1:
                        at[j] = c * chunk + 8 * i + bit
                        j += 1
    for c in range(nchunks):
        if buf[start + c] == 3:
            for u in range(c * chunk, min((c + 1) * chunk, n)):
                at[j] = u
                j += 1
    vstart = off + n_bm * (chunk // 8)
    for q in range(n_vals):
        v = ZERO
        for k in range(width):
            v |= np.uint64(buf[vstart + k * n_vals + q]) << np.uint64(8 * k)
        z[q] = v
    return 0


@jit
def read_changes(
    units: UInt, at: U64, z: U64, coding: int, old: U64, new: U64, acc: U64, olds: U64
) -> None:
    """Read units ``at`` (ascending) into ``old`` and the values the stored ``z`` make of them
    (:func:`~policies.codec.kernels.inverse`) into ``new``, writing nothing; a two-lane ``acc``
    takes the change of the units' ``sum-128`` checksum were they written and ``olds`` (three
    entries) the terms of the words they change, as they are (the record's ``old_words``:
    :func:`~policies.codec.kernels_sum.add_word_changes`; empty: not tracked).
    How an engine that holds a tensor elsewhere reads a section's changes
    (:mod:`policies.serve.backends.engine_changes`): each unit is read once."""
    sign = sign_bit(units)
    for q in range(at.size):  # the reads alone first: their (mostly DRAM) misses overlap
        old[q] = units[at[q]]
    for q in range(at.size):
        new[q] = inverse(old[q], z[q], coding, sign)
    if acc.size:
        add_word_changes(units, at, old, new, at.size, acc, olds)
