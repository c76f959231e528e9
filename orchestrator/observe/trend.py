"""Did a per-step series move beyond its noise? The judgement the run summary and the lag
experiment print.

``compare(before, after)`` takes two windows of per-step values (e.g. the mean episode reward of
each trainer step) and reports each window's mean with its standard error, the difference and the
noise band ``2σ = 2·sqrt(SE_before² + SE_after²)``: "rose" / "fell" when ``|Δ| > 2σ``, "within
noise" otherwise. That treats the steps of a window as independent samples of one level (roughly
true when each step averages fresh episodes; a trend inside a window only widens the band), so
``|Δ| > 2σ`` is a rough 95% test, not an exact one. A window of fewer than two values has no SE
(0) and the comparison is marked ``too_short``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Judgement = Literal["rose", "fell", "within noise"]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    values = list(values) or [0.0]
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((r - mean) ** 2 for r in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


@dataclass(frozen=True)
class Comparison:
    before: float
    before_se: float
    after: float
    after_se: float
    too_short: bool
    """A window has fewer than two values: no noise estimate, no judgement."""

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def noise(self) -> float:
        """2σ of the difference."""
        return 2 * math.hypot(self.before_se, self.after_se)

    @property
    def judged(self) -> Judgement | None:
        if self.too_short:
            return None
        if abs(self.delta) <= self.noise:
            return "within noise"
        return "rose" if self.delta > 0 else "fell"

    def render(self) -> str:
        """``0.450±0.020 → 0.610±0.018 (rose, Δ=+0.160, 2σ=0.054)``"""
        judged = self.judged or "too few steps to judge"
        return (
            f"{self.before:.3f}±{self.before_se:.3f} → {self.after:.3f}±{self.after_se:.3f} "
            f"({judged}, Δ={self.delta:+.3f}, 2σ={self.noise:.3f})"
        )


def compare(before: Sequence[float], after: Sequence[float]) -> Comparison:
    b, b_se = mean_se(before)
    a, a_se = mean_se(after)
    return Comparison(b, b_se, a, a_se, too_short=min(len(before), len(after)) < 2)


def halves(values: Sequence[float]) -> Comparison:
    """First half vs second half (the middle value of an odd count goes to the second)."""
    half = len(values) // 2
    return compare(values[:half], values[half:])


def quarters(values: Sequence[float]) -> Comparison:
    """First quarter vs last quarter (``len // 4`` values each; the middle is left out)."""
    q = len(values) // 4
    return compare(values[:q], values[len(values) - q :])
