"""A version's manifest as bytes on the board: its digest, its seal, its record of the base files,
and reading it back (no I/O here; numpy and xxhash, not the storage edge).

Guarantees: :func:`parse_manifest` returns a manifest only if it is of the format this sprawl
reads (:data:`~policies.board.types.FORMAT`; a chunked patch's chunk sizes add up to the
patch's), every field validates (patch names are the layout's, base
file names are :data:`~policies.board.types.BASE_FILES`), its digest is that of its tensor
entries and its seal that of all its fields; otherwise :class:`VersionCorrupt` or, for another
format, :class:`BoardFormatError` saying how to proceed — each in one line naming the version. A
sharded manifest is also consistent (:func:`check_shards`): ranks ``0 … n-1`` in order; every
piece lies inside its tensor and the pieces of a tensor hold exactly its element count; each
tensor's checksum is :func:`pieces_checksum` of its pieces and each shard's digest that of its
pieces; every rank has one patch per base of the version's patches, and the version's patch
sizes and counts are the sums of the ranks'. It does not check that pieces do not overlap
(the seal and the per-piece checksums catch damage; only a dishonest writer could lay out
overlapping pieces whose sizes add up). The digest (:func:`manifest_digest`) is the same string
as a patch's target digest; the seal (:func:`manifest_seal`) covers everything else. Not
covered: xxh3 and the tensors' sum-128 are checksums, not signatures — they catch damage and
inconsistent edits, not a writer who recomputes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import BaseModel, ValidationError

from policies.board.types import (
    FORMAT,
    FileEntry,
    Manifest,
    PieceEntry,
    TensorEntry,
)
from policies.codec.digests import bytes_checksum, digest_of
from policies.errors import BoardFormatError, VersionCorrupt


def manifest_digest(entries: Mapping[str, TensorEntry]) -> str:
    """Digest of a version from its manifest entries: names, dtypes, shapes and checksums — the
    same string as :func:`policies.codec.digests.state_digest` of the tensors."""
    return digest_of((k, e.dtype, e.shape, e.checksum) for k, e in entries.items())


def pieces_checksum(pieces: Mapping[int, PieceEntry]) -> str:
    """A sharded tensor's checksum from its pieces by rank: xxh3-128 over each piece's rank,
    offset, shape and checksum, in rank order (a change to any piece changes it)."""
    lines = (f"{r}|{p.offset}|{p.shape}|{p.checksum}\n" for r, p in sorted(pieces.items()))
    return bytes_checksum("".join(lines).encode())


def check_shards(m: Manifest) -> str | None:
    """What is inconsistent in a sharded manifest's pieces and patches (module docstring), or
    None if nothing is."""
    if [s.rank for s in m.shards] != list(range(len(m.shards))):
        return "shard ranks are not 0..n-1 in order"
    by_tensor: dict[str, dict[int, PieceEntry]] = {}
    for shard in m.shards:
        for name, piece in shard.pieces.items():
            entry = m.tensors.get(name)
            if entry is None or name in m.aliases:
                return f"rank {shard.rank} holds a piece of {name}, which has no own tensor entry"
            inside = len(piece.offset) == len(piece.shape) == len(entry.shape) and all(
                o >= 0 and n >= 0 and o + n <= full
                for o, n, full in zip(piece.offset, piece.shape, entry.shape, strict=True)
            )
            if not inside:
                return f"rank {shard.rank}'s piece of {name} lies outside it"
            by_tensor.setdefault(name, {})[shard.rank] = piece
        rows = shard.pieces.items()
        own = digest_of((k, m.tensors[k].dtype, p.shape, p.checksum) for k, p in rows)
        if own != shard.digest:
            return f"rank {shard.rank}'s digest is not that of its pieces"
        if sorted(p.base for p in shard.patches) != sorted(p.base for p in m.patches):
            return f"rank {shard.rank}'s patches are not from the version's bases"
    for name, entry in m.tensors.items():
        if name in m.aliases:
            continue
        pieces = by_tensor.get(name, {})
        if sum(_numel(p.shape) for p in pieces.values()) != _numel(entry.shape):
            return f"the pieces of {name} do not hold its {_numel(entry.shape)} elements"
        if pieces_checksum(pieces) != entry.checksum:
            return f"the checksum of {name} is not that of its pieces"
    for ref in m.patches:
        refs = [p for s in m.shards for p in s.patches if p.base == ref.base]
        sums = tuple(sum(getattr(p, f) for p in refs) for f in ("bytes", "changed", "units"))
        if sums != (ref.bytes, ref.changed, ref.units):
            return f"the patch from {ref.base} is not the sum of the ranks' patches"
    if m.kind == "anchor" and sum(s.bytes for s in m.shards) != m.bytes:
        return "the anchor's size is not the sum of the ranks' anchor files"
    return None


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def manifest_seal(m: Manifest) -> str:
    """The seal of a manifest: xxh3-128 of every field but ``seal``, as canonical JSON (sorted
    keys, Python's float repr), so it does not depend on how the manifest file is formatted."""
    body = json.dumps(m.model_dump(mode="json", exclude={"seal"}), sort_keys=True)
    return bytes_checksum(body.encode())


def file_entries(files: Mapping[str, bytes]) -> dict[str, FileEntry]:
    """How a manifest records base files: size and checksum per name."""
    return {n: FileEntry(bytes=len(d), checksum=bytes_checksum(d)) for n, d in files.items()}


def one_line(exc: ValidationError, what: str) -> str:
    """A validation error in one line: the first three fields and what is wrong with each."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or what}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False)[:3]
    )


class _Format(BaseModel):
    """Only a manifest's format, read before the rest (another format has other fields)."""

    format: int = 1


def parse_manifest(raw: bytes, version: int, board: str) -> Manifest:
    """The manifest of ``version`` from its bytes, verified (module docstring); ``board`` names
    the board and run in a format error."""
    try:
        fmt = _Format.model_validate_json(raw).format
        if fmt != FORMAT:
            raise _format_error(version, fmt, board)
        m = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise VersionCorrupt(
            f"version {version}: manifest unreadable: {one_line(exc, 'manifest')}"
        ) from None
    if m.version != version or manifest_digest(m.tensors) != m.digest or manifest_seal(m) != m.seal:
        raise VersionCorrupt(f"version {version}: manifest does not match its own digest")
    chunked = [p for p in m.patches if p.chunks]
    if chunked and m.shards:
        raise VersionCorrupt(f"version {version}: a sharded manifest has chunked patches")
    for ref in chunked:
        if sum(c.bytes for c in ref.chunks) != ref.bytes:
            raise VersionCorrupt(
                f"version {version}: the chunks of {ref.file} do not add up to its "
                f"{ref.bytes} bytes"
            )
    wrong = check_shards(m) if m.shards else None
    if wrong is not None:
        raise VersionCorrupt(f"version {version}: sharded manifest inconsistent: {wrong}")
    return m


def _format_error(version: int, fmt: int, board: str) -> BoardFormatError:
    where = f"version {version} on {board}"
    if fmt < FORMAT:
        return BoardFormatError(
            f"{where} was written by an older sprawl (board format {fmt}; this sprawl reads "
            f"format {FORMAT}): publish a new run (another --run.name) with this sprawl, or "
            "read this one with the sprawl that wrote it"
        )
    return BoardFormatError(
        f"{where} was written by a newer sprawl (board format {fmt}; this sprawl reads format "
        f"{FORMAT}): upgrade sprawl to read it"
    )
