"""The change scan with torch ops, on the tensors' own device: :func:`scan_tensor`, and the host
copy of a device view built from its changes alone: :func:`host_copy`.

The encoder scans CPU tensors with the compiled kernel
(:func:`policies.codec.changes.find_changes`).
Tensors on another device (a trainer's GPU) are scanned where they live by the same torch code
that runs on CPU: compare, changed positions, chunk modes, and the base and target units of the
changes are computed there, and only those compacted arrays (plus every unit of the dense chunks,
which the format stores whole) cross to the host, where the section is entropy coded.

Guarantees: :func:`scan_tensor` returns the :class:`~policies.codec.changes.Changes` the compiled
scan finds for the same units, field for field (``dense`` aside, which it fills so that the
section needs no host copy of the tensors; ``old_words`` summed on the device too), so
:func:`~policies.codec.ops.encode_section` writes the same bytes (held to it by
``tests/policies/codec/test_codec_scan.py``). Units are compared as integers of the unit width,
never as floats.

:func:`host_copy` is how a publisher whose view lives on a device (a GPU trainer) gets the host copy
it checksums and keeps, without copying the view across: it compares the new view with the previous
one where both live and scatters only the changed units into a copy of the previous version's host
copy. Guarantee: the result equals ``target`` bit for bit whenever ``base_host`` equals ``base``
(the caller's invariant: ``base_host`` is the host copy of the view published before, which must not
have been modified since); names that alias one storage in ``target`` alias one host tensor. Given
the ``sum-128`` checksums of ``base_host``, it also returns the copy's, each patched tensor's from
its base's and the words its changes write (:func:`policies.codec.kernels_sum.scatter_summing`, as
a reader checks a patch), with no pass over the copy (only tensors copied whole are hashed). Every
byte :func:`scan_tensor` and :func:`host_copy` move to the host from another device is counted in
:data:`host_bytes` (a publish logs them as ``to_host_bytes``).

Not covered: tensors whose element size is not 1, 2, 4 or 8 bytes or a multiple of 8 (the
encoder refuses them before scanning); a base and target on different devices
(:class:`~policies.errors.PatchError`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from policies.codec.changes import Changes
from policies.codec.digests import StorageKey, checksums, hex_lanes, lanes_hex, storage_key
from policies.codec.kernels import SEED_A, SEED_B, STEP_A, STEP_B, U64
from policies.codec.kernels_sum import scatter_summing
from policies.codec.ops import BITMASK, DENSE, SPARSE
from policies.errors import PatchError


class HostBytes:
    """A running count of the bytes moved to the host by this module (thread-safe: scans run
    on the codec's threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


host_bytes = HostBytes()
"""Bytes moved to the host through :func:`to_host` in this process."""


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host, its bytes counted in :data:`host_bytes` when it was elsewhere."""
    if x.device.type != "cpu":
        host_bytes.add(x.numel() * x.element_size())
    return x.cpu()


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
    return np.ascontiguousarray(to_host(x).numpy()).view(np.dtype(f"<u{width}"))


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
        modes=to_host(modes).numpy(),
        spos=to_host(spos.to(small)).numpy().astype(np.int64),
        svals=_host(torch.stack((bu[spos], tu[spos])), width),
        bpos=to_host(bpos.to(small)).numpy().astype(np.int64),
        bvals=_host(torch.stack((bu[bpos], tu[bpos])), width),
        dense_changed=dense_changed,
        dense=_host(torch.stack((bu[at], tu[at])), width),
        old_words=_old_words(bu, pos, width),
    )


def _signed(x: np.uint64) -> int:
    """A ``uint64`` constant as the int64 of the same bits (torch's integer arithmetic)."""
    v = int(x)
    return v - (1 << 64) if v >= 1 << 63 else v


def _old_words(bu: torch.Tensor, pos: torch.Tensor, width: int) -> U64:
    """The two ``sum-128`` lanes of the terms of the base words holding the changed units
    ``pos`` (ascending; each word once, zero-padded past the end), computed where ``bu`` lives
    (two numbers cross): int64 arithmetic wraps as the compiled kernels' ``uint64`` does
    (:func:`policies.codec.kernels.sum_terms`)."""
    if pos.numel() == 0:
        return np.zeros(2, dtype=np.uint64)
    per = 8 // width
    dev = bu.device
    words = torch.unique_consecutive(pos // per)
    mates = words[:, None] * per + torch.arange(per, device=dev)
    n = bu.numel()
    units = bu[mates.clamp(max=n - 1)].to(torch.int64)
    units = torch.where(mates < n, units, 0)
    if width < 8:
        units &= (1 << 8 * width) - 1
    w = (units << (torch.arange(per, device=dev) * 8 * width)).sum(dim=1)  # disjoint bits
    low = 0xFFFFFFFF
    ta = w + (words * _signed(STEP_A) + _signed(SEED_A))
    tb = w ^ (words * _signed(STEP_B) + _signed(SEED_B))
    swapped = (w << 32) | ((w >> 32) & low)
    lane_a = ((ta & low) * ((ta >> 32) & low) + swapped).sum()
    lane_b = ((tb & low) * ((tb >> 32) & low) + w).sum()
    lanes = to_host(torch.stack((lane_a, lane_b))).tolist()
    return np.array([v & (1 << 64) - 1 for v in lanes], dtype=np.uint64)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


class HostCopy(NamedTuple):
    """What :func:`host_copy` returns."""

    view: dict[str, torch.Tensor]
    checksums: dict[str, str] | None
    """Every tensor's ``sum-128`` checksum, when the base's were given (else None): a patched
    tensor's from its base's and the words its changes write (no pass over the tensor), a
    tensor copied whole or without a base checksum hashed."""


def _patched(
    copy: torch.Tensor, width: int, at: torch.Tensor, new: torch.Tensor, held: U64 | None
) -> str | None:
    """Write the units ``new`` at positions ``at`` (host tensors) into ``copy``; the copy's
    ``sum-128`` checksum from ``held``, its lanes before the write, when given."""
    units = _units(copy, width)
    if held is None:
        units[at] = new
        return None
    acc = np.zeros(2, dtype=np.uint64)
    unsigned = np.dtype(f"<u{width}")
    scatter_summing(units.numpy().view(unsigned), at.numpy(), new.numpy().view(unsigned), acc)
    return lanes_hex(held + acc)


def host_copy(
    base_host: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    base_checksums: Mapping[str, str] | None = None,
) -> HostCopy:
    """The host copy of ``target`` from the host copy of ``base`` and the changes ``base →
    target``, found where the two live (module docstring), and, given ``base_host``'s
    ``sum-128`` checksums, the copy's (:class:`HostCopy`). A name ``base`` lacks, or whose
    dtype or shape changed, is copied whole."""
    out: dict[str, torch.Tensor] = {}
    made: dict[StorageKey, tuple[str, torch.Tensor]] = {}
    sums: dict[str, str] = {}
    for name, t in target.items():
        key = storage_key(t)
        if key in made:  # a tied name: the one host tensor (and its checksum)
            first, out[name] = made[key]
            if first in sums:
                sums[name] = sums[first]
            continue
        b, h = base.get(name), base_host.get(name)
        if b is None or h is None or not _same_layout(b, t) or h.dtype != t.dtype:
            out[name] = to_host(t.detach().contiguous())
            made[key] = (name, out[name])
            continue
        copy = h.detach().contiguous().clone()
        known = base_checksums.get(name) if base_checksums is not None else None
        held = hex_lanes(known) if known is not None else None
        if known is not None and held is not None:  # unchanged, it keeps its base's
            sums[name] = known
        if t.numel():
            width = t.element_size() if t.element_size() in _SIGNED else 8
            bu, tu = _units(b, width), _units(t, width)
            pos = torch.nonzero(bu != tu).reshape(-1)
            if pos.numel():
                small = torch.int32 if bu.numel() < 1 << 31 else torch.int64
                at, new = to_host(pos.to(small)).long(), to_host(tu[pos])
                summed = _patched(copy, width, at, new, held)
                if summed is not None:
                    sums[name] = summed
        made[key] = (name, copy)
        out[name] = copy
    if base_checksums is None:
        return HostCopy(out, None)
    hashed = checksums({k: v for k, v in out.items() if k not in sums})
    return HostCopy(out, {k: sums.get(k) or hashed[k] for k in out})
