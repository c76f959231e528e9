"""The length-bias guard: is the drop rule dropping long episodes more than short ones?

A lag-based drop rule silently prefers short episodes: a long episode spans more trainer versions,
so it accumulates more lag and is dropped more often, and the policy learns mostly from short
episodes. :class:`LengthBias` counts staleness decisions per length bucket on two axes and tests
the difference; the live run (:class:`orchestrator.observe.metrics.RunMetrics`), the live view and
the offline report and replay all use it, so they agree.

- **Unit.** One decision per *group* (the staleness policy decides groups), its length being the
  group's longest episode: ``tokens`` = most sampled tokens (``Episode.n_sampled``), ``turns`` =
  most model calls (``len(Episode.segments)``). The longest episode is the one whose lag decides
  a ``max`` rule. Counting groups, not episodes, keeps the decisions the test compares independent.
- **Buckets.** Powers of two (:func:`bucket`): ``0-1``, ``2``, ``3-4``, ``5-8``, ``9-16``, … —
  stable labels for Prometheus, whatever the run's length distribution.
- **Excluded.** Groups the run's stop dropped (``orchestrator.record.events.STOP_REASONS``) were
  never decided by the staleness policy; callers do not :meth:`~LengthBias.add` them.
- **The test** (:func:`bias_test`). The buckets are split, at a bucket boundary, into a short and a
  long half holding as close to half the decisions each as the boundaries allow. A one-sided
  two-proportion z-test (pooled variance) compares the long half's drop rate with the short
  half's: biased when both halves hold ≥ ``min_groups`` decisions and ``z ≥ z_threshold``.
  ``z_threshold = 3`` is a one-sided false-alarm rate of ≈0.13 % per look for a rule that is
  blind to length; it is stricter than the usual 1.96 because the live guard looks again after
  every decision, and repeated looks at a 5 % test fire on noise far more than 5 % of the time.
  ``min_groups = 20`` per half keeps the normal approximation honest.

Guarantees: :func:`bucket` and :func:`bias_test` are pure; :class:`LengthBias` logs one
``length_bias`` warning per crossing (biased after not biased), only when built with
``warn=True``. Empty inputs give zeros, never NaN. Not covered: a bias that only shows between
inner buckets (the test compares halves), and exporting (the caller owns the registry).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import structlog

__all__ = [
    "AXES",
    "Axis",
    "BiasVerdict",
    "BucketCount",
    "LengthBias",
    "bias_test",
    "bucket",
    "bucket_label",
]

log = structlog.get_logger(__name__)

Axis = Literal["tokens", "turns"]
AXES: tuple[Axis, ...] = ("tokens", "turns")

HINT = (
    "long episodes are dropped more often than short ones: raise staleness.drop.max_lag, use "
    "drop.statistic='token_weighted', correct instead of dropping, or set "
    "staleness.length_bias.requeue = true"
)


def bucket(n: int) -> int:
    """The power-of-two bucket of a length: 0 for ``n ≤ 1``, else ``k`` with
    ``2^(k−1) < n ≤ 2^k``."""
    return max(n - 1, 0).bit_length()


def bucket_label(k: int) -> str:
    """``0-1``, ``2``, ``3-4``, ``5-8``, … (the lengths bucket ``k`` holds)."""
    if k == 0:
        return "0-1"
    lo, hi = 2 ** (k - 1) + 1, 2**k
    return str(hi) if lo == hi else f"{lo}-{hi}"


@dataclass
class BucketCount:
    """Decisions in one bucket and how many of them were drops."""

    decided: int = 0
    dropped: int = 0

    @property
    def drop_rate(self) -> float:
        return self.dropped / self.decided if self.decided else 0.0


@dataclass(frozen=True)
class BiasVerdict:
    """The long-vs-short test on one axis. ``split``: the first bucket of the long half (−1 when
    fewer than two buckets hold decisions); ``z``: the z statistic (0 when undefined)."""

    axis: Axis
    split: int
    short: BucketCount
    long: BucketCount
    z: float
    biased: bool


def bias_test(
    counts: Mapping[int, BucketCount],
    axis: Axis = "tokens",
    *,
    z_threshold: float = 3.0,
    min_groups: int = 20,
) -> BiasVerdict:
    """Short half vs long half of ``counts`` (bucket → count), module docstring."""
    ks = sorted(k for k, c in counts.items() if c.decided)
    if len(ks) < 2:
        return BiasVerdict(axis, -1, BucketCount(), BucketCount(), 0.0, False)
    total = sum(counts[k].decided for k in ks)
    best, cum, best_gap = 1, 0, math.inf
    for i, k in enumerate(ks[:-1], start=1):
        cum += counts[k].decided
        if abs(2 * cum - total) < best_gap:
            best, best_gap = i, abs(2 * cum - total)
    short = BucketCount(
        sum(counts[k].decided for k in ks[:best]), sum(counts[k].dropped for k in ks[:best])
    )
    long = BucketCount(
        sum(counts[k].decided for k in ks[best:]), sum(counts[k].dropped for k in ks[best:])
    )
    p = (short.dropped + long.dropped) / total
    se = math.sqrt(p * (1 - p) * (1 / short.decided + 1 / long.decided))
    z = (long.drop_rate - short.drop_rate) / se if se > 0 else 0.0
    biased = min(short.decided, long.decided) >= min_groups and z >= z_threshold
    return BiasVerdict(axis, ks[best], short, long, z, biased)


@dataclass
class LengthBias:
    """Decided/dropped counts per bucket on both axes, and the test (module docstring).

    :meth:`add` one staleness decision at a time (live) or :meth:`of` many (offline).
    """

    z_threshold: float = 3.0
    min_groups: int = 20
    warn: bool = False
    counts: dict[Axis, dict[int, BucketCount]] = field(
        default_factory=lambda: {a: {} for a in AXES}
    )
    _biased: dict[Axis, bool] = field(default_factory=lambda: dict.fromkeys(AXES, False))

    @classmethod
    def of(
        cls,
        groups: Iterable[tuple[int, int, bool]],
        *,
        z_threshold: float = 3.0,
        min_groups: int = 20,
    ) -> LengthBias:
        """Counts of ``(tokens, turns, dropped)`` decisions (no warning)."""
        out = cls(z_threshold=z_threshold, min_groups=min_groups)
        for tokens, turns, dropped in groups:
            out.add(tokens, turns, dropped=dropped)
        return out

    def add(self, tokens: int, turns: int, *, dropped: bool) -> list[BiasVerdict]:
        """Count one decision; returns the axes that just became biased (warned, if ``warn``)."""
        crossed = []
        lengths: dict[Axis, int] = {"tokens": tokens, "turns": turns}
        for axis, n in lengths.items():
            c = self.counts[axis].setdefault(bucket(n), BucketCount())
            c.decided += 1
            c.dropped += dropped
            v = self.verdict(axis)
            if v.biased and not self._biased[axis]:
                crossed.append(v)
                if self.warn:
                    log.warning(
                        "length_bias",
                        axis=axis,
                        long_from=bucket_label(v.split),
                        long_drop_rate=round(v.long.drop_rate, 4),
                        short_drop_rate=round(v.short.drop_rate, 4),
                        long_groups=v.long.decided,
                        short_groups=v.short.decided,
                        z=round(v.z, 2),
                        hint=HINT,
                    )
            self._biased[axis] = v.biased
        return crossed

    def verdict(self, axis: Axis) -> BiasVerdict:
        return bias_test(
            self.counts[axis], axis, z_threshold=self.z_threshold, min_groups=self.min_groups
        )

    @property
    def decided(self) -> int:
        return sum(c.decided for c in self.counts["tokens"].values())

    @property
    def dropped(self) -> int:
        return sum(c.dropped for c in self.counts["tokens"].values())

    @property
    def biased(self) -> bool:
        return any(self.verdict(a).biased for a in AXES)

    def rows(self, axis: Axis) -> list[tuple[str, BucketCount]]:
        """``(label, count)`` per non-empty bucket, shortest first."""
        return [(bucket_label(k), c) for k, c in sorted(self.counts[axis].items())]

    def as_dict(self) -> dict[str, float]:
        """Flat metrics: ``drop/rate``, ``drop/length_biased`` and per axis
        ``drop/<axis>/z``, ``drop/<axis>/rate_long``, ``drop/<axis>/rate_short``,
        ``drop/<axis>/rate_<bucket label>``."""
        n = self.decided
        out = {"drop/rate": self.dropped / n if n else 0.0, "drop/length_biased": 0.0}
        for a in AXES:
            v = self.verdict(a)
            out["drop/length_biased"] = max(out["drop/length_biased"], float(v.biased))
            out[f"drop/{a}/z"] = v.z
            out[f"drop/{a}/rate_short"] = v.short.drop_rate
            out[f"drop/{a}/rate_long"] = v.long.drop_rate
            for label, c in self.rows(a):
                out[f"drop/{a}/rate_{label}"] = c.drop_rate
        return out
