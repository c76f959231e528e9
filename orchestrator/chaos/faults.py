"""The faults ``orchestrate chaos`` injects, each into a real run of the loop.

Every fault names the trainer version after which it strikes (``at_version``), the config it
needs (``overrides``), environment variables for the processes (``env``: failpoints, see
:mod:`policies.board.failpoints`), and what the harness does at that moment (``inject``).
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import psutil

from orchestrator.chaos.ctx import ChaosError, Ctx, poll
from orchestrator.chaos.link import FaultyLink, LinkMode
from orchestrator.record.events import read_events
from orchestrator.record.frames import iter_records
from policies.board.types import MAX_POINTER_BYTES

Inject = Callable[[Ctx], Awaitable[None]]
Evidence = Callable[["Seen"], str | None]


async def _nothing(_ctx: Ctx) -> None:
    return None


@dataclass
class Seen:
    """What a finished trial left behind, for a fault to show that it really struck."""

    run_dir: Path
    log_dir: Path

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run_dir) if e.get("kind") == kind]

    def lines(self, pattern: str, *globs: str) -> list[str]:
        """Log lines (engine logs, the harness's process logs) that contain ``pattern``."""
        paths = [p for g in globs for d in (self.run_dir / "logs", self.log_dir) for p in d.glob(g)]
        return [
            line
            for p in paths
            for line in p.read_text(errors="replace").splitlines()
            if pattern in line
        ]

    def errors(self, needle: str) -> int:
        return sum(
            needle in str((r["episode"].get("error") or {}).get("message", ""))
            for r in iter_records(self.run_dir / "trajectories", "episodes")
        )


def _failed_calls(endpoint: str) -> Evidence:
    """Calls to ``endpoint`` failed, or it was marked unhealthy, or (its calls done a moment
    before the fault struck) the supervisor saw its island die."""

    def seen(s: Seen) -> str | None:
        n = sum(e["endpoint"] == endpoint for e in s.events("call_failed"))
        down = sum(e["id"] == endpoint and not e["healthy"] for e in s.events("endpoint"))
        died = sum(e["endpoint"] == endpoint for e in s.events("island_died"))
        if not (n or down or died):
            return None
        return f"{n} failed calls, {down}× marked unhealthy" + (f", died {died}×" if died else "")

    return seen


def _slow_calls(s: Seen) -> str | None:
    slow = [e for e in s.events("served") if e["endpoint"] == "chaos-link"]
    return f"{len(slow)} calls through the slow link" if slow else None


def _patch_refused(s: Seen) -> str | None:
    fired = s.lines("failpoint.fired", "orchestrator.log")
    caught = s.lines("patch_failed_reloading_anchor", "engine-*.log") + s.lines(
        "version_refused", "engine-*.log"
    )
    if not fired or not caught:
        return None
    return f"damaged on write, caught {len(caught)}× by the islands"


def _pointer_skipped(s: Seen) -> str | None:
    """Replicas read the dangling pointer and kept serving (each publish also repaired it)."""
    seen = len(s.lines("version_unavailable", "engine-*.log"))
    repaired = len(s.lines("board.pointer_dangling", "orchestrator.log", "trainer.log"))
    if not seen:
        return None
    return f"{seen}× not found by the islands, {repaired}× repaired by the publisher"


def _logged(pattern: str, glob: str) -> Evidence:
    def seen(s: Seen) -> str | None:
        return f"{pattern} logged" if s.lines(pattern, glob) else None

    return seen


def _resumed(s: Seen) -> str | None:
    resumed = s.events("resumed")
    return f"resumed at v{resumed[0].get('trainer_version')}" if resumed else None


def _episode_errors(needle: str) -> Evidence:
    def seen(s: Seen) -> str | None:
        n = s.errors(needle)
        return f"{n} episodes recorded the error" if n else None

    return seen


def _always(_s: Seen) -> str | None:
    return "no fault injected"


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    inject: Inject = _nothing
    evidence: Evidence = _always
    """What the logs show when the fault really struck (None: it did not, the trial is void)."""
    at_version: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    external_trainer: bool = False


# -- islands and endpoints -------------------------------------------------------------------------
async def _busy(ctx: Ctx, endpoint: str, timeout_s: float = 30.0) -> int:
    """Wait (≤ ``timeout_s``) until ``endpoint`` has calls in flight; how many it has."""
    with anyio.move_on_after(timeout_s):
        while True:
            fleet = (await ctx.admin("GET", "/v1/fleet"))["endpoints"]
            n = next((e["outstanding"] for e in fleet if e["id"] == endpoint), 0)
            if n:
                return int(n)
            await anyio.sleep(0.02)
    return 0


async def _kill_island(ctx: Ctx) -> None:
    busy = await _busy(ctx, "engine-0")
    ctx.engine("engine-0").send_signal(signal.SIGKILL)
    ctx.notes.append(f"killed with {busy} calls in flight")


async def _hang_island(ctx: Ctx) -> None:
    busy = await _busy(ctx, "engine-0")
    proc = ctx.engine("engine-0")
    proc.send_signal(signal.SIGSTOP)  # alive, holds its connections, answers nothing
    ctx.notes.append(f"stopped with {busy} calls in flight")

    async def resume() -> None:  # only so that the run's own shutdown can stop it promptly
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGCONT)

    ctx.cleanups.append(resume)


def _link(mode: LinkMode) -> Inject:
    """``engine-0`` reachable only through a faulty link, from version 0 on. The pool sends a
    burst of waiting calls to whichever endpoint qualifies first, so ``engine-1`` is held out of
    rotation until the link has taken two calls (its in-flight calls finish; calls that fail on
    the link wait for it to come back): every group admitted after version 1 meets the link, so
    the fault is certain to strike; then both share the load."""

    async def inject(ctx: Ctx) -> None:
        fleet = {e["id"]: e["url"] for e in (await ctx.admin("GET", "/v1/fleet"))["endpoints"]}
        if "engine-0" not in fleet or "engine-1" not in fleet:
            raise ChaosError(f"a link fault needs engine-0 and engine-1; the fleet is {fleet}")
        link = FaultyLink(fleet["engine-0"], mode)
        url = await link.start()
        ctx.cleanups.append(link.close)
        ctx.aliases["chaos-link"] = "engine-0"
        await ctx.admin("POST", "/v1/fleet", {"id": "chaos-link", "url": url})
        await ctx.admin("DELETE", "/v1/fleet/engine-0")
        await ctx.admin("DELETE", "/v1/fleet/engine-1")

        async def readmit() -> None:
            with anyio.move_on_after(30):
                await poll(lambda: link.damaged >= 2)
            ctx.notes.append(f"engine-0 behind the {mode} link ({link.damaged} calls damaged)")
            await ctx.admin("POST", "/v1/fleet", {"id": "engine-1", "url": fleet["engine-1"]})

        assert ctx.background is not None
        ctx.background.start_soon(readmit)

    return inject


# -- board -----------------------------------------------------------------------------------------
def _damaged_patch(action: str) -> dict[str, str]:
    rule = {"site": "board.write", "match": "*/versions/00000002/from-00000001/*.patch"}
    return {"SPRAWL_FAULTS": json.dumps([{**rule, "action": action}])}


async def _dangling_pointer(ctx: Ctx) -> None:
    """The pointer names a version 50 ahead that does not exist, for 2 s: each publish repairs
    it and the harness breaks it again (so the islands, not only the publisher, meet it), then
    it is left naming the newest real version, as the next publish would."""
    latest = await ctx.latest()
    missing = (latest or 0) + 50
    pointer = f"{ctx.board.root}/POINTER"
    board = ctx.board

    def named() -> int | None:
        raw = board.store.read(pointer, MAX_POINTER_BYTES)
        return int(json.loads(raw)["version"])

    def point(version: int) -> None:
        board.store.write(pointer, json.dumps({"version": version}).encode())

    async def keep_dangling() -> None:
        with anyio.move_on_after(2.0):
            while ctx.orchestrator is not None and ctx.orchestrator.poll() is None:
                if await anyio.to_thread.run_sync(named) != missing:
                    await anyio.to_thread.run_sync(point, missing)
                await anyio.sleep(0.1)
        if await anyio.to_thread.run_sync(named) == missing:
            await anyio.to_thread.run_sync(point, max(board.versions()))
        ctx.notes.append(f"pointer named missing v{missing} for 2 s")

    assert ctx.background is not None
    ctx.background.start_soon(keep_dangling)


# -- trainer and orchestrator ----------------------------------------------------------------------
async def _kill_trainer(ctx: Ctx) -> None:
    assert ctx.trainer is not None
    ctx.trainer.send_signal(signal.SIGKILL)
    ctx.trainer.wait()
    await anyio.sleep(1.0)
    ctx.start_trainer()


async def _kill_orchestrator(ctx: Ctx) -> None:
    assert ctx.orchestrator is not None
    ctx.orchestrator.send_signal(signal.SIGKILL)
    ctx.orchestrator.wait()
    await anyio.sleep(1.0)
    ctx.start_orchestrator(**{"run.resume": True})


# -- environment and sandbox -----------------------------------------------------------------------
async def _crash_sandboxes(ctx: Ctx) -> None:
    """SIGKILL every sandbox process that appears during the next few seconds."""

    async def killer() -> None:
        killed = 0
        with anyio.move_on_after(6.0):
            while True:
                assert ctx.orchestrator is not None
                try:
                    procs = psutil.Process(ctx.orchestrator.pid).children(recursive=True)
                except psutil.Error:
                    return
                for p in procs:
                    try:
                        if p.name() == "bwrap":
                            p.send_signal(signal.SIGKILL)
                            killed += 1
                    except psutil.Error:
                        continue
                await anyio.sleep(0.05)
        ctx.notes.append(f"{killed} sandbox processes killed")

    assert ctx.background is not None
    ctx.background.start_soon(killer)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("none", "no fault: the baseline"),
        Fault(
            "island-kill",
            "SIGKILL of an island mid-episode",
            _kill_island,
            _failed_calls("engine-0"),
        ),
        Fault(
            "island-hang",
            "an island stops answering (SIGSTOP)",
            _hang_island,
            _failed_calls("engine-0"),
        ),
        Fault(
            "endpoint-500",
            "an endpoint answers every generate with 500",
            _link("error"),
            _failed_calls("chaos-link"),
            at_version=0,
        ),
        Fault(
            "endpoint-garbage",
            "an endpoint answers with malformed bodies",
            _link("garbage"),
            _failed_calls("chaos-link"),
            at_version=0,
        ),
        Fault(
            "slow-link",
            "0.5 s added to every call to one endpoint",
            _link("slow"),
            _slow_calls,
            at_version=0,
        ),
        Fault(
            "patch-corrupt",
            "one bit flipped in version 2's patch on the board",
            evidence=_patch_refused,
            at_version=2,
            env=_damaged_patch("corrupt"),
        ),
        Fault(
            "patch-truncated",
            "version 2's patch cut in half on the board",
            evidence=_patch_refused,
            at_version=2,
            env=_damaged_patch("truncate"),
        ),
        Fault(
            "patch-reordered",
            "version 2's patch replaced by version 1's",
            evidence=_patch_refused,
            at_version=2,
            env=_damaged_patch("reorder"),
        ),
        Fault(
            "pointer-missing",
            "the board pointer names a missing version",
            _dangling_pointer,
            _pointer_skipped,
        ),
        Fault(
            "trainer-kill",
            "SIGKILL of the (external) trainer, then a restart",
            _kill_trainer,
            _logged("trainer_resumed", "trainer.log"),
            at_version=2,
            overrides={"trainer.checkpoint": True},
            external_trainer=True,
        ),
        Fault(
            "orchestrator-kill",
            "SIGKILL of the orchestrator, then a restart from its log and checkpoint",
            _kill_orchestrator,
            _resumed,
            at_version=2,
            overrides={"trainer.checkpoint": True},
        ),
        Fault(
            "sandbox-crash",
            "sandbox processes SIGKILLed while they run",
            _crash_sandboxes,
            _episode_errors("sandbox check failed"),
            overrides={"environment.cls": "orchestrator.chaos.envs:SandboxChecked"},
        ),
        Fault(
            "env-raises",
            "the environment raises on a third of its tasks",
            evidence=_episode_errors("injected environment failure"),
            overrides={"environment.cls": "orchestrator.chaos.envs:Raising"},
        ),
    )
}
