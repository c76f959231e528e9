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

- ``model/`` — the warm-started model (:func:`orchestrator.warm_start.sft_phases`: SFT on operands
  2..99, then on the run's ``environment.args.max_operand``), built once and reused while
  ``model/sft.json`` records the same phases;
- ``runs/s<seed>/<arm>/`` — each run's directory (trajectory log, board, checkpoints);
- ``rewards.csv`` — ``step,<arm>/s<seed>…`` mean episode reward per trainer step;
- ``rewards.png`` — each arm's curve, averaged over seeds (raw and a moving average);
- ``summary.json`` — per run: rewards, measured lag histogram (per model call, trainer version at
  consumption minus the version that started the call), dropped groups, wall time; per arm the
  across-seed statistics; the checks; the verdict (also in ``verdict.txt``).

**The verdict** (:func:`~orchestrator.offline.experiment_verdict.verdict`): each arm's
second-half reward across seeds against on-policy's, and two checks, as
:mod:`~orchestrator.offline.experiment_verdict` states them. The arms and their configs are
:mod:`~orchestrator.offline.experiment_arms`.

``configs/experiment-lag.toml`` is the setting measured in docs/benchmarks.md.

Not covered: a different starting model per seed, a GPU fleet.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
import structlog

from orchestrator.config import Config, load_config, parse_overrides
from orchestrator.errors import ConfigError
from orchestrator.models import calculator_max_operand
from orchestrator.offline.experiment_arms import (
    ARMS,
    REFERENCE,
    Arm,
    ArmResult,
    arm_config,
    lag_histogram,
    pick_arms,
)
from orchestrator.offline.experiment_verdict import arm_stats, checks, verdict

log = structlog.get_logger(__name__)


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
    from orchestrator.warm_start import sft_phases, warm_model

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
            results.append(_run_arm(cfg, arm, run_seed))
    text = verdict(results)
    _write_outputs(
        results, text, out, steps=steps, seeds=range(seed, seed + seeds), started=started
    )
    return results, text


def _run_arm(cfg: Config, arm: Arm, seed: int) -> ArmResult:
    """One run of ``arm`` through the real loop (``seed``: its run seed); a run stopped by a
    signal stops the experiment (``KeyboardInterrupt``)."""
    from orchestrator.run import run

    t0 = time.perf_counter()
    log.info("experiment_arm_started", arm=arm.name, seed=seed, max_lag=arm.max_lag)
    summary = anyio.run(run, cfg)
    if summary.interrupted:
        raise KeyboardInterrupt
    result = ArmResult(
        arm=arm.name,
        label=arm.label,
        rewards=list(summary.rewards),
        seed=seed,
        lag_histogram=lag_histogram(cfg.run_dir / "trajectories"),
        dropped_groups=summary.dropped_groups,
        seconds=time.perf_counter() - t0,
    )
    log.info(
        "experiment_arm_done",
        arm=arm.name,
        seed=seed,
        seconds=round(result.seconds, 1),
        lag_histogram=result.lag_histogram,
    )
    return result


def _write_outputs(
    results: Sequence[ArmResult],
    text: str,
    out: Path,
    *,
    steps: int,
    seeds: range,
    started: float,
) -> None:
    """``rewards.csv``, ``rewards.png``, ``summary.json`` and ``verdict.txt`` in ``out``
    (``started``: when the experiment started, for its wall time)."""
    write_csv(results, out / "rewards.csv")
    write_png(results, out / "rewards.png", text)
    report = {
        "verdict": text,
        "steps": steps,
        "seeds": list(seeds),
        "seconds": time.perf_counter() - started,
        "arms": [asdict(r) for r in results],
        "stats": [asdict(s) for s in arm_stats(results)],
        "checks": checks(results),
    }
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "verdict.txt").write_text(text + "\n")


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
