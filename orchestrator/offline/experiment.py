"""``orchestrate experiment lag``: does a lag correction make stale rollouts as good as fresh ones?

Runs three arms of the real loop (:func:`orchestrator.run.run`: engines, scheduler, batcher,
trainer, board) from one SFT-warm-started model, with the same seed, tasks and sizes:

- ``on_policy``: ``scheduler.max_lag = 0`` (synchronous), no correction;
- ``lag4_tis``: ``max_lag = 4`` with token-level truncated IS (cap 2);
- ``lag4_none``: ``max_lag = 4`` uncorrected (``type = "none"``, no drop rule).

Everything else comes from ``--config`` plus any ``--section.key VALUE`` overrides;
``staleness.drop`` is cleared in every arm so the correction is the only difference, and
``scheduler.max_concurrent_episodes`` is raised to what the lag budget can admit, so that rollout
really runs ahead of the trainer in the lag arms. Outputs in ``--out``:

- ``model/`` — the warm-started model (:func:`policies.train.sft.sft_phases`: SFT on operands
  2..99, then on the run's ``environment.args.max_operand``), built once and reused while
  ``model/sft.json`` records the same phases;
- ``runs/<arm>/`` — each arm's run directory (trajectory log, board, checkpoints);
- ``rewards.csv`` — ``step,<arm>…`` mean episode reward per trainer step;
- ``rewards.png`` — the curves (raw and a moving average);
- ``summary.json`` — per arm: rewards, measured lag histogram (per model call, trainer version at
  consumption minus the version that started the call), dropped groups, wall time; the verdict.

The verdict says whether on-policy reward rose (second-half minus first-half mean of its per-step
rewards) and compares the mean reward over the second half of each lag arm's steps with
on-policy's, with the standard error of each mean as the noise scale: "within noise" means
|Δ| ≤ 2·SE (the two SEs combined). It states what was measured; it does not assume the expected
outcome. ``configs/experiment-lag.toml`` is the setting measured in docs/benchmarks.md.

Not covered: several seeds per arm (run the command again with ``--seed``), a GPU fleet.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from orchestrator.config import Config, load_config, parse_overrides
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


ARMS = (
    Arm("on_policy", "on-policy (max_lag 0)", 0, {"type": "none"}),
    Arm("lag4_tis", "max_lag 4 + TIS (cap 2)", 4, {"type": "tis", "cap": 2.0}),
    Arm("lag4_none", "max_lag 4, uncorrected", 4, {"type": "none"}),
)


@dataclass
class ArmResult:
    arm: str
    label: str
    rewards: list[float]
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
    """The resolved config of one arm: ``config`` < ``overrides`` < what the arm fixes."""
    base = load_config(config, overrides)
    in_flight = (1 + arm.max_lag) * base.scheduler.groups_per_batch * base.scheduler.group_size
    fixed: dict[str, Any] = {
        "run.root": str(out / "runs"),
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


def _tail_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the second half of ``rewards``."""
    return mean_se(rewards[len(rewards) // 2 :])


def _rise(rewards: Sequence[float]) -> str:
    """Did reward rise? Second-half minus first-half mean, judged against 2·(combined SE)."""
    c = halves(rewards)
    judged = c.judged or "too few steps"
    return f"{c.before:.3f}→{c.after:.3f} ({judged}, Δ={c.delta:+.3f}, 2σ={c.noise:.3f})"


def verdict(results: Sequence[ArmResult]) -> str:
    """One line: did on-policy reward rise (first vs second half), and how the lag arms compare
    with on-policy (second-half mean reward)."""
    by_name = {r.arm: r for r in results}
    ref_mean, ref_se = _tail_stats(by_name["on_policy"].rewards)
    parts = [f"on-policy {ref_mean:.3f}±{ref_se:.3f}"]
    for name, what in (("lag4_tis", "corrected lag-4"), ("lag4_none", "uncorrected lag-4")):
        if name not in by_name:
            continue
        mean, se = _tail_stats(by_name[name].rewards)
        delta = mean - ref_mean
        noise = 2 * math.hypot(se, ref_se)
        if abs(delta) <= noise:
            judged = "within noise of on-policy"
        else:
            judged = "better than on-policy" if delta > 0 else "worse than on-policy"
        parts.append(f"{what} {mean:.3f}±{se:.3f} ({judged}, Δ={delta:+.3f}, 2σ={noise:.3f})")
    rise = _rise(by_name["on_policy"].rewards)
    return f"on-policy reward, first→second half: {rise}. Second-half mean reward: " + "; ".join(
        parts
    )


def write_csv(results: Sequence[ArmResult], path: Path) -> None:
    steps = max((len(r.rewards) for r in results), default=0)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(r.arm for r in results)])
        for i in range(steps):
            w.writerow(
                [i + 1, *(f"{r.rewards[i]:.6f}" if i < len(r.rewards) else "" for r in results)]
            )


def write_png(results: Sequence[ArmResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        xs = list(range(1, len(r.rewards) + 1))
        (line,) = ax.plot(xs, r.rewards, alpha=0.3, linewidth=1)
        k = max(1, len(r.rewards) // 8)
        smooth = [
            sum(r.rewards[max(0, i - k + 1) : i + 1]) / len(r.rewards[max(0, i - k + 1) : i + 1])
            for i in range(len(r.rewards))
        ]
        ax.plot(xs, smooth, color=line.get_color(), linewidth=2, label=r.label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean episode reward (moving average, solid)")
    ax.set_title(title, fontsize=9)
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
    size: str = "tiny",
    sft_steps: int = 1800,
    focus_steps: int = 100,
    sft_eval_episodes: int = 32,
    overrides: dict[str, Any] | None = None,
    arms: Sequence[Arm] = ARMS,
) -> tuple[list[ArmResult], str]:
    """Run every arm; write CSV, PNG and summary.json into ``out``; return results + verdict.

    ``steps`` defaults to the config's ``trainer.max_steps``."""
    from orchestrator.run import run
    from policies.train.sft import sft_phases, warm_model

    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config, overrides)
    steps = base.trainer.max_steps if steps is None else steps
    model_dir = warm_model(
        out / "model",
        size="small" if size == "small" else "tiny",
        seed=seed,
        phases=sft_phases(sft_steps, focus_steps, calculator_max_operand(base) or 99),
        eval_episodes=sft_eval_episodes,
    )
    results = []
    for arm in arms:
        cfg = arm_config(
            config, arm, out=out, model_dir=model_dir, steps=steps, seed=seed, overrides=overrides
        )
        t0 = time.perf_counter()
        log.info("experiment_arm_started", arm=arm.name, max_lag=arm.max_lag)
        summary = anyio.run(run, cfg)
        if summary.interrupted:
            raise KeyboardInterrupt
        result = ArmResult(
            arm=arm.name,
            label=arm.label,
            rewards=list(summary.rewards),
            lag_histogram=lag_histogram(cfg.run_dir / "trajectories"),
            dropped_groups=summary.dropped_groups,
            seconds=time.perf_counter() - t0,
        )
        log.info(
            "experiment_arm_done",
            arm=arm.name,
            seconds=round(result.seconds, 1),
            lag_histogram=result.lag_histogram,
            reward_first=result.rewards[:1],
            reward_last=result.rewards[-1:],
        )
        results.append(result)
    line = verdict(results)
    write_csv(results, out / "rewards.csv")
    write_png(results, out / "rewards.png", line.replace(". ", ".\n").replace("; ", "\n"))
    (out / "summary.json").write_text(
        json.dumps(
            {"verdict": line, "steps": steps, "seed": seed, "arms": [asdict(r) for r in results]},
            indent=1,
        )
        + "\n"
    )
    (out / "verdict.txt").write_text(line + "\n")
    return results, line


def main(argv: list[str]) -> int:
    """``orchestrate experiment lag --config X.toml [--steps N] [--out DIR] [--section.key V …]``"""
    parser = argparse.ArgumentParser(
        prog="orchestrate experiment",
        description="Compare on-policy, corrected lag-4 and uncorrected lag-4 RL on one model.",
        epilog="Any config field can be overridden with --section.key VALUE (all arms).",
    )
    parser.add_argument("name", choices=["lag"])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: trainer.max_steps")
    parser.add_argument("--out", type=Path, default=Path("runs/experiment-lag"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--sft-steps", type=int, default=1800, help="SFT on operands 2..99")
    parser.add_argument(
        "--sft-focus-steps", type=int, default=100, help="then SFT on the run's max_operand"
    )
    parser.add_argument("--sft-eval", type=int, default=32, help="episodes scored before/after SFT")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    results, line = run_lag_experiment(
        args.config,
        args.out,
        steps=args.steps,
        seed=args.seed,
        size=args.size,
        sft_steps=args.sft_steps,
        focus_steps=args.sft_focus_steps,
        sft_eval_episodes=args.sft_eval,
        overrides=overrides,
    )
    import sys

    for r in results:
        sys.stdout.write(
            f"{r.label:<26} {r.seconds:7.1f}s  lag {r.lag_histogram}  dropped {r.dropped_groups}  "
            "reward " + " ".join(f"{x:.3f}" for x in r.rewards) + "\n"
        )
    sys.stdout.write(f"{line}\nwrote {args.out / 'rewards.csv'}, {args.out / 'rewards.png'}\n")
    return 0
