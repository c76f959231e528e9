"""Compiled (numba) writers of the patch encoder: a section's coding and its byte planes.

:func:`best_coding` picks the coding a section's values are stored in (the one whose stored
bytes have the fewest order-0 entropy bits, :func:`entropy_bits` over :func:`byte_counts`);
:func:`varint_lengths` and :func:`write_varints` write the gaps of the sparse positions as varint
planes, :func:`write_bitmasks` the rows of the bitmask chunks, and :func:`write_rows` and
:func:`write_dense` the values of the changes, split into byte planes. They take what the scan
found (:mod:`policies.codec.kernels_scan`) and are compiled like every codec kernel
(:mod:`policies.codec.kernels`).

Guarantees: the writers write exactly the layout the reference numpy encoder of
:mod:`policies.codec.ops` specifies (held to it by ``tests/policies/codec/test_codec_kernels.py``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from policies.codec.kernels import I64, ONE, U8, ZERO, UInt, forward, jit, sign_bit, unit_bytes

_BYTE = np.uint64(0xFF)
_LOW7 = np.uint64(0x7F)
_SEVEN = np.uint64(7)


@jit
def byte_counts(b: UInt, t: UInt, coding: int) -> npt.NDArray[np.int64]:
    """How often each byte value occurs in each byte plane of the values stored for the
    changes ``b → t`` in ``coding`` (row k: plane k)."""
    width = unit_bytes(b)
    sign = sign_bit(b)
    counts = np.zeros((width, 256), dtype=np.int64)
    for i in range(b.size):
        z = forward(np.uint64(b[i]), np.uint64(t[i]), coding, sign)
        for k in range(width):
            counts[k, (z >> np.uint64(8 * k)) & _BYTE] += 1
    return counts


@jit
def entropy_bits(counts: npt.NDArray[np.int64]) -> float:
    """Order-0 entropy, in bits, of the bytes counted in ``counts`` (one row per plane):
    per row, n·log2(n) − Σ c·log2(c) over its counts c summing to n."""
    bits = 0.0
    for k in range(counts.shape[0]):
        n = 0
        sum_c_log_c = 0.0
        for v in range(counts.shape[1]):
            c = counts[k, v]
            if c:
                n += c
                sum_c_log_c += c * np.log2(c)
        if n:
            bits += n * np.log2(n) - sum_c_log_c
    return bits


@jit
def best_coding(b: UInt, t: UInt, codings: npt.NDArray[np.int64]) -> int:
    """The first of ``codings`` whose stored values for ``b → t`` have the fewest order-0
    entropy bits (what the encoder picks a coding by)."""
    best, fewest = codings[0], np.inf
    for c in codings:
        bits = entropy_bits(byte_counts(b, t, c))
        if bits < fewest:
            best, fewest = c, bits
    return int(best)


@jit
def varint_lengths(pos: I64) -> I64:
    """Bytes in each varint plane of the gaps of sorted positions ``pos`` (trailing zeros kept).

    Plane k holds a byte of every gap of 7k bits or more: one counting pass per plane
    (vectorized), stopping at the first empty one.
    """
    lens = np.zeros(8, dtype=np.int64)
    lens[0] = pos.size
    for k in range(1, 8):
        shift = np.uint64(7 * k)
        count = 0
        if pos.size:
            count += (np.uint64(pos[0]) >> shift) != 0
        for i in range(1, pos.size):
            count += (np.uint64(pos[i] - pos[i - 1] - 1) >> shift) != 0
        lens[k] = count
        if count == 0:
            break
    return lens


@jit
def write_varints(pos: I64, out: U8, pstart: I64, lens: I64) -> None:
    """The gaps of sorted positions ``pos`` as varints split into planes at ``out[pstart[k]:]``.

    Branch-free: every gap stores a byte in each plane written in a pass, and a plane's cursor
    advances only if the gap has a byte there (a branch would mispredict on about half the
    gaps). With one or two planes (every gap under 2**14: any density above ~0.1%) one pass
    writes both; with more, one pass per plane. After a plane's last byte its cursor rests on
    the next plane's first byte, which a later store writes, so stray stores land only there;
    the last plane's land on the byte after it, which is restored. ``out`` must extend past
    the last plane (a section's value planes follow).
    """
    if pos.size == 0:
        return
    end = pstart[lens.size - 1] + lens[lens.size - 1]
    if end >= out.size:
        raise ValueError("write_varints: out must extend past the last plane")
    kept = out[end]
    if lens.size <= 2:
        cur0 = np.uint64(pstart[0])
        cur1 = np.uint64(pstart[1] if lens.size == 2 else end)
        prev = ZERO - ONE  # wraps: the first gap is the first position
        for i in range(np.uint64(pos.size)):
            p = np.uint64(pos[i])
            g = p - prev - ONE
            prev = p
            more = np.uint64((g >> _SEVEN) != ZERO)
            out[cur0 + i] = (g & _LOW7) | (more << _SEVEN)
            out[cur1] = (g >> _SEVEN) & _LOW7
            cur1 += more
    else:
        for k in range(lens.size):
            shift = np.uint64(7 * k)
            nxt = np.uint64(7 * k + 7)
            cur = pstart[k]
            last = -1
            for i in range(pos.size):
                g = np.uint64(pos[i] - last - 1)
                last = pos[i]
                out[cur] = ((g >> shift) & _LOW7) | (np.uint64((g >> nxt) != ZERO) << _SEVEN)
                cur += (g >> shift) != ZERO or k == 0
    out[end] = kept


@jit
def write_bitmasks(bpos: I64, chunk: int, out: U8, start: int) -> None:
    """Set the bits of ``bpos`` in the (zeroed) bitmask rows at ``out[start:]``, one per chunk."""
    row = chunk // 8
    rank = -1
    current = -1
    for p in bpos:
        c = p // chunk
        if c != current:
            current = c
            rank += 1
        i = p - c * chunk
        out[start + rank * row + i // 8] |= np.uint8(1 << (i % 8))


@jit
def _put_values(
    b: UInt, t: UInt, lo: int, m: int, coding: int, out: U8, j: int, n_vals: int
) -> None:
    """The stored values of the changes ``b[lo + q] → t[lo + q]`` (``q < m``) at indices
    ``j …`` of the byte planes in ``out`` (plane k at ``k * n_vals``); called with a constant
    ``coding`` (:func:`_values`)."""
    sign = sign_bit(b)
    at, nv, first = np.uint64(j), np.uint64(n_vals), np.uint64(lo)
    for q in range(np.uint64(m)):
        z = forward(np.uint64(b[first + q]), np.uint64(t[first + q]), coding, sign)
        for k in range(unit_bytes(b)):
            out[at + np.uint64(k) * nv + q] = (z >> np.uint64(8 * k)) & _BYTE


@jit
def _values(b: UInt, t: UInt, lo: int, m: int, coding: int, out: U8, j: int, n_vals: int) -> None:
    """:func:`_put_values`, one loop per coding (a constant inside each): the loop has no
    branches and vectorizes, where testing the coding per value made it 4–5× slower."""
    if coding == 0:
        _put_values(b, t, lo, m, 0, out, j, n_vals)
    elif coding == 1:
        _put_values(b, t, lo, m, 1, out, j, n_vals)
    else:
        _put_values(b, t, lo, m, 2, out, j, n_vals)


@jit
def write_rows(
    vals: UInt,
    coding: int,
    out: U8,
    j: int,
    n_vals: int,
) -> int:
    """The values of the changes ``vals`` ((base, target) rows) as byte planes from index ``j``
    of the planes in ``out`` (plane k at ``k * n_vals``); returns the index after them."""
    _values(vals[0], vals[1], 0, vals.shape[1], coding, out, j, n_vals)
    return j + int(vals.shape[1])


@jit
def write_dense(
    b: UInt,
    t: UInt,
    modes: U8,
    chunk: int,
    coding: int,
    out: U8,
    j: int,
    n_vals: int,
) -> None:
    """The values of every unit of the dense chunks of ``b → t`` as byte planes from index
    ``j`` on (after the sparse and bitmask values, :func:`write_rows`)."""
    for c in range(modes.size):
        if modes[c] == 3:
            lo = c * chunk
            m = min(lo + chunk, b.size) - lo
            _values(b, t, lo, m, coding, out, j, n_vals)
            j += m
