"""The policies package's error tree: board, engine and trainer failures.

Every error names what was wrong (the version, the tensor, the field). The engine converts these
into JSON error bodies on the lane; the sidecar logs and counts version failures and keeps
serving the version it has.
"""

from __future__ import annotations


class PolicyError(Exception):
    """Root of the policies package's errors."""


class BoardError(PolicyError):
    """The board is missing, unreadable, or an operation would break its rules."""


class VersionCorrupt(BoardError):
    """A version's bytes do not match its manifest (torn, truncated or corrupted)."""


class EngineError(PolicyError):
    """The engine cannot serve a request."""


class BadRequest(EngineError):
    """A request is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
