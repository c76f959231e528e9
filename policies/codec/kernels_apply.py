"""Compiled (numba) decoder of the patch codec: validate a section, then write its changes.

See :mod:`policies.codec.kernels` for how the kernels are compiled and cached.

Guarantees: :func:`apply_changes` checks the whole section against the tensor before writing
anything and returns a non-zero :data:`ERRORS` code (nothing written) when it does not fit;
it never writes outside the tensor.
"""

from __future__ import annotations

import numpy as np

from policies.codec.kernels import (
    I64,
    U8,
    U64,
    ZERO,
    UInt,
    inverse,
    jit,
    jit_inline,
    prefetch_write,
    sign_bit,
    unit_bytes,
)
from policies.codec.kernels_sum import add_word_changes

BLOCK = 1024
"""Units a block of :func:`_write_block` applies (its scattered lines stay in the cache between
its passes)."""
AHEAD = 64
"""How many units ahead a near-sequential block's writes prefetch (best of 16…256 on
``bench codec``)."""

ERRORS = {
    1: "bad chunk modes",
    2: "position planes past the section end",
    3: "bitmask chunks do not add up",
    4: "section sizes do not add up",
    5: "varint continues past its last plane",
    6: "varint planes do not add up",
    7: "sparse position past the tensor end",
    8: "bitmask position past its chunk",
}
"""What a non-zero return of :func:`apply_changes` means (the caller raises it as corruption)."""


@jit_inline
def _write_block(
    units: UInt,
    at: U64,
    m: int,
    buf: U8,
    vstart: int,
    n_vals: int,
    j: int,
    coding: int,
    z: U64,
    old: U64,
    acc: U64,
    olds: U64,
) -> None:
    """Apply values ``j … j+m`` of the byte planes at ``buf[vstart:]`` to units ``at[:m]``
    (ascending, as every caller lists them; ``at`` has :data:`AHEAD` readable entries past them).
    A two-lane ``acc`` takes the change of the ``sum-128`` checksum (each written word's term
    after its writes less its term before, :mod:`policies.codec.kernels_sum`), computed in the
    passes (they hold each unit's old and new value), and ``olds`` the terms of the words
    before they change (:func:`~policies.codec.kernels_sum.add_word_changes`); empty ones skip
    that.

    Scattered changes (two cache lines or more apart on average, as at 1% density) are applied
    in three passes: the units read into ``old``, the targets computed into ``z``, then
    written back. The read pass is a few instructions a unit, so the core's window holds
    dozens of its (mostly DRAM) misses at once, and the writes find their lines in the cache.
    One loop that read, computed and wrote each unit (≈ 20 instructions) held a third as many:
    a 32 MiB bf16 tensor's 168 k changes at 1% took 2.2 ms that way even with software
    prefetches, against 1.7 ms in passes (the int32 scatter: 1.15 ms). Denser changes touch
    nearly every line in order, which the hardware streams: there the one loop, prefetching
    :data:`AHEAD` units ahead, is faster (at 10%: 5.2 ms against 6.9 ms in passes; at 3%, a
    change about every line, 3.4 against 3.7 ms).
    Inlined into :func:`apply_changes`, which allocates ``at``, ``z`` and ``old``: LLVM then
    knows they do not alias ``units`` (the apply ~9% faster than with a call).
    """
    sign = sign_bit(units)
    n = np.uint64(m)
    line = np.uint64(64 // unit_bytes(units))  # units per cache line
    scattered = m > 0 and at[n - np.uint64(1)] - at[0] >= np.uint64(2) * line * n
    scattered |= acc.size > 0  # the checksum's change needs each unit's old and new values
    if scattered:
        for q in range(n):
            old[q] = units[at[q]]
    else:
        for q in range(min(AHEAD, m)):
            prefetch_write(units, at[q])
    z[:m] = ZERO
    for k in range(unit_bytes(units)):
        plane = np.uint64(vstart + k * n_vals + j)
        shift = np.uint64(8 * k)
        for q in range(n):
            z[q] |= np.uint64(buf[plane + q]) << shift
    # One loop per coding (a constant inside each), so no loop has branches.
    if scattered:
        if coding == 0:
            for q in range(n):
                z[q] = inverse(old[q], z[q], 0, sign)
        elif coding == 1:
            for q in range(n):
                z[q] = inverse(old[q], z[q], 1, sign)
        else:
            for q in range(n):
                z[q] = inverse(old[q], z[q], 2, sign)
        if acc.size:
            add_word_changes(units, at, old, z, m, acc, olds)
        for q in range(n):
            units[at[q]] = z[q]
    elif coding == 0:
        for q in range(n):
            units[at[q]] = inverse(np.uint64(units[at[q]]), z[q], 0, sign)
            prefetch_write(units, at[q + np.uint64(AHEAD)])
    elif coding == 1:
        for q in range(n):
            units[at[q]] = inverse(np.uint64(units[at[q]]), z[q], 1, sign)
            prefetch_write(units, at[q + np.uint64(AHEAD)])
    else:
        for q in range(n):
            units[at[q]] = inverse(np.uint64(units[at[q]]), z[q], 2, sign)
            prefetch_write(units, at[q + np.uint64(AHEAD)])


@jit
def varint(buf: U8, pstart: I64, cur: I64, i: int) -> int:
    """Gap ``i`` of a checked section (its first byte in plane 0); advances the plane cursors.

    Branch-free: every plane is read (one byte past a plane's end at most, which is still
    inside the section because the value planes follow) and only the bytes that belong to
    the gap are kept.
    """
    byte = buf[pstart[0] + i]
    g = int(byte & 0x7F)
    more = int(byte >> 7)
    for k in range(1, pstart.size):
        byte = buf[pstart[k] + cur[k]]
        g |= (int(byte & 0x7F) * more) << (7 * k)
        cur[k] += more
        more &= int(byte >> 7)
    return g


@jit
def _short_positions(
    buf: U8,
    p0: np.uint64,
    p1: np.uint64,
    c1: np.uint64,
    i0: np.uint64,
    m: int,
    pos: np.uint64,
    at: U64,
) -> tuple[np.uint64, np.uint64]:
    """Positions after ``pos`` from gaps ``i0 … i0+m`` of a checked section whose gaps take at
    most two varint bytes (plane 0 at ``p0``; plane 1 at ``p1``, its cursor ``c1``) into
    ``at[:m]``; returns the last position and the cursor.

    The common case (every gap below 2**14: densities above ~0.05%) decoded with the cursor in
    a register: :func:`varint` keeps its cursors in an array, stored and reloaded per gap.
    Like it, branch-free, reading at most one byte past plane 1 (still inside the section).
    """
    low7, seven, one = np.uint64(0x7F), np.uint64(7), np.uint64(1)
    for q in range(m):
        i = i0 + np.uint64(q)
        b0 = np.uint64(buf[p0 + i])
        more = b0 >> seven
        b1 = np.uint64(buf[p1 + c1])
        pos += (b0 & low7) + (((b1 & low7) * more) << seven) + one
        c1 += more
        at[q] = pos
    return pos, c1


@jit
def _check_varints(buf: U8, pstart: I64, lens: I64, n: int) -> int:
    """Whether the gap planes decode to positions inside ``n`` units; 0 or an error code.

    Plane k+1 holds one byte per byte of plane k whose continuation bit is set, and the last
    plane has none set; then every gap decodes from exactly its planes' bytes. The positions
    stay below ``n`` iff the gaps plus one per gap sum to at most ``n``, and each plane's
    share of that sum is computed on its own (no decoding, no overflow).
    """
    total = lens[0] if lens.size else 0
    for k in range(lens.size):
        ones = ZERO
        low = ZERO
        lo = np.uint64(pstart[k])
        for i in range(lens[k]):  # unsigned indices: the loop vectorizes (see kernels)
            byte = np.uint64(buf[lo + np.uint64(i)])
            ones += byte >> np.uint64(7)
            low += byte & np.uint64(0x7F)
        more, share = np.int64(ones), np.int64(low)  # signed again for the arithmetic below
        if more != (lens[k + 1] if k + 1 < lens.size else 0):
            return 5 if k + 1 == lens.size else 6
        if share > n >> (7 * k):
            return 7
        total += share << (7 * k)
        if total > n:
            return 7
    return 0


@jit
def _check_layout(
    n: int, width: int, buf: U8, start: int, lens: I64, n_vals: int, n_bm: int, chunk: int
) -> int:
    """Check modes, plane, bitmask and value sizes of a section of a tensor of ``n`` units of
    ``width`` bytes; 0 or an :data:`ERRORS` code."""
    nchunks = (n + chunk - 1) // chunk
    if start + nchunks > buf.size:
        return 1
    off = start + nchunks
    for k in range(lens.size):
        off += lens[k]
    if off > buf.size:
        return 2
    row = chunk // 8
    if off + n_bm * row > buf.size:
        return 3
    expected = lens[0] if lens.size else 0
    rank = 0
    for c in range(nchunks):
        mode = buf[start + c]
        clen = min(chunk, n - c * chunk)
        if mode > 3:
            return 1
        if mode == 3:
            expected += clen
        elif mode == 2:
            if rank >= n_bm:
                return 3
            base = off + rank * row
            for i in range(row):
                byte = buf[base + i]
                for bit in range(8):
                    if byte >> bit & 1:
                        if 8 * i + bit >= clen:
                            return 8
                        expected += 1
            rank += 1
    if rank != n_bm:
        return 3
    if expected != n_vals or off + n_bm * row + n_vals * width != buf.size:
        return 4
    return 0


@jit
def checked_planes(
    n: int, width: int, buf: U8, start: int, lens: I64, n_vals: int, n_bm: int, chunk: int
) -> tuple[int, I64, int]:
    """Check a section of a tensor of ``n`` units of ``width`` bytes (layout and gap planes):
    ``(0 or an ERRORS code, where each gap plane starts, where the bitmasks start)``."""
    err = _check_layout(n, width, buf, start, lens, n_vals, n_bm, chunk)
    pstart = np.empty(lens.size, dtype=np.int64)
    off = start + (n + chunk - 1) // chunk
    for k in range(lens.size):
        pstart[k] = off
        off += lens[k]
    if err == 0:
        err = _check_varints(buf, pstart, lens, n)
    return err, pstart, off


@jit
def apply_changes(
    units: UInt,
    buf: U8,
    start: int,
    lens: I64,
    n_vals: int,
    n_bm: int,
    chunk: int,
    coding: int,
    acc: U64,
    olds: U64,
) -> int:
    """Write the changes of an uncompressed section into ``units``; 0 or an error code.

    ``buf`` is the whole section, ``start`` where its MODES begin, ``lens`` its gap plane
    lengths; a two-lane ``acc`` takes the change of the units' ``sum-128`` checksum and
    ``olds`` the terms of the words it changes, as they were (three entries:
    :func:`~policies.codec.kernels_sum.add_word_changes`; both empty: not tracked). Everything
    is checked first; on an error nothing has been written.
    """
    err, pstart, off = checked_planes(
        units.size, units.itemsize, buf, start, lens, n_vals, n_bm, chunk
    )
    if err:
        return err
    nchunks = (units.size + chunk - 1) // chunk
    vstart = off + n_bm * (chunk // 8)
    # Positions are produced a block at a time and then written by _write_block.
    cur = np.zeros(lens.size, dtype=np.int64)
    at = np.zeros(BLOCK + AHEAD, dtype=np.uint64)  # slack: see _write_block
    z = np.empty(BLOCK, dtype=np.uint64)
    old = np.empty(BLOCK, dtype=np.uint64)
    n_sparse = lens[0] if lens.size else 0
    pos = -1
    upos = ZERO - np.uint64(1)  # wraps: the first gap is the first position
    c1 = ZERO
    p0 = np.uint64(pstart[0] if lens.size else 0)
    p1 = np.uint64(off if lens.size < 2 else pstart[1])  # one plane: its next byte, unused
    for j in range(0, n_sparse, BLOCK):
        m = min(BLOCK, n_sparse - j)
        if lens.size <= 2:
            upos, c1 = _short_positions(buf, p0, p1, c1, np.uint64(j), m, upos, at)
        else:
            for q in range(m):
                pos += varint(buf, pstart, cur, j + q) + 1
                at[q] = pos
        _write_block(units, at, m, buf, vstart, n_vals, j, coding, z, old, acc, olds)
    j = n_sparse
    rank = 0
    for c in range(nchunks):
        mode = buf[start + c]
        if mode == 2:
            row = off + rank * (chunk // 8)
            rank += 1
            m = 0
            for i in range(chunk // 8):
                byte = buf[row + i]
                for bit in range(8):
                    if byte >> bit & 1:
                        at[m] = c * chunk + 8 * i + bit
                        m += 1
                        if m == BLOCK:
                            _write_block(
                                units, at, m, buf, vstart, n_vals, j, coding, z, old, acc, olds
                            )
                            j += m
                            m = 0
            _write_block(units, at, m, buf, vstart, n_vals, j, coding, z, old, acc, olds)
            j += m
    for c in range(nchunks):  # dense values come after all bitmask values
        if buf[start + c] == 3:
            hi = min((c + 1) * chunk, units.size)
            for lo in range(c * chunk, hi, BLOCK):
                m = min(BLOCK, hi - lo)
                for q in range(m):
                    at[q] = lo + q
                _write_block(units, at, m, buf, vstart, n_vals, j, coding, z, old, acc, olds)
                j += m
    return 0
