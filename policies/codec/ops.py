"""Array transforms of the patch codec: positions, values, byte planes and whole sections.

:mod:`policies.codec` frames what this module produces. The wire format is specified in the
``policies.codec`` docstring: chunk modes (0 unchanged, :data:`SPARSE`, :data:`BITMASK`,
:data:`DENSE`), gap varints split into byte planes, packed bitmasks, and values transformed by a
:data:`Coding` and split into ``width`` byte planes, low byte first. Whole sections are found
(:mod:`policies.codec.changes`), written and applied (:func:`encode_section`,
:func:`apply_section`) by the compiled loops of :mod:`policies.codec.kernels_scan`,
:mod:`policies.codec.kernels_encode` and :mod:`policies.codec.kernels_apply`; the vectorized
numpy functions here (:func:`encode_positions`, :func:`decode_positions`, :func:`transform`,
:func:`varint_planes`) are the readable reference the tests hold them to.

Guarantees: :func:`apply_section` applies exactly what :func:`encode_section` wrote, and raises
``ValueError`` without writing anything for a section that does not fit the tensor;
:func:`decode_positions` inverts :func:`encode_positions` and raises ``ValueError`` (never reads
out of range) on inconsistent input; :func:`varint_values` inverts :func:`varint_planes` for
integers below 2**56.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from policies.codec.changes import Changes
from policies.codec.kernels import I64, U8, U64, UInt
from policies.codec.kernels_apply import ERRORS, apply_changes
from policies.codec.kernels_encode import (
    best_coding,
    varint_lengths,
    write_bitmasks,
    write_dense,
    write_rows,
    write_varints,
)

Coding = Literal["xor", "delta", "odelta"]
SPARSE, BITMASK, DENSE = 1, 2, 3
MAX_PLANES = 8
SAMPLE = 16384
"""Stored values :func:`pick_coding` looks at."""
CODINGS: tuple[Coding, ...] = ("xor", "delta", "odelta")


def unit_view(raw: U8, width: int) -> UInt:
    """``raw`` bytes read as little-endian unsigned integers of ``width`` bytes."""
    return raw.view(np.dtype(f"<u{width}"))


def _zigzag(d: UInt) -> UInt:
    one, top = d.dtype.type(1), d.dtype.type(d.dtype.itemsize * 8 - 1)
    return (d << one) ^ (np.zeros_like(d) - (d >> top))


def _ordered(u: UInt) -> UInt:
    """Sign-magnitude bits → integers whose order is the float order (a bijection)."""
    sign = u.dtype.type(1 << (u.dtype.itemsize * 8 - 1))
    return np.where(u & sign, ~u, u | sign)


def transform(b: UInt, t: UInt, coding: Coding) -> UInt:
    """Values stored for a change from ``b`` to ``t`` (the compiled codec's reference)."""
    if coding == "xor":
        return b ^ t
    if coding == "delta":
        return _zigzag(t - b)
    return _zigzag(_ordered(t) - _ordered(b))


_CANDIDATES = {
    True: np.array([CODINGS.index(c) for c in ("delta", "odelta", "xor")], dtype=np.int64),
    False: np.array([CODINGS.index(c) for c in ("delta", "xor")], dtype=np.int64),
}
"""The codings tried for floating and integer units, in the order ties go by."""


def pick_coding(b: UInt, t: UInt, floating: bool) -> Coding:
    """The coding whose byte planes have the lowest order-0 entropy on the first :data:`SAMPLE`
    changes ``b → t`` (compiled: :func:`policies.codec.kernels_encode.best_coding`)."""
    return CODINGS[best_coding(b[:SAMPLE], t[:SAMPLE], _CANDIDATES[floating])]


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


def _sample(ch: Changes, source: UInt | tuple[UInt, UInt], chunk: int) -> tuple[UInt, UInt]:
    """Base and target units of (at least) the first :data:`SAMPLE` stored values
    (``source``: the dense units, :func:`_dense_source`)."""
    vals = np.concatenate([ch.svals[:, :SAMPLE], ch.bvals[:, :SAMPLE]], axis=1)
    dense = np.flatnonzero(ch.modes == DENSE)
    if vals.shape[1] >= SAMPLE or not dense.size:
        return vals[0], vals[1]
    if isinstance(source, tuple):
        lo = int(dense[0]) * chunk
        first = np.stack([source[0][lo : lo + chunk], source[1][lo : lo + chunk]])
    else:
        first = source[:, :chunk]  # the first dense chunk (all of them when it is partial)
    return np.concatenate([vals[0], first[0]]), np.concatenate([vals[1], first[1]])


def _dense_source(b: UInt | None, t: UInt | None, ch: Changes) -> UInt | tuple[UInt, UInt]:
    """Where the units of dense chunks are read: ``ch.dense`` rows, else the tensors."""
    if ch.dense is not None:
        return ch.dense
    if b is None or t is None:
        raise ValueError("encode_section needs the tensors' units or Changes.dense")
    return b, t


def encode_section(b: UInt | None, t: UInt | None, ch: Changes, floating: bool, chunk: int) -> U8:
    """The uncompressed section storing changes ``ch`` of ``b → t`` (empty if none).

    Written straight into one buffer by compiled loops: head, modes, gap planes, bitmasks,
    value planes. ``b`` and ``t`` (the tensors' units) are read for dense chunks only, and may
    be ``None`` when ``ch.dense`` holds those units.
    """
    if not ch.changed:
        return np.empty(0, dtype=np.uint8)
    source = _dense_source(b, t, ch)
    coding = CODINGS.index(pick_coding(*_sample(ch, source, chunk), floating))
    lens = varint_lengths(ch.spos)
    lens = lens[: np.count_nonzero(lens)]
    dense = np.flatnonzero(ch.modes == DENSE)
    if isinstance(source, tuple):
        n_dense = dense.size * chunk
        if dense.size and dense[-1] == ch.modes.size - 1:
            n_dense -= ch.modes.size * chunk - source[0].size  # the last chunk is partial
    else:
        n_dense = source.shape[1]
    n_vals = ch.spos.size + ch.bpos.size + n_dense
    n_bm = int(np.count_nonzero(ch.modes == BITMASK))
    head = SECTION.pack(coding, lens.size, n_vals, n_bm) + lens.astype("<u8").tobytes()
    row_bytes = n_bm * (chunk // 8)
    width = ch.svals.dtype.itemsize
    size = len(head) + ch.modes.size + int(lens.sum()) + row_bytes + n_vals * width
    out = np.empty(size, dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    off = len(head) + ch.modes.size
    out[len(head) : off] = ch.modes
    write_varints(ch.spos, out, off + np.cumsum(lens) - lens, lens)
    off += int(lens.sum())
    out[off : off + row_bytes] = 0
    write_bitmasks(ch.bpos, chunk, out, off)
    j = off + row_bytes
    j = write_rows(ch.svals, coding, out, j, n_vals)
    j = write_rows(ch.bvals, coding, out, j, n_vals)
    if isinstance(source, tuple):
        write_dense(*source, ch.modes, chunk, coding, out, j, n_vals)
    else:
        write_rows(source, coding, out, j, n_vals)
    return out


def section_head(data: bytes) -> tuple[int, int, int, npt.NDArray[np.int64], int]:
    """A section's ``(coding, values, bitmask chunks, gap plane lengths, where MODES start)``;
    raises ``ValueError`` when it cannot be a section."""
    buf_size = len(data)
    if buf_size < SECTION.size:
        raise ValueError("section too short")
    code, n_planes, n_vals, n_bm = SECTION.unpack_from(data, 0)
    start = SECTION.size + 8 * n_planes
    if code >= len(CODINGS) or n_planes > MAX_PLANES or buf_size < start:
        raise ValueError("bad section head")
    lens = np.frombuffer(data, dtype="<u8", count=n_planes, offset=SECTION.size)
    if np.any(lens > buf_size) or max(n_vals, n_bm) > buf_size:
        raise ValueError("section sizes do not add up")
    return code, n_vals, n_bm, lens.astype(np.int64), start


def apply_section(
    units: UInt, data: bytes, chunk: int, acc: U64 | None = None, olds: U64 | None = None
) -> None:
    """Write the changes of an uncompressed section into ``units`` (in place); a two-lane
    ``acc`` takes the change of their ``sum-128`` checksum (:mod:`policies.codec.digests`) and
    ``olds`` (three entries, given with ``acc``) the terms of the words they change, as they
    were (:func:`policies.codec.kernels_sum.add_word_changes`).

    Raises ``ValueError`` if the section does not fit ``units`` (nothing is written then).
    """
    code, n_vals, n_bm, lens64, start = section_head(data)
    buf = np.frombuffer(data, dtype=np.uint8)
    none = np.empty(0, dtype=np.uint64)
    track = none if acc is None else acc
    old_words = none if acc is None or olds is None else olds
    err = apply_changes(units, buf, start, lens64, n_vals, n_bm, chunk, code, track, old_words)
    if err:
        raise ValueError(ERRORS[err])
