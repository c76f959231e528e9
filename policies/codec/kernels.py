"""Compiled (numba) loops of the patch codec: how they are compiled, and the unit arithmetic
they share.

The wire format is the one specified in the :mod:`policies.codec` docstring; the kernels only
make it fast: :mod:`policies.codec.kernels_scan` (the encoder's change scan),
:mod:`policies.codec.kernels_encode` (the encoder's writers), :mod:`policies.codec.kernels_apply`
(the decoder), :mod:`policies.codec.kernels_read` (reading a section without writing it) and
:mod:`policies.codec.kernels_sum` (the ``sum-128`` checksum). Every kernel works on
unsigned unit arrays (``uint8`` … ``uint64``) and does its arithmetic in ``uint64``, so one body
serves every width: the unit's low bits come out exact (the carries and borrows above them are
left as they fall, and dropped when a value is stored into a unit or split into its bytes), and
the unit's width and sign bit are compile-time constants (:func:`unit_bytes`,
:func:`sign_bit`). Masking every step to the width with a mask passed at run time cost the
apply ~20% of its time. They release the GIL (``nogil``) so the codec runs
them on its threads (:mod:`policies.codec.workers`), and are compiled on first use and cached on
disk (``cache=True``): the first process pays the compile time once per unit width, later ones
load the machine code. The cache lives under ``~/.cache/sprawl/numba/<numba version>-<digest>``
unless ``NUMBA_CACHE_DIR`` says otherwise: an engine's environment (vLLM's, which reads patches with
these kernels) carries another numba release, and two releases sharing one ``__pycache__`` would
each throw the other's machine code away and compile again in every process. The digest is of
every ``kernels*.py`` source: numba checks a cached kernel against its own file only, so a kernel
that calls one from another module (``inverse``, ``varint``, …) would otherwise keep the old
callee's machine code after that module changed (a ``git pull`` touches only the files it changes).
Hot loops index arrays with unsigned integers: numba checks every signed index for wraparound
(a negative index counts from the end), which keeps a loop from vectorizing.

Guarantees: :func:`inverse` undoes :func:`forward` exactly in a unit's bits, for every coding
(xor, zigzag delta, ordered zigzag delta) and unit width; the decoder's exactness rests on it.
"""

from __future__ import annotations

import hashlib
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
ONE = np.uint64(1)


def cache_dir(package: Path = Path(__file__).parent) -> Path:
    """Where the kernels in ``package`` are cached unless ``NUMBA_CACHE_DIR`` is set (module
    docstring)."""
    digest = hashlib.sha256()
    for source in sorted(package.glob("kernels*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    name = f"{numba.__version__}-{digest.hexdigest()[:16]}"
    return Path.home() / ".cache" / "sprawl" / "numba" / name


if not os.environ.get("NUMBA_CACHE_DIR"):  # before any kernel below is made
    numba.config.CACHE_DIR = str(cache_dir())  # type: ignore[attr-defined]  # config is untyped

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
    return ONE << np.uint64(8 * unit_bytes(a) - 1)


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
    return (d << ONE) ^ _all_ones_if(d & sign)


@jit
def inverse(b: np.uint64, z: np.uint64, coding: int, sign: np.uint64) -> Any:
    """The target unit from base ``b`` and stored value ``z`` (a unit's bits, nothing above:
    it is shifted right), the inverse of :func:`forward`; exact in the unit's bits."""
    if coding == 0:
        return b ^ z
    d = (z >> ONE) ^ (ZERO - (z & ONE))
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
