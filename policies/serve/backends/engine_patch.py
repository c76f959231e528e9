"""The engine patch: what an island's sidecar hands its engine to move it from one version to the
next, in checkpoint coordinates, as one island-local file of about the patch's size.

The sidecar's shadow knows, per tensor, the flat positions the board's patches wrote since the
version the engine serves and their new values (:mod:`policies.codec.written`); :func:`write`
stores them, and :func:`read` gives them back to the engine's side
(:mod:`policies.serve.backends.vllm_transfer`), which writes them in place through the engine's
own loader. A tensor the shadow replaced whole (an anchor) travels whole (*dense*).

Layout: a safetensors file. A sparse tensor ``NAME`` is two uint8 entries, ``NAME@gaps`` (the
zstd-compressed little-endian uint32 gaps between its sorted positions, the first from −1) and
``NAME@values`` (its new values split into byte planes, low byte first, then zstd-compressed: a
weight's sign-and-exponent byte repeats, which is most of what the board's patch saves too); a
dense one is ``NAME`` with the tensor's shape and dtype. Metadata: ``format`` (:data:`FORMAT`),
``version``, and ``sparse``: a JSON object of each sparse tensor's dtype. The file's xxh3-128 digest
(:func:`file_digest`) travels beside its path, and the reader refuses any other bytes.

Guarantees of :func:`read`: the digest is checked first; every name is one of the checkpoint's
(``expected``: name → dtype string and shape), in its dtype; a sparse tensor's positions are
strictly increasing and inside the tensor, one value each; a dense one has the checkpoint's shape.
Anything else raises ``ValueError`` naming the tensor. This module imports no engine, so both
sides share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "sprawl-engine-patch/1"
GAPS = "@gaps"
VALUES = "@values"


@dataclass(frozen=True)
class EngineTensor:
    """One tensor of an engine patch: ``positions`` None means ``values`` is the whole tensor."""

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    positions: torch.Tensor | None = None


def _zstd(raw: bytes) -> torch.Tensor:
    packed = zstandard.ZstdCompressor(level=3).compress(raw)
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
    return _zstd(gaps.astype("<u4").tobytes())


def _positions(blob: torch.Tensor, name: str) -> torch.Tensor:
    raw = _unzstd(blob, name + GAPS)
    if len(raw) % 4:
        raise ValueError(f"{name}: {len(raw)} bytes of positions is not whole uint32 gaps")
    g = np.frombuffer(raw, dtype="<u4").astype(np.int64) + 1
    return torch.from_numpy(np.cumsum(g) - 1)


def _planes(values: torch.Tensor) -> torch.Tensor:
    width = values.element_size()
    units = values.contiguous().reshape(-1).view(torch.uint8).reshape(-1, width)
    return _zstd(units.t().contiguous().numpy().tobytes()) if units.numel() else _zstd(b"")


def _values(blob: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    raw = _unzstd(blob, name + VALUES)
    width = torch.empty((), dtype=dtype).element_size()
    if len(raw) % width:
        raise ValueError(f"{name}: {len(raw)} bytes of values is not whole {dtype} values")
    if not raw:
        return torch.empty(0, dtype=dtype)
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(width, -1)
    return planes.t().reshape(-1).view(dtype)  # 1-D first: a (1, width) view may keep stride 1


def encode(tensors: list[EngineTensor], version: int) -> bytes:
    """The engine patch of ``tensors`` (for ``version``) as bytes."""
    out: dict[str, torch.Tensor] = {}
    sparse: dict[str, str] = {}
    for t in tensors:
        if t.positions is None:
            out[t.name] = t.values.contiguous().reshape(t.shape)
        else:
            out[t.name + GAPS] = _gaps(t.positions)
            out[t.name + VALUES] = _planes(t.values)
            sparse[t.name] = _dtype_name(t.values)
    meta = {"format": FORMAT, "version": str(version), "sparse": json.dumps(sparse)}
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
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises its own untyped errors on torn files
        raise ValueError(f"{path}: not an engine patch: {exc}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not {FORMAT}")
    try:
        sparse: dict[str, str] = json.loads(meta.get("sparse", "{}"))
    except ValueError:
        raise ValueError(f"{path}: unreadable metadata") from None
    names = {n for n in tensors if not n.endswith((GAPS, VALUES))} | set(sparse)
    extra = set(tensors) - names - {n + s for n in sparse for s in (GAPS, VALUES)}
    if extra:
        raise ValueError(f"{sorted(extra)[0]}: not part of a sparse tensor")
    out = []
    for name in sorted(names):
        if name not in expected:
            raise ValueError(f"{name}: not a tensor of the engine's checkpoint")
        dtype, shape = expected[name]
        if name not in sparse:
            out.append(_dense(name, tensors[name], dtype, shape))
            continue
        if sparse[name] != dtype or name in tensors:
            raise ValueError(f"{name}: sparse {sparse[name]}, the checkpoint's is {dtype}")
        if name + GAPS not in tensors or name + VALUES not in tensors:
            raise ValueError(f"{name}: positions or values missing")
        positions = _positions(tensors[name + GAPS], name)
        values = _values(tensors[name + VALUES], getattr(torch, dtype), name)
        numel = int(np.prod(shape))
        if positions.numel() != values.numel():
            raise ValueError(f"{name}: {positions.numel()} positions for {values.numel()} values")
        if positions.numel() and int(positions[-1]) >= numel:
            raise ValueError(f"{name}: a position past the tensor's {numel} elements")
        out.append(EngineTensor(name, tuple(shape), values, positions))
    return int(meta.get("version", -1)), out


def _dense(name: str, values: torch.Tensor, dtype: str, shape: list[int]) -> EngineTensor:
    if _dtype_name(values) != dtype or list(values.shape) != shape:
        raise ValueError(
            f"{name}: {_dtype_name(values)}{list(values.shape)}, the checkpoint's {dtype}{shape}"
        )
    return EngineTensor(name, tuple(shape), values.reshape(-1))
