"""The compiled (numba) change scan of the patch encoder: one pass finds what changed, and where.

:func:`scan_changes` reads a base and its target once, as 8-byte words, classifies each chunk by
how many of its units changed (none, sparse, bitmask or dense: the modes of the
:mod:`policies.codec` format) and lists the positions, base units and target units of the
changes a section stores; while each target word is in L1 it adds the word's ``sum-128`` terms
(:mod:`policies.codec.kernels_sum`), so the target's checksum costs no pass of its own, and for
each word that changed, the terms its base word had (the patch's ``old_words``, what a reader
checks the words it changes against: :mod:`policies.codec.apply`). The
scan of one tensor runs as jobs over ranges of chunks on the codec's threads
(:func:`policies.codec.changes.start_changes`); it is compiled like every codec kernel
(:mod:`policies.codec.kernels`).

Guarantees: the modes and the changes listed are exactly those the reference numpy encoder of
:mod:`policies.codec.ops` specifies (held to it by ``tests/policies/codec/test_codec_kernels.py``),
and the lanes gain the terms of every whole target word of the chunks scanned, whatever the
density, and the old-word lanes those of every base word of those chunks that differs from its
target word (zero-padded past the tensor's end), each once.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from policies.codec.kernels import (
    I64,
    ONE,
    SEED_A,
    SEED_B,
    STEP_A,
    STEP_B,
    U8,
    U64,
    ZERO,
    UInt,
    jit,
    jit_inline,
    prefetch_read,
    sum_terms,
    trailing_zeros,
    unit_bytes,
)
from policies.codec.kernels_sum import word_of

_PREFETCH = np.uint64(512)
"""Words ahead of the compare that the scan prefetches (4 KiB)."""


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
    lanes ``acc[0:2]`` (read while the words are in L1: the checksum of the target costs no pass
    of its own; a caller that knows it skips that compute); always add the terms of every word
    of ``b`` there that differs from ``t``'s to ``acc[2:4]`` (the old words).

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
    lanes = 8 // unit_bytes(b)
    nwords = bw.size
    last = np.uint64(max(nwords - 1, 0))
    ns = nb = nd = 0
    a = acc[0]
    sb = acc[1]
    old = (acc[2], acc[3])
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
            words = _changed_words(bw, tw, w, last)
            if summing:
                a, sb = _sum_block(tw, w, a, sb)
            k, old = _list_words(b, t, bw, tw, w, words, spos, svals, k, old)
            w += np.uint64(64)
        if summing:
            a, sb = _sum_tail(tw, w, whi, a, sb)
        old = _old_tail(b, t, w, hi, old)
        k_end = int(np.int64(k))  # signed again for the arithmetic below
        for i in range(int(np.int64(w)) * lanes, hi):  # the last < 64 words' units
            if b[i] != t[i]:
                spos[k_end] = i
                svals[0, k_end] = b[i]
                svals[1, k_end] = t[i]
                k_end += 1
        ns, nb, nd = _settle(c, hi - lo, ns, k_end, nb, nd, modes, spos, svals, bpos, bvals)
    acc[0] = a
    acc[1] = sb
    acc[2], acc[3] = old
    return ns, nb, nd


@jit_inline
def _changed_words(
    bw: npt.NDArray[np.uint64], tw: npt.NDArray[np.uint64], w: np.uint64, last: np.uint64
) -> np.uint64:
    """One bit per word of the 64 from ``w``, set where ``bw`` and ``tw`` differ; the words
    :data:`_PREFETCH` ahead (at most ``last``) are prefetched."""
    for i in range(0, 64, 8):  # a cache line each
        ahead = min(w + _PREFETCH + np.uint64(i), last)
        prefetch_read(bw, ahead)
        prefetch_read(tw, ahead)
    words = ZERO
    for i in range(64):
        words |= np.uint64(bw[w + np.uint64(i)] != tw[w + np.uint64(i)]) << np.uint64(i)
    return words


@jit_inline
def _sum_block(
    tw: npt.NDArray[np.uint64], w: np.uint64, a: np.uint64, sb: np.uint64
) -> tuple[np.uint64, np.uint64]:
    """The lanes ``a``, ``sb`` plus the ``sum-128`` terms of the 64 words of ``tw`` from ``w``."""
    ka = SEED_A + w * STEP_A
    kb = SEED_B + w * STEP_B
    for i in range(64):  # running keys: the loop vectorizes
        ta, tb = sum_terms(tw[w + np.uint64(i)], ka, kb)
        a += ta
        sb += tb
        ka += STEP_A
        kb += STEP_B
    return a, sb


@jit_inline
def _sum_tail(
    tw: npt.NDArray[np.uint64], j: np.uint64, whi: np.uint64, a: np.uint64, sb: np.uint64
) -> tuple[np.uint64, np.uint64]:
    """The lanes ``a``, ``sb`` plus the terms of the words ``j … whi`` (the last < 64)."""
    while j < whi:
        ta, tb = sum_terms(tw[j], SEED_A + j * STEP_A, SEED_B + j * STEP_B)
        a += ta
        sb += tb
        j += ONE
    return a, sb


@jit_inline
def _list_words(
    b: UInt,
    t: UInt,
    bw: npt.NDArray[np.uint64],
    tw: npt.NDArray[np.uint64],
    w: np.uint64,
    words: np.uint64,
    spos: I64,
    svals: UInt,
    k: np.uint64,
    old: tuple[np.uint64, np.uint64],
) -> tuple[np.uint64, tuple[np.uint64, np.uint64]]:
    """List the changed units of the words ``words`` marks (bit i: word ``w + i``) at index
    ``k`` on of ``spos`` and ``svals``, and add their base words' ``sum-128`` terms to the lanes
    ``old``; return the index after them and the lanes."""
    size = unit_bytes(b)
    lanes = 8 // size
    bits = np.uint64(8 * size)
    unit = ~ZERO >> np.uint64(64 - 8 * size)  # a unit's bits, low in a word
    oa, ob = old
    while words:
        cw = w + trailing_zeros(words)
        words &= words - ONE
        ta, tb = sum_terms(bw[cw], SEED_A + cw * STEP_A, SEED_B + cw * STEP_B)
        oa += ta
        ob += tb
        x = bw[cw] ^ tw[cw]
        lane_mask = ZERO
        for lane in range(lanes):
            differs = np.uint64((x >> (bits * np.uint64(lane))) & unit != ZERO)
            lane_mask |= differs << np.uint64(lane)
        u0 = cw * np.uint64(lanes)
        while lane_mask:
            u = u0 + trailing_zeros(lane_mask)
            lane_mask &= lane_mask - ONE
            spos[k] = u
            svals[0, k] = b[u]
            svals[1, k] = t[u]
            k += ONE
    return k, (oa, ob)


@jit_inline
def _old_tail(
    b: UInt, t: UInt, w: np.uint64, hi: int, old: tuple[np.uint64, np.uint64]
) -> tuple[np.uint64, np.uint64]:
    """The lanes ``old`` plus the terms of each base word from ``w`` to the one holding unit
    ``hi - 1`` (the last < 64 of a chunk, the tensor's short last word included) that differs
    from its target word."""
    lanes = np.uint64(8 // unit_bytes(b))
    oa, ob = old
    end = (np.uint64(hi) + lanes - ONE) // lanes
    while w < end:
        before = word_of(b, w)
        if before != word_of(t, w):
            ta, tb = sum_terms(before, SEED_A + w * STEP_A, SEED_B + w * STEP_B)
            oa += ta
            ob += tb
        w += ONE
    return oa, ob


@jit_inline
def _settle(
    c: int,
    clen: int,
    ns: int,
    k_end: int,
    nb: int,
    nd: int,
    modes: U8,
    spos: I64,
    svals: UInt,
    bpos: I64,
    bvals: UInt,
) -> tuple[int, int, int]:
    """Set the mode of chunk ``c`` (``clen`` units) from its changes, listed at ``ns … k_end``
    of ``spos``: none, dense (only counted), bitmask (moved to ``bpos``) or sparse (kept);
    return the new ``ns, nb, nd``."""
    count = k_end - ns
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
    return ns, nb, nd
