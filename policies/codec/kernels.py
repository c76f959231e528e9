"""Compiled (numba) loops of the patch codec: the shared unit arithmetic and the encoder.

The wire format is the one specified in the :mod:`policies.codec` docstring; these kernels only
make it fast (:mod:`policies.codec.kernels_apply` holds the decoder). Every kernel works on
unsigned unit arrays (``uint8`` … ``uint64``) and does its arithmetic in ``uint64`` masked to the
unit width, so one body serves every width. They release the GIL (``nogil``) so the codec runs
them on its threads (:mod:`policies.codec.workers`), and are compiled on first use and cached on
disk (``cache=True``): the first process pays the compile time once per unit width, later ones
load the machine code.
Hot loops index arrays with unsigned integers: numba checks every signed index for wraparound
(a negative index counts from the end), which keeps a loop from vectorizing.

Guarantees: the encoder kernels write exactly the layout the reference numpy encoder of
:mod:`policies.codec.ops` specifies (held to it by ``tests/policies/codec/test_codec_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

UInt = npt.NDArray[np.unsignedinteger[Any]]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
U8 = npt.NDArray[np.uint8]

ZERO = np.uint64(0)
_ONE = np.uint64(1)
_BYTE = np.uint64(0xFF)
_LOW7 = np.uint64(0x7F)
_SEVEN = np.uint64(7)

BLOCK = 4096
"""Units handled per block by the blocked loops (scratch arrays stay in L1/L2)."""
jit = numba.njit(cache=True, nogil=True)
"""How every kernel is compiled: machine code cached on disk, the GIL released."""


def unit_bytes(a: UInt) -> int:
    """Bytes per element of ``a``; inside a kernel a compile-time constant (loops unroll)."""
    return int(a.itemsize)


@overload(unit_bytes)
def _unit_bytes_constant(a):  # type: ignore[no-untyped-def]  # numba matches unannotated names
    size = a.dtype.bitwidth // 8
    return lambda a: size


@intrinsic
def prefetch_write(typingctx, a, i):  # type: ignore[no-untyped-def]  # numba reads the names
    """Hint the CPU to fetch element ``i`` of array ``a`` for writing (LLVM ``llvm.prefetch``).

    The apply pass issues these for a block of scattered positions before it reads and writes
    them, so their (mostly DRAM) misses overlap instead of stalling one after another.
    """

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = [args[1]]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index)  # type: ignore[no-untyped-call]
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        name = "llvm.prefetch.p0"
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)  # type: ignore[no-untyped-call]
        builder.call(fn, [ptr, i32(1), i32(3), i32(1)])  # write, high locality, data cache
        return context.get_dummy_value()

    return types.void(a, types.intp), codegen


@jit
def _all_ones_if(bit: np.uint64) -> np.uint64:
    """All ones when ``bit`` is non-zero, else zero, without a branch (the sign of a float is a
    coin flip, so a branch on it mispredicts half the time and stalls the scattered writes)."""
    return ZERO - np.uint64(bit != ZERO)


@jit
def _ordered(u: np.uint64, mask: np.uint64, sign: np.uint64) -> np.uint64:
    """Sign-magnitude bits → integers whose order is the float order (a bijection): negatives
    have every bit flipped, non-negatives only the sign bit."""
    return u ^ (sign | (_all_ones_if(u & sign) & mask))


@jit
def _unordered(o: np.uint64, mask: np.uint64, sign: np.uint64) -> np.uint64:
    return o ^ (mask ^ (_all_ones_if(o & sign) & (mask ^ sign)))


@jit
def forward(b: np.uint64, t: np.uint64, coding: int, mask: np.uint64, sign: np.uint64) -> Any:
    """The stored value of a change ``b → t`` (0 xor, 1 zigzag delta, 2 ordered zigzag delta)."""
    if coding == 0:
        return b ^ t
    if coding == 2:
        b = _ordered(b, mask, sign)
        t = _ordered(t, mask, sign)
    d = (t - b) & mask
    neg = _all_ones_if(d & sign) & mask
    return ((d << _ONE) ^ neg) & mask


@jit
def inverse(b: np.uint64, z: np.uint64, coding: int, mask: np.uint64, sign: np.uint64) -> Any:
    """The target unit from base ``b`` and stored value ``z`` (inverse of :func:`forward`)."""
    if coding == 0:
        return b ^ z
    d = ((z >> _ONE) ^ ((ZERO - (z & _ONE)) & mask)) & mask
    if coding == 1:
        return (b + d) & mask
    return _unordered((_ordered(b, mask, sign) + d) & mask, mask, sign)


@intrinsic
def trailing_zeros(typingctx, x):  # type: ignore[no-untyped-def]  # numba reads the names
    """The number of trailing zero bits of the non-zero ``uint64`` ``x`` (LLVM ``cttz``)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))  # 1: x is never zero

    return types.uint64(types.uint64), codegen


@jit
def _changed_words(
    bw: npt.NDArray[np.uint64],
    tw: npt.NDArray[np.uint64],
    w0: np.uint64,
    w1: np.uint64,
    out: npt.NDArray[np.uint64],
) -> np.uint64:
    """List the indices ``w0 … w1`` where ``bw`` and ``tw`` differ into ``out``; their count.

    64 words are compared into one bit mask (a loop without stores, which vectorizes), then
    the mask's set bits are listed: the work beyond the compare is per changed word, and the
    only unpredictable branch is the end of each mask's bits.
    """
    kw = ZERO
    w = w0
    while w + np.uint64(64) <= w1:
        m = ZERO
        for i in range(64):
            m |= np.uint64(bw[w + np.uint64(i)] != tw[w + np.uint64(i)]) << np.uint64(i)
        while m:
            low = m & (ZERO - m)  # the lowest set bit
            m ^= low
            kw += _ONE
            out[kw - _ONE] = w + trailing_zeros(low)  # type: ignore[call-arg]  # typed by numba
        w += np.uint64(64)
    while w < w1:  # the last < 64 words: stores unconditional, advanced by the comparison
        out[kw] = w
        kw += np.uint64(bw[w] != tw[w])
        w += _ONE
    return kw


@jit
def scan_changes(
    b: UInt,
    t: UInt,
    bw: npt.NDArray[np.uint64],
    tw: npt.NDArray[np.uint64],
    c0: int,
    c1: int,
    chunk: int,
    modes: U8,
    spos: I64,
    svals: UInt,
    bpos: I64,
    bvals: UInt,
) -> tuple[int, int, int]:
    """Classify chunks ``c0 … c1`` of ``b → t`` and list what changed in them.

    Compares the 8-byte words ``bw``/``tw`` (the same memory, whole words only) first and the
    units of changed words after. Writes each chunk's mode into ``modes``; the changed
    positions of sparse chunks, in order, into ``spos`` and their base and target units into
    ``svals[0]`` and ``svals[1]``; those of bitmask chunks into ``bpos`` and ``bvals``
    (capacities: a range of U units has < U/8 + 1 sparse and ≤ U/2 bitmask changes). Returns
    both counts and the changed units of dense chunks (which list nothing: all their units are
    stored).
    """
    n = b.size
    lanes = 8 // unit_bytes(b)
    nwords = bw.size
    changed_words = np.empty(chunk // lanes + 1, dtype=np.uint64)
    at = np.empty(chunk + 8, dtype=np.int64)
    vals = np.empty((2, chunk + 8), dtype=b.dtype)
    ns = nb = nd = 0
    for c in range(c0, c1):
        lo = c * chunk
        hi = min(lo + chunk, n)
        whi = min(hi // lanes, nwords)
        # The unit loop stores unconditionally and advances by the comparison: no
        # data-dependent branch, which at 1-10% density would mispredict on most changed
        # words. Indices are unsigned: numba checks every signed index for wraparound
        # (negative means from the end), which halves the speed of such a loop.
        kw = _changed_words(bw, tw, np.uint64(lo // lanes), np.uint64(whi), changed_words)
        uk = np.uint64(0)
        for i in range(kw):
            u0 = changed_words[i] * np.uint64(lanes)
            for lane in range(lanes):
                u = u0 + np.uint64(lane)
                at[uk] = u
                vals[0, uk] = b[u]
                vals[1, uk] = t[u]
                uk += np.uint64(b[u] != t[u])
        k = int(np.int64(uk))  # signed again for the arithmetic below
        for u in range(max(whi * lanes, lo), hi):
            if b[u] != t[u]:
                at[k] = u
                vals[0, k] = b[u]
                vals[1, k] = t[u]
                k += 1
        clen = hi - lo
        if k == 0:
            modes[c] = 0
        elif 2 * k > clen:
            modes[c] = 3
            nd += k
        elif 8 * k >= clen:
            modes[c] = 2
            bpos[nb : nb + k] = at[:k]
            bvals[:, nb : nb + k] = vals[:, :k]
            nb += k
        else:
            modes[c] = 1
            spos[ns : ns + k] = at[:k]
            svals[:, ns : ns + k] = vals[:, :k]
            ns += k
    return ns, nb, nd


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

    One branch-free pass per plane: every gap stores a byte and the plane's cursor advances
    only if the gap has one there (a branch would mispredict on about half the gaps). After a
    plane's last byte its cursor rests on the next plane's first byte, which the next pass
    writes, so stray stores land only there; the last plane's land on the byte after it, which
    is restored. ``out`` must extend past the last plane (a section's value planes follow).
    """
    if pos.size == 0:
        return
    end = pstart[lens.size - 1] + lens[lens.size - 1]
    if end >= out.size:
        raise ValueError("write_varints: out must extend past the last plane")
    kept = out[end]
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
def _put_block(
    out: U8, at: int, n_vals: int, width: int, z: npt.NDArray[np.uint64], m: int
) -> None:
    """Store values ``z[:m]`` at indices ``at …`` of the byte planes (plane k at ``k * n_vals``)."""
    for k in range(width):
        plane = at + k * n_vals
        shift = np.uint64(8 * k)
        for q in range(m):
            out[plane + q] = (z[q] >> shift) & _BYTE


@jit
def write_rows(
    vals: UInt,
    coding: int,
    mask: np.uint64,
    sign: np.uint64,
    out: U8,
    j: int,
    n_vals: int,
) -> int:
    """The values of the changes ``vals`` ((base, target) rows) as byte planes from index ``j``
    of the planes in ``out`` (plane k at ``k * n_vals``); returns the index after them."""
    width = unit_bytes(vals)
    z = np.empty(BLOCK, dtype=np.uint64)
    for lo in range(0, vals.shape[1], BLOCK):
        m = min(BLOCK, vals.shape[1] - lo)
        for q in range(m):
            z[q] = forward(
                np.uint64(vals[0, lo + q]), np.uint64(vals[1, lo + q]), coding, mask, sign
            )
        _put_block(out, j, n_vals, width, z, m)
        j += m
    return j


@jit
def write_dense(
    b: UInt,
    t: UInt,
    modes: U8,
    chunk: int,
    coding: int,
    mask: np.uint64,
    sign: np.uint64,
    out: U8,
    j: int,
    n_vals: int,
) -> None:
    """The values of every unit of the dense chunks of ``b → t`` as byte planes from index
    ``j`` on (after the sparse and bitmask values, :func:`write_rows`)."""
    width = unit_bytes(b)
    z = np.empty(BLOCK, dtype=np.uint64)
    for c in range(modes.size):
        if modes[c] == 3:
            hi = min((c + 1) * chunk, b.size)
            for lo in range(c * chunk, hi, BLOCK):
                m = min(BLOCK, hi - lo)
                for q in range(m):
                    z[q] = forward(np.uint64(b[lo + q]), np.uint64(t[lo + q]), coding, mask, sign)
                _put_block(out, j, n_vals, width, z, m)
                j += m
