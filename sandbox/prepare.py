"""Pure helpers shared by the backends: validate a run's files, turn `Limits` into rlimits.

`checked_files` guarantees every path stays inside the work dir (relative, no `..`, no empty or
NUL parts) and that the files fit in the work-dir tmpfs; anything else raises
`SandboxRequestError` before a process exists.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import PurePosixPath

from sandbox.errors import SandboxRequestError
from sandbox.types import FileContent, Limits

NOBODY = 65534
"""uid and gid sandboxed code runs as."""

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


def checked_files(
    files: Mapping[str, FileContent] | None, limits: Limits
) -> list[tuple[PurePosixPath, bytes]]:
    """Validated (relative path, bytes) pairs, in a stable order."""
    checked: list[tuple[PurePosixPath, bytes]] = []
    total = 0
    for name, content in sorted((files or {}).items()):
        path = PurePosixPath(name)
        if (
            not name
            or "\0" in name
            or path.is_absolute()
            or any(part in ("..", ".", "") for part in name.split("/"))
        ):
            raise SandboxRequestError(
                f"sandbox file path {name!r} must be relative and stay inside the work dir"
            )
        data = content.encode() if isinstance(content, str) else bytes(content)
        total += len(data)
        checked.append((path, data))
    if total > limits.tmpfs_mb << 20:
        raise SandboxRequestError(
            f"sandbox files total {total} bytes, more than the work dir's "
            f"{limits.tmpfs_mb} MiB (sandbox.tmpfs_mb)"
        )
    return checked


def parent_dirs(paths: list[PurePosixPath]) -> list[PurePosixPath]:
    """Every directory the files need, parents before children."""
    dirs = {parent for path in paths for parent in path.parents if parent != PurePosixPath(".")}
    return sorted(dirs, key=lambda d: (len(d.parts), str(d)))


def rlimits(limits: Limits, *, with_nproc: bool) -> dict[str, tuple[int, int]]:
    """RLIMIT_* name → (soft, hard). CPU gets one second of grace: SIGXCPU, then SIGKILL."""
    cpu = max(1, math.ceil(limits.cpu_seconds))
    fsize = limits.tmpfs_mb << 20
    table = {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_mb << 20, limits.memory_mb << 20),
        "RLIMIT_FSIZE": (fsize, fsize),
        "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }
    if with_nproc:
        table["RLIMIT_NPROC"] = (limits.max_processes, limits.max_processes)
    return table


def prlimit_args(limits: Limits) -> list[str]:
    """`prlimit` options applying `rlimits(limits, with_nproc=True)` to the command it runs."""
    flags = {
        "RLIMIT_CPU": "--cpu",
        "RLIMIT_AS": "--as",
        "RLIMIT_FSIZE": "--fsize",
        "RLIMIT_NOFILE": "--nofile",
        "RLIMIT_CORE": "--core",
        "RLIMIT_NPROC": "--nproc",
    }
    table = rlimits(limits, with_nproc=True)
    return [f"{flags[name]}={soft}:{hard}" for name, (soft, hard) in table.items()]


def host_identity() -> tuple[int, int] | None:
    """(uid, gid) to drop to on the host before starting a backend: nobody when we are root,
    so RLIMIT_NPROC binds and sandboxed processes own nothing on the host; None otherwise."""
    return (NOBODY, NOBODY) if os.geteuid() == 0 else None
