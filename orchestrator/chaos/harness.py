"""Runs the real loop as subprocesses, injects one fault, and checks the invariants afterwards.

One trial (:func:`trial`): start ``orchestrate --config X`` (and ``orchestrate train`` when the
fault needs an external trainer) with the chaos overrides, wait until the trainer has published
the fault's trigger version, inject the fault (:mod:`orchestrator.chaos.faults`), wait for the run
to finish (a restart is part of some faults), then check :mod:`orchestrator.chaos.invariants`.
While the run goes on, the harness samples the process tree of every process it started, so
that a process left behind after the run is found even when its parent was SIGKILLed.

Recovery time: seconds from the injection to the next version the trainer published (the run
trained again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from orchestrator.chaos.ctx import ChaosError, Ctx, Tracked, poll
from orchestrator.chaos.faults import Fault, Seen
from orchestrator.chaos.invariants import Verdict, check
from orchestrator.config import load_config

if TYPE_CHECKING:
    pass

log = structlog.get_logger(__name__)

CHAOS_DEFAULTS: dict[str, Any] = {
    "trainer.max_steps": 4,
    "trainer.entropy_coef": 0.01,  # every step moves the weights, so every patch is a real one
    "timeouts.call_s": 5.0,
    "timeouts.version_wait_s": 60.0,
    "timeouts.episode_s": 120.0,
    "timeouts.trainer_step_s": 300.0,
    "fleet.breaker_cooldown_s": 2.0,
    "admin.enabled": True,
    "admin.port": 0,
    "log.format": "json",
    "run.overwrite": True,
}
"""Chaos runs are short and detect failures fast; ``--section.key`` overrides still win."""


@dataclass
class Outcome:
    fault: str
    run_dir: Path
    verdict: Verdict
    recovery_s: float | None
    seconds: float
    notes: list[str]

    def row(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "fault": self.fault,
            "ok": v.ok,
            "episodes": v.episodes,
            "lost": v.lost,
            "duplicated": v.duplicated,
            "failed_or_dropped": v.failed_or_dropped,
            "wrong_version": v.wrong_version,
            "unverified": v.unverified,
            "final_version": v.final_version,
            "leftover": len(v.leftover),
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 1),
            "seconds": round(self.seconds, 1),
            "problems": v.problems,
            "notes": self.notes,
            "run_dir": str(self.run_dir),
        }


async def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the run records what it has and stops its engines), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(30):
            await poll(lambda: proc.poll() is not None)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@asynccontextmanager
async def _stopped_at_exit(ctx: Ctx) -> AsyncIterator[None]:
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            for fn in reversed(ctx.cleanups):
                await fn()
            for proc in (ctx.orchestrator, ctx.trainer):
                if proc is not None:
                    await _terminate(proc)
            # engines exit when their parent's pipe closes; give them a moment before judging
            with anyio.move_on_after(15):
                await poll(lambda: not ctx.tracked.alive(), 0.5)


async def _drive(ctx: Ctx, fault: Fault, timeout_s: float) -> float:
    """Start the run, inject ``fault`` at its version, wait for the end; the recovery time."""
    ctx.start_orchestrator()
    if fault.external_trainer:
        with anyio.move_on_after(120):
            await poll((ctx.cfg.run_dir / "config.json").exists)
        if not (ctx.cfg.run_dir / "config.json").exists():
            raise ChaosError("the orchestrator did not create its run directory within 120 s")
        ctx.start_trainer()
    before = await ctx.wait_version(fault.at_version, timeout_s)
    t_fault = time.time()
    log.info("chaos.inject", fault=fault.name, version=before)
    await fault.inject(ctx)
    after = await ctx.wait_version(before + 1, timeout_s)
    recovery = time.time() - t_fault
    log.info("chaos.recovered", fault=fault.name, version=after, seconds=round(recovery, 2))
    assert ctx.orchestrator is not None
    await ctx.wait_exit(ctx.orchestrator, timeout_s)
    if ctx.trainer is not None:
        await ctx.wait_exit(ctx.trainer, 120)
    return recovery


async def trial(
    fault: Fault,
    config_path: Path | None,
    overrides: dict[str, Any],
    out_dir: Path,
    index: int = 0,
    *,
    timeout_s: float = 600.0,
) -> Outcome:
    """Run the loop once with ``fault`` injected; check the invariants."""
    from policies.board import Board

    t0 = time.time()
    name = f"{fault.name}-{index}"
    ov = {**CHAOS_DEFAULTS, **overrides, "run.name": name, "run.root": str(out_dir)}
    ov.update(fault.overrides)
    if fault.external_trainer:
        board_dir = out_dir / f"{name}.board"  # outside the run dir, which the run recreates
        if board_dir.exists():
            import shutil

            shutil.rmtree(board_dir)
        ov.update({"trainer.mode": "external", "board.url": str(board_dir)})
    cfg = load_config(config_path, ov)
    env = {**os.environ, **fault.env}
    ctx = Ctx(
        cfg=cfg,
        config_path=config_path,
        overrides=ov,
        env=env,
        board=Board(cfg.board_url, cfg.run.name),
        tracked=Tracked(),
        log_dir=out_dir / f"{name}.logs",
    )
    recovery: float | None = None
    failure: str | None = None
    try:
        async with _stopped_at_exit(ctx), anyio.create_task_group() as tg:
            ctx.background = tg
            recovery = await _drive(ctx, fault, timeout_s)
    except* ChaosError as group:  # the run broke down: a result too, checked like any other
        failure = "; ".join(str(e) for e in group.exceptions)
    verdict = check(
        cfg.run_dir,
        ctx.board,
        group_size=cfg.scheduler.group_size,
        max_steps=cfg.trainer.max_steps,
        aliases=ctx.aliases,
        leftover=ctx.tracked.alive(),
    )
    if failure is not None:
        verdict.problems.append(f"the trial broke down: {failure}")
    if ctx.orchestrator is not None and ctx.orchestrator.returncode != 0:
        verdict.problems.append(f"the orchestrator exited with {ctx.orchestrator.returncode}")
    evidence = fault.evidence(Seen(cfg.run_dir, ctx.log_dir))
    if evidence is None:
        verdict.problems.append(f"the fault {fault.name} left no trace: the trial proves nothing")
    else:
        ctx.notes.append(evidence)
    return Outcome(fault.name, cfg.run_dir, verdict, recovery, time.time() - t0, ctx.notes)
