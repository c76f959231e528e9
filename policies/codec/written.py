"""Where patches wrote: the positions and old values a run of patches changed, per tensor.

An island that advances its shadow with patches (:mod:`policies.serve.backends.shadow`) hands its
engine only what changed since the version the engine serves: an **engine patch** of flat
positions and each value's change against the old one, per tensor
(:mod:`policies.serve.backends.engine_patch`). The codec knows those positions as it applies a
section; :func:`recording` asks it to note them.

Inside ``with recording() as written:``, every :func:`~policies.codec.apply_patch` called *in this
thread* (a context variable: the codec's worker threads report to the caller) adds, per patched
tensor, the flat unit positions its section wrote and the values they held before. A tensor
written whole (a ``full`` record, an anchor, a view replaced) is marked :meth:`Written.whole`.
:meth:`Written.take` merges what several patches wrote (a chain, a squashed catch-up, streamed
chunks): each position once, with the value it held before the *first* of them.

Guarantees: the positions are exactly those the section encodes (a superset of the units whose
value changed: a dense chunk lists all its units), so gathering the target's values there and
writing them into the base gives the target bit for bit. Cost: proportional to the changes (the
section's positions decoded with numpy, :func:`section_positions`), no pass
over the tensor. Not covered: a recording does not survive a thread hop made by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from policies.codec.ops import decode_positions, section_head

I64 = npt.NDArray[np.int64]
_CURRENT: ContextVar[Written | None] = ContextVar("sprawl_codec_written", default=None)


def section_positions(data: bytes, units: int, chunk: int) -> I64:
    """The flat positions an uncompressed section writes (sparse, bitmask, then every unit of
    its dense chunks), in work proportional to the section; ``ValueError`` when the section does
    not fit ``units``."""
    _, _, n_bm, lens, start = section_head(data)
    buf = np.frombuffer(data, dtype=np.uint8)
    nchunks = -(-units // chunk)
    (sparse, bitmask), dense, _ = decode_positions(
        buf[start:], nchunks, units, chunk, [int(n) for n in lens], n_bm
    )
    spans = (dense[:, None] * chunk + np.arange(chunk, dtype=np.int64)).reshape(-1)
    return np.concatenate([sparse, bitmask, spans[spans < units]])


@dataclass(frozen=True)
class TensorChanges:
    """One tensor's changes: flat unit positions (sorted, unique), their old and new values in
    the tensor's own dtype (1-D)."""

    positions: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor


@dataclass
class Written:
    """Positions written and their first old values, per tensor name (see the module docstring)."""

    parts: dict[str, list[tuple[I64, torch.Tensor]]] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)

    def add(self, name: str, positions: I64, old: torch.Tensor) -> None:
        """``name``'s flat ``positions`` were written; ``old`` held their values before."""
        if name not in self.replaced and positions.size:
            self.parts.setdefault(name, []).append((positions, old))

    def whole(self, names: Iterable[str]) -> None:
        """These tensors were replaced whole (their old values are not kept)."""
        for name in names:
            self.replaced.add(name)
            self.parts.pop(name, None)

    def merge(self, later: Written) -> None:
        """Add what ``later`` recorded after what this one did."""
        self.whole(later.replaced)
        for name, parts in later.parts.items():
            for positions, old in parts:
                self.add(name, positions, old)

    def add_boxes(
        self, inner: Written, boxes: dict[str, tuple[list[int], list[int], list[int]]]
    ) -> None:
        """Add what ``inner`` recorded of pieces of tensors, each piece's positions moved into
        its full tensor: ``boxes[name]`` = (the piece's shape, its offset, the full shape). A
        piece written whole counts its tensor as written whole."""
        self.whole(inner.replaced)
        for name, parts in inner.parts.items():
            shape, offset, full = boxes[name]
            for positions, old in parts:
                coords = np.unravel_index(positions, shape)
                moved = tuple(c + o for c, o in zip(coords, offset, strict=True))
                self.add(name, np.ravel_multi_index(moved, full).astype(np.int64), old)

    def take(self, name: str, current: torch.Tensor) -> TensorChanges:
        """``name``'s changes, the new values read from ``current`` (the tensor as written)."""
        parts = self.parts.get(name, [])
        flat = current.detach().reshape(-1)
        if not parts:
            empty = torch.empty(0, dtype=torch.int64)
            return TensorChanges(empty, flat[:0].clone(), flat[:0].clone())
        if len(parts) == 1 and _increasing(parts[0][0]):  # one section: sorted and unique
            positions = torch.from_numpy(parts[0][0])
            return TensorChanges(positions, parts[0][1], flat.index_select(0, positions))
        pos = np.concatenate([p for p, _ in parts])
        old = torch.cat([o for _, o in parts])
        uniq, first = np.unique(pos, return_index=True)  # the first write's old value wins
        positions = torch.from_numpy(uniq)
        return TensorChanges(
            positions, old[torch.from_numpy(first)], flat.index_select(0, positions)
        )


def _increasing(positions: I64) -> bool:
    return bool(positions.size < 2 or (positions[1:] > positions[:-1]).all())


@contextmanager
def recording() -> Iterator[Written]:
    """Note where every patch applied in this block (in this thread) writes."""
    written = Written()
    token = _CURRENT.set(written)
    try:
        yield written
    finally:
        _CURRENT.reset(token)


def current() -> Written | None:
    """The recording this thread is in, if any."""
    return _CURRENT.get()
