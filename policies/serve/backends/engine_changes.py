"""An engine patch's frames read against an engine's own weights: per checkpoint tensor, the
positions it writes and the values they get, checked against the patch's target checksums.

:func:`changes` walks the frames in order (a chain of versions, a squashed catch-up, streamed
chunks), and for each ``patch`` record reads its section without the tensor
(:mod:`policies.codec.sections`): the positions (moved into the full tensor for a piece of one),
the values held there now (the engine's, or what an earlier frame of this patch planned), and the
new values from the stored ones. Where the engine holds the record's tensor (or piece) whole, the
tensor's ``sum-128`` checksum, moved by what the record writes, must give the record's target
checksum from the frame's base checksum (:func:`policies.codec.kernels_read.read_changes`,
which reads only the words written), and the words it changes must, as held, sum to the record's
``old_words`` (a value already wrong where the frame writes survives a delta and cancels out of
the first check alone): the engine is then known to hold the version the frame starts from, bit
for bit in the words it changes, and the frame to be read right. A tensor held on the host as
one run of a parameter (or as a copy) is read in place; one held otherwise (on an accelerator, in
several pieces) or already changed by an earlier frame of the patch has the 64-bit words around
its changes gathered for the check. A tensor-parallel rank holding a slice
of a tensor cannot check the whole tensor's sum: it writes the positions it holds, unchecked.
``full`` records are whole tensors (an anchor, a restart); aliases (a name sharing its primary's
storage) are written through their primary. Names the patch writes whole are skipped in every
frame but the last.

Guarantees: nothing is written here (:class:`Held` only reads); a mismatch raises ``ValueError``
naming the tensor. Cost: proportional to the frames, no pass over a tensor a ``patch`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import zstandard

from policies.codec.digests import hex_lanes, lanes_hex
from policies.codec.format import PatchHeader, TensorRecord, parse_patch
from policies.codec.kernels_read import read_changes
from policies.codec.kernels_sum import add_word_terms
from policies.codec.ops import CODINGS, Coding
from policies.codec.sections import section_values, untransform
from policies.codec.written import Box, Frame

I64 = npt.NDArray[np.int64]
UInt = npt.NDArray[np.unsignedinteger[Any]]
Bools = npt.NDArray[np.bool_]
U64 = npt.NDArray[np.uint64]


class Held(Protocol):
    """How an engine holds a checkpoint tensor, read as unsigned integers of the value's width."""

    def whole(self, name: str) -> UInt | None:
        """The tensor's flat values in place (one run of a parameter, or a copy), if so held."""

    def gather(self, name: str, positions: I64) -> tuple[Bools, UInt]:
        """The values at flat ``positions`` (sorted) and which of them this engine holds (the
        others are zero)."""


@dataclass
class Changes:
    """Per checkpoint tensor, the flat positions (sorted, unique) this engine writes, their new
    values and the values there now (None: not kept, as after several frames); ``whole``:
    tensors written whole (flat values); ``offered``: positions per tensor in the patch (this
    engine writes those it holds)."""

    at: dict[str, tuple[I64, UInt, UInt | None]] = field(default_factory=dict)
    whole: dict[str, UInt] = field(default_factory=dict)
    offered: dict[str, int] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)
    """Tensors changed since the caller last emptied this."""

    def values(self, held: Held, name: str, positions: I64) -> tuple[Bools, UInt]:
        """What ``name`` holds at ``positions`` once the changes so far are written."""
        mine, vals = held.gather(name, positions)
        if name in self.at:
            pos, new, _ = self.at[name]
            i = np.minimum(np.searchsorted(pos, positions), max(pos.size - 1, 0))
            hit = pos[i] == positions if pos.size else np.zeros(positions.size, dtype=bool)
            vals[hit] = new[i[hit]]
        return mine, vals

    def set(self, name: str, positions: I64, values: UInt, old: UInt | None = None) -> None:
        """``positions`` (sorted) of ``name`` get ``values`` (holding ``old`` now), over earlier
        changes."""
        if name in self.at:
            pos, new, _ = self.at[name]
            old = None
            positions = np.concatenate([pos, positions])
            values = np.concatenate([new, values])
            order = np.argsort(positions, kind="stable")  # a later change after an earlier one
            positions, values = positions[order], values[order]
            last = np.append(positions[1:] != positions[:-1], True)
            positions, values = positions[last], values[last]
        self.at[name] = (positions, values, old)
        self.fresh.add(name)


def changes(
    frames: list[Frame], replaced: set[str], held: Held, out: Changes | None = None
) -> Changes:
    """What ``frames`` write into the engine ``held`` reads (module docstring), after ``out``
    (the changes of frames read before them: an engine patch read in parts) when given."""
    out = Changes() if out is None else out
    for i, frame in enumerate(frames):
        header, body = parse_patch(frame.data)
        last = i == len(frames) - 1
        for rec in header.tensors:
            if rec.op == "alias" or (rec.name in replaced and not last):
                continue
            section = bytes(body[rec.offset : rec.offset + rec.length])
            try:
                data = zstandard.ZstdDecompressor().decompress(section) if rec.length else b""
            except zstandard.ZstdError as exc:
                raise ValueError(f"{rec.name}: section does not decompress: {exc}") from None
            if rec.op == "full":
                _whole(out, frame, rec, data, held)
            elif rec.op == "patch" and data:
                _patch(out, frame, header, rec, data, held)
            elif rec.op != "patch":
                raise ValueError(f"{rec.name}: unknown op {rec.op}")
    return out


def _patch(
    out: Changes, frame: Frame, header: PatchHeader, rec: TensorRecord, data: bytes, held: Held
) -> None:
    local, coding, z = section_values(data, rec.units, header.chunk, rec.width)
    if local.size > 1 and not (local[1:] > local[:-1]).all():  # sparse, bitmask, dense chunks
        order = np.argsort(local, kind="stable")
        local, z = local[order], z[order]
    box = None if frame.boxes is None else frame.boxes[rec.name]
    positions = _moved(local, box)
    base = None if frame.base_checksums is None else frame.base_checksums.get(rec.name)
    lanes = hex_lanes(base) if base is not None else None
    olds = np.zeros(3, dtype=np.uint64)  # the words changed, as the engine holds them
    units = None if rec.name in out.at else _piece(held.whole(rec.name), box)
    if units is not None:  # held in place: read, computed and summed in one pass
        mine = np.ones(local.size, dtype=bool)
        old, new = _read(units, local, z, coding, lanes, olds)
    else:
        mine, old = out.values(held, rec.name, positions)
        new = untransform(old, z, coding)
        if lanes is not None and mine.all():  # held elsewhere, or changed: its words gathered
            _word_change(out, held, rec, box, local, new, lanes, olds)
    if lanes is not None and mine.all():
        _check(rec, lanes, olds)
    out.offered[rec.name] = out.offered.get(rec.name, 0) + local.size
    out.set(rec.name, positions[mine], new[mine], old[mine] if units is not None else None)


def _check(rec: TensorRecord, lanes: U64, olds: U64) -> None:
    """Refuse what the engine holds where ``rec`` writes unless the words it changes held what
    the patch's base held (``olds``) and the writes give the target's checksum (``lanes``)."""
    if lanes_hex(olds[:2]) != rec.old_words:
        raise ValueError(
            f"{rec.name}: the engine's values are not the ones the patch starts from (the words "
            f"it changes sum to {lanes_hex(olds[:2])}, the patch's base's to {rec.old_words})"
        )
    if lanes_hex(lanes) != rec.checksum:
        raise ValueError(
            f"{rec.name}: the engine's values are not the ones the patch starts from "
            f"(checksum {lanes_hex(lanes)} after writing, the patch's {rec.checksum})"
        )


def _read(
    units: UInt, local: I64, z: UInt, coding: Coding, lanes: U64 | None, olds: U64
) -> tuple[UInt, UInt]:
    """``units``' values at ``local`` and the new ones ``z`` makes of them; ``lanes`` (a
    checksum's) moved by writing them, and ``olds`` given the terms of the words they change."""
    n = local.size
    old, new = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64)
    none = np.empty(0, dtype=np.uint64)
    acc, tracked = (lanes, olds) if lanes is not None else (none, none)
    at = local.astype(np.uint64)
    read_changes(units, at, z.astype(np.uint64), CODINGS.index(coding), old, new, acc, tracked)
    return old.astype(units.dtype), new.astype(units.dtype)


def _word_change(
    out: Changes,
    held: Held,
    rec: TensorRecord,
    box: Box | None,
    local: I64,
    new: UInt,
    lanes: U64,
    olds: U64,
) -> None:
    """Move ``lanes`` by writing ``new`` at ``local`` (sorted), from the 64-bit words they
    touch, gathered (a word's units past the tensor's end are zero); ``olds`` takes the terms
    of the words that change, as they were."""
    per = 8 // rec.width
    w = local // per
    words = w[np.append(True, w[1:] != w[:-1])] if w.size else w
    mates = (words[:, None] * per + np.arange(per, dtype=np.int64)).reshape(-1)
    inside = mates < rec.units
    before = np.zeros(mates.size, dtype=new.dtype)
    before[inside] = out.values(held, rec.name, _moved(mates[inside], box))[1]
    after = before.copy()
    after[np.searchsorted(words, w) * per + local % per] = new
    words64, before64, after64 = (
        words.astype(np.uint64),
        before.view(np.uint64),
        after.view(np.uint64),
    )
    add_word_terms(words64, before64, after64, lanes, olds)


def _whole(out: Changes, frame: Frame, rec: TensorRecord, data: bytes, held: Held) -> None:
    if len(data) != rec.units * rec.width:
        raise ValueError(f"{rec.name}: {len(data)} bytes for {rec.units} values")
    values = np.frombuffer(data, dtype=f"<u{rec.width}")
    if frame.boxes is None:
        out.whole[rec.name] = values
        out.at.pop(rec.name, None)
        out.fresh.add(rec.name)
        return
    where = _moved(np.arange(values.size, dtype=np.int64), frame.boxes[rec.name])  # a piece
    mine, _ = out.values(held, rec.name, where)
    out.offered[rec.name] = out.offered.get(rec.name, 0) + values.size
    out.set(rec.name, where[mine], values[mine])


def _piece(units: UInt | None, box: Box | None) -> UInt | None:
    """The flat values of ``box`` of a tensor held whole as ``units``, in place when the box is
    a run of whole rows; else None."""
    if units is None or box is None:
        return units
    shape, offset, full = box
    if tuple(shape[1:]) != tuple(full[1:]) or any(offset[1:]):
        return None
    start = offset[0] * prod(full[1:])
    return units[start : start + prod(shape)]


def _moved(local: I64, box: Box | None) -> I64:
    """Flat positions of a piece (``box``) as flat positions of its tensor."""
    if box is None:
        return local
    shape, offset, full = box
    coords = np.unravel_index(local, shape)
    moved = tuple(c + o for c, o in zip(coords, offset, strict=True))
    return np.ravel_multi_index(moved, full).astype(np.int64)
