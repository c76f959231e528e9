"""Bitwise sparse patches between two versions of a served view.

A patch turns the tensors of a *base* version into those of a *target* version bit for bit.
Tensors are compared as raw unsigned integers of their element width (never as floats), so
±0, NaN payloads, infinities and subnormals round-trip, and applying a patch any number of times
in a chain cannot drift.

Guarantees:

- ``apply_patch(base, encode_patch(base, target))`` equals ``target`` bit for bit, for every
  dtype whose element size is 1, 2, 4 or 8 bytes (or a multiple of 8: compared in 8-byte units).
- A patch names its base and target by :func:`state_digest`; applying it to any other base
  raises :class:`PatchBaseMismatch` before anything is modified.
- Any change to the patch bytes (a flipped byte, truncation, appended bytes) raises
  :class:`PatchCorrupt` before anything is modified (xxh3-128 over the whole frame).
- With ``verify=True`` every tensor the patch writes is checked against the target's xxh3-128
  checksum (:class:`PatchChecksumMismatch`). Tensors the patch does not touch are covered by the
  base digest (computed, or vouched for by the caller with ``base_digest=``).
- Tensors added, or whose dtype or shape changed, are shipped whole; removed names are listed.
  Names that alias one storage in the target (tied embeddings) are encoded once and stay tied.

Not covered: partially overlapping views of one storage (each is patched on its own, which is
exact only when their target bytes agree); device tensors (encoding reads CPU copies; applying
refuses non-CPU tensors with :class:`PatchError`).

Wire format (all integers little-endian)::

    frame   := MAGIC(8 = b"SPRWLPT1") | u32 H | header (H bytes, UTF-8 JSON) | body | xxh3-128(16)
    header  := {"format": 1, "base_digest", "target_digest", "chunk": C, "removed": [name…],
                "tensors": [{"name", "op", "dtype", "shape", "checksum", "units", "width",
                             "changed", "offset", "length", "alias_of"}…]}
    op      := "patch" (section at body[offset:offset+length]; length 0 = unchanged)
             | "full"  (section = zstd(raw target bytes))  | "alias" (no section)

A ``patch`` section is one zstd frame of::

    CODING u8 | K u8 | N_VALUES u64 | N_BITMASK u64 | K × u64 plane lengths
    | MODES (one u8 per chunk) | K gap planes | N_BITMASK × C/8 bytes | N_VALUES × width bytes

The tensor is read as ``units`` unsigned integers of ``width`` bytes, cut into chunks of C units.
MODES: 0 unchanged, 1 sparse (< C/8 changes), 2 bitmask (C/8 … C/2), 3 dense (> C/2). The
changes in sparse chunks, taken together in order, are stored as gaps ``g0 = p0``,
``gi = pi - p(i-1) - 1``, each a 7-bit-group varint (low group first, high bit = more follows)
split into byte planes: plane k holds the k-th byte of every gap that has one (K ≤ 8). Each
bitmask chunk stores C/8 bytes, bit ``i % 8`` of byte ``i // 8`` marking unit ``i`` of the chunk.
Dense chunks store no positions. Values, in order: sparse changes, bitmask changes, then every
unit of every dense chunk (chunk order), each transformed by CODING — 0 ``xor`` (base ^ target),
1 ``delta`` (zigzag of target - base, wrapping), 2 ``odelta`` (the same after mapping
sign-magnitude floats to ordered integers) — and split into ``width`` byte planes, low byte
first. The encoder picks the coding with the lowest order-0 entropy on the first 64k changes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import structlog
import torch
import xxhash
import zstandard

from policies.codec_ops import (
    BITMASK,
    DENSE,
    SPARSE,
    Coding,
    apply_section,
    decode_positions,
    encode_positions,
    encode_section,
    unit_view,
    varint_planes,
    varint_values,
)
from policies.digests import (
    checksums,
    digest_of,
    dtype_name,
    raw_bytes,
    state_digest,
    storage_key,
    tensor_checksum,
)
from policies.errors import PatchBaseMismatch, PatchChecksumMismatch, PatchCorrupt, PatchError

__all__ = [
    "BITMASK",
    "CODEC",
    "DENSE",
    "SPARSE",
    "Coding",
    "PatchBaseMismatch",
    "PatchChecksumMismatch",
    "PatchCorrupt",
    "PatchError",
    "PatchHeader",
    "TensorRecord",
    "apply_patch",
    "checksums",
    "decode_positions",
    "digest_of",
    "encode_patch",
    "encode_positions",
    "read_patch_header",
    "squash",
    "state_digest",
    "tensor_checksum",
    "varint_planes",
    "varint_values",
]

log = structlog.get_logger(__name__)

MAGIC = b"SPRWLPT1"
FORMAT = 1
CODEC = f"sprawl-patch/{FORMAT}"
"""The codec's name and format version, as a board manifest records it."""
CHUNK = 1 << 16
_U32 = struct.Struct("<I")

Op = Literal["patch", "full", "alias"]


@dataclass(frozen=True)
class TensorRecord:
    """How one target tensor is carried in a patch."""

    name: str
    op: Op
    dtype: str
    shape: tuple[int, ...]
    checksum: str
    units: int
    width: int
    changed: int
    offset: int
    length: int
    alias_of: str | None


@dataclass(frozen=True)
class PatchHeader:
    """What a patch says about itself (read without applying it)."""

    format: int
    base_digest: str
    target_digest: str
    chunk: int
    tensors: tuple[TensorRecord, ...]
    removed: tuple[str, ...]
    patch_bytes: int

    @property
    def changed(self) -> int:
        """Units that differ in patched tensors (whole-shipped tensors count all their units)."""
        return sum(t.changed for t in self.tensors if t.op != "alias")

    @property
    def units(self) -> int:
        return sum(t.units for t in self.tensors if t.op != "alias")

    @property
    def density(self) -> float:
        return self.changed / self.units if self.units else 0.0

    @property
    def checksums(self) -> dict[str, str]:
        """The target's per-tensor xxh3-128 checksums (what a manifest records)."""
        return {t.name: t.checksum for t in self.tensors}


# -- encoding -------------------------------------------------------------------------------------


def _width(t: torch.Tensor) -> int:
    size = t.element_size()
    if size in (1, 2, 4, 8):
        return size
    if size % 8 == 0:
        return 8
    raise PatchError(f"unsupported element size {size} for dtype {t.dtype}")


def _compress(raw: bytes, level: int) -> bytes:
    # zstd's multi-threaded mode emits the same bytes for any worker count ≥ 1; below a few MiB
    # it would not split the input anyway.
    threads = 2 if len(raw) > 1 << 22 else 0
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)


def _encode_tensor(
    base: torch.Tensor, target: torch.Tensor, pool: ThreadPoolExecutor, level: int, chunk: int
) -> tuple[bytes, int]:
    width = _width(target)
    b = unit_view(raw_bytes(base), width)
    t = unit_view(raw_bytes(target), width)
    raw, changed = encode_section(b, t, target.dtype.is_floating_point, pool, chunk)
    return (_compress(raw, level) if changed else b""), changed


def encode_patch(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    level: int = 3,
    base_digest: str | None = None,
    target_checksums: Mapping[str, str] | None = None,
    chunk: int = CHUNK,
) -> bytes:
    """Encode the patch that turns ``base`` into ``target``.

    ``base_digest`` and ``target_checksums`` may be passed when already known (a publisher has
    them from the previous and current version); otherwise they are computed. ``chunk`` (units
    per chunk, a multiple of 8 up to 2**21) is recorded in the patch.
    """
    if chunk % 8 or not 8 <= chunk <= 1 << 21:
        raise ValueError(f"chunk must be a multiple of 8 in [8, 2**21], got {chunk}")
    sums = dict(target_checksums) if target_checksums is not None else checksums(target)
    sums.update(checksums({k: v for k, v in target.items() if k not in sums}))
    bdig = base_digest if base_digest is not None else state_digest(base)
    tdig = digest_of((k, dtype_name(t), list(t.shape), sums[k]) for k, t in target.items())
    records: list[dict[str, Any]] = []
    body: list[bytes] = []
    offset = 0
    primary: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], str] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name in sorted(target):
            t = target[name]
            rec: dict[str, Any] = {
                "name": name,
                "dtype": dtype_name(t),
                "shape": list(t.shape),
                "checksum": sums[name],
                "width": _width(t),
                "alias_of": None,
            }
            rec["units"] = t.numel() * t.element_size() // rec["width"]
            key = storage_key(t)
            b = base.get(name)
            if key in primary:
                rec.update(op="alias", alias_of=primary[key], changed=0, section=b"")
            elif b is None or dtype_name(b) != rec["dtype"] or tuple(b.shape) != tuple(t.shape):
                section = _compress(raw_bytes(t).tobytes(), level)
                rec.update(op="full", changed=rec["units"], section=section)
            else:
                section, changed = _encode_tensor(b, t, pool, level, chunk)
                rec.update(op="patch", changed=changed, section=section)
            primary.setdefault(key, name)
            section = rec.pop("section")
            rec.update(offset=offset, length=len(section))
            offset += len(section)
            body.append(section)
            records.append(rec)
    header = {
        "format": FORMAT,
        "base_digest": bdig,
        "target_digest": tdig,
        "chunk": chunk,
        "removed": sorted(set(base) - set(target)),
        "tensors": records,
    }
    hbytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    frame = b"".join([MAGIC, _U32.pack(len(hbytes)), hbytes, *body])
    log.info(
        "patch.encoded",
        base=bdig,
        target=tdig,
        tensors=len(records),
        bytes=len(frame) + 16,
        changed=sum(r["changed"] for r in records if r["op"] != "alias"),
    )
    return frame + xxhash.xxh3_128_digest(frame)


# -- decoding -------------------------------------------------------------------------------------


def _parse(patch: bytes) -> tuple[PatchHeader, memoryview]:
    view = memoryview(patch)
    if len(view) < len(MAGIC) + _U32.size + 16 or bytes(view[:8]) != MAGIC:
        raise PatchCorrupt("not a sprawl patch (bad magic or too short)")
    if xxhash.xxh3_128_digest(view[:-16]) != bytes(view[-16:]):
        raise PatchCorrupt("patch frame checksum mismatch: the patch is damaged or truncated")
    (hlen,) = _U32.unpack_from(view, 8)
    start = 12 + hlen
    try:
        h = json.loads(bytes(view[12:start]))
        recs = tuple(
            TensorRecord(
                name=r["name"],
                op=r["op"],
                dtype=r["dtype"],
                shape=tuple(r["shape"]),
                checksum=r["checksum"],
                units=r["units"],
                width=r["width"],
                changed=r["changed"],
                offset=r["offset"],
                length=r["length"],
                alias_of=r["alias_of"],
            )
            for r in h["tensors"]
        )
        header = PatchHeader(
            format=h["format"],
            base_digest=h["base_digest"],
            target_digest=h["target_digest"],
            chunk=h["chunk"],
            tensors=recs,
            removed=tuple(h["removed"]),
            patch_bytes=len(view),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchCorrupt(f"unreadable patch header: {exc}") from exc
    if header.chunk % 8 or not 8 <= header.chunk <= 1 << 21:
        raise PatchCorrupt(f"bad chunk size {header.chunk}")
    if any(r.width not in (1, 2, 4, 8) or r.offset < 0 or r.length < 0 for r in recs):
        raise PatchCorrupt("bad tensor record")
    if header.format != FORMAT:
        raise PatchCorrupt(f"unsupported patch format {header.format} (expected {FORMAT})")
    body = view[start:-16]
    if any(r.offset + r.length > len(body) for r in recs):
        raise PatchCorrupt("a tensor section extends past the patch body")
    return header, body


def read_patch_header(patch: bytes) -> PatchHeader:
    """Verify the frame and return the header (base/target digests, tensors, change counts)."""
    return _parse(patch)[0]


def _decompress(data: memoryview, name: str) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as exc:
        raise PatchCorrupt(f"{name}: section does not decompress: {exc}") from exc


def _apply_section(dst: torch.Tensor, rec: TensorRecord, data: bytes, chunk: int) -> None:
    units = unit_view(dst.reshape(-1).view(torch.uint8).numpy(), rec.width)
    if units.size != rec.units:
        raise PatchBaseMismatch(f"{rec.name}: base has {units.size} units, patch {rec.units}")
    try:
        apply_section(units, data, chunk)
    except ValueError as exc:
        raise PatchCorrupt(f"{rec.name}: {exc}") from exc


def _target_tensor(rec: TensorRecord, data: bytes) -> torch.Tensor:
    dtype = getattr(torch, rec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PatchCorrupt(f"{rec.name}: unknown dtype {rec.dtype}")
    buf = bytearray(data)
    if len(buf) != rec.units * rec.width:
        raise PatchCorrupt(f"{rec.name}: {len(buf)} bytes for {rec.units} units")
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(rec.shape)


def apply_patch(
    base: MutableMapping[str, torch.Tensor],
    patch: bytes,
    *,
    in_place: bool = True,
    base_digest: str | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Apply ``patch`` to ``base`` and return the target state.

    ``in_place=True`` writes into the base tensors and the base mapping (no copy of the view);
    ``in_place=False`` leaves ``base`` untouched. ``base_digest`` vouches for the base (e.g. the
    digest a previous apply returned) instead of hashing it. If a checksum check fails after
    writing in place, the base is partially patched: reload it from a verified version.
    """
    header, body = _parse(patch)
    bdig = base_digest if base_digest is not None else state_digest(base)
    if bdig != header.base_digest:
        raise PatchBaseMismatch(
            f"patch expects base {header.base_digest}, got base {bdig}: apply the patch to the "
            "version it was made from (or fetch a patch or anchor for this base)"
        )
    out: dict[str, torch.Tensor] = {}
    base_groups: dict[int, list[str]] = {}
    for name, t in base.items():
        base_groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    target_group = {r.name: r.alias_of or r.name for r in header.tensors}
    for rec in header.tensors:
        if rec.op == "alias":
            if rec.alias_of not in out:
                raise PatchCorrupt(f"{rec.name}: alias of unknown tensor {rec.alias_of}")
            out[rec.name] = out[rec.alias_of]
            continue
        section = body[rec.offset : rec.offset + rec.length]
        if rec.op == "full":
            out[rec.name] = _target_tensor(rec, _decompress(section, rec.name))
        elif rec.op == "patch":
            src = base.get(rec.name)
            if src is None or dtype_name(src) != rec.dtype or tuple(src.shape) != rec.shape:
                raise PatchBaseMismatch(
                    f"{rec.name}: base lacks this tensor as {rec.dtype}{list(rec.shape)}"
                )
            if src.device.type != "cpu":
                raise PatchError(f"{rec.name}: apply_patch works on CPU tensors, got {src.device}")
            dst = src.detach()
            sharers = base_groups.get(dst.untyped_storage().data_ptr(), [])
            shared = any(target_group.get(s, s) != rec.name for s in sharers if s != rec.name)
            if not in_place or (rec.length and (shared or not dst.is_contiguous())):
                dst = dst.contiguous().clone()
            if rec.length:
                _apply_section(dst, rec, _decompress(section, rec.name), header.chunk)
            out[rec.name] = dst
        else:
            raise PatchCorrupt(f"{rec.name}: unknown op {rec.op}")
        if verify and (rec.op == "full" or rec.length):
            got = tensor_checksum(out[rec.name])
            if got != rec.checksum:
                raise PatchChecksumMismatch(
                    f"{rec.name}: patched tensor checksum {got} != target {rec.checksum}"
                )
    log.info(
        "patch.applied",
        base=header.base_digest,
        target=header.target_digest,
        changed=header.changed,
        bytes=header.patch_bytes,
        verified=verify,
    )
    if in_place:
        for name in header.removed:
            base.pop(name, None)
        base.update(out)
    return out


def squash(base: Mapping[str, torch.Tensor], patches: Iterable[bytes], *, level: int = 3) -> bytes:
    """One patch equal to applying ``patches`` in order to ``base`` (catch-up v → v+k)."""
    state: dict[str, torch.Tensor] = dict(base)
    first = True
    for p in patches:
        state = apply_patch(state, p, in_place=not first)
        first = False
    return encode_patch(base, state, level=level)
