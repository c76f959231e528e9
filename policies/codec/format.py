"""The patch frame: magic, format version, header records and the frame check.

:mod:`policies.codec` specifies the wire format (its docstring); this module holds what both
the encoder and :mod:`policies.codec.apply` need to agree on: the constants, the header
dataclasses and :func:`parse_patch`, which verifies the frame's xxh3-128 before reading it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Literal

import xxhash

from policies.codec.digests import hex_lanes
from policies.errors import PatchCorrupt

MAGIC = b"SPRWLPT1"
FORMAT = 3
"""The one patch format this sprawl writes and reads: its tensor records carry ``sum-128``
checksums (:mod:`policies.codec.digests`) of the target and, for a ``patch`` record, of the base
words it changes (``old_words``). Another format is refused (``docs/codec.md``); format 2 (no
``old_words``) was never released, so it is not read."""
CODEC = f"sprawl-patch/{FORMAT}"
"""The codec's name and format version, as a board manifest records it."""
CHUNK = 1 << 16
U32 = struct.Struct("<I")

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
    old_words: str | None
    """For a ``patch`` record, the two lanes (hex) of the ``sum-128`` terms of the base's 64-bit
    words that the patch changes, each word once (no byte count); None for other ops."""


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
        """The target's per-tensor checksums (what a manifest records)."""
        return {t.name: t.checksum for t in self.tensors}


def _lanes(value: object) -> object:
    """The lanes of a ``sum-128`` hex ``value`` (None: not one)."""
    return hex_lanes(value) if isinstance(value, str) else None


def _header(raw: bytes, patch_bytes: int) -> PatchHeader:
    """The header from its JSON ``raw``; another format is refused before its fields are read
    (they differ)."""
    try:
        h = json.loads(raw)
        fmt = h["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchCorrupt(f"unreadable patch header: {exc}") from exc
    if fmt != FORMAT:
        raise PatchCorrupt(f"unsupported patch format {fmt} (this sprawl reads format {FORMAT})")
    try:
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
                old_words=r["old_words"],
            )
            for r in h["tensors"]
        )
        return PatchHeader(
            format=fmt,
            base_digest=h["base_digest"],
            target_digest=h["target_digest"],
            chunk=h["chunk"],
            tensors=recs,
            removed=tuple(h["removed"]),
            patch_bytes=patch_bytes,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchCorrupt(f"unreadable patch header: {exc}") from exc


def parse_patch(patch: bytes) -> tuple[PatchHeader, memoryview]:
    """The verified header and the body of ``patch`` (:class:`PatchCorrupt` if damaged)."""
    view = memoryview(patch)
    if len(view) < len(MAGIC) + U32.size + 16 or bytes(view[:8]) != MAGIC:
        raise PatchCorrupt("not a sprawl patch (bad magic or too short)")
    if xxhash.xxh3_128_digest(view[:-16]) != bytes(view[-16:]):
        raise PatchCorrupt("patch frame checksum mismatch: the patch is damaged or truncated")
    (hlen,) = U32.unpack_from(view, 8)
    start = 12 + hlen
    header = _header(bytes(view[12:start]), len(view))
    recs = header.tensors
    if header.chunk % 8 or not 8 <= header.chunk <= 1 << 21:
        raise PatchCorrupt(f"bad chunk size {header.chunk}")
    if any(r.width not in (1, 2, 4, 8) or r.offset < 0 or r.length < 0 for r in recs):
        raise PatchCorrupt("bad tensor record")
    if any(r.op == "patch" and _lanes(r.old_words) is None for r in recs):
        raise PatchCorrupt("a patch record without the checksum of the base words it changes")
    body = view[start:-16]
    if any(r.offset + r.length > len(body) for r in recs):
        raise PatchCorrupt("a tensor section extends past the patch body")
    return header, body


def read_patch_header(patch: bytes) -> PatchHeader:
    """Verify the frame and return the header (base/target digests, tensors, change counts)."""
    return parse_patch(patch)[0]
