"""A publisher held mid-stream and an island's staging watched, for tests of streamed publish
(policies/board/stream_publish.py, policies/board/stream.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from policies.board import Board, BoardReader
from policies.board import stream as board_stream
from policies.errors import BoardError


class Gate:
    """Stops ``board``'s publisher before it writes chunk ``at`` of its patch from version 0
    until ``go`` is set, then lets it write (or, with ``crash``, raises there: a publisher that
    dies mid-stream). ``reached`` is set when it gets there."""

    def __init__(self, board: Board, at: int, *, crash: bool = False) -> None:
        self.at, self.crash = at, crash
        self.reached, self.go = threading.Event(), threading.Event()
        self._write = board._write
        board._write = self.write  # type: ignore[method-assign]

    def write(self, path: str, data: bytes) -> None:
        if path.endswith(f"/from-00000000/{self.at:05d}.patch"):
            self.reached.set()
            assert self.go.wait(30), "the test never let the publisher go on"
            if self.crash:
                raise BoardError("publisher died")
        self._write(path, data)


class AskedTogether:
    """Has ``board``'s first reads of the pointer and of ``STREAM`` each wait (10 s at most) for
    the other to be asked for: asked one after the other (two round trips to a distant board),
    the first raises ``AssertionError``. ``both`` is set once both were asked for."""

    def __init__(self, board: BoardReader) -> None:
        self._lock, self.both, self._asked = threading.Lock(), threading.Event(), 0
        self._read = board._read
        board._read = self.read  # type: ignore[method-assign]

    def read(self, path: str, limit: int) -> bytes:
        if path.rsplit("/", 1)[-1] in ("POINTER", "STREAM"):
            with self._lock:
                self._asked += 1
                first_pair = self._asked <= 2
                if self._asked == 2:
                    self.both.set()
            if first_pair and not self.both.wait(10):
                raise AssertionError(f"{path} was asked for alone")
        return self._read(path, limit)


class Staging:
    """Records what an island following a stream applies: it wraps
    ``policies.board.stream.apply_frame`` (what :class:`~policies.board.stream.Follower` applies
    each chunk with) for the test's duration, and wakes whoever waits for a tensor to be
    staged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._applied = threading.Condition()
        self.written: set[str] = set()
        """The tensors the chunks applied so far wrote."""
        apply = board_stream.apply_frame

        def recording(*args: Any, **kwargs: Any) -> board_stream.StagedChunk:
            staged = apply(*args, **kwargs)
            with self._applied:
                self.written |= set(staged.sums)
                self._applied.notify_all()
            return staged

        monkeypatch.setattr(board_stream, "apply_frame", recording)

    def wait_for(self, name: str, timeout_s: float = 30.0) -> bool:
        """Whether a chunk writing ``name`` was applied (now, or within ``timeout_s``)."""
        with self._applied:
            return self._applied.wait_for(lambda: name in self.written, timeout_s)
