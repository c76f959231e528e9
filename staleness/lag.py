"""Lag accounting: how many trainer versions old each sampled token is, and the drop decision.

Definitions (see ARCHITECTURE.md, "Versions and lag"):

- The trainer version ``v_T`` is the number of optimizer steps published when a batch is consumed.
- A segment (one model call) was generated while versions ``start..end`` were applied. Its lag is
  ``v_T - start``: the lag of the *oldest* version that produced any of its tokens. The engine
  reports no finer stamp, so a token cannot be attributed to ``end`` without guessing; using
  ``start`` makes every lag an upper bound, which is the safe side for a drop rule (a rule never
  keeps an episode that is staler than it allows).
- Every sampled token of a segment carries the segment's lag.
- An episode (a sequence of segments) has three statistics: ``max`` over segments, ``mean`` over
  segments (one vote per model call), ``token_weighted`` (one vote per sampled token; falls back to
  ``mean`` when the episode sampled no token). A group's statistics are those of all its
  episodes' segments pooled, so ``group_lag(eps) == episode_lag(concat(eps))``.

Guarantees: pure functions, no torch import; lags are never negative (a version ahead of the
trainer raises :class:`~staleness.errors.LagError`, as does an episode with no segments).
Not covered: the trainer version is taken as given; nothing here checks it against the board.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from staleness.config import DropRule
from staleness.errors import LagError, ShapeError
from staleness.types import LagStats, SegmentVersions

__all__ = [
    "LagStats",
    "SegmentVersions",
    "batch_token_lags",
    "episode_lag",
    "group_lag",
    "keep",
    "lag_statistic",
    "segment_lag",
    "token_lags",
]


def segment_lag(seg: SegmentVersions, trainer_version: int) -> int:
    """Lag of one model call: ``trainer_version - seg.start`` (its oldest contributing version)."""
    if seg.end > trainer_version:
        msg = f"segment produced by version {seg.end} is ahead of trainer version {trainer_version}"
        raise LagError(msg)
    return trainer_version - seg.start


def episode_lag(segments: Sequence[SegmentVersions], trainer_version: int) -> LagStats:
    """Max, mean-over-segments and token-weighted lag of one episode."""
    if not segments:
        msg = "an episode needs at least one segment to have a lag"
        raise LagError(msg)
    lags = [segment_lag(s, trainer_version) for s in segments]
    n_tokens = sum(s.n_tokens for s in segments)
    mean = sum(lags) / len(lags)
    token_weighted = mean
    if n_tokens > 0:
        weighted_sum = sum(lag * s.n_tokens for lag, s in zip(lags, segments, strict=True))
        token_weighted = weighted_sum / n_tokens
    return LagStats(max=max(lags), mean=mean, token_weighted=token_weighted, n_tokens=n_tokens)


def group_lag(episodes: Sequence[Sequence[SegmentVersions]], trainer_version: int) -> LagStats:
    """Lag statistics of a group: those of all its episodes' segments pooled."""
    pooled = [seg for episode in episodes for seg in episode]
    return episode_lag(pooled, trainer_version)


def lag_statistic(stats: LagStats, statistic: str) -> float:
    """The named statistic (``max`` / ``mean`` / ``token_weighted``) of ``stats``."""
    match statistic:
        case "max":
            return float(stats.max)
        case "mean":
            return stats.mean
        case "token_weighted":
            return stats.token_weighted
        case _:
            msg = f"unknown lag statistic {statistic!r}"
            raise LagError(msg)


def keep(rule: DropRule | None, stats: LagStats) -> bool:
    """Whether an episode (or group) with these lag statistics is trained on.

    No rule keeps everything; otherwise keep iff ``statistic(stats) ≤ rule.max_lag``.
    """
    if rule is None:
        return True
    return lag_statistic(stats, rule.statistic) <= rule.max_lag


def token_lags(segments: Sequence[SegmentVersions], trainer_version: int) -> npt.NDArray[np.int64]:
    """Per sampled token lag of one episode, in generation order (length ``Σ n_tokens``)."""
    parts = [np.full(s.n_tokens, segment_lag(s, trainer_version), dtype=np.int64) for s in segments]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts)


def batch_token_lags(
    episodes: Sequence[Sequence[SegmentVersions]],
    trainer_version: int,
    mask: npt.NDArray[np.bool_],
    *,
    fill: int = -1,
) -> npt.NDArray[np.int64]:
    """Per-position lags for a [B, T] batch whose ``mask`` marks each row's sampled tokens.

    Row ``b``'s sampled-token lags (from :func:`token_lags`) are laid on its true positions in
    order; other positions (prompt, tool output, padding) get ``fill``. Raises
    :class:`~staleness.errors.ShapeError` when a row's mask count differs from its token count.
    """
    if mask.ndim != 2 or mask.shape[0] != len(episodes):
        msg = f"mask must be [B={len(episodes)}, T], got shape {mask.shape}"
        raise ShapeError(msg)
    out = np.full(mask.shape, fill, dtype=np.int64)
    for row, segments in enumerate(episodes):
        lags = token_lags(segments, trainer_version)
        positions = np.flatnonzero(mask[row])
        if positions.size != lags.size:
            msg = f"row {row}: mask marks {positions.size} tokens, segments sampled {lags.size}"
            raise ShapeError(msg)
        out[row, positions] = lags
    return out
