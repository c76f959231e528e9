"""The change scan with torch ops, on the tensors' own device: :func:`scan_tensor`.

The encoder scans CPU tensors with the compiled kernel (:func:`policies.codec.ops.find_changes`).
Tensors on another device (a trainer's GPU) are scanned where they live by the same torch code
that runs on CPU: compare, changed positions, chunk modes, and the base and target units of the
changes are computed there, and only those compacted arrays (plus every unit of the dense chunks,
which the format stores whole) cross to the host, where the section is entropy coded.

Guarantees: :func:`scan_tensor` returns the :class:`~policies.codec.ops.Changes` the compiled
scan finds for the same units, field for field (``dense`` aside, which it fills so that the
section needs no host copy of the tensors), so :func:`~policies.codec.ops.encode_section`
writes the same bytes (held to it by ``tests/policies/codec/test_codec_scan.py``). Units are
compared as integers of the unit width, never as floats.

Not covered: tensors whose element size is not 1, 2, 4 or 8 bytes or a multiple of 8 (the
encoder refuses them before scanning); a base and target on different devices
(:class:`~policies.errors.PatchError`).
"""

from __future__ import annotations

import numpy as np
import torch

from policies.codec.ops import BITMASK, DENSE, SPARSE, Changes
from policies.errors import PatchError

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Same-width integer dtypes the units are compared and moved as (equality ignores the sign)."""


def _units(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t``'s bytes as a flat tensor of ``width``-byte integers, on ``t``'s device."""
    if t.numel() == 0:  # an empty tensor's stride cannot be viewed as bytes
        return torch.empty(0, dtype=_SIGNED[width], device=t.device)
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).view(_SIGNED[width])


def _host(x: torch.Tensor, width: int) -> np.ndarray:
    """``x`` copied to the host as unsigned integers of ``width`` bytes (a C-contiguous array)."""
    return np.ascontiguousarray(x.cpu().numpy()).view(np.dtype(f"<u{width}"))


def scan_tensor(b: torch.Tensor, t: torch.Tensor, width: int, chunk: int) -> Changes:
    """The changes of ``b → t`` read as ``width``-byte units, scanned on their device.

    ``b`` and ``t`` must hold the same number of bytes on one device.
    """
    if b.device != t.device:
        raise PatchError(f"the base is on {b.device} and the target on {t.device}: scan on one")
    bu, tu = _units(b, width), _units(t, width)
    if bu.numel() != tu.numel():
        raise PatchError(f"the base has {bu.numel()} units and the target {tu.numel()}")
    n = bu.numel()
    nchunks = -(-n // chunk)
    pos = torch.nonzero(bu != tu).reshape(-1)
    counts = torch.bincount(pos // chunk, minlength=nchunks)
    clen = torch.full((nchunks,), chunk, dtype=torch.int64, device=bu.device)
    if nchunks:
        clen[-1] = n - (nchunks - 1) * chunk
    modes = torch.zeros(nchunks, dtype=torch.uint8, device=bu.device)
    modes[counts > 0] = SPARSE
    modes[(counts > 0) & (counts * 8 >= clen)] = BITMASK
    modes[2 * counts > clen] = DENSE
    cmode = modes[pos // chunk]
    spos, bpos = pos[cmode == SPARSE], pos[cmode == BITMASK]
    dense_chunks = torch.nonzero(modes == DENSE).reshape(-1)
    # Every unit of the dense chunks, in chunk order (the last chunk may be partial).
    at = (dense_chunks[:, None] * chunk + torch.arange(chunk, device=bu.device)).reshape(-1)
    at = at[at < n]
    dense_changed = int(counts[modes == DENSE].sum())
    # int32 positions cross the link in half the bytes when the tensor allows it.
    small = torch.int32 if n < 1 << 31 else torch.int64
    return Changes(
        modes=modes.cpu().numpy(),
        spos=spos.to(small).cpu().numpy().astype(np.int64),
        svals=_host(torch.stack((bu[spos], tu[spos])), width),
        bpos=bpos.to(small).cpu().numpy().astype(np.int64),
        bvals=_host(torch.stack((bu[bpos], tu[bpos])), width),
        dense_changed=dense_changed,
        dense=_host(torch.stack((bu[at], tu[at])), width),
    )
