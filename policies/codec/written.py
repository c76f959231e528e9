"""What patches wrote: the frames a run of patches applied, in order, to hand on to an engine.

An island that advances its shadow with patches (:mod:`policies.serve.backends.shadow`) hands its
engine only what changed since the version the engine serves, and the cheapest exact account of
that is the patches themselves: the frames the board sent, as they crossed the link
(:mod:`policies.serve.backends.engine_patch`). :func:`recording` asks the codec to keep them.

Inside ``with recording() as written:``, every :func:`~policies.codec.apply_patch` that succeeds
*in this thread* (a context variable) adds its frame and the base checksums it was checked
against (:class:`Frame`). A tensor replaced outside a frame (an anchor loaded, a view rebuilt)
is marked :meth:`Written.whole`; its frames before that no longer count for it. Frames of pieces
of tensors (a sharded board: each rank's patch covers boxes of tensors) carry the boxes
(:meth:`Written.add_boxes`).

Guarantees: applying the frames in order, then the replaced tensors whole, to the version the
recording started from gives the version it ended at, bit for bit. Cost: none beyond holding the
frames (the patch's size). Not covered: a recording does not survive a thread hop made by the
caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

_CURRENT: ContextVar[Written | None] = ContextVar("sprawl_codec_written", default=None)

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A piece of a tensor: the piece's shape, its offset in the tensor, the tensor's shape."""


@dataclass(frozen=True)
class Frame:
    """One applied patch frame, the ``sum-128`` checksums of its base tensors (None: not known)
    and, for pieces of tensors, each record's box (None: whole tensors)."""

    data: bytes
    base_checksums: Mapping[str, str] | None = None
    boxes: Mapping[str, Box] | None = None


@dataclass
class Written:
    """The frames applied and the tensors replaced whole (see the module docstring)."""

    frames: list[Frame] = field(default_factory=list)
    replaced: set[str] = field(default_factory=set)
    on_frame: Callable[[Frame], None] | None = None
    """Told of each frame as it is added (not of frames merged in)."""

    def add(self, frame: Frame) -> None:
        self.frames.append(frame)
        if self.on_frame is not None:
            self.on_frame(frame)

    def whole(self, names: Iterable[str]) -> None:
        """These tensors were replaced whole."""
        self.replaced.update(names)

    def merge(self, later: Written) -> None:
        """Add what ``later`` recorded after what this one did."""
        self.frames.extend(later.frames)
        self.whole(later.replaced)

    def add_boxes(self, inner: Written, boxes: Mapping[str, Box]) -> None:
        """Add what ``inner`` recorded of pieces of tensors, ``boxes[name]`` each piece's box; a
        piece replaced whole counts its tensor as replaced whole."""
        for frame in inner.frames:
            self.add(Frame(frame.data, frame.base_checksums, boxes))
        self.whole(inner.replaced)


@contextmanager
def recording(on_frame: Callable[[Frame], None] | None = None) -> Iterator[Written]:
    """Keep every patch frame applied in this block (in this thread); ``on_frame`` is called
    with each as it is applied (an island hands them on while the rest cross the link)."""
    written = Written(on_frame=on_frame)
    token = _CURRENT.set(written)
    try:
        yield written
    finally:
        _CURRENT.reset(token)


def current() -> Written | None:
    """The recording this thread is in, if any."""
    return _CURRENT.get()
