"""Staleness metrics: how old the trained tokens are, what the corrections did, what was dropped.

Every function returns plain ``dict[str, float]`` (for structlog lines and Prometheus gauges) or a
small frozen dataclass with an ``as_dict()``. Keys are stable and slash-separated
(``lag_hist/3``, ``is/ess_frac``, ``mismatch/logp_abs_mean``).

The length-bias guard lives in :mod:`staleness.length_bias`.

Guarantees: pure; empty inputs give zeros, never NaN.
Not covered: exporting to Prometheus (the caller owns the registry).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from staleness.config import Correction, TruncatedIS
from staleness.errors import ShapeError
from staleness.types import Corrected

__all__ = [
    "correction_metrics",
    "effective_sample_size",
    "lag_histogram",
    "logprob_mismatch",
]


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
