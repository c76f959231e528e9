"""The engine patch: what an island's sidecar hands its engine to move it from one version to the
next, as one island-local file of about the patch's size.

It holds the board's own patch frames, as they crossed the link, that the shadow applied since
the version the engine serves (:mod:`policies.codec.written`), in order, each with the
``sum-128`` checksums of its base tensors; and, for tensors replaced whole since (an anchor
loaded; every tensor when the engine restarted), one frame of ``full`` records made from the
shadow (:func:`whole_frame`). Nothing is re-encoded on the island, and an engine checks what it
writes against each frame's target checksums (:mod:`policies.serve.backends.engine_apply`).

Layout: an 8-byte little-endian header length, the header (JSON: ``format``
(:data:`FORMAT`), ``version``, ``replaced`` (names whose frame records are skipped: the last
frame writes them whole) and ``frames``: per frame its ``length``, ``base_checksums`` (name →
checksum, or null) and ``boxes`` (name → [piece shape, offset, tensor shape] for frames of pieces
of tensors, or null)), then the frames, back to back. The file's xxh3-128 digest
(:func:`file_digest`) travels beside its path; the reader refuses any other bytes.

Guarantees of :func:`read`: the digest is checked first, then every frame's own checksum; every
record names a tensor of the checkpoint (``expected``: name → dtype and shape) in its dtype and
shape (a piece: inside the tensor); anything else raises ``ValueError`` naming the tensor.
This module imports no engine, so both sides share it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from policies.board.types import Manifest
from policies.codec import encode_patch
from policies.codec.format import PatchHeader, parse_patch
from policies.codec.written import Box, Frame, Written
from policies.errors import PatchError

FORMAT = "sprawl-engine-patch/2"
Expected = Mapping[str, tuple[str, list[int]]]
"""The engine's checkpoint: name → (dtype, shape)."""


def whole_frame(view: Mapping[str, torch.Tensor]) -> Frame:
    """A frame writing ``view``'s tensors whole (``full`` records)."""
    return Frame(encode_patch({}, dict(view), base_digest=""))


class Chain:
    """Frames in the order they were applied, each given the checksums of the tensors it starts
    from when it came without them (from ``live``: the engine's version's, and each earlier
    frame's targets)."""

    def __init__(self, live: Mapping[str, str]) -> None:
        self.sums = dict(live)

    def next(self, frame: Frame) -> Frame:
        if frame.boxes is not None:  # pieces: their base checksums came with them, or none
            return frame
        if frame.base_checksums is None:
            frame = Frame(frame.data, dict(self.sums))
        self.sums.update({r.name: r.checksum for r in parse_patch(frame.data)[0].tensors})
        return frame


def live_sums(live: Manifest | None) -> dict[str, str]:
    """The checksums of the version the engine serves (none for its startup weights)."""
    return {} if live is None else {n: e.checksum for n, e in live.tensors.items()}


def engine_frames(
    written: Written | None, view: Mapping[str, torch.Tensor], live: Mapping[str, str]
) -> tuple[list[Frame], set[str]]:
    """The frames that move an engine from the version ``written`` started at to ``view``
    (``live``: that version's checksums, :class:`Chain`), and the tensors written whole;
    ``written`` None (the engine's version is unknown): all of ``view`` whole."""
    if written is None:
        return [whole_frame(view)], set(view)
    chain = Chain(live)
    frames = [chain.next(frame) for frame in written.frames]
    replaced = written.replaced & set(view)
    if replaced:
        frames.append(whole_frame({n: view[n] for n in sorted(replaced)}))
    return frames, replaced


def encode(frames: list[Frame], replaced: set[str], version: int) -> bytes:
    """The engine patch of ``frames`` (the last one writing ``replaced`` whole) for
    ``version``."""
    header = {
        "format": FORMAT,
        "version": version,
        "replaced": sorted(replaced),
        "frames": [
            {
                "length": len(f.data),
                "base_checksums": None if f.base_checksums is None else dict(f.base_checksums),
                "boxes": None if f.boxes is None else {n: list(b) for n, b in f.boxes.items()},
            }
            for f in frames
        ],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *(f.data for f in frames)])


def build(
    written: Written | None,
    view: Mapping[str, torch.Tensor],
    live: Manifest | None,
    version: int,
) -> bytes:
    """The engine patch that moves an engine from ``live`` (the version it serves; None: its
    startup weights), where ``written`` started, to ``view`` at ``version``; ``written`` None:
    the engine's version is unknown, all of ``view`` whole."""
    return encode(*engine_frames(written, view, live_sums(live)), version)


def file_digest(data: bytes) -> str:
    """The digest the reader checks the file's bytes against."""
    return xxhash.xxh3_128_hexdigest(data)


def write(path: Path, data: bytes) -> None:
    """Write an engine patch next to ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def read(path: str, digest: str, expected: Expected) -> tuple[int, list[Frame], set[str]]:
    """The version, the frames and the names written whole (by the last frame) of the engine
    patch at ``path``, checked (module docstring)."""
    with open(path, "rb") as f:
        data = f.read()
    got = file_digest(data)
    if got != digest:
        raise ValueError(f"{path}: digest {got} is not the sidecar's {digest}")
    try:
        size = int.from_bytes(data[:8], "little")
        header: dict[str, Any] = json.loads(data[8 : 8 + size])
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r} is not {FORMAT}")
        version = int(header["version"])
        replaced = {str(n) for n in header["replaced"]}
        out, at = [], 8 + size
        for entry in header["frames"]:
            frame = Frame(
                data[at : at + int(entry["length"])],
                entry["base_checksums"],
                _boxes(entry["boxes"]),
            )
            at += int(entry["length"])
            out.append((frame, parse_patch(frame.data)[0]))
    except (ValueError, KeyError, TypeError, PatchError) as exc:
        raise ValueError(f"{path}: not an engine patch: {exc}") from None
    if at != len(data):
        raise ValueError(f"{path}: {len(data) - at} bytes after the last frame")
    for frame, hdr in out:
        _check(frame, hdr, expected)
    return version, [frame for frame, _ in out], replaced


def _boxes(raw: Any) -> dict[str, Box] | None:
    if raw is None:
        return None
    return {
        str(n): (tuple(map(int, s)), tuple(map(int, o)), tuple(map(int, f)))
        for n, (s, o, f) in raw.items()
    }


def _check(frame: Frame, hdr: PatchHeader, expected: Expected) -> None:
    """Every record of ``hdr`` fits the checkpoint (module docstring)."""
    for rec in hdr.tensors:
        if rec.name not in expected:
            raise ValueError(f"{rec.name}: not a tensor of the engine's checkpoint")
        dtype, shape = expected[rec.name]
        width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        box = None if frame.boxes is None else frame.boxes.get(rec.name)
        if frame.boxes is not None and box is None:
            raise ValueError(f"{rec.name}: a piece without its box")
        if box is not None:
            piece, offset, full = box
            inside = all(o >= 0 and o + s <= n for s, o, n in zip(piece, offset, full, strict=True))
            if list(full) != shape or piece != rec.shape or not inside:
                raise ValueError(f"{rec.name}: piece {list(piece)} at {list(offset)} of {shape}")
        elif list(rec.shape) != shape:
            raise ValueError(f"{rec.name}: {rec.dtype}{list(rec.shape)}, the checkpoint's {shape}")
        if rec.dtype != dtype or rec.width != width:
            raise ValueError(f"{rec.name}: {rec.dtype}, the checkpoint's {dtype}")
        if rec.op == "alias" and rec.alias_of not in {r.name for r in hdr.tensors}:
            raise ValueError(f"{rec.name}: alias of {rec.alias_of}, not in its frame")
