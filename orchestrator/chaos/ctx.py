"""One trial's processes: the orchestrator, the external trainer and the engines it starts.

:class:`Ctx` starts them with the chaos overrides, tracks every process tree it started (so a
process left behind is found even when its parent was SIGKILLed), and gives the faults their
handles: kill, stop, restart, wait for a version. :func:`poll` waits on a condition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import psutil
import structlog
from anyio.abc import TaskGroup

from orchestrator.config import Config
from orchestrator.errors import SprawlError
from policies.errors import PolicyError

if TYPE_CHECKING:
    from policies.board import Board

log = structlog.get_logger(__name__)

ADMIN_RETRY_S = 10.0
"""How long a failed connect to a running orchestrator's admin API is tried again."""


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
        written = json.loads(where.read_text())
        url = written["url"]
        headers = {"Authorization": f"Bearer {written['token']}"}
        deadline = anyio.current_time() + ADMIN_RETRY_S
        while True:
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
            except aiohttp.ClientConnectorError as exc:
                # a connect that failed while the orchestrator still runs is tried again, for
                # ADMIN_RETRY_S and in the trial's notes (one CI run saw a single refusal)
                alive = self.orchestrator is not None and self.orchestrator.poll() is None
                if not alive or anyio.current_time() >= deadline:
                    raise ChaosError(f"admin API {method} {path}: {exc}") from None
                self.notes.append(f"admin API {method} {path}: {exc}; tried again")
                await anyio.sleep(0.2)
            except aiohttp.ClientError as exc:  # the run has ended (or died): its API is gone
                raise ChaosError(f"admin API {method} {path}: {exc}") from None
