"""Pure array transforms of the patch codec: positions, values and byte planes.

Everything here is a function of numpy arrays (no I/O, no framing; torch only for its fast
gather/scatter); :mod:`policies.codec`
frames the results. The wire format these produce is specified in the ``policies.codec``
docstring: chunk modes (0 unchanged, :data:`SPARSE`, :data:`BITMASK`, :data:`DENSE`), gap varints
split into byte planes, packed bitmasks, and values transformed by a :data:`Coding` and split
into ``width`` byte planes, low byte first.

Guarantees: :func:`untransform` inverts :func:`transform` for every coding and unsigned width;
:func:`decode_positions` inverts :func:`encode_positions` and raises ``ValueError`` (never reads
out of range) on inconsistent input; :func:`varint_values` inverts :func:`varint_planes` for
integers below 2**56.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

Coding = Literal["xor", "delta", "odelta"]
SPARSE, BITMASK, DENSE = 1, 2, 3
MAX_PLANES = 8
CODINGS: tuple[Coding, ...] = ("xor", "delta", "odelta")
_JOB_WORDS = 1 << 20
_scratch = threading.local()
UInt = npt.NDArray[np.unsignedinteger[Any]]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def unit_view(raw: U8, width: int) -> UInt:
    """``raw`` bytes read as little-endian unsigned integers of ``width`` bytes."""
    return raw.view(np.dtype(f"<u{width}"))


def find_changes(b: UInt, t: UInt, pool: ThreadPoolExecutor) -> tuple[I64, UInt, UInt]:
    """Sorted positions where ``b`` and ``t`` differ, with the base and target units there.

    Compares 8-byte words first (most words are equal), then the units inside changed words;
    the word scan runs in slices on ``pool`` (numpy releases the GIL).
    """
    lanes = 8 // b.itemsize
    shift = lanes.bit_length() - 1
    nwords = b.size // lanes
    bw = b[: nwords * lanes].view(np.uint64)
    tw = t[: nwords * lanes].view(np.uint64)

    def job(s: int) -> tuple[I64, UInt, UInt]:
        e = min(s + _JOB_WORDS, nwords)
        scratch = getattr(_scratch, "mask", None)
        if scratch is None:  # one reusable mask per worker thread: no page faults per slice
            scratch = _scratch.mask = np.empty(_JOB_WORDS, dtype=bool)
        w = np.flatnonzero(np.not_equal(bw[s:e], tw[s:e], out=scratch[: e - s]))
        w += s
        be = bw[w].view(b.dtype)
        te = tw[w].view(b.dtype)
        i = np.flatnonzero(be != te)
        return (w[i >> shift] << shift) | (i & (lanes - 1)), be[i], te[i]

    parts = list(pool.map(job, range(0, nwords, _JOB_WORDS)))
    tail = np.flatnonzero(b[nwords * lanes :] != t[nwords * lanes :]) + nwords * lanes
    parts.append((tail, b[tail], t[tail]))
    return (
        np.concatenate([p[0] for p in parts]).astype(np.int64, copy=False),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )


def _zigzag(d: UInt) -> UInt:
    one, top = d.dtype.type(1), d.dtype.type(d.dtype.itemsize * 8 - 1)
    return (d << one) ^ (np.zeros_like(d) - (d >> top))


def _unzigzag(z: UInt) -> UInt:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def _ordered(u: UInt) -> UInt:
    """Sign-magnitude bits → integers whose order is the float order (a bijection)."""
    sign = u.dtype.type(1 << (u.dtype.itemsize * 8 - 1))
    return np.where(u & sign, ~u, u | sign)


def _unordered(o: UInt) -> UInt:
    sign = o.dtype.type(1 << (o.dtype.itemsize * 8 - 1))
    return np.where(o & sign, o ^ sign, ~o)


def transform(b: UInt, t: UInt, coding: Coding) -> UInt:
    """Values stored for a change from ``b`` to ``t`` (inverse: :func:`untransform`)."""
    if coding == "xor":
        return b ^ t
    if coding == "delta":
        return _zigzag(t - b)
    return _zigzag(_ordered(t) - _ordered(b))


def untransform(b: UInt, z: UInt, coding: Coding) -> UInt:
    if coding == "xor":
        return b ^ z
    if coding == "delta":
        return b + _unzigzag(z)
    return _unordered(_ordered(b) + _unzigzag(z))


def _entropy_bits(plane: U8) -> float:
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum() * plane.size)


def pick_coding(b: UInt, t: UInt, floating: bool) -> Coding:
    """The coding whose byte planes have the lowest order-0 entropy on the first 64k changes."""
    b, t = b[:65536], t[:65536]
    order: tuple[Coding, ...] = ("delta", "odelta", "xor") if floating else ("delta", "xor")
    costs = [sum(_entropy_bits(p) for p in _planes(transform(b, t, c))) for c in order]
    return order[int(np.argmin(costs))]


def _planes(values: UInt) -> U8:
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, values.itemsize).T)


def to_planes(values: UInt) -> U8:
    """Split units into byte planes, low byte first (all low bytes, then the next byte, …)."""
    return _planes(values).reshape(-1)


def from_planes(raw: U8, n: int, width: int) -> UInt:
    planes = raw[: n * width].reshape(width, n)
    return np.ascontiguousarray(planes.T).view(np.dtype(f"<u{width}")).reshape(-1)


@dataclass(frozen=True)
class Positions:
    """Chunk modes and position streams of one tensor (see the wire format)."""

    modes: U8
    gap_planes: list[U8]
    bitmasks: U8
    sparse_sel: npt.NDArray[np.bool_] | None
    """Which changes sit in sparse chunks (``None``: all of them)."""
    bitmask_sel: npt.NDArray[np.bool_] | None
    dense_chunks: I64


def varint_planes(g: I64) -> list[U8]:
    """Non-negative integers as 7-bit-group varints, plane k holding every k-th byte."""
    planes: list[U8] = []
    while g.size:
        more = g > 0x7F
        planes.append((g.astype(np.uint8) & np.uint8(0x7F)) | (more.view(np.uint8) << np.uint8(7)))
        g = g[more] >> 7
    return planes


def varint_values(planes: list[U8]) -> I64:
    """Inverse of :func:`varint_planes`; ``ValueError`` if the planes do not fit together."""
    if not planes:
        return np.empty(0, dtype=np.int64)
    if len(planes) > MAX_PLANES:
        raise ValueError("varint longer than 56 bits")
    g = (planes[0] & 0x7F).astype(np.int64)
    sel = np.flatnonzero(planes[0] >> 7)
    for k, p in enumerate(planes[1:], 1):
        if p.size != sel.size:
            raise ValueError("varint planes do not add up")
        g[sel] |= (p & 0x7F).astype(np.int64) << (7 * k)
        sel = sel[np.flatnonzero(p >> 7)]
    if sel.size:
        raise ValueError("varint continues past its last plane")
    return g


def encode_positions(pos: I64, units: int, chunk: int) -> Positions:
    """Choose a mode per chunk by its change count and encode the positions (vectorized)."""
    nchunks = -(-units // chunk)
    starts = np.arange(nchunks + 1, dtype=np.int64) * chunk
    starts[-1] = units
    counts = np.diff(np.searchsorted(pos, starts))  # positions are sorted
    clen = np.diff(starts)
    modes = np.where(counts > 0, SPARSE, 0).astype(np.uint8)
    modes[(counts > 0) & (counts * 8 >= clen)] = BITMASK
    modes[(counts > 0) & (counts * 2 > clen)] = DENSE
    sparse_sel = bitmask_sel = None
    ps = pos
    if modes.max(initial=0) > SPARSE:
        cid = pos // chunk
        cmode = modes[cid]
        sparse_sel, bitmask_sel = cmode == SPARSE, cmode == BITMASK
        ps = pos[sparse_sel]
    g = np.empty_like(ps)
    g[:1] = ps[:1]
    np.subtract(ps[1:], ps[:-1], out=g[1:])
    g[1:] -= 1
    is_bm = modes == BITMASK
    mask = np.zeros((int(is_bm.sum()), chunk), dtype=bool)
    if bitmask_sel is not None and mask.size:
        rank = np.cumsum(is_bm) - 1
        bcid = pos[bitmask_sel] // chunk
        mask[rank[bcid], pos[bitmask_sel] - bcid * chunk] = True
    return Positions(
        modes=modes,
        gap_planes=varint_planes(g),
        bitmasks=np.packbits(mask, axis=1, bitorder="little"),
        sparse_sel=sparse_sel,
        bitmask_sel=bitmask_sel,
        dense_chunks=np.flatnonzero(modes == DENSE),
    )


def decode_positions(
    buf: U8, nchunks: int, units: int, chunk: int, plane_lens: list[int], n_bitmask: int
) -> tuple[list[I64], I64, int]:
    """Inverse of :func:`encode_positions`: ``([sparse, bitmask] positions, dense chunks, end)``.

    Raises ``ValueError`` on any inconsistency (the caller reports it as corruption).
    """
    modes = buf[:nchunks]
    if modes.size != nchunks or modes.max(initial=0) > DENSE:
        raise ValueError("bad chunk modes")
    off = nchunks
    planes = []
    for n in plane_lens:
        planes.append(buf[off : off + n])
        off += n
    if off > buf.size:
        raise ValueError("position planes past the section end")
    g = varint_values(planes)
    if g.size > units or (g.size and int(g.max()) >= units):
        raise ValueError("sparse gaps out of range")
    g += 1
    sparse = np.cumsum(g, out=g)
    sparse -= 1
    if sparse.size and sparse[-1] >= units:
        raise ValueError("sparse position past the tensor end")
    bc = np.flatnonzero(modes == BITMASK)
    row = chunk // 8
    raw_bm = buf[off : off + n_bitmask * row]
    off += n_bitmask * row
    if bc.size != n_bitmask or raw_bm.size != n_bitmask * row:
        raise ValueError("bitmask chunks do not add up")
    r, c = np.nonzero(np.unpackbits(raw_bm.reshape(n_bitmask, row), axis=1, bitorder="little"))
    starts = bc * chunk
    if np.any(c >= np.minimum(starts + chunk, units)[r] - starts[r]):
        raise ValueError("bitmask position past its chunk")
    return [sparse, starts[r] + c], np.flatnonzero(modes == DENSE), off


# -- one tensor section (uncompressed) -------------------------------------------------------------

SECTION = struct.Struct("<BBQQ")
"""CODING u8 | K u8 | N_VALUES u64 | N_BITMASK u64 (then K × u64 plane lengths)."""


def encode_section(
    b: UInt, t: UInt, floating: bool, pool: ThreadPoolExecutor, chunk: int
) -> tuple[bytes, int]:
    """The uncompressed section turning units ``b`` into ``t``, and the changed unit count."""
    pos, bv, tv = find_changes(b, t, pool)
    if pos.size == 0:
        return b"", 0
    coding = pick_coding(bv, tv, floating)
    enc = encode_positions(pos, b.size, chunk)
    if enc.sparse_sel is None:
        parts_b, parts_t = [bv], [tv]
    else:
        parts_b = [bv[enc.sparse_sel], bv[enc.bitmask_sel]]
        parts_t = [tv[enc.sparse_sel], tv[enc.bitmask_sel]]
    for c in enc.dense_chunks:
        lo, hi = int(c) * chunk, min((int(c) + 1) * chunk, b.size)
        parts_b.append(b[lo:hi])
        parts_t.append(t[lo:hi])
    values = transform(np.concatenate(parts_b), np.concatenate(parts_t), coding)
    lens = [p.size for p in enc.gap_planes]
    head = SECTION.pack(CODINGS.index(coding), len(lens), values.size, enc.bitmasks.shape[0])
    streams = [enc.modes, *enc.gap_planes, enc.bitmasks.reshape(-1), to_planes(values)]
    raw = b"".join([head, struct.pack(f"<{len(lens)}Q", *lens), *(s.tobytes() for s in streams)])
    return raw, int(pos.size)


def apply_section(units: UInt, data: bytes, chunk: int) -> None:
    """Write the changes of an uncompressed section into ``units`` (in place).

    Raises ``ValueError`` if the section does not fit ``units`` (nothing is written then).
    """
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < SECTION.size:
        raise ValueError("section too short")
    code, n_planes, n_vals, n_bm = SECTION.unpack_from(data, 0)
    start = SECTION.size + 8 * n_planes
    if code >= len(CODINGS) or n_planes > MAX_PLANES or buf.size < start:
        raise ValueError("bad section head")
    coding = CODINGS[code]
    lens = list(struct.unpack_from(f"<{n_planes}Q", data, SECTION.size))
    n = units.size
    width = units.itemsize
    groups, dense, end = decode_positions(buf[start:], -(-n // chunk), n, chunk, lens, n_bm)
    expected = sum(g.size for g in groups) + sum(
        min((int(c) + 1) * chunk, n) - int(c) * chunk for c in dense
    )
    if expected != n_vals or start + end + n_vals * width != buf.size:
        raise ValueError("section sizes do not add up")
    values = from_planes(buf[start + end :], n_vals, width)
    signed = np.dtype(f"<i{width}")
    flat = torch.from_numpy(units.view(signed))
    cursor = 0
    for pos in groups:
        if pos.size:
            idx = torch.from_numpy(pos)
            old = flat.take(idx).numpy().view(units.dtype)
            new = untransform(old, values[cursor : cursor + pos.size], coding)
            flat.index_put_((idx,), torch.from_numpy(new.view(signed)))
        cursor += pos.size
    for c in dense:
        lo, hi = int(c) * chunk, min((int(c) + 1) * chunk, n)
        units[lo:hi] = untransform(units[lo:hi], values[cursor : cursor + hi - lo], coding)
        cursor += hi - lo
