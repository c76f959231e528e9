"""A version's manifest as bytes on the board: its digest, its seal, its record of the base files,
and reading it back (no I/O here; numpy and xxhash, not the storage edge).

Guarantees: :func:`parse_manifest` returns a manifest only if it is of this sprawl's format
(:data:`~policies.board.types.BOARD_FORMAT`), every field validates (patch names are the
layout's, base file names are :data:`~policies.board.types.BASE_FILES`), its digest is that of
its tensor entries and its seal that of all its fields; otherwise :class:`VersionCorrupt` or, for
another format, :class:`BoardFormatError` saying how to proceed — each in one line naming the
version. The digest (:func:`manifest_digest`) is the same string as a patch's target digest; the
seal (:func:`manifest_seal`) covers everything else. Not covered: xxh3 is a checksum, not a
signature — it catches damage and inconsistent edits, not a writer who recomputes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import BaseModel, ValidationError

from policies.board.types import BOARD_FORMAT, FileEntry, Manifest, TensorEntry
from policies.codec.digests import bytes_checksum, digest_of
from policies.errors import BoardFormatError, VersionCorrupt


def manifest_digest(entries: Mapping[str, TensorEntry]) -> str:
    """Digest of a version from its manifest entries: names, dtypes, shapes and checksums — the
    same string as :func:`policies.codec.digests.state_digest` of the tensors."""
    return digest_of((k, e.dtype, e.shape, e.checksum) for k, e in entries.items())


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
        if fmt != BOARD_FORMAT:
            raise _format_error(version, fmt, board)
        m = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise VersionCorrupt(
            f"version {version}: manifest unreadable: {one_line(exc, 'manifest')}"
        ) from None
    if m.version != version or manifest_digest(m.tensors) != m.digest or manifest_seal(m) != m.seal:
        raise VersionCorrupt(f"version {version}: manifest does not match its own digest")
    return m


def _format_error(version: int, fmt: int, board: str) -> BoardFormatError:
    where = f"version {version} on {board}"
    if fmt < BOARD_FORMAT:
        return BoardFormatError(
            f"{where} was written by an older sprawl (board format {fmt}; this sprawl reads "
            f"format {BOARD_FORMAT}, which also verifies base files and patch names): publish a "
            "new run (another --run.name) with this sprawl, or read this one with the sprawl "
            "that wrote it"
        )
    return BoardFormatError(
        f"{where} was written by a newer sprawl (board format {fmt}; this sprawl reads format "
        f"{BOARD_FORMAT}): upgrade sprawl to read it"
    )
