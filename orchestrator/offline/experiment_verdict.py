"""The verdict of ``orchestrate experiment lag``: each arm's reward across seeds against on-policy.

The statistic of a run is its *second-half reward*: the mean per-step reward over the second
half of its steps, with its standard error (the steps taken as independent samples). Per arm: the
mean of that statistic over seeds ± the half-width of its 95% interval (Student's t with
``seeds − 1`` degrees of freedom on the per-seed values; none for one seed). Two checks, stated
as measured, not assumed:

- *best correction within noise of on-policy in every seed*: the corrected arm with the highest
  across-seed mean; in each seed, its second-half reward minus on-policy's against 2σ, σ the
  two runs' standard errors combined;
- *uncorrected worse beyond 2σ pooled*: the mean over seeds of (uncorrected − on-policy) against
  2σ pooled, σ = √(Σ_seeds (SE_on² + SE_none²)) / seeds.

Pure functions of the arms' results: nothing here runs or reads a run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.observe.trend import halves, mean_se
from orchestrator.offline.experiment_arms import (
    ARMS,
    CORRECTED,
    REFERENCE,
    UNCORRECTED,
    ArmResult,
)

# Two-sided 95% quantiles of Student's t, t(0.975, dof), for dof 1..30 (the normal's 1.96 beyond).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def tail_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """A run's second-half reward: mean and standard error of the second half of ``rewards``."""
    return mean_se(rewards[len(rewards) // 2 :])


def interval95(values: Sequence[float]) -> tuple[float, float]:
    """Mean of ``values`` and the half-width of its 95% Student-t interval (0 for one value)."""
    mean, se = mean_se(values)
    dof = len(values) - 1
    if dof < 1:
        return mean, 0.0
    return mean, se * (_T975[dof - 1] if dof <= len(_T975) else 1.96)


@dataclass(frozen=True)
class ArmStats:
    """An arm's second-half reward across seeds."""

    arm: str
    label: str
    per_seed: dict[int, tuple[float, float]]
    """seed → (second-half mean, its standard error)"""
    mean: float
    ci95: float


def arm_stats(results: Sequence[ArmResult]) -> list[ArmStats]:
    """One :class:`ArmStats` per arm, in :data:`ARMS` order."""
    order = {a.name: i for i, a in enumerate(ARMS)}
    by_arm: dict[str, list[ArmResult]] = {}
    for r in sorted(results, key=lambda r: order.get(r.arm, len(order))):
        by_arm.setdefault(r.arm, []).append(r)
    stats = []
    for name, runs in by_arm.items():
        per_seed = {r.seed: tail_stats(r.rewards) for r in runs}
        mean, ci = interval95([m for m, _ in per_seed.values()])
        stats.append(ArmStats(name, runs[0].label, per_seed, mean, ci))
    return stats


def _gap(a: ArmStats, ref: ArmStats) -> tuple[list[tuple[int, float, float]], float, float]:
    """``a`` − ``ref`` per shared seed as (seed, Δ, 2σ), and pooled (mean Δ, 2σ pooled)."""
    seeds = sorted(set(a.per_seed) & set(ref.per_seed))
    rows = []
    var = 0.0
    for s in seeds:
        (m, se), (rm, rse) = a.per_seed[s], ref.per_seed[s]
        rows.append((s, m - rm, 2 * math.hypot(se, rse)))
        var += se**2 + rse**2
    n = max(len(seeds), 1)
    return rows, sum(d for _, d, _ in rows) / n, 2 * math.sqrt(var) / n


def _judge(delta: float, noise: float) -> str:
    if abs(delta) <= noise:
        return "within noise of on-policy"
    return "better than on-policy" if delta > 0 else "worse than on-policy"


def checks(results: Sequence[ArmResult]) -> dict[str, Any]:
    """The two checks of the module docstring, as data (``summary.json["checks"]``)."""
    stats = {s.arm: s for s in arm_stats(results)}
    ref = stats[REFERENCE]
    out: dict[str, Any] = {}
    corrected = [stats[n] for n in CORRECTED if n in stats]
    if corrected:
        best = max(corrected, key=lambda s: s.mean)
        rows, _, _ = _gap(best, ref)
        out["best_correction"] = {
            "arm": best.arm,
            "seeds": [{"seed": s, "delta": d, "noise": n} for s, d, n in rows],
            "not_worse_every_seed": all(d >= -n for _, d, n in rows),
        }
    if UNCORRECTED in stats:
        _, delta, noise = _gap(stats[UNCORRECTED], ref)
        out["uncorrected"] = {"delta": delta, "noise": noise, "worse_beyond_2sigma": delta < -noise}
    return out


def verdict(results: Sequence[ArmResult]) -> str:
    """The verdict, one statement per line: whether on-policy reward rose, each arm's second-half
    reward across seeds (mean ± 95% interval) and how it compares with on-policy's, the checks."""
    stats = arm_stats(results)
    by_name = {s.arm: s for s in stats}
    if REFERENCE not in by_name:
        raise ValueError(f"the verdict compares every arm with {REFERENCE}, which did not run")
    ref = by_name[REFERENCE]
    seeds = len(ref.per_seed)
    rises = [halves(r.rewards) for r in results if r.arm == REFERENCE]
    rose = sum(c.judged == "rose" for c in rises)
    before = sum(c.before for c in rises) / len(rises)
    after = sum(c.after for c in rises) / len(rises)
    lines = [
        f"on-policy reward, first→second half (mean of {seeds} seed(s)): {before:.3f}→{after:.3f}"
        f" (rose beyond 2σ in {rose} of {seeds})"
    ]
    lines.append(f"second-half reward, mean ± 95% interval over {seeds} seed(s):")
    for s in stats:
        line = f"  {s.label:<34} {s.mean:.3f} ± {s.ci95:.3f}"
        if s is not ref:
            rows, delta, noise = _gap(s, ref)
            within = sum(abs(d) <= n for _, d, n in rows)
            line += (
                f"  Δ {delta:+.3f} (2σ pooled {noise:.3f}: {_judge(delta, noise)};"
                f" within noise in {within} of {len(rows)} seeds)"
            )
        lines.append(line)
    found = checks(results)
    if "best_correction" in found:
        best = found["best_correction"]
        ok = sum(r["delta"] >= -r["noise"] for r in best["seeds"])
        lines.append(
            f"best correction {best['arm']}: not worse than on-policy beyond 2σ in {ok} of "
            f"{len(best['seeds'])} seeds"
        )
    if "uncorrected" in found:
        unc = found["uncorrected"]
        judged = "worse beyond 2σ" if unc["worse_beyond_2sigma"] else "not worse beyond 2σ"
        lines.append(
            f"uncorrected vs on-policy, pooled: Δ {unc['delta']:+.3f}, 2σ {unc['noise']:.3f}"
            f" ({judged})"
        )
    return "\n".join(lines)
