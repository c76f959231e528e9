"""Pure helpers shared by the backends: validate a run's request, turn `Limits` into rlimits.

`checked_files` guarantees every path stays inside the work dir (relative, no `..`, no empty or
NUL parts), fits the kernel's name limits, is not also a directory of another file and not
inside a read-only bind, and that the files fit in the work-dir tmpfs; `checked_argv`
guarantees the kernel will accept the argv at `exec`. Anything else raises
`SandboxRequestError` before a process or a descriptor exists.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

from sandbox.errors import SandboxRequestError
from sandbox.types import WORKDIR, FileContent, Limits

NAME_MAX = 255
"""Bytes in one file name (a path component), the kernel's limit."""
PATH_MAX = 4096
"""Bytes in a whole path including its terminating NUL, the kernel's limit."""
MAX_ARG_STRLEN = 32 * 4096
"""Bytes in one `exec` argument including its terminating NUL, the kernel's limit."""
_ARGV_HEADROOM = 64 << 10
"""Room kept for what travels with the command's argv (launcher, bwrap and prlimit options,
the environment) within the kernel's total `ARG_MAX`."""

NOBODY = 65534
"""uid and gid sandboxed code runs as."""

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


def checked_files(
    files: Mapping[str, FileContent] | None,
    limits: Limits,
    *,
    binds: Sequence[str] = (),
) -> list[tuple[PurePosixPath, bytes]]:
    """Validated (relative path, bytes) pairs, in a stable order. `binds` are the work-dir
    relative places of read-only binds (`sandbox.ro_binds`) no file may lie in or above."""
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
        longest = max(len(os.fsencode(part)) for part in path.parts)
        if longest > NAME_MAX:
            raise SandboxRequestError(
                f"sandbox file path {_shown(name)} has a name of {longest} bytes; "
                f"the limit is {NAME_MAX} (NAME_MAX)"
            )
        if len(os.fsencode(f"{WORKDIR}/{name}")) >= PATH_MAX:
            raise SandboxRequestError(
                f"sandbox file path {_shown(name)} is longer than the kernel's "
                f"{PATH_MAX} bytes (PATH_MAX) in the work dir"
            )
        for bind in binds:
            if path.is_relative_to(bind) or PurePosixPath(bind).is_relative_to(path):
                raise SandboxRequestError(
                    f"sandbox file path {name!r} collides with the read-only bind "
                    f"{WORKDIR}/{bind} (sandbox.ro_binds)"
                )
        data = content.encode() if isinstance(content, str) else bytes(content)
        total += len(data)
        checked.append((path, data))
    names = {path for path, _ in checked}
    for path, _ in checked:
        for parent in path.parents:
            if parent in names:
                raise SandboxRequestError(
                    f"sandbox file path {str(parent)!r} is a file, but {str(path)!r} needs it "
                    "to be a directory"
                )
    if total > limits.tmpfs_mb << 20:
        raise SandboxRequestError(
            f"sandbox files total {total} bytes, more than the work dir's "
            f"{limits.tmpfs_mb} MiB (sandbox.tmpfs_mb)"
        )
    return checked


def checked_argv(argv: Sequence[str]) -> list[str]:
    """`argv` as a list, if `exec` will take it: not empty, no NUL byte, each argument under
    `MAX_ARG_STRLEN`, all of them under the kernel's `ARG_MAX` (less room for the launch)."""
    if not argv:
        raise SandboxRequestError("argv must not be empty")
    total = 0
    for index, arg in enumerate(argv):
        if "\0" in arg:
            raise SandboxRequestError(f"argv[{index}] contains a NUL byte")
        size = len(os.fsencode(arg)) + 1
        if size > MAX_ARG_STRLEN:
            raise SandboxRequestError(
                f"argv[{index}] is {size} bytes; the kernel takes at most {MAX_ARG_STRLEN} "
                "per argument (MAX_ARG_STRLEN): pass large data in files= or stdin"
            )
        total += size + 8  # the string and its pointer
    limit = os.sysconf("SC_ARG_MAX") - _ARGV_HEADROOM
    if total > limit:
        raise SandboxRequestError(
            f"argv totals {total} bytes; the kernel takes at most {limit} here (ARG_MAX less "
            "the launch's own arguments): pass large data in files= or stdin"
        )
    return list(argv)


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 60 else f"{name[:60]!r}..."


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


def init_rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    """The rlimits bwrap itself starts under, so the namespace's init has them too: all of
    `rlimits` but RLIMIT_NPROC (set on bwrap, it would count every run's processes, which
    share host uid 65534) and RLIMIT_NOFILE (bwrap holds one descriptor per file of the run)."""
    table = rlimits(limits, with_nproc=False)
    del table["RLIMIT_NOFILE"]
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
