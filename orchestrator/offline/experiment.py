"""``orchestrate experiment lag``: do lag corrections make stale rollouts as good as fresh ones?

Runs arms of the real loop (:func:`orchestrator.run.run`: engines, scheduler, batcher, trainer,
board) from one SFT-warm-started model, over several seeds, with the same tasks and sizes:

- ``on_policy``: ``scheduler.max_lag = 0`` (synchronous), no correction — the reference;
- ``lag4_none``: ``max_lag = 4`` uncorrected (``type = "none"``);
- ``lag4_tis``: ``max_lag = 4`` with token-level truncated IS (cap 2);
- ``lag4_dppo``: ``max_lag = 4`` with decoupled PPO (``decoupled_ppo``, cap 2): the PPO ratio is
  taken against the proximal policy — the trainer's policy before the step, as AReaL defines
  it — and tokens whose π_prox/μ exceeds the cap are masked;
- ``lag4_mask``: ``max_lag = 4`` with two-sided token masking (``token_mask``, c = 2).

``--arms`` picks a subset (``on_policy`` is always run: it is what the others are judged
against); ``--seeds N`` runs every arm with run seeds ``--seed … --seed + N − 1``. The model is
built once (from ``--seed``) and shared by every seed, so seeds differ in what the run samples
(task order, engine sampling, the trainer's shuffles), not in the starting point.

Everything else comes from ``--config`` plus any ``--section.key VALUE`` overrides;
``staleness.drop`` is cleared in every arm so the correction is the only difference, and
``scheduler.max_concurrent_episodes`` is raised to what the lag budget can admit, so that rollout
really runs ahead of the trainer in the lag arms. Outputs in ``--out``:

- ``model/`` — the warm-started model (:func:`policies.train.sft.sft_phases`: SFT on operands
  2..99, then on the run's ``environment.args.max_operand``), built once and reused while
  ``model/sft.json`` records the same phases;
- ``runs/s<seed>/<arm>/`` — each run's directory (trajectory log, board, checkpoints);
- ``rewards.csv`` — ``step,<arm>/s<seed>…`` mean episode reward per trainer step;
- ``rewards.png`` — each arm's curve, averaged over seeds (raw and a moving average);
- ``summary.json`` — per run: rewards, measured lag histogram (per model call, trainer version at
  consumption minus the version that started the call), dropped groups, wall time; per arm the
  across-seed statistics; the checks; the verdict (also in ``verdict.txt``).

**The verdict** (:func:`verdict`). The statistic of a run is its *second-half reward*: the mean
per-step reward over the second half of its steps, with its standard error (the steps taken as
independent samples). Per arm: the mean of that statistic over seeds ± the half-width of its 95%
interval (Student's t with ``seeds − 1`` degrees of freedom on the per-seed values; none for
one seed). Two checks, stated as measured, not assumed:

- *best correction within noise of on-policy in every seed*: the corrected arm with the highest
  across-seed mean; in each seed, its second-half reward minus on-policy's against 2σ, σ the
  two runs' standard errors combined;
- *uncorrected worse beyond 2σ pooled*: the mean over seeds of (uncorrected − on-policy) against
  2σ pooled, σ = √(Σ_seeds (SE_on² + SE_none²)) / seeds.

``configs/experiment-lag.toml`` is the setting measured in docs/benchmarks.md.

Not covered: a different starting model per seed, a GPU fleet.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from orchestrator.config import Config, load_config, parse_overrides
from orchestrator.errors import ConfigError
from orchestrator.models import calculator_max_operand
from orchestrator.observe.trend import halves, mean_se
from orchestrator.record.frames import iter_records

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    max_lag: int
    correction: dict[str, Any]


REFERENCE = "on_policy"
UNCORRECTED = "lag4_none"

ARMS = (
    Arm(REFERENCE, "on-policy (max_lag 0)", 0, {"type": "none"}),
    Arm(UNCORRECTED, "max_lag 4, uncorrected", 4, {"type": "none"}),
    Arm("lag4_tis", "max_lag 4 + TIS (cap 2)", 4, {"type": "tis", "cap": 2.0}),
    Arm("lag4_dppo", "max_lag 4 + decoupled PPO (cap 2)", 4, {"type": "decoupled_ppo", "cap": 2.0}),
    Arm("lag4_mask", "max_lag 4 + token mask (c 2)", 4, {"type": "token_mask", "c": 2.0}),
)
CORRECTED = tuple(a.name for a in ARMS if a.correction["type"] != "none")

# Two-sided 95% quantiles of Student's t, t(0.975, dof), for dof 1..30 (the normal's 1.96 beyond).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def pick_arms(names: str | None) -> tuple[Arm, ...]:
    """The arms ``--arms a,b,…`` names, in :data:`ARMS` order, ``on_policy`` always included."""
    if names is None:
        return ARMS
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {a.name for a in ARMS}
    if unknown:
        known = ", ".join(a.name for a in ARMS)
        raise ConfigError(f"--arms: unknown arm {', '.join(sorted(unknown))} (known: {known})")
    return tuple(a for a in ARMS if a.name in wanted | {REFERENCE})


@dataclass
class ArmResult:
    arm: str
    label: str
    rewards: list[float]
    seed: int = 0
    lag_histogram: dict[int, int] = field(default_factory=dict)
    dropped_groups: int = 0
    seconds: float = 0.0


def arm_config(
    config: Path | None,
    arm: Arm,
    *,
    out: Path,
    model_dir: Path,
    steps: int,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """The resolved config of one arm and seed: ``config`` < ``overrides`` < what the arm fixes."""
    base = load_config(config, overrides)
    in_flight = (1 + arm.max_lag) * base.scheduler.groups_per_batch * base.scheduler.group_size
    fixed: dict[str, Any] = {
        "run.root": str(out / "runs" / f"s{seed}"),
        "run.name": arm.name,
        "run.seed": seed,
        "run.overwrite": True,
        "model.path": str(model_dir),
        "model.init": None,
        "model.warm_start": None,  # the experiment warm-starts its model itself
        "trainer.max_steps": steps,
        "scheduler.max_lag": arm.max_lag,
        "scheduler.max_concurrent_episodes": max(base.scheduler.max_concurrent_episodes, in_flight),
        "staleness.correction": arm.correction,
        "staleness.drop": None,
    }
    return load_config(config, {**(overrides or {}), **fixed})


def lag_histogram(log_dir: Path) -> dict[int, int]:
    """Model calls of trained episodes by lag: consuming trainer version − version at call start."""
    consumed: dict[str, int] = {}
    for rec in iter_records(log_dir, "batches"):
        for gid in rec["groups"]:
            consumed[gid] = int(rec["trained_at_version"])
    hist: Counter[int] = Counter()
    for rec in iter_records(log_dir, "episodes"):
        episode = rec["episode"]
        version = consumed.get(episode["group_id"])
        if version is None:  # dropped, or never batched before the run ended
            continue
        for seg in episode["segments"]:
            hist[version - int(seg["policy_version"]["start"])] += 1
    return dict(sorted(hist.items()))


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


def write_csv(results: Sequence[ArmResult], path: Path) -> None:
    steps = max((len(r.rewards) for r in results), default=0)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(f"{r.arm}/s{r.seed}" for r in results)])
        for i in range(steps):
            w.writerow(
                [i + 1, *(f"{r.rewards[i]:.6f}" if i < len(r.rewards) else "" for r in results)]
            )


def write_png(results: Sequence[ArmResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    by_arm: dict[str, list[ArmResult]] = {}
    for r in results:
        by_arm.setdefault(r.arm, []).append(r)
    for runs in by_arm.values():
        n = min(len(r.rewards) for r in runs)
        mean = [sum(r.rewards[i] for r in runs) / len(runs) for i in range(n)]
        xs = list(range(1, n + 1))
        (line,) = ax.plot(xs, mean, alpha=0.3, linewidth=1)
        k = max(1, n // 8)
        smooth = [
            sum(mean[max(0, i - k + 1) : i + 1]) / len(mean[max(0, i - k + 1) : i + 1])
            for i in range(n)
        ]
        label = f"{runs[0].label} ({len(runs)} seed{'s' * (len(runs) > 1)})"
        ax.plot(xs, smooth, color=line.get_color(), linewidth=2, label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean episode reward over seeds (moving average, solid)")
    ax.set_title(title, fontsize=7, loc="left")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_lag_experiment(
    config: Path | None,
    out: Path,
    *,
    steps: int | None = None,
    seed: int = 0,
    seeds: int = 1,
    size: str = "tiny",
    sft_steps: int = 1800,
    focus_steps: int = 100,
    sft_eval_episodes: int = 32,
    overrides: dict[str, Any] | None = None,
    arms: Sequence[Arm] = ARMS,
) -> tuple[list[ArmResult], str]:
    """Run every arm for every seed; write CSV, PNG and summary.json into ``out``; return the
    results and the verdict. ``steps`` defaults to the config's ``trainer.max_steps``."""
    from orchestrator.run import run
    from policies.train.sft import sft_phases, warm_model

    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config, overrides)
    steps = base.trainer.max_steps if steps is None else steps
    started = time.perf_counter()
    model_dir = warm_model(
        out / "model",
        size="small" if size == "small" else "tiny",
        seed=seed,
        phases=sft_phases(sft_steps, focus_steps, calculator_max_operand(base) or 99),
        eval_episodes=sft_eval_episodes,
    )
    results = []
    for run_seed in range(seed, seed + seeds):
        for arm in arms:
            cfg = arm_config(
                config,
                arm,
                out=out,
                model_dir=model_dir,
                steps=steps,
                seed=run_seed,
                overrides=overrides,
            )
            t0 = time.perf_counter()
            log.info("experiment_arm_started", arm=arm.name, seed=run_seed, max_lag=arm.max_lag)
            summary = anyio.run(run, cfg)
            if summary.interrupted:
                raise KeyboardInterrupt
            result = ArmResult(
                arm=arm.name,
                label=arm.label,
                rewards=list(summary.rewards),
                seed=run_seed,
                lag_histogram=lag_histogram(cfg.run_dir / "trajectories"),
                dropped_groups=summary.dropped_groups,
                seconds=time.perf_counter() - t0,
            )
            log.info(
                "experiment_arm_done",
                arm=arm.name,
                seed=run_seed,
                seconds=round(result.seconds, 1),
                lag_histogram=result.lag_histogram,
            )
            results.append(result)
    text = verdict(results)
    write_csv(results, out / "rewards.csv")
    write_png(results, out / "rewards.png", text)
    report = {
        "verdict": text,
        "steps": steps,
        "seeds": list(range(seed, seed + seeds)),
        "seconds": time.perf_counter() - started,
        "arms": [asdict(r) for r in results],
        "stats": [asdict(s) for s in arm_stats(results)],
        "checks": checks(results),
    }
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "verdict.txt").write_text(text + "\n")
    return results, text


def main(argv: list[str]) -> int:
    """``orchestrate experiment lag --config X.toml [--seeds N] [--arms a,b] [--steps N] …``"""
    parser = argparse.ArgumentParser(
        prog="orchestrate experiment",
        description="Compare on-policy RL with lag-4 RL, uncorrected and under each correction.",
        epilog="Any config field can be overridden with --section.key VALUE (all arms).",
    )
    parser.add_argument("name", choices=["lag"])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: trainer.max_steps")
    parser.add_argument("--out", type=Path, default=Path("runs/experiment-lag"))
    parser.add_argument("--seed", type=int, default=0, help="the first run seed and the model's")
    parser.add_argument("--seeds", type=int, default=1, help="run seeds --seed … --seed+N-1")
    parser.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated subset of {','.join(a.name for a in ARMS)} (default: all; "
        f"{REFERENCE} always runs)",
    )
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--sft-steps", type=int, default=1800, help="SFT on operands 2..99")
    parser.add_argument(
        "--sft-focus-steps", type=int, default=100, help="then SFT on the run's max_operand"
    )
    parser.add_argument("--sft-eval", type=int, default=32, help="episodes scored before/after SFT")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    results, text = run_lag_experiment(
        args.config,
        args.out,
        steps=args.steps,
        seed=args.seed,
        seeds=args.seeds,
        size=args.size,
        sft_steps=args.sft_steps,
        focus_steps=args.sft_focus_steps,
        sft_eval_episodes=args.sft_eval,
        overrides=overrides,
        arms=pick_arms(args.arms),
    )
    for r in results:
        sys.stdout.write(
            f"s{r.seed} {r.label:<34} {r.seconds:7.1f}s  lag {r.lag_histogram}  "
            f"dropped {r.dropped_groups}\n"
        )
    sys.stdout.write(f"{text}\nwrote {args.out / 'rewards.csv'}, {args.out / 'rewards.png'}\n")
    return 0
