"""Vocabulary of the staleness package: version stamps, lag statistics, corrected weights.

No I/O and no runtime torch import (the tensor annotation is for type checkers only), so
:mod:`staleness.lag` stays usable without torch. Every other staleness module depends on this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from staleness.errors import LagError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Corrected", "LagStats", "SegmentVersions", "Surrogate"]


@dataclass(frozen=True)
class SegmentVersions:
    """One model call of an episode: the policy versions applied when its generation started and
    ended (they differ only if an update landed mid-generation), and how many tokens it sampled."""

    start: int
    end: int
    n_tokens: int

    def __post_init__(self) -> None:
        if self.start < 0:
            msg = f"segment start version must be >= 0, got {self.start}"
            raise LagError(msg)
        if self.end < self.start:
            msg = f"segment end version {self.end} is before its start version {self.start}"
            raise LagError(msg)
        if self.n_tokens < 0:
            msg = f"segment n_tokens must be >= 0, got {self.n_tokens}"
            raise LagError(msg)


@dataclass(frozen=True)
class LagStats:
    """Lag of an episode or group, in trainer versions.

    ``max``: the largest segment lag; ``mean``: the mean over segments (model calls);
    ``token_weighted``: the mean over sampled tokens (equals ``mean`` when no token was sampled);
    ``n_tokens``: sampled tokens counted.
    """

    max: int
    mean: float
    token_weighted: float
    n_tokens: int


@dataclass(frozen=True)
class Surrogate:
    """The policy-gradient term a correction trains with in place of PPO-clip
    (:mod:`staleness.surrogates`): ``cispo`` or ``gspo``, with the clip band of its ratio,
    ``[1 − clip_eps, 1 + clip_eps_high]``."""

    kind: Literal["cispo", "gspo"]
    clip_eps: float
    clip_eps_high: float


@dataclass(frozen=True)
class Corrected:
    """A correction's verdict on a [B, T] batch.

    ``weights``: float per-token multiplier of the policy-gradient term, detached, 0 wherever
    ``mask`` is false. ``mask``: bool, the tokens that still count (a subset of the input mask).
    ``valid``: bool, the input mask the correction was given (what the ``original`` normaliser of
    :func:`staleness.loss.aggregate` counts); ``None`` means the same as ``mask``.
    ``surrogate``: the term the loss takes instead of PPO-clip (``None``: PPO-clip with the
    trainer's clip). ``log_rho``: ``log ρ_t = log π_prox/μ`` on the kept tokens (0 elsewhere)
    when the ratio of PPO-clip or of the surrogate is anchored on μ (``anchor="behaviour"`` of
    ``none`` or CISPO): that ratio is ``exp(logp − logp_prox + log_rho) = π_θ/μ``; ``None``:
    anchored on π_prox.
    """

    weights: Tensor
    mask: Tensor
    valid: Tensor | None = None
    surrogate: Surrogate | None = None
    log_rho: Tensor | None = None

    def rows(self, index: slice, width: int | None = None) -> Corrected:
        """The rows ``index`` of the verdict (the first ``width`` positions; None: all): what a
        minibatch or micro-batch of a batch corrected as a whole takes."""

        def cut(t: Tensor) -> Tensor:
            return t[index, :width]

        return Corrected(
            weights=cut(self.weights),
            mask=cut(self.mask),
            valid=None if self.valid is None else cut(self.valid),
            surrogate=self.surrogate,
            log_rho=None if self.log_rho is None else cut(self.log_rho),
        )
