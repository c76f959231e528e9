"""Optional cgroup limits (v1 or v2) for one sandboxed run: memory of the whole run, process count.

Guarantees, when `detect()` finds a writable hierarchy with the memory and pids controllers:
every run gets its own child cgroup (joined by the launcher before the backend starts, so no
process of the run is ever outside it), `memory` caps the run's total memory including its
tmpfs pages, `pids.max` caps its processes independently of uid mapping, `oom_killed()` tells
whether the kernel OOM-killed inside it, `cpu_seconds()` what CPU time its processes used (v2,
or v1 with a writable `cpuacct` hierarchy; else None), and `close()` kills whatever is left and
removes it.

Not covered: CPU shares/quota and I/O bandwidth (the wall-time limit bounds both), hierarchies
that need systemd delegation (v2 with processes in our own cgroup: `detect()` returns None and
the rlimits alone apply).
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import structlog

from sandbox.types import Limits

log = structlog.get_logger(__name__)

_PREFIX = "sprawl-sbx-"


@dataclass(frozen=True)
class CgroupHost:
    """Where run cgroups are created."""

    version: Literal[1, 2]
    memory_parent: Path
    pids_parent: Path
    cpu_parent: Path | None = None
    """Where the run's CPU time is counted (v2: the same parent; v1: `cpuacct`, if writable)."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount of this process."""
    found: list[tuple[str, str, set[str]]] = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            pre, _, post = line.partition(" - ")
            fstype, _source, superopts = ([*post.split(), "", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((pre.split()[4], fstype, set(superopts.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller name ("" for v2) → this process's cgroup path."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _usable(parent: Path, needed: tuple[str, ...]) -> bool:
    probe = parent / f"{_PREFIX}probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return all((probe / name).exists() for name in needed)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def detect() -> CgroupHost | None:
    """A writable hierarchy with memory + pids control for child cgroups, or None."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError:
        return None
    v1 = {c: point for point, fstype, opts in mounts if fstype == "cgroup" for c in opts}
    if "memory" in v1 and "pids" in v1 and "memory" in own and "pids" in own:
        mem = Path(v1["memory"] + own["memory"])
        pids = Path(v1["pids"] + own["pids"])
        if _usable(mem, ("memory.limit_in_bytes",)) and _usable(pids, ("pids.max",)):
            cpu = Path(v1["cpuacct"] + own["cpuacct"]) if "cpuacct" in v1.keys() & own else None
            usable = cpu is not None and _usable(cpu, ("cpuacct.usage",))
            return CgroupHost(1, mem, pids, cpu if usable else None)
    for point, fstype, _opts in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        parent = Path(point + own[""])
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        if _usable(parent, ("memory.max", "pids.max")):
            return CgroupHost(2, parent, parent, parent)
    return None


class RunCgroup:
    """The cgroup(s) of one run. Create with `create`, always `close`."""

    def __init__(self, host: CgroupHost, limits: Limits) -> None:
        self._host = host
        name = f"{_PREFIX}{uuid.uuid4().hex}"
        self._mem = host.memory_parent / name
        self._pids = host.pids_parent / name
        self._cpu = None if host.cpu_parent is None else host.cpu_parent / name
        self._dirs = list(dict.fromkeys(d for d in (self._mem, self._pids, self._cpu) if d))
        for directory in self._dirs:
            directory.mkdir()
        try:
            self._apply(limits)
        except OSError:
            self._rmdir_all()
            raise

    def _apply(self, limits: Limits) -> None:
        # tmpfs pages are charged to the writer's memory cgroup, so the cap covers both.
        memory = (limits.memory_mb + limits.tmpfs_mb) << 20
        # The backend's own helpers (outer bwrap, the namespace's init) are in the cgroup too.
        pids = str(limits.max_processes + 2)
        if self._host.version == 1:
            (self._mem / "memory.limit_in_bytes").write_text(str(memory))
            memsw = self._mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(memory))
        else:
            (self._mem / "memory.max").write_text(str(memory))
            swap = self._mem / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        (self._pids / "pids.max").write_text(pids)

    @property
    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files the launcher writes its pid into."""
        return [str(directory / "cgroup.procs") for directory in self._dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of this run."""
        name = "memory.oom_control" if self._host.version == 1 else "memory.events"
        try:
            text = (self._mem / name).read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def cpu_seconds(self) -> float | None:
        """CPU time the run's processes used (v2 ``cpu.stat``, v1 ``cpuacct.usage``), or None
        where no hierarchy counts it."""
        if self._cpu is None:
            return None
        try:
            if self._host.version == 1:
                return int((self._cpu / "cpuacct.usage").read_text()) / 1e9
            text = (self._cpu / "cpu.stat").read_text()
        except (OSError, ValueError):
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec" and value.strip().isdigit():
                return int(value) / 1e6
        return None

    def _pids_inside(self) -> list[int]:
        found: set[int] = set()
        for directory in self._dirs:
            with contextlib.suppress(OSError):
                text = (directory / "cgroup.procs").read_text()
                found.update(int(p) for p in text.split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process still in the run's cgroups."""
        kill_file = self._mem / "cgroup.kill"
        if self._host.version == 2 and kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
                return
        for pid in self._pids_inside():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _rmdir_all(self) -> bool:
        removed = True
        for directory in self._dirs:
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed

    async def close(self) -> None:
        """Kill leftovers and remove the cgroups; gives up (with a log line) after ~2 s."""
        with anyio.CancelScope(shield=True):
            for _ in range(200):
                if not self._pids_inside() and self._rmdir_all():
                    return
                self.kill()
                await anyio.sleep(0.01)
            log.warning("sandbox.cgroup_not_removed", path=str(self._mem))
