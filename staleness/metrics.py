"""Staleness metrics: how old the trained tokens are, what the corrections did, what was dropped.

Every function returns plain ``dict[str, float]`` (for structlog lines and Prometheus gauges) or a
small frozen dataclass with an ``as_dict()``. Keys are stable and slash-separated
(``lag_hist/3``, ``is/ess_frac``, ``mismatch/logp_abs_mean``, ``drop/rate_bucket_0``).

The length-bias guard: a drop rule on lag silently prefers short episodes, because a long episode
spans more trainer versions and so accumulates more lag. :func:`drop_by_duration` splits episodes
into equal-count duration buckets and logs a ``staleness.length_bias`` warning when the longest
bucket is dropped at least ``bias_ratio`` (default 2) times as often as the shortest one — the
signal to raise ``max_lag``, switch the drop statistic, or correct instead of dropping.

Guarantees: pure apart from that one warning; empty inputs give zeros, never NaN.
Not covered: exporting to Prometheus (the caller owns the registry).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from torch import Tensor

from staleness.config import Correction, TruncatedIS
from staleness.errors import ShapeError
from staleness.types import Corrected

__all__ = [
    "DropByDuration",
    "DurationBucket",
    "correction_metrics",
    "drop_by_duration",
    "effective_sample_size",
    "lag_histogram",
    "logprob_mismatch",
]

log = structlog.get_logger(__name__)


def lag_histogram(lags: Iterable[int], *, max_lag: int = 16) -> dict[str, float]:
    """Counts of lags ``0 … max_lag − 1`` (keys ``lag_hist/<k>``) and ``≥ max_lag``
    (``lag_hist/<max_lag>+``); every key is present, so the series is dense."""
    if max_lag < 1:
        msg = f"max_lag must be >= 1, got {max_lag}"
        raise ShapeError(msg)
    values = np.asarray(list(lags), dtype=np.int64)
    if values.size and int(values.min()) < 0:
        msg = f"lags must be >= 0, got {int(values.min())}"
        raise ShapeError(msg)
    counts = np.bincount(np.minimum(values, max_lag), minlength=max_lag + 1)
    out = {f"lag_hist/{k}": float(counts[k]) for k in range(max_lag)}
    out[f"lag_hist/{max_lag}+"] = float(counts[max_lag])
    return out


@dataclass(frozen=True)
class DurationBucket:
    """Episodes whose duration lies in ``[lo, hi]`` and how many of them were dropped."""

    lo: float
    hi: float
    episodes: int
    dropped: int

    @property
    def drop_rate(self) -> float:
        """Fraction dropped (0 for an empty bucket)."""
        return self.dropped / self.episodes if self.episodes else 0.0


@dataclass(frozen=True)
class DropByDuration:
    """Drop rates by duration bucket, shortest first, and the length-bias verdict.

    ``ratio`` is the longest bucket's drop rate over the shortest's (``inf`` when only the longest
    drops anything, 1 when neither does). ``biased`` is true when both buckets hold at least
    ``min_per_bucket`` episodes and ``ratio ≥ bias_ratio``.
    """

    buckets: tuple[DurationBucket, ...]
    ratio: float
    biased: bool

    def as_dict(self) -> dict[str, float]:
        """Flat metrics: overall and per-bucket drop rates, the long/short ratio, the verdict."""
        total = sum(b.episodes for b in self.buckets)
        dropped = sum(b.dropped for b in self.buckets)
        out = {
            "drop/rate": dropped / total if total else 0.0,
            "drop/long_short_ratio": self.ratio,
            "drop/length_biased": float(self.biased),
        }
        for i, b in enumerate(self.buckets):
            out[f"drop/rate_bucket_{i}"] = b.drop_rate
            out[f"drop/duration_max_bucket_{i}"] = b.hi
        return out


def drop_by_duration(
    durations: Sequence[float],
    kept: Sequence[bool],
    *,
    n_buckets: int = 4,
    bias_ratio: float = 2.0,
    min_per_bucket: int = 8,
) -> DropByDuration:
    """Drop rate per equal-count duration bucket, warning on length bias.

    Episodes are sorted by duration (any unit: seconds, model calls, trainer versions) and split
    into ``min(n_buckets, len)`` buckets of near-equal size; ties may straddle a boundary. When the
    verdict is biased, logs ``staleness.length_bias`` at warning level with both rates.
    """
    if len(durations) != len(kept):
        msg = f"durations ({len(durations)}) and kept ({len(kept)}) differ in length"
        raise ShapeError(msg)
    if n_buckets < 2 or bias_ratio <= 1:
        msg = f"need n_buckets >= 2 and bias_ratio > 1, got {n_buckets}, {bias_ratio}"
        raise ShapeError(msg)
    d = np.asarray(durations, dtype=np.float64)
    k = np.asarray(kept, dtype=np.bool_)
    order = np.argsort(d, kind="stable")
    chunks = [c for c in np.array_split(order, min(n_buckets, d.size)) if c.size] if d.size else []
    buckets = tuple(
        DurationBucket(
            lo=float(d[c].min()),
            hi=float(d[c].max()),
            episodes=int(c.size),
            dropped=int((~k[c]).sum()),
        )
        for c in chunks
    )
    if len(buckets) < 2:
        return DropByDuration(buckets=buckets, ratio=1.0, biased=False)
    short, long = buckets[0], buckets[-1]
    if short.drop_rate > 0:
        ratio = long.drop_rate / short.drop_rate
    else:
        ratio = math.inf if long.drop_rate > 0 else 1.0
    enough = min(short.episodes, long.episodes) >= min_per_bucket
    biased = enough and ratio >= bias_ratio
    if biased:
        log.warning(
            "staleness.length_bias",
            long_drop_rate=long.drop_rate,
            short_drop_rate=short.drop_rate,
            ratio=ratio,
            long_min_duration=long.lo,
            short_max_duration=short.hi,
            hint="long episodes are dropped more often: raise drop.max_lag, use "
            "drop.statistic='token_weighted', or correct instead of dropping",
        )
    return DropByDuration(buckets=buckets, ratio=ratio, biased=biased)


def effective_sample_size(weights: Tensor, mask: Tensor) -> float:
    """Kish effective sample size ``(Σw)² / Σw²`` over the mask (0 when nothing has weight)."""
    if weights.shape != mask.shape:
        msg = f"weights {tuple(weights.shape)} and mask {tuple(mask.shape)} differ in shape"
        raise ShapeError(msg)
    w = weights.detach().to(torch.float64)[mask.to(torch.bool)]
    sq = float(w.square().sum().item())
    return float(w.sum().item()) ** 2 / sq if sq > 0 else 0.0


def logprob_mismatch(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> float:
    """Mean ``|logp_prox − logp_behav|`` over the mask's tokens whose difference is finite (0 when
    there are none; the others are counted by ``is/nonfinite_tokens``).

    ~0 on-policy with no update between rollout and training; grows with lag and with numeric
    differences between the engine and the trainer."""
    if logp_prox.shape != logp_behav.shape or logp_prox.shape != mask.shape:
        msg = "logp_prox, logp_behav and mask must share one shape"
        raise ShapeError(msg)
    m = mask.to(torch.bool)
    diff = (logp_prox.detach().double() - logp_behav.detach().double())[m]
    diff = diff[torch.isfinite(diff)]
    return float(diff.abs().mean().item()) if diff.numel() else 0.0


def _p99(values: Tensor) -> float:
    """Nearest-rank 99th percentile (exact, no interpolation; 0 when empty)."""
    if values.numel() == 0:
        return 0.0
    ordered = values.flatten().sort().values
    rank = max(math.ceil(0.99 * ordered.numel()) - 1, 0)
    return float(ordered[rank].item())


def correction_metrics(
    cfg: Correction,
    corrected: Corrected,
    *,
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
) -> dict[str, float]:
    """What a correction did to a batch.

    ``is/weight_mean|max|p99`` over kept tokens; ``is/frac_masked`` (valid tokens the correction
    masked, non-finite ones included); ``is/nonfinite_tokens`` (valid tokens whose log ratio is
    NaN or ±inf: every policy masks them); ``is/frac_truncated`` (valid tokens whose ratio — their
    sequence's, for ``level="sequence"`` — exceeded the TIS cap; 0 for other policies, which mask
    rather than truncate); ``is/ess`` and ``is/ess_frac`` (Kish ESS over kept tokens, and over the
    number of valid tokens); ``mismatch/logp_abs_mean`` and ``mismatch/kl_k3`` (k3 estimate of
    KL(μ ‖ π_prox) from μ's samples) over the valid tokens with a finite log ratio.
    """
    valid = mask.to(torch.bool)
    kept = corrected.mask.to(torch.bool)
    n_valid = int(valid.sum().item())
    n_kept = int(kept.sum().item())
    w = corrected.weights.detach().to(torch.float64)[kept]
    diff = logp_prox.detach().double() - logp_behav.detach().double()
    usable = valid & torch.isfinite(diff)
    n_nonfinite = n_valid - int(usable.sum().item())
    log_r = diff[usable]
    truncated = 0.0
    if isinstance(cfg, TruncatedIS) and n_valid:
        if cfg.level == "sequence":
            seq = torch.where(usable, diff, torch.zeros_like(diff)).sum(dim=1, keepdim=True)
            over = usable & (seq > math.log(cfg.cap))
        else:
            over = usable & (diff > math.log(cfg.cap))
        truncated = float(over.sum().item()) / n_valid
    ess = effective_sample_size(corrected.weights, kept)
    return {
        "is/weight_mean": float(w.mean().item()) if n_kept else 0.0,
        "is/weight_max": float(w.max().item()) if n_kept else 0.0,
        "is/weight_p99": _p99(w),
        "is/frac_masked": (n_valid - n_kept) / n_valid if n_valid else 0.0,
        "is/nonfinite_tokens": float(n_nonfinite),
        "is/frac_truncated": truncated,
        "is/ess": ess,
        "is/ess_frac": ess / n_valid if n_valid else 0.0,
        "is/kept_tokens": float(n_kept),
        "mismatch/logp_abs_mean": logprob_mismatch(logp_prox, logp_behav, mask),
        "mismatch/kl_k3": float((torch.expm1(log_r) - log_r).mean().item())
        if log_r.numel()
        else 0.0,
    }
