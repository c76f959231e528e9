"""The staleness package's error tree.

Every error raised on purpose by :mod:`staleness` derives from :class:`StalenessError`, and also
from :class:`ValueError` so callers that validate inputs generically still catch it. A bad input
here is a caller bug (mismatched shapes, a version from the future), never a bad rollout: bad
rollouts are data and are dropped or masked by the policies, not raised.
"""

from __future__ import annotations

from policies.wire.errors import SprawlError

__all__ = ["LagError", "ShapeError", "StalenessError"]


class StalenessError(SprawlError, ValueError):
    """Root of the staleness error tree."""


class LagError(StalenessError):
    """Version stamps that cannot describe a real episode (end before start, version ahead of the
    trainer, no segments, negative token counts)."""


class ShapeError(StalenessError):
    """Tensors whose shapes or dtypes do not line up ([B, T] log probs and masks, [B] advantages,
    rewards not divisible into groups)."""
