"""A publisher held mid-stream, for tests of streamed publish (policies/board/stream.py)."""

from __future__ import annotations

import threading

from policies.board import Board
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
