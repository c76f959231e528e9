"""One section's changes read without its tensor: where they go, the values they store and the
values they make.

The shadow applies a section to a whole tensor (:func:`policies.codec.ops.apply_section`). An
engine holds its weights elsewhere (fused, sliced; :mod:`policies.serve.backends.engine_changes`):
it reads the section's positions and stored values (:func:`section_values`), gathers the values it
holds there, and computes the new ones with :func:`untransform`, the inverse of
:func:`policies.codec.ops.transform`.

Guarantees: every function works in time proportional to the section (no pass over the tensor);
a section that does not fit ``units`` raises ``ValueError``; positions and values come in the same
order (sparse changes, bitmask changes, then every unit of the dense chunks), the order the
compiled decoder writes them in.
"""

from __future__ import annotations

import numpy as np

from policies.codec.kernels import I64, UInt
from policies.codec.kernels_apply import ERRORS
from policies.codec.kernels_read import read_section
from policies.codec.ops import CODINGS, Coding, section_head


def section_values(data: bytes, units: int, chunk: int, width: int) -> tuple[I64, Coding, UInt]:
    """A section's positions, its coding and the values it stores for them (unsigned integers of
    ``width`` bytes, transformed by the coding), decoded by a compiled loop
    (:func:`policies.codec.kernels_read.read_section`)."""
    code, n_vals, n_bm, lens, start = section_head(data)
    at = np.empty(n_vals, dtype=np.int64)
    z = np.empty(n_vals, dtype=np.uint64)
    buf = np.frombuffer(data, dtype=np.uint8)
    err = read_section(units, width, buf, start, lens, n_vals, n_bm, chunk, at, z)
    if err:
        raise ValueError(ERRORS[err])
    return at, CODINGS[code], z.astype(f"<u{width}")


def _unzigzag(z: UInt) -> UInt:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def untransform(b: UInt, z: UInt, coding: Coding) -> UInt:
    """The target units from base units ``b`` and stored values ``z`` (inverse of
    :func:`policies.codec.ops.transform`; exact in the units' bits)."""
    if coding == "xor":
        return b ^ z
    if coding == "delta":
        return b + _unzigzag(z)
    sign = b.dtype.type(1 << (b.dtype.itemsize * 8 - 1))
    ordered = np.where(b & sign, ~b, b | sign) + _unzigzag(z)
    return np.where(ordered & sign, ordered ^ sign, ~ordered)
