"""Compiled (numba) loops of the patch codec: the shared unit arithmetic and the encoder.

The wire format is the one specified in the :mod:`policies.codec` docstring; these kernels only
make it fast (:mod:`policies.codec.kernels_apply` holds the decoder). Every kernel works on
unsigned unit arrays (``uint8`` … ``uint64``) and does its arithmetic in ``uint64``, so one body
serves every width: the unit's low bits come out exact (the carries and borrows above them are
left as they fall, and dropped when a value is stored into a unit or split into its bytes), and
the unit's width and sign bit are compile-time constants (:func:`unit_bytes`,
:func:`sign_bit`). Masking every step to the width with a mask passed at run time cost the
apply ~20% of its time. They release the GIL (``nogil``) so the codec runs
them on its threads (:mod:`policies.codec.workers`), and are compiled on first use and cached on
disk (``cache=True``): the first process pays the compile time once per unit width, later ones
load the machine code. The cache lives under ``~/.cache/sprawl/numba/<numba version>`` unless
``NUMBA_CACHE_DIR`` says otherwise: an engine's environment (vLLM's, which reads patches with these
kernels) carries another numba release, and two releases sharing one ``__pycache__`` would each
throw the other's machine code away and compile again in every process.
Hot loops index arrays with unsigned integers: numba checks every signed index for wraparound
(a negative index counts from the end), which keeps a loop from vectorizing.

Guarantees: the encoder kernels write exactly the layout the reference numpy encoder of
:mod:`policies.codec.ops` specifies (held to it by ``tests/policies/codec/test_codec_kernels.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
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

if not os.environ.get("NUMBA_CACHE_DIR"):  # before any kernel below is made (module docstring)
    _CACHE = Path.home() / ".cache" / "sprawl" / "numba" / numba.__version__
    numba.config.CACHE_DIR = str(_CACHE)  # type: ignore[attr-defined]  # numba's config is untyped

_PREFETCH = np.uint64(512)
"""Words ahead of the compare that the scan prefetches (4 KiB)."""
jit = numba.njit(cache=True, nogil=True)
"""How every kernel is compiled: machine code cached on disk, the GIL released."""
jit_inline = numba.njit(cache=True, nogil=True, inline="always")
""":data:`jit`, the body inlined into its callers (numba IR): what they allocate and pass it,
LLVM then knows not to alias the other arrays."""


def unit_bytes(a: UInt) -> int:
    """Bytes per element of ``a``; inside a kernel a compile-time constant (loops unroll)."""
    return int(a.itemsize)


@overload(unit_bytes)
def _unit_bytes_constant(a):  # type: ignore[no-untyped-def]  # numba matches unannotated names
    size = a.dtype.bitwidth // 8
    return lambda a: size


def _prefetch(write: int, locality: int) -> Any:
    """An intrinsic ``(a, i)`` hinting the CPU to fetch element ``i`` of array ``a`` into the
    data cache (LLVM ``llvm.prefetch``, for reading or for writing, ``locality`` 0 … 3)."""

    @intrinsic
    def hint(typingctx, a, i):  # type: ignore[no-untyped-def]  # numba reads the names
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            index = [args[1]]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index)  # type: ignore[no-untyped-call]
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
            builder.call(fn, [ptr, i32(write), i32(locality), i32(1)])  # 1: the data cache
            return context.get_dummy_value()

        return types.void(a, types.intp), codegen

    return hint


prefetch_write = _prefetch(write=1, locality=3)
"""The apply issues these a few dozen units ahead of a near-sequential read-modify-write loop
(changes at least every other cache line), so that its misses overlap."""
prefetch_read = _prefetch(write=0, locality=3)
"""The scan issues these a few KiB ahead of the words it compares: one thread's sequential reads
ran ~30% faster than with the hardware prefetcher alone (12 → 16 GB/s on the 2-core dev VM),
two threads' ~15%. Locality 3 (``prefetcht0``), not the non-temporal 0 (``prefetchnta``): on a
Sapphire-Rapids-class VM the non-temporal hint halved the scan of a 1 GiB view (two threads 6.8
against 13.4 GB/s of view; no prefetch 9.4), since those lines skip the L2 that the next reads
come from; locality 1–3 ran alike there."""


@jit
def _all_ones_if(bit: np.uint64) -> np.uint64:
    """All ones when ``bit`` is non-zero, else zero, without a branch (the sign of a float is a
    coin flip, so a branch on it mispredicts half the time and stalls the scattered writes)."""
    return ZERO - np.uint64(bit != ZERO)


@jit
def sign_bit(a: UInt) -> np.uint64:
    """The top bit of a unit of ``a`` (inside a kernel a compile-time constant)."""
    return _ONE << np.uint64(8 * unit_bytes(a) - 1)


@jit
def _ordered(u: np.uint64, sign: np.uint64) -> np.uint64:
    """Sign-magnitude bits → integers whose order is the float order (a bijection): negatives
    have every bit flipped, non-negatives only the sign bit."""
    return u ^ (sign | _all_ones_if(u & sign))


@jit
def _unordered(o: np.uint64, sign: np.uint64) -> np.uint64:
    return o ^ (sign | _all_ones_if(~o & sign))


@jit
def forward(b: np.uint64, t: np.uint64, coding: int, sign: np.uint64) -> Any:
    """The stored value of a change ``b → t`` (0 xor, 1 zigzag delta, 2 ordered zigzag delta);
    exact in the unit's bits (``sign`` its top one), the bits above left as they fall."""
    if coding == 0:
        return b ^ t
    if coding == 2:
        b = _ordered(b, sign)
        t = _ordered(t, sign)
    d = t - b
    return (d << _ONE) ^ _all_ones_if(d & sign)


@jit
def inverse(b: np.uint64, z: np.uint64, coding: int, sign: np.uint64) -> Any:
    """The target unit from base ``b`` and stored value ``z`` (a unit's bits, nothing above:
    it is shifted right), the inverse of :func:`forward`; exact in the unit's bits."""
    if coding == 0:
        return b ^ z
    d = (z >> _ONE) ^ (ZERO - (z & _ONE))
    if coding == 1:
        return b + d
    return _unordered(_ordered(b, sign) + d, sign)


@intrinsic
def _cttz(typingctx, x):  # type: ignore[no-untyped-def]  # numba reads the names
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))  # 1: x is never zero

    return types.uint64(types.uint64), codegen


@jit
def trailing_zeros(x: np.uint64) -> np.uint64:
    """The number of trailing zero bits of the non-zero ``uint64`` ``x`` (LLVM ``cttz``)."""
    return _cttz(x)  # type: ignore[call-arg]  # an intrinsic, typed by numba


SEED_A = np.uint64(0x165667B19E3779F9)
STEP_A = np.uint64(0x9E3779B97F4A7C15)
SEED_B = np.uint64(0x27D4EB2F165667C5)
STEP_B = np.uint64(0xC2B2AE3D27D4EB4F)
"""The two lanes' keys of the ``sum-128`` checksum: word ``j``'s is ``SEED + j · STEP``
(:mod:`policies.codec.kernels_sum`)."""
_LOW = np.uint64(0xFFFFFFFF)
_HALF = np.uint64(32)


@jit_inline
def sum_terms(w: np.uint64, ka: np.uint64, kb: np.uint64) -> tuple[np.uint64, np.uint64]:
    """The ``sum-128`` terms of word ``w`` under the lanes' keys ``ka`` and ``kb``."""
    ta = w + ka
    tb = w ^ kb
    swapped = (w << _HALF) | (w >> _HALF)
    return (ta & _LOW) * (ta >> _HALF) + swapped, (tb & _LOW) * (tb >> _HALF) + w


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
    acc: U64,
    summing: bool,
) -> tuple[int, int, int]:
    """Classify chunks ``c0 … c1`` of ``b → t`` and list what changed in them; when
    ``summing``, add the ``sum-128`` terms of every whole word of ``t`` in those chunks to the
    two lanes ``acc`` (read while the words are in L1: the checksum of the target costs no pass
    of its own; a caller that knows it skips that compute).

    Compares the 8-byte words ``bw``/``tw`` (the same memory, whole words only) first and the
    units of changed words after. Writes each chunk's mode into ``modes``; the changed
    positions of sparse chunks, in order, into ``spos`` and their base and target units into
    ``svals[0]`` and ``svals[1]``; those of bitmask chunks into ``bpos`` and ``bvals``.
    A chunk's changes are listed straight into ``spos`` and moved to ``bpos`` or dropped once
    its mode is known, so ``spos`` holds a chunk more than the sparse changes (capacities: a
    range of U units needs U/8 + 1 + ``chunk`` in ``spos``, U/2 + 1 in ``bpos``). Returns both
    counts and the changed units of dense chunks (which list nothing: all their units are
    stored).
    """
    n = b.size
    size = unit_bytes(b)
    lanes = 8 // size
    bits = np.uint64(8 * size)
    unit = ~ZERO >> np.uint64(64 - 8 * size)  # a unit's bits, low in a word
    nwords = bw.size
    last = np.uint64(max(nwords - 1, 0))
    ns = nb = nd = 0
    a = acc[0]
    sb = acc[1]
    for c in range(c0, c1):
        lo = c * chunk
        hi = min(lo + chunk, n)
        whi = np.uint64(min(hi // lanes, nwords))
        k = np.uint64(ns)
        w = np.uint64(lo // lanes)
        # 64 words are compared into one bit mask (a loop without stores, which vectorizes);
        # each set bit's word, still in L1, is XORed and tested lane by lane in registers, and
        # its changed units are listed: at low density one per changed word, so that loop runs
        # once and predicts well. Indices are unsigned: numba checks every signed index for
        # wraparound (negative means from the end), which halves the speed of such a loop.
        while w + np.uint64(64) <= whi:
            for i in range(0, 64, 8):  # a cache line each
                ahead = min(w + _PREFETCH + np.uint64(i), last)
                prefetch_read(bw, ahead)
                prefetch_read(tw, ahead)
            words = ZERO
            for i in range(64):
                words |= np.uint64(bw[w + np.uint64(i)] != tw[w + np.uint64(i)]) << np.uint64(i)
            if summing:
                ka = SEED_A + w * STEP_A
                kb = SEED_B + w * STEP_B
                for i in range(64):  # running keys: the loop vectorizes
                    ta, tb = sum_terms(tw[w + np.uint64(i)], ka, kb)
                    a += ta
                    sb += tb
                    ka += STEP_A
                    kb += STEP_B
            while words:
                cw = w + trailing_zeros(words)
                words &= words - _ONE
                x = bw[cw] ^ tw[cw]
                lane_mask = ZERO
                for lane in range(lanes):
                    differs = np.uint64((x >> (bits * np.uint64(lane))) & unit != ZERO)
                    lane_mask |= differs << np.uint64(lane)
                u0 = cw * np.uint64(lanes)
                while lane_mask:
                    u = u0 + trailing_zeros(lane_mask)
                    lane_mask &= lane_mask - _ONE
                    spos[k] = u
                    svals[0, k] = b[u]
                    svals[1, k] = t[u]
                    k += _ONE
            w += np.uint64(64)
        j = w if summing else whi
        while j < whi:  # the last < 64 whole words' terms
            ta, tb = sum_terms(tw[j], SEED_A + j * STEP_A, SEED_B + j * STEP_B)
            a += ta
            sb += tb
            j += _ONE
        k_end = int(np.int64(k))  # signed again for the arithmetic below
        for i in range(int(np.int64(w)) * lanes, hi):  # the last < 64 words' units
            if b[i] != t[i]:
                spos[k_end] = i
                svals[0, k_end] = b[i]
                svals[1, k_end] = t[i]
                k_end += 1
        count = k_end - ns
        clen = hi - lo
        if count == 0:
            modes[c] = 0
        elif 2 * count > clen:
            modes[c] = 3
            nd += count
        elif 8 * count >= clen:
            modes[c] = 2
            bpos[nb : nb + count] = spos[ns:k_end]
            bvals[:, nb : nb + count] = svals[:, ns:k_end]
            nb += count
        else:
            modes[c] = 1
            ns = k_end
    acc[0] = a
    acc[1] = sb
    return ns, nb, nd


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
        prev = ZERO - _ONE  # wraps: the first gap is the first position
        for i in range(np.uint64(pos.size)):
            p = np.uint64(pos[i])
            g = p - prev - _ONE
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
