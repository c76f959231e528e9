"""Spawn one sandboxed command and supervise it to the end: output budget, wall time, cleanup.

Guarantees for every run, whatever the command does:
- it is started through `_launch.py` (cgroups joined, rlimits set, root dropped before `exec`),
  in a new session, with an explicit environment and only the descriptors it is given;
- at most `max_output_bytes` of stdout + stderr are kept; the next byte kills the run;
- at `wall_seconds` the run is killed; so is a run whose caller is cancelled;
- when `supervise` returns, no process of the run is left: the outer process is reaped, the
  namespace's init (for bwrap, announced on `--json-status-fd`) has exited — and a pid
  namespace's init exits only after every other process in it — and the run's cgroup, if any,
  is empty; an init re-parented to this process (PID 1 of a container, or a subreaper) is
  reaped too, so no zombie is left;
- a run whose command never started because bwrap could not set it up or the launcher failed
  (for bwrap: it exited 1 or 125 and never wrote an `exit-code` on its status fd, which only
  bwrap writes, once the command was started) raises `SandboxRequestError` with their message
  instead of passing off their exit status as the command's.

What it only attempts: telling *why* the kernel stopped a command. SIGXCPU and SIGXFSZ deaths
map to `cpu_time` and `file_size`, a cgroup OOM kill to `memory`, and with a cgroup v2 a SIGKILL
after the run used its CPU seconds to `cpu_time` (a command that ignores SIGXCPU is killed at the
hard limit a second later); a command that handles those signals itself without a cgroup v2, or
dies of `MemoryError` under RLIMIT_AS, is reported by its exit status only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import ByteReceiveStream, Process

from sandbox.cgroups import RunCgroup
from sandbox.errors import SandboxRequestError
from sandbox.types import ExecResult, KilledReason, Limits

LAUNCHER = Path(__file__).with_name("_launch.py")
_KILL_GRACE_S = 5.0
_SETUP_FAILED = (1, 125)
"""Exit statuses of a run that failed before its command: bwrap's set-up errors exit 1, the
launcher's 125 (`_launch.LAUNCH_FAILED`). A bwrap killed by a signal is the run's data."""


@dataclass
class Launch:
    """Everything `supervise` needs to start one run. Owns `pass_fds` and `status_fd`."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None
    uid: int | None = None
    gid: int | None = None
    rlimits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    pass_fds: Sequence[int] = ()
    status_fd: int | None = None
    """Read end of bwrap's `--json-status-fd` pipe: JSON lines naming the namespace init's host
    pid (`child-pid`) and, once the command was started, its `exit-code`."""
    cgroup: RunCgroup | None = None

    def command(self) -> list[str]:
        """The launcher's argv: its spec, then `argv` as separate arguments."""
        spec = {
            "cgroup_procs": self.cgroup.procs_files if self.cgroup else [],
            "rlimits": {name: list(pair) for name, pair in self.rlimits.items()},
            "uid": self.uid,
            "gid": self.gid,
        }
        return [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec), *self.argv]


class _Budget:
    def __init__(self, limit: int) -> None:
        self.left = limit
        self.overflowed = False

    def take(self, size: int) -> int:
        granted = min(size, self.left)
        self.left -= granted
        if granted < size:
            self.overflowed = True
        return granted


class _Init:
    """The namespace init's pidfd, once bwrap has announced it, and whether the command ran."""

    def __init__(self, status_fd: int | None) -> None:
        self.status_fd = status_fd
        self.pidfd: int | None = None
        self.command_started = False
        self._buffer = b""

    def _consume(self, data: bytes) -> None:
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            try:
                status = json.loads(line)
            except ValueError:
                continue
            if not isinstance(status, dict):
                continue
            if "child-pid" in status and self.pidfd is None:
                with contextlib.suppress(ProcessLookupError):
                    self.pidfd = os.pidfd_open(int(status["child-pid"]))
            self.command_started |= "exit-code" in status

    def _read(self) -> bytes | None:
        """What the status fd has now (b"" at its end), or None when it would block."""
        assert self.status_fd is not None
        try:
            data = os.read(self.status_fd, 4096)
        except BlockingIOError:
            return None
        self._consume(data)
        return data

    async def watch(self) -> None:
        while self.status_fd is not None and self.pidfd is None:
            await anyio.wait_readable(self.status_fd)
            if self._read() == b"":
                return

    def drain(self) -> None:
        """Read what is left without blocking (the writer, bwrap, is gone by now)."""
        while self.status_fd is not None and self._read():
            pass

    def kill(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    async def wait_gone(self) -> None:
        if self.pidfd is not None:
            await anyio.wait_readable(self.pidfd)

    def reap(self) -> None:
        """Reap the init if it became this process's child: re-parented here when this process
        is PID 1 or a subreaper, it would stay a zombie `bwrap`. Elsewhere it is not this
        process's child and this does nothing."""
        if self.pidfd is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)

    def close(self) -> None:
        self.reap()
        for fd in (self.status_fd, self.pidfd):
            if fd is not None:
                os.close(fd)
        self.status_fd = self.pidfd = None


def reap_announced_init(status_fd: int, timeout_s: float) -> None:
    """After a bwrap run started outside :func:`supervise` (the pool's probe) has returned: wait
    up to ``timeout_s`` for the init it announced on ``status_fd`` to exit, reap it if it became
    this process's child (:meth:`_Init.reap`), and close ``status_fd``."""
    os.set_blocking(status_fd, False)
    init = _Init(status_fd)
    init.drain()
    if init.pidfd is not None:
        select.select([init.pidfd], [], [], timeout_s)
    init.close()


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _reason_from_exit(
    status: int, oom_killed: bool, cpu_used: float | None, limits: Limits
) -> KilledReason | None:
    if oom_killed:
        return "memory"
    if status == 128 + signal.SIGXCPU:
        return "cpu_time"
    if status == 128 + signal.SIGKILL and cpu_used is not None and cpu_used >= limits.cpu_seconds:
        return "cpu_time"  # SIGXCPU ignored: the hard limit's SIGKILL, a second later
    if status == 128 + signal.SIGXFSZ:
        return "file_size"
    return None


async def _pump(stream: ByteReceiveStream, sink: bytearray, budget: _Budget) -> None:
    async for chunk in stream:
        sink += chunk[: budget.take(len(chunk))]
        if budget.overflowed:
            return


async def _feed(process: Process, data: bytes) -> None:
    assert process.stdin is not None
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.send(data)
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await process.stdin.aclose()


async def _kill_everything(process: Process, init: _Init, cgroup: RunCgroup | None) -> None:
    init.kill()
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.kill()
    await process.wait()
    init.drain()
    init.kill()
    await init.wait_gone()


async def supervise(launch: Launch, limits: Limits, stdin: bytes | None) -> ExecResult:
    """Run `launch` under `limits`; see the module docstring for what is guaranteed."""
    init = _Init(launch.status_fd)
    if launch.status_fd is not None:
        os.set_blocking(launch.status_fd, False)
    started = time.monotonic()
    try:
        process = await anyio.open_process(
            launch.command(),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=launch.cwd,
            env=dict(launch.env),
            start_new_session=True,
            pass_fds=tuple(launch.pass_fds),
        )
    except BaseException:
        init.close()
        if launch.cgroup is not None:
            await launch.cgroup.close()
        raise
    finally:
        for fd in launch.pass_fds:
            os.close(fd)
    out, err, budget = bytearray(), bytearray(), _Budget(limits.max_output_bytes)
    reason: KilledReason | None = None
    finished = False
    try:
        with anyio.move_on_after(limits.wall_seconds) as deadline:
            async with anyio.create_task_group() as tg:

                async def pump(stream: ByteReceiveStream | None, sink: bytearray) -> None:
                    assert stream is not None
                    await _pump(stream, sink, budget)
                    if budget.overflowed:
                        deadline.cancel()

                tg.start_soon(pump, process.stdout, out)
                tg.start_soon(pump, process.stderr, err)
                tg.start_soon(init.watch)
                if stdin is not None:
                    tg.start_soon(_feed, process, stdin)
                await process.wait()
            finished = True
        if budget.overflowed:
            reason = "output_limit"
        elif not finished:
            reason = "wall_time"
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_KILL_GRACE_S):
            await _kill_everything(process, init, launch.cgroup)
        oom_killed = launch.cgroup is not None and launch.cgroup.oom_killed()
        cpu_used = launch.cgroup.cpu_seconds() if launch.cgroup is not None else None
        with anyio.CancelScope(shield=True):
            await process.aclose()
            if launch.cgroup is not None:
                await launch.cgroup.close()
        init.close()
    setup_failed = process.returncode in _SETUP_FAILED and not init.command_started
    if reason is None and launch.status_fd is not None and setup_failed:
        raise SandboxRequestError(
            "the sandbox could not set up this run, so its command never started: "
            + err.decode("utf-8", errors="replace").strip()
        )
    exit_code: int | None = None
    if reason is None:
        assert process.returncode is not None
        exit_code = _exit_status(process.returncode)
        reason = _reason_from_exit(exit_code, oom_killed, cpu_used, limits)
    return ExecResult(
        exit_code=exit_code,
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        timed_out=reason == "wall_time",
        killed_reason=reason,
        duration_s=time.monotonic() - started,
        truncated=budget.overflowed,
    )
