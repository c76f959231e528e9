"""The verdict of ``orchestrate experiment lag``: each run's reward across seeds against on-policy.

The statistic of a run is its *second-half reward*: the mean per-step reward over the second
half of its steps, with its standard error (the steps taken as independent samples). Per run (an
arm at a lag): the mean of that statistic over seeds ± the half-width of its 95% interval
(Student's t with ``seeds − 1`` degrees of freedom on the per-seed values; none for one seed),
which :func:`table` lays out per arm and lag. A run is compared with on-policy by Δ, the mean over
seeds of (run − on-policy), against 2σ pooled, σ = √(Σ_seeds (SE_run² + SE_on²)) / seeds. The
issue's two targets, stated as measured, not assumed (:func:`checks`):

- *uncorrected below on-policy beyond 2σ pooled at every lag ≥ 4* (:data:`UNCORRECTED_FROM`),
  judged for each arm without a correction that ran (``uncorrected``, ``naive_ppo``);
- *the best correction within 2σ pooled of on-policy at every lag up to 8*
  (:data:`CORRECTED_UP_TO`): the corrected arm with the highest mean over those lags, not below
  on-policy by more than 2σ pooled at any of them.

The same comparisons are made on a second statistic where the runs have it, the *final-policy
reward* (:data:`FINAL`): the mean reward of fresh episodes sampled from each run's last version
(:mod:`orchestrator.run.score`), with its standard error over episodes. A lag-L run's training
reward at step t is that of the version that sampled step t's episodes, up to L versions old; the
final policy's is what the run ended with. The issue's targets are judged on the second-half
reward; the verdict states them on the final-policy reward as well, as such.

Pure functions of the runs' results: nothing here runs or reads a run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.observe.trend import halves, mean_se
from orchestrator.offline.experiment_arms import (
    ARMS,
    REFERENCE,
    UNCORRECTED,
    ArmResult,
)

UNCORRECTED_FROM = 4
"""The uncorrected target holds at every lag from this one."""
CORRECTED_UP_TO = 8
"""The best-correction target holds at every lag up to this one."""

# Two-sided 95% quantiles of Student's t, t(0.975, dof), for dof 1..30 (the normal's 1.96 beyond).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def tail_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """A run's second-half reward: mean and standard error of the second half of ``rewards``."""
    return mean_se(rewards[len(rewards) // 2 :])


Statistic = Literal["second_half", "final"]
SECOND_HALF: Statistic = "second_half"
FINAL: Statistic = "final"
_OF: dict[Statistic, Callable[[ArmResult], tuple[float, float] | None]] = {
    SECOND_HALF: lambda r: tail_stats(r.rewards),
    FINAL: lambda r: mean_se(r.final_rewards) if r.final_rewards else None,
}
"""Each statistic of one run: (mean, standard error), or None where the run lacks it."""
FINAL_TITLE = "final-policy reward (fresh episodes of each run's last version)"


def scored(results: Sequence[ArmResult]) -> bool:
    """Whether the final-policy reward can be compared: on-policy and another run have it."""
    have = [r for r in results if r.final_rewards]
    return any(r.arm == REFERENCE for r in have) and any(r.arm != REFERENCE for r in have)


def interval95(values: Sequence[float]) -> tuple[float, float]:
    """Mean of ``values`` and the half-width of its 95% Student-t interval (0 for one value)."""
    mean, se = mean_se(values)
    dof = len(values) - 1
    if dof < 1:
        return mean, 0.0
    return mean, se * (_T975[dof - 1] if dof <= len(_T975) else 1.96)


@dataclass(frozen=True)
class ArmStats:
    """One run's (an arm at a lag) second-half reward across seeds."""

    arm: str
    """the run's name: ``on_policy`` or ``lag<L>_<arm>``"""
    label: str
    per_seed: dict[int, tuple[float, float]]
    """seed → (second-half mean, its standard error)"""
    mean: float
    ci95: float
    correction: str = REFERENCE
    lag: int = 0


def arm_stats(results: Sequence[ArmResult], statistic: Statistic = SECOND_HALF) -> list[ArmStats]:
    """One :class:`ArmStats` of ``statistic`` per run name that has it, by lag, then in
    :data:`ARMS` order."""
    order = {a.name: i for i, a in enumerate(ARMS)}
    by_arm: dict[str, list[tuple[ArmResult, tuple[float, float]]]] = {}
    for r in sorted(results, key=lambda r: (r.lag, order.get(r.correction, -1))):
        value = _OF[statistic](r)
        if value is not None:
            by_arm.setdefault(r.arm, []).append((r, value))
    stats = []
    for name, runs in by_arm.items():
        per_seed = {r.seed: value for r, value in runs}
        mean, ci = interval95([m for m, _ in per_seed.values()])
        first = runs[0][0]
        stats.append(ArmStats(name, first.label, per_seed, mean, ci, first.correction, first.lag))
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


def _reference(stats: Sequence[ArmStats]) -> ArmStats:
    ref = next((s for s in stats if s.arm == REFERENCE), None)
    if ref is None:
        raise ValueError(f"the verdict compares every arm with {REFERENCE}, which did not run")
    return ref


def checks(results: Sequence[ArmResult], statistic: Statistic = SECOND_HALF) -> dict[str, Any]:
    """The issue's two targets on ``statistic``, as data (``summary.json["checks"]``): per lag,
    Δ against on-policy and 2σ pooled; ``met`` is None when no lag the target names was run."""
    stats = arm_stats(results, statistic)
    ref = _reference(stats)
    out: dict[str, Any] = {}
    for arm in UNCORRECTED:
        unc = [s for s in stats if s.correction == arm and s.lag >= UNCORRECTED_FROM]
        if unc:
            lags = [_lag_gap(s, ref, worse=True) for s in unc]
            out[arm] = {"lags": lags, "met": all(g["worse_beyond_2sigma"] for g in lags)}
    corrected = [s for s in stats if s.correction not in (REFERENCE, *UNCORRECTED)]
    held = [s for s in corrected if s.lag <= CORRECTED_UP_TO]
    if held:
        means: dict[str, list[float]] = {}
        for s in held:
            means.setdefault(s.correction, []).append(s.mean)
        best = max(means, key=lambda name: sum(means[name]) / len(means[name]))
        lags = [_lag_gap(s, ref, worse=False) for s in held if s.correction == best]
        out["best_correction"] = {
            "arm": best,
            "lags": lags,
            "met": all(g["within_2sigma"] for g in lags),
        }
    return out


def _lag_gap(s: ArmStats, ref: ArmStats, *, worse: bool) -> dict[str, Any]:
    _, delta, noise = _gap(s, ref)
    found: dict[str, Any] = {"lag": s.lag, "delta": delta, "noise": noise}
    if worse:
        found["worse_beyond_2sigma"] = delta < -noise
    else:
        found["within_2sigma"] = delta >= -noise
    return found


def verdict(results: Sequence[ArmResult]) -> str:
    """The verdict, one statement per line: whether on-policy reward rose, each run's second-half
    reward across seeds (mean ± 95% interval) and how it compares with on-policy's, the targets."""
    stats = arm_stats(results)
    ref = _reference(stats)
    seeds = len(ref.per_seed)
    rises = [halves(r.rewards) for r in results if r.arm == REFERENCE]
    rose = sum(c.judged == "rose" for c in rises)
    before = sum(c.before for c in rises) / len(rises)
    after = sum(c.after for c in rises) / len(rises)
    lines = [
        f"on-policy reward, first→second half (mean of {seeds} seed(s)): {before:.3f}→{after:.3f}"
        f" (rose beyond 2σ in {rose} of {seeds})",
        f"second-half reward, mean ± 95% t-interval over {seeds} seed(s); Δ against on-policy:",
        *_run_lines(stats, ref),
    ]
    lines += _drift_lines(results) + _target_lines(checks(results))
    if scored(results):
        final = arm_stats(results, FINAL)
        final_ref = _reference(final)
        episodes = max(len(r.final_rewards) for r in results)
        lines += [
            f"{FINAL_TITLE}, {episodes} each, mean ± 95% t-interval over"
            f" {len(final_ref.per_seed)} seed(s); Δ against on-policy:",
            *_run_lines(final, final_ref),
            *("final policy: " + line for line in _target_lines(checks(results, FINAL))),
        ]
    return "\n".join(lines)


def _run_lines(stats: Sequence[ArmStats], ref: ArmStats) -> list[str]:
    """One line per run: its statistic across seeds and, but for ``ref``, Δ against it."""
    lines = []
    for s in stats:
        line = f"  {s.label:<40} {s.mean:.3f} ± {s.ci95:.3f}"
        if s is not ref:
            rows, delta, noise = _gap(s, ref)
            within = sum(abs(d) <= n for _, d, n in rows)
            line += (
                f"  Δ {delta:+.3f} (2σ pooled {noise:.3f}: {_judge(delta, noise)};"
                f" within noise in {within} of {len(rows)} seeds)"
            )
        lines.append(line)
    return lines


def _drift_lines(results: Sequence[ArmResult]) -> list[str]:
    """μ against π_prox per lag, each metric the mean over that lag's runs (arms and seeds)."""
    by_lag: dict[int, list[dict[str, float]]] = {}
    for r in results:
        if r.lag > 0 and r.drift:
            by_lag.setdefault(r.lag, []).append(r.drift)
    if not by_lag:
        return []
    lines = ["behaviour μ against π_prox per lag (mean over its runs):"]
    for lag, drifts in sorted(by_lag.items()):
        names = sorted({name for d in drifts for name in d})
        means = {
            n: sum(d[n] for d in drifts if n in d) / sum(n in d for d in drifts) for n in names
        }
        lines.append(f"  lag {lag}: " + ", ".join(f"{n} {v:.4f}" for n, v in means.items()))
    return lines


def _target_lines(found: dict[str, Any]) -> list[str]:
    lines = []
    for arm in (a for a in UNCORRECTED if a in found):
        unc = found[arm]
        gaps = ", ".join(
            f"lag {g['lag']} Δ {g['delta']:+.3f} (2σ {g['noise']:.3f})" for g in unc["lags"]
        )
        lines.append(
            f"target, {arm} below on-policy beyond 2σ pooled at lag ≥ {UNCORRECTED_FROM}: "
            f"{'met' if unc['met'] else 'not met'} ({gaps})"
        )
    if "best_correction" in found:
        best = found["best_correction"]
        gaps = ", ".join(
            f"lag {g['lag']} Δ {g['delta']:+.3f} (2σ {g['noise']:.3f})" for g in best["lags"]
        )
        lines.append(
            f"target, best correction ({best['arm']}) within 2σ pooled of on-policy up to lag "
            f"{CORRECTED_UP_TO}: {'met' if best['met'] else 'not met'} ({gaps})"
        )
    return lines


def table(
    results: Sequence[ArmResult], statistic: Statistic = SECOND_HALF
) -> tuple[list[str], list[list[str]]]:
    """``statistic`` (mean ± 95% t-interval over seeds) per arm (rows) and lag (columns): the
    header and rows; the lag-0 column is on-policy, shared by every arm."""
    stats = arm_stats(results, statistic)
    ref = _reference(stats)
    lags = sorted({s.lag for s in stats})
    cells = {(s.correction, s.lag): f"{s.mean:.3f} ± {s.ci95:.3f}" for s in stats}
    arms = [a.name for a in ARMS if any(s.correction == a.name for s in stats)] or [REFERENCE]
    header = ["arm", *("lag 0 (on-policy)" if lag == 0 else f"lag {lag}" for lag in lags)]
    rows = [
        [
            arm,
            *(cells[ref.correction, 0] if lag == 0 else cells.get((arm, lag), "") for lag in lags),
        ]
        for arm in arms
    ]
    return header, rows


def markdown_table(results: Sequence[ArmResult], statistic: Statistic = SECOND_HALF) -> str:
    """:func:`table` as a markdown table."""
    header, rows = table(results, statistic)
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
