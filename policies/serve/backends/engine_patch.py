"""The engine patch: what an island's sidecar hands its engine to move it from one version to the
next, in checkpoint coordinates, as one island-local file of about the patch's size.

The sidecar's shadow knows, per tensor, the flat positions the board's patches wrote since the
version the engine serves, their old and their new values (:mod:`policies.codec.written`).
:func:`encode` stores, per tensor:

- ``delta`` (the usual case): the positions and each value's change, the new value's bits less
  the old one's as an integer of the value's width, zigzagged (an Adam step moves a bf16 value by
  one or two units in the last place, so these are tiny numbers that compress to almost nothing,
  as in the board's patch), plus ``old_sum``, the sum of the old values' bits: the engine reads the
  old values from its own weights, checks that sum (it is not serving the version the patch starts
  from otherwise) and adds the changes;
- ``dense``: the whole tensor (an anchor replaced it, or the engine restarted).

Layout: a safetensors file. For ``delta``, ``NAME@gaps`` (uint8: the gaps between sorted
positions, the first from −1, as little-endian uint32) and ``NAME@values`` (uint8: the
changes), each split into byte planes, low byte first, and zstd-compressed (the high
planes are nearly all zero); for ``dense``, ``NAME`` itself (its shape and dtype). Metadata:
``format`` (:data:`FORMAT`), ``version``, and ``tensors``: a JSON object of each sparse
tensor's ``coding``, ``dtype`` and ``old_sum``. The file's xxh3-128 digest (:func:`file_digest`)
travels beside its path; the reader refuses any other bytes.

Guarantees of :func:`read`: the digest is checked first; every name is one of the checkpoint's
(``expected``: name → dtype and shape), in its dtype; positions are strictly increasing and inside
the tensor, one value each; a dense tensor has the checkpoint's shape. Anything else raises
``ValueError`` naming the tensor. :func:`apply_deltas` is the only way changes become values.
This module imports no engine (only the codec's worker pool), so both sides share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import xxhash
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.codec.workers import workers

FORMAT = "sprawl-engine-patch/1"
GAPS = "@gaps"
VALUES = "@values"
Coding = Literal["delta", "dense"]


@dataclass(frozen=True)
class EngineTensor:
    """One tensor of an engine patch. ``values``: the whole tensor, flat (``dense``: then
    ``positions`` is None), or the zigzagged changes at ``positions``, their bits held in the
    tensor's dtype (``delta``: :func:`delta`, :func:`apply_deltas`)."""

    name: str
    shape: tuple[int, ...]
    coding: Coding
    values: torch.Tensor
    positions: torch.Tensor | None = None
    old_sum: int | None = None


def units(t: torch.Tensor) -> npt.NDArray[Any]:
    """``t``'s values as unsigned integers of their width (a copy-free view when contiguous)."""
    w = t.element_size()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().view(np.dtype(f"<u{w}"))


def unit_sum(t: torch.Tensor) -> int:
    """The sum of ``t``'s bits as unsigned integers, modulo 2**64 (what ``old_sum`` checks)."""
    return int(units(t).astype(np.uint64).sum(dtype=np.uint64))


def delta(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``'s bits less ``old``'s as integers of the width, zigzagged; held in the dtype."""
    w = old.element_size()
    diff = (units(new) - units(old)).view(np.dtype(f"<i{w}"))
    zz = (diff << 1) ^ (diff >> (8 * w - 1))
    return torch.from_numpy(zz.view(np.uint8).copy()).view(old.dtype)


def apply_deltas(old: torch.Tensor, changes: torch.Tensor) -> torch.Tensor:
    """The values ``old`` becomes with ``changes`` (:func:`delta`'s output)."""
    w = old.element_size()
    zz = units(changes)
    signed = (zz >> 1).view(np.dtype(f"<i{w}")) ^ -(zz & 1).view(np.dtype(f"<i{w}"))
    new = units(old) + signed.view(np.dtype(f"<u{w}"))
    return torch.from_numpy(new.view(np.uint8).copy()).view(old.dtype)


def _zstd(raw: bytes) -> torch.Tensor:
    packed = zstandard.ZstdCompressor(level=1).compress(raw)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def _unzstd(blob: torch.Tensor, name: str) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(blob.numpy().tobytes())
    except zstandard.ZstdError as exc:
        raise ValueError(f"{name}: does not decompress: {exc}") from None


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    gaps = np.diff(positions.numpy().astype(np.int64), prepend=-1) - 1
    if gaps.size and int(gaps.max()) >= 1 << 32:
        raise ValueError("a gap between two positions does not fit 32 bits")
    return _planes(torch.from_numpy(gaps.astype("<u4").view(np.uint8)), 4)


def _positions(blob: torch.Tensor, name: str) -> torch.Tensor:
    raw = _unplane(blob, 4, name + GAPS)
    g = raw.numpy().view("<u4").astype(np.int64) + 1
    return torch.from_numpy(np.cumsum(g) - 1)


def _planes(raw: torch.Tensor, width: int) -> torch.Tensor:
    rows = raw.contiguous().reshape(-1).view(torch.uint8).reshape(-1, width)
    return _zstd(rows.t().contiguous().numpy().tobytes() if rows.numel() else b"")


def _unplane(blob: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """Byte planes back to values' bytes (uint8, ``width`` per value)."""
    raw = _unzstd(blob, name)
    if len(raw) % width:
        raise ValueError(f"{name}: {len(raw)} bytes of values is not whole {width}-byte values")
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(width, -1)
    return planes.t().reshape(-1)  # 1-D first: a (1, width) view may keep stride 1


def _sections(t: EngineTensor) -> dict[str, torch.Tensor]:
    if t.coding == "dense" or t.positions is None:
        return {t.name: t.values.contiguous().reshape(t.shape)}
    width = torch.empty((), dtype=t.values.dtype).element_size()
    return {t.name + GAPS: _gaps(t.positions), t.name + VALUES: _planes(t.values, width)}


def encode(tensors: list[EngineTensor], version: int) -> bytes:
    """The engine patch of ``tensors`` (for ``version``) as bytes; the tensors are compressed on
    the codec's threads (:mod:`policies.codec.workers`)."""
    out: dict[str, torch.Tensor] = {}
    for sections in workers("apply").map(_sections, tensors):
        out.update(sections)
    sparse = {
        t.name: {"coding": t.coding, "dtype": _dtype_name(t.values), "old_sum": t.old_sum}
        for t in tensors
        if t.coding != "dense" and t.positions is not None
    }
    meta = {"format": FORMAT, "version": str(version), "tensors": json.dumps(sparse)}
    return bytes(st_save(out, metadata=meta))


def file_digest(data: bytes) -> str:
    """The digest the reader checks the file's bytes against."""
    return xxhash.xxh3_128_hexdigest(data)


def write(path: Path, data: bytes) -> None:
    """Write an engine patch next to ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def read(
    path: str, digest: str, expected: dict[str, tuple[str, list[int]]]
) -> tuple[int, list[EngineTensor]]:
    """The version and tensors of the engine patch at ``path``, checked (module docstring)."""
    with open(path, "rb") as f:
        data = f.read()
    got = file_digest(data)
    if got != digest:
        raise ValueError(f"{path}: digest {got} is not the sidecar's {digest}")
    try:
        tensors = st_load(data)
        meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r} is not {FORMAT}")
        sparse: dict[str, dict[str, Any]] = json.loads(meta["tensors"])
        version = int(meta["version"])
    except Exception as exc:  # safetensors raises its own untyped errors on torn files
        raise ValueError(f"{path}: not an engine patch: {exc}") from None
    names = {n for n in tensors if not n.endswith((GAPS, VALUES))} | set(sparse)
    extra = set(tensors) - names - {n + s for n in sparse for s in (GAPS, VALUES)}
    if extra:
        raise ValueError(f"{sorted(extra)[0]}: not part of a sparse tensor")
    out = []
    for name in sorted(names):
        if name not in expected:
            raise ValueError(f"{name}: not a tensor of the engine's checkpoint")
        dtype, shape = expected[name]
        if name in sparse:
            out.append(_sparse(name, sparse[name], tensors, dtype, shape))
            continue
        values = tensors[name]
        if _dtype_name(values) != dtype or list(values.shape) != shape:
            got = f"{_dtype_name(values)}{list(values.shape)}"
            raise ValueError(f"{name}: {got}, the checkpoint's {dtype}{shape}")
        out.append(EngineTensor(name, tuple(shape), "dense", values.reshape(-1)))
    return version, out


def _sparse(
    name: str, info: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: str, shape: list[int]
) -> EngineTensor:
    coding = info.get("coding")
    if coding != "delta" or info.get("dtype") != dtype or name in tensors:
        raise ValueError(f"{name}: {info}, the checkpoint's dtype is {dtype}")
    if name + GAPS not in tensors or name + VALUES not in tensors:
        raise ValueError(f"{name}: positions or values missing")
    torch_dtype = getattr(torch, dtype)
    width = torch.empty((), dtype=torch_dtype).element_size()
    positions = _positions(tensors[name + GAPS], name)
    raw = _unplane(tensors[name + VALUES], width, name + VALUES)
    values = raw.view(torch_dtype)
    numel = int(np.prod(shape))
    if positions.numel() * width != raw.numel():
        raise ValueError(f"{name}: {positions.numel()} positions for {raw.numel()} value bytes")
    if positions.numel() and int(positions[-1]) >= numel:
        raise ValueError(f"{name}: a position past the tensor's {numel} elements")
    old_sum = info.get("old_sum")
    if not isinstance(old_sum, int):
        raise ValueError(f"{name}: a delta without old_sum")
    return EngineTensor(name, tuple(shape), "delta", values, positions, old_sum)
