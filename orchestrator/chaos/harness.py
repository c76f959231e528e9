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

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import psutil
import structlog
from anyio.abc import TaskGroup

from orchestrator.chaos.invariants import Verdict, check
from orchestrator.config import Config, load_config
from orchestrator.errors import SprawlError
from policies.errors import PolicyError

if TYPE_CHECKING:
    from orchestrator.chaos.faults import Fault
    from policies.board import Board

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


async def poll(done: Callable[[], bool], interval_s: float = 0.2) -> None:
    """Wait until ``done()``; what it reads is changed by other processes, so it is polled."""
    while True:
        if done():
            return
        await anyio.sleep(interval_s)


class ChaosError(SprawlError):
    """A trial could not be carried out (not an invariant violation: those are data)."""


def _toml(value: Any) -> str:
    """``value`` as a TOML value on the command line (strings, lists and tables as JSON)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


@dataclass
class Tracked:
    """Processes seen in a run's trees: pid → (create time, command line)."""

    seen: dict[int, tuple[float, str]] = field(default_factory=dict)

    def sample(self, roots: list[int]) -> None:
        for pid in roots:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    self.seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:160]))
                except psutil.Error:
                    continue

    def alive(self) -> list[str]:
        out = []
        for pid, (created, cmd) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"pid {pid}: {cmd}")
            except psutil.Error:
                continue
        return out


@dataclass
class Ctx:
    """What a fault's injection can reach: the run's processes, config, board and admin API."""

    cfg: Config
    config_path: Path | None
    overrides: dict[str, Any]
    env: dict[str, str]
    board: Board
    tracked: Tracked
    log_dir: Path
    orchestrator: subprocess.Popen[bytes] | None = None
    trainer: subprocess.Popen[bytes] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    background: TaskGroup | None = None
    """Where a fault that lasts a while runs (the trial waits for it before checking)."""

    # -- processes ------------------------------------------------------------------------------
    def _spawn(
        self, argv: list[str], log_name: str, extra: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        args = [f"--{k}={_toml(v)}" for k, v in {**self.overrides, **extra}.items()]
        if self.config_path is not None:
            args = ["--config", str(self.config_path), *args]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = (self.log_dir / log_name).open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", *argv, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        out.close()
        self.tracked.sample([proc.pid])
        return proc

    def start_orchestrator(self, **extra: Any) -> None:
        self.orchestrator = self._spawn([], "orchestrator.log", extra)

    def start_trainer(self) -> None:
        self.trainer = self._spawn(["train"], "trainer.log", {})

    def roots(self) -> list[int]:
        return [p.pid for p in (self.orchestrator, self.trainer) if p is not None]

    def engine(self, name: str) -> psutil.Process:
        """The live engine process ``name`` (``engine-0``…), found by the log it writes."""
        assert self.orchestrator is not None
        for p in psutil.Process(self.orchestrator.pid).children(recursive=True):
            try:
                if any(f.path.endswith(f"/{name}.log") for f in p.open_files()):
                    return p
            except psutil.Error:
                continue
        raise ChaosError(f"no live process serves as {name}")

    # -- waiting --------------------------------------------------------------------------------
    async def latest(self) -> int | None:
        """The newest version on the board (None while there is none, or the pointer dangles)."""

        def durable() -> int | None:
            latest = self.board.latest()
            if latest is not None:
                self.board.manifest(latest)  # raises if the pointer names a missing version
            return latest

        try:
            return await anyio.to_thread.run_sync(durable)
        except PolicyError:
            return None

    async def wait_version(self, version: int, timeout_s: float) -> int:
        """Wait until the board's pointer is at ``version`` or later; return it."""
        with anyio.move_on_after(timeout_s):
            while True:
                latest = await self.latest()
                if latest is not None and latest >= version:
                    return latest
                if self.orchestrator is not None and self.orchestrator.poll() is not None:
                    raise ChaosError(
                        f"the orchestrator exited ({self.orchestrator.returncode}) before "
                        f"version {version}; see {self.log_dir}/orchestrator.log"
                    )
                self.tracked.sample(self.roots())
                await anyio.sleep(0.2)
        raise ChaosError(f"version {version} not published within {timeout_s}s")

    async def wait_exit(self, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        with anyio.move_on_after(timeout_s):
            while proc.poll() is None:
                self.tracked.sample(self.roots())
                await anyio.sleep(0.2)
            return proc.returncode
        proc.kill()
        raise ChaosError(f"pid {proc.pid} still running after {timeout_s}s: killed")

    # -- admin API ------------------------------------------------------------------------------
    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        where = self.cfg.run_dir / "admin.json"  # written once the engines serve
        with anyio.move_on_after(120):
            await poll(where.exists)
        if not where.exists():
            raise ChaosError(f"the admin API did not come up within 120 s ({where})")
        url = json.loads(where.read_text())["url"]
        headers = (
            {"Authorization": f"Bearer {self.cfg.admin.token}"} if self.cfg.admin.token else {}
        )
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.request(method, f"{url}{path}", json=body, headers=headers) as r,
            ):
                if r.status >= 400:
                    raise ChaosError(
                        f"admin API {method} {path}: HTTP {r.status}: {await r.text()}"
                    )
                return await r.json()
        except aiohttp.ClientError as exc:  # the run has ended (or died): its API is gone
            raise ChaosError(f"admin API {method} {path}: {exc}") from None


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
    from orchestrator.chaos.faults import Seen

    evidence = fault.evidence(Seen(cfg.run_dir, ctx.log_dir))
    if evidence is None:
        verdict.problems.append(f"the fault {fault.name} left no trace: the trial proves nothing")
    else:
        ctx.notes.append(evidence)
    return Outcome(fault.name, cfg.run_dir, verdict, recovery, time.time() - t0, ctx.notes)
