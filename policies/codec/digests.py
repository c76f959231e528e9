"""Checksums and digests of served views, shared by the patch codec and the board (which also
checksums its base files and manifests with :func:`bytes_checksum`, xxh3-128).

``tensor_checksum`` sums a tensor's raw bytes in contiguous native order into a ``sum-128``
checksum (:data:`SUM`, :mod:`policies.codec.kernels_sum`): a sum over its 64-bit words, so an
apply that writes a few words updates the checksum of the tensor it held from those words alone
(:mod:`policies.codec.apply`) instead of hashing the tensor again. It is the one tensor checksum
(patches and manifests alike); xxh3-128 checks bytes (files, frames, manifests), not tensors.
``state_digest`` hashes ``name|dtype|shape|checksum`` lines in name order, so a board
manifest's digest and a patch's target digest are the same string for the same state. Names
that alias one storage (tied embeddings) are hashed once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from policies.codec.kernels_sum import add_words, finish_sum


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def raw_bytes(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """The tensor's bytes as a flat uint8 array (a view when the tensor is contiguous on CPU)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def bytes_checksum(data: bytes | memoryview) -> str:
    """xxh3-128 (hex) of ``data``: the checksum of a file's bytes (a board's base files)."""
    return xxhash.xxh3_128_hexdigest(data)


def _sum_lanes(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    acc = np.zeros(2, dtype=np.uint64)
    whole = raw.size // 8
    if whole:
        body = raw[: whole * 8] if raw.ctypes.data % 8 == 0 else raw[: whole * 8].copy()
        add_words(body.view("<u8"), 0, acc)
    return finish_sum(raw, whole, acc)


def lanes_hex(acc: npt.NDArray[np.uint64]) -> str:
    """A ``sum-128`` checksum's hex from its two lanes."""
    return f"{int(acc[0]):016x}{int(acc[1]):016x}"


def hex_lanes(checksum: str) -> npt.NDArray[np.uint64] | None:
    """The two lanes of a ``sum-128`` checksum's hex (None when it is not one)."""
    if len(checksum) != 32:
        return None
    try:
        return np.array([int(checksum[:16], 16), int(checksum[16:], 16)], dtype=np.uint64)
    except ValueError:
        return None


def tensor_checksum(t: torch.Tensor) -> str:
    """The ``sum-128`` checksum (hex) of the tensor's raw bytes in contiguous native order."""
    return lanes_hex(_sum_lanes(raw_bytes(t)))


StorageKey = tuple[int, int, tuple[int, ...], tuple[int, ...], str]
"""Storage address, offset, shape, stride and dtype: equal keys mean one tensor under two names."""


def storage_key(t: torch.Tensor) -> StorageKey:
    return (
        t.untyped_storage().data_ptr(),
        int(t.storage_offset()),
        tuple(t.shape),
        t.stride(),
        dtype_name(t),
    )


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums; names aliasing one storage are hashed once."""
    seen: dict[StorageKey, str] = {}
    out: dict[str, str] = {}
    for name, t in tensors.items():
        key = storage_key(t)
        if key not in seen:
            seen[key] = tensor_checksum(t)
        out[name] = seen[key]
    return out


def digest_of(entries: Iterable[tuple[str, str, list[int], str]]) -> str:
    """Whole-version digest over (name, dtype, shape, checksum), in name order."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, checksum in sorted(entries):
        h.update(f"{name}|{dtype}|{list(shape)}|{checksum}\n".encode())
    return h.hexdigest()


def state_digest(
    tensors: Mapping[str, torch.Tensor],
    *,
    known: Mapping[str, str] | None = None,
) -> str:
    """Digest of a whole state; ``known`` supplies checksums already computed."""
    sums = dict(known) if known is not None else checksums(tensors)
    missing = {k: v for k, v in tensors.items() if k not in sums}
    sums.update(checksums(missing))
    return digest_of((k, dtype_name(t), list(t.shape), sums[k]) for k, t in tensors.items())
