"""``orchestrate experiment lag``: do lag corrections make stale rollouts as good as fresh ones?

Runs the real loop (:func:`orchestrator.run.run`: engines, scheduler, batcher, trainer, board)
from one SFT-warm-started model, over several seeds and lag budgets, with the same tasks and
sizes. ``--lags 0,1,2,4,8`` are ``scheduler.max_lag`` budgets; ``--arms a,b`` are corrections
(:data:`~orchestrator.offline.experiment_arms.ARMS`: ``uncorrected``, ``naive_ppo``, ``tis``,
``decoupled_ppo``, ``token_mask``, ``m2po``, ``cispo``, ``gspo``). Every arm runs at every lag
above 0; lag 0 is on-policy (synchronous, no correction), run once per seed and shared by all
arms: what they are judged against. ``--seeds N`` runs every run with run seeds ``--seed …
--seed + N − 1``. The model is built once (from ``--seed``) and shared by every seed, so seeds
differ in what the run samples (task order, engine sampling, the trainer's shuffles), not in the
starting point.

Everything else comes from ``--config`` plus any ``--section.key VALUE`` overrides
(``--trainer.minibatches 4``, ``--staleness.overlong mask``, …; the config system's own
parsing), passed to every run; ``staleness.drop`` is cleared in every run so the correction is
the only difference, and ``scheduler.max_concurrent_episodes`` is raised to what the lag budget
can admit, so that rollout really runs ahead of the trainer. Outputs in ``--out``:

- ``model/`` — the warm-started model (:func:`orchestrator.warm_start.sft_phases`: SFT on operands
  2..99, then on the run's ``environment.args.max_operand``), built once and reused while
  ``model/sft.json`` records the same phases;
- ``runs/s<seed>/<run>/`` — each run's directory (``on_policy`` or ``lag<L>_<arm>``), with
  ``experiment-run.json`` once the run finished: its result and the fingerprint of what made it
  (the resolved config and the model's ``sft.json``). The same command run again reuses every
  finished run whose fingerprint matches and runs the rest, so an interrupted sweep resumes
  where it stopped; a run whose config or model changed is run again. Each run's last version
  is then scored on ``--score-episodes N`` (default 512, 0: none) fresh episodes
  (:mod:`orchestrator.run.score`; the same tasks and seeds for every run), kept in the same file:
  a finished run scored on another number of episodes is scored again, not run again;
- ``rewards.csv`` — ``step,<run>/s<seed>…`` mean episode reward per trainer step;
- ``rewards.png`` — each run's curve, averaged over seeds (raw and a moving average);
- ``table.md`` — second-half reward per arm and lag, mean ± 95% t-interval over seeds, then the
  final-policy reward likewise;
- ``report.html`` — the table, the verdict, reward against lag per arm and reward per step
  (:mod:`~orchestrator.offline.experiment_report`);
- ``summary.json`` — per run: rewards, measured lag histogram (per model call, trainer version at
  consumption minus the version that started the call), dropped groups, wall time; per run the
  across-seed statistics; the table; the targets (``checks``, and ``checks_final`` on the
  final-policy reward); the verdict (also in ``verdict.txt``).

**The verdict** (:func:`~orchestrator.offline.experiment_verdict.verdict`): each run's
second-half reward across seeds against on-policy's, and the issue's two targets, then the same
on the final-policy reward, as
:mod:`~orchestrator.offline.experiment_verdict` states them. The arms, lags and run configs are
:mod:`~orchestrator.offline.experiment_arms`.

``configs/experiment-lag.toml`` is the lag-4 setting measured in docs/benchmarks.md,
``configs/experiment-sweep.toml`` the sweep's.

Not covered: a different starting model per seed, a GPU fleet.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import anyio
import structlog
from pydantic import BaseModel

from orchestrator.config import Config, load_config, parse_overrides
from orchestrator.errors import ConfigError, TrajlogError
from orchestrator.models import calculator_max_operand
from orchestrator.offline.experiment_arms import (
    ARMS,
    DEFAULT_ARMS,
    DEFAULT_LAGS,
    Arm,
    ArmResult,
    Run,
    arm_config,
    check_overrides,
    drift,
    lag_histogram,
    parse_lags,
    pick_arms,
    plan,
)
from orchestrator.offline.experiment_report import write_csv, write_html, write_png
from orchestrator.offline.experiment_verdict import (
    FINAL,
    FINAL_TITLE,
    arm_stats,
    checks,
    markdown_table,
    scored,
    verdict,
)
from orchestrator.record.frames import read_regular, write_private

log = structlog.get_logger(__name__)

RESULT = "experiment-run.json"
"""A finished run's result and fingerprint, in its run directory."""


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
    lags: Sequence[int] = (0, 4),
    score_episodes: int = 512,
    command: str = "",
) -> tuple[list[ArmResult], str]:
    """Run on-policy and every arm at every lag above 0, for every seed; write the outputs of the
    module docstring into ``out``; return the results and the verdict. ``steps`` defaults to the
    config's ``trainer.max_steps``; ``command`` is the invocation, shown in ``report.html``."""
    from orchestrator.warm_start import sft_phases, warm_model

    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    if score_episodes < 0:
        raise ConfigError(f"--score-episodes must be at least 0, got {score_episodes}")
    check_overrides(overrides)
    runs = plan(tuple(arms), tuple(lags))
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config, overrides)
    steps = base.trainer.max_steps if steps is None else steps
    started = time.perf_counter()
    model_dir = out / "model"
    # every run's config resolved before the first runs: a bad one is refused now, not an hour in
    resolve = functools.partial(
        arm_config, config, out=out, model_dir=model_dir, steps=steps, overrides=overrides
    )
    jobs = [(s, run, resolve(run, seed=s)) for s in range(seed, seed + seeds) for run in runs]
    warm_model(
        model_dir,
        size="small" if size == "small" else "tiny",
        seed=seed,
        phases=sft_phases(sft_steps, focus_steps, calculator_max_operand(base) or 99),
        eval_episodes=sft_eval_episodes,
    )
    results = []
    for run_seed, run, cfg in jobs:
        key = _fingerprint(cfg, model_dir)
        result = _finished(cfg, run, key) or _run_arm(cfg, run, run_seed, key)
        results.append(_scored(cfg, result, score_episodes, key))
    text = verdict(results)
    info = {
        "steps": steps,
        "seeds": list(range(seed, seed + seeds)),
        "lags": sorted(set(lags)),
        "score_episodes": score_episodes,
    }
    _write_outputs(results, text, out, info=info, started=started, command=command)
    return results, text


def _fingerprint(cfg: Config, model_dir: Path) -> str:
    """What a run's result depends on besides the code: its resolved config and its model. Only
    values that differ from their defaults are hashed (a default is code), so an option a newer
    sprawl adds, at its default, keeps the runs that finished before it."""
    config = cfg.model_dump(mode="json", exclude_defaults=True)
    _put_back_kinds(cfg, config)
    made = {"config": config, "sft": (model_dir / "sft.json").read_text()}
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()


def _put_back_kinds(model: Any, dumped: Any) -> None:
    """Put back into ``dumped`` (``model``'s dump without defaults) the kind of every model in it:
    a field that admits one literal (a correction's ``type``, an island's ``kind``) is always at
    its default, so the dump drops it and two kinds at their defaults would hash alike."""
    if isinstance(model, BaseModel) and isinstance(dumped, dict):
        for name, field in type(model).model_fields.items():
            tag = get_args(field.annotation)
            if get_origin(field.annotation) is Literal and len(tag) == 1:
                dumped[name] = tag[0]
            elif name in dumped:
                _put_back_kinds(getattr(model, name), dumped[name])
    elif isinstance(model, list | tuple) and isinstance(dumped, list):
        for item, item_dumped in zip(model, dumped, strict=False):
            _put_back_kinds(item, item_dumped)
    elif isinstance(model, dict) and isinstance(dumped, dict):
        for key in dumped.keys() & model.keys():
            _put_back_kinds(model[key], dumped[key])


def _finished(cfg: Config, run: Run, key: str) -> ArmResult | None:
    """The result of this run from an earlier invocation, if it finished with the same
    fingerprint; None when it must run (never ran, unfinished, changed, or unreadable)."""
    path = cfg.run_dir / RESULT
    try:
        saved = json.loads(read_regular(path))
        if saved["fingerprint"] != key:
            return None
        result = ArmResult(**saved["result"])
        result.lag_histogram = {int(k): int(v) for k, v in result.lag_histogram.items()}
    except (TrajlogError, ValueError, TypeError, KeyError) as exc:
        if path.exists():
            log.warning("experiment_run_not_reused", run=run.name, path=str(path), error=str(exc))
        return None
    if not result.drift:  # saved before runs measured it: from the run's log, if it is there
        with contextlib.suppress(TrajlogError, OSError):
            result.drift = drift(cfg.run_dir / "trajectories")
    log.info("experiment_run_reused", run=run.name, seed=result.seed, path=str(path))
    return result


def _run_arm(cfg: Config, run: Run, seed: int, key: str) -> ArmResult:
    """One run through the real loop (``seed``: its run seed), its result saved beside it under
    ``key`` (:func:`_fingerprint`); a run stopped by a signal stops the experiment
    (``KeyboardInterrupt``)."""
    from orchestrator.run import run as run_loop

    t0 = time.perf_counter()
    log.info("experiment_arm_started", run=run.name, seed=seed, max_lag=run.lag)
    summary = anyio.run(run_loop, cfg)
    if summary.interrupted:
        raise KeyboardInterrupt
    result = ArmResult(
        arm=run.name,
        label=run.label,
        rewards=list(summary.rewards),
        seed=seed,
        lag_histogram=lag_histogram(cfg.run_dir / "trajectories"),
        drift=drift(cfg.run_dir / "trajectories"),
        dropped_groups=summary.dropped_groups,
        seconds=time.perf_counter() - t0,
        correction=run.arm.name,
        lag=run.lag,
    )
    _save(cfg, result, key)
    log.info(
        "experiment_arm_done",
        run=run.name,
        seed=seed,
        seconds=round(result.seconds, 1),
        lag_histogram=result.lag_histogram,
    )
    return result


def _save(cfg: Config, result: ArmResult, key: str) -> None:
    saved = json.dumps({"fingerprint": key, "result": asdict(result)}, indent=1)
    write_private(cfg.run_dir / RESULT, saved + "\n")


def _scored(cfg: Config, result: ArmResult, episodes: int, key: str) -> ArmResult:
    """``result`` with its last version scored on ``episodes`` fresh episodes
    (:func:`~orchestrator.run.score.score_policy`), saved beside it; as it is when ``episodes``
    is 0 or it was scored on as many before. A reused run whose board is gone keeps no score."""
    from orchestrator.run.score import score_policy

    if episodes == 0 or len(result.final_rewards) == episodes:
        return result
    try:
        score = anyio.run(score_policy, cfg, episodes)
    except ConfigError as exc:  # the board has no version: a run dir pruned after it finished
        log.warning("experiment_run_not_scored", run=result.arm, seed=result.seed, error=str(exc))
        return result
    result.final_rewards, result.final_failed = score.rewards, score.failed
    _save(cfg, result, key)
    log.info("experiment_run_scored", run=result.arm, seed=result.seed, reward=score.mean)
    return result


def _write_outputs(
    results: Sequence[ArmResult],
    text: str,
    out: Path,
    *,
    info: dict[str, Any],
    started: float,
    command: str,
) -> None:
    """``rewards.csv``, ``rewards.png``, ``table.md``, ``report.html``, ``summary.json`` and
    ``verdict.txt`` in ``out`` (``info``: steps, seeds and lags; ``started``: when the
    experiment started, for its wall time)."""
    write_csv(results, out / "rewards.csv")
    write_png(results, out / "rewards.png", text)
    table = markdown_table(results)
    final = markdown_table(results, FINAL) if scored(results) else ""
    tables = table + (f"\n\n{FINAL_TITLE}:\n\n{final}" if final else "")
    (out / "table.md").write_text(tables + "\n")
    write_html(results, text, command, out / "report.html")
    report = {
        "verdict": text,
        "command": command,
        **info,
        "seconds": time.perf_counter() - started,
        "arms": [asdict(r) for r in results],
        "stats": [asdict(s) for s in arm_stats(results)],
        "table": table,
        "checks": checks(results),
        "checks_final": checks(results, FINAL) if final else {},
    }
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "verdict.txt").write_text(text + "\n")


def main(argv: list[str]) -> int:
    """``orchestrate experiment lag --config X.toml [--lags 0,4] [--arms a,b] [--seeds N] …``"""
    parser = argparse.ArgumentParser(
        prog="orchestrate experiment",
        description="Second-half reward of on-policy RL against lagged RL, uncorrected and under "
        "each correction, per lag budget.",
        epilog="Any config field can be overridden with --section.key VALUE (every run).",
    )
    parser.add_argument("name", choices=["lag"])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: trainer.max_steps")
    parser.add_argument("--out", type=Path, default=Path("runs/experiment-lag"))
    parser.add_argument("--seed", type=int, default=0, help="the first run seed and the model's")
    parser.add_argument("--seeds", type=int, default=1, help="run seeds --seed … --seed+N-1")
    parser.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"corrections, comma-separated, of {','.join(a.name for a in ARMS)} "
        f"(default: {DEFAULT_ARMS})",
    )
    parser.add_argument(
        "--lags",
        default=DEFAULT_LAGS,
        help=f"scheduler.max_lag budgets, comma-separated; 0 (on-policy) always runs "
        f"(default: {DEFAULT_LAGS})",
    )
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--sft-steps", type=int, default=1800, help="SFT on operands 2..99")
    parser.add_argument(
        "--sft-focus-steps", type=int, default=100, help="then SFT on the run's max_operand"
    )
    parser.add_argument("--sft-eval", type=int, default=32, help="episodes scored before/after SFT")
    parser.add_argument(
        "--score-episodes",
        type=int,
        default=512,
        help="fresh episodes of each run's last version to score it on (0: none)",
    )
    args, rest = parser.parse_known_args(argv)
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
        overrides=parse_overrides(rest),
        arms=pick_arms(args.arms),
        lags=parse_lags(args.lags),
        score_episodes=args.score_episodes,
        command=shlex.join(["orchestrate", "experiment", *argv]),
    )
    for r in results:
        sys.stdout.write(
            f"s{r.seed} {r.label:<40} {r.seconds:7.1f}s  lag {r.lag_histogram}  "
            f"dropped {r.dropped_groups}\n"
        )
    sys.stdout.write(f"{(args.out / 'table.md').read_text()}\n{text}\n")
    sys.stdout.write(f"wrote {args.out / 'table.md'}, {args.out / 'report.html'}\n")
    return 0
