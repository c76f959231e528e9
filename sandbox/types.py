"""Vocabulary of the sandbox package: its config, limits, results and the backend seam.

No I/O happens here and nothing heavier than pydantic is imported, so the config tree can load
this module without pulling in torch or the process machinery.

- `SandboxConfig` is the `[sandbox]` table of the run config.
- `Limits` is the resource envelope of one run; `SandboxConfig.limits()` gives the default one
  and callers override single fields with `dataclasses.replace`.
- `ExecResult` is what every run returns. A run that hit a limit is *data*, not an exception:
  `killed_reason` says which limit, `exit_code` is `None` when the sandbox killed the command.
- `WORKDIR`, `SANDBOX_MOUNTS` and `checked_binds` describe where the bwrap backend mounts
  things, so a `ro_binds` entry that would be hidden, replace one of them or overlap another
  fails when the config is loaded.
- `Sandbox` is the backend protocol: bubblewrap and the unsandboxed fallback implement it here,
  and a remote sandbox (HTTP service, VM pool) only has to implement the same `run`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

BackendName = Literal["bwrap", "unsandboxed"]
"""Which backend a pool builds."""

KilledReason = Literal["wall_time", "cpu_time", "memory", "output_limit", "file_size"]
"""Why a run was stopped by a limit (`None` on `ExecResult` when it ended by itself)."""

CgroupMode = Literal["auto", "off", "required"]
"""Whether to add cgroup memory/pids limits on top of rlimits."""

FileContent = str | bytes
"""A file to place in the work dir; `str` is written as UTF-8."""

WORKDIR = "/work"
"""The run's work dir inside the bwrap sandbox (a tmpfs); `/tmp` links to it."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Host directories (or links) the bwrap backend shows read-only where they exist."""

ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
"""Host files of /etc the bwrap backend shows read-only (passwd and group are synthesized)."""

SANDBOX_MOUNTS = (
    *SYSTEM_DIRS,
    *(f"/etc/{entry}" for entry in (*ETC_ENTRIES, "passwd", "group")),
    *("/proc", "/dev", WORKDIR, "/tmp"),
)
"""What the bwrap backend itself mounts; a `ro_binds` entry may not replace or repeat these."""

KERNEL_DIRS = ("/proc", "/dev", "/sys")
"""The host kernel's interfaces: nothing in them is ever bound into the sandbox."""


def bind_target(path: str) -> str:
    """Where the bwrap backend mounts the `ro_binds` entry `path`: the same place, with `/tmp/x`
    at `/work/x` (inside the sandbox `/tmp` is a link to the work dir)."""
    return WORKDIR + path[len("/tmp") :] if path.startswith("/tmp/") else path


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def checked_binds(paths: Sequence[str]) -> None:
    """Raise `ValueError` naming `sandbox.ro_binds` unless every entry can be mounted as asked:
    absolute and normalized, not replacing or inside what the sandbox mounts itself (binds in
    the work dir and `/tmp` are fine), and no two landing in the same place or one in another."""
    seen: dict[str, str] = {}
    for path in paths:
        if "\0" in path:
            raise ValueError(f"sandbox.ro_binds entry {path!r} contains a NUL byte")
        if not path.startswith("/"):
            raise ValueError(f"sandbox.ro_binds entries must be absolute paths: {path!r}")
        if str(PurePosixPath(path)) != path or ".." in path.split("/") or path.startswith("//"):
            raise ValueError(
                f"sandbox.ro_binds entry {path!r} is not normalized (no trailing '/', '.', "
                "'..' or '//'); write it as the plain absolute path"
            )
        target = bind_target(path)
        for mount in SANDBOX_MOUNTS:
            if _within(mount, target):
                raise ValueError(
                    f"sandbox.ro_binds entry {path!r} would replace the sandbox's own {mount}"
                )
            if mount not in (WORKDIR, "/tmp") and _within(target, mount):
                where = "inside" if mount in KERNEL_DIRS else "already visible inside"
                raise ValueError(
                    f"sandbox.ro_binds entry {path!r} is {where} the sandbox's own {mount}; drop it"
                )
        if _within(target, "/sys"):
            raise ValueError(f"sandbox.ro_binds entry {path!r} is inside the host's /sys; drop it")
        for other_target, other in seen.items():
            if target == other_target:
                kind = "twice" if path == other else f"in the same place as {other!r}"
                raise ValueError(f"sandbox.ro_binds entry {path!r} is listed {kind}")
            if _within(target, other_target) or _within(other_target, target):
                raise ValueError(
                    f"sandbox.ro_binds entries {other!r} and {path!r} overlap (one is inside "
                    "the other); keep the outer one"
                )
        seen[target] = path


def checked_source(path: str, real: str) -> None:
    """Raise `ValueError` naming `sandbox.ro_binds` when the entry `path`, resolved through its
    symlinks to `real` (what the bind would show), shows what no entry may: a place the sandbox
    mounts itself or one above it (the host's `/`, `/etc`, `/work`, …), or anything of the
    kernel's `/proc`, `/dev` or `/sys`."""
    for place in (*SANDBOX_MOUNTS, "/sys"):
        if _within(place, real) or (place in KERNEL_DIRS and _within(real, place)):
            raise ValueError(
                f"sandbox.ro_binds entry {path!r} resolves to {real!r}, which would show the "
                f"host's {place} inside the sandbox; bind the directory you mean directly"
            )


@dataclass(frozen=True)
class Limits:
    """Resource envelope of one sandboxed run. Every field is a hard cap."""

    cpu_seconds: float
    """CPU time per process (RLIMIT_CPU); SIGXCPU at the limit, SIGKILL one second later."""
    wall_seconds: float
    """Wall-clock time of the whole run; the parent kills every process of the run at the limit."""
    memory_mb: int
    """Address space per process (RLIMIT_AS) and, with cgroups, memory of the whole run."""
    max_processes: int
    """Processes of the run (RLIMIT_NPROC in the sandbox's user namespace; cgroup pids.max)."""
    max_output_bytes: int
    """stdout + stderr bytes kept; one byte more and the run is killed."""
    tmpfs_mb: int
    """Size of the work-dir tmpfs (also RLIMIT_FSIZE, the largest single file)."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""

    def __post_init__(self) -> None:
        if self.cpu_seconds <= 0 or self.wall_seconds <= 0:
            raise ValueError("cpu_seconds and wall_seconds must be > 0")
        if min(self.memory_mb, self.max_processes, self.tmpfs_mb, self.max_open_files) < 1:
            raise ValueError("memory_mb, max_processes, tmpfs_mb, max_open_files must be >= 1")
        if self.max_output_bytes < 0:
            raise ValueError("max_output_bytes must be >= 0")


class SandboxConfig(BaseModel):
    """How tool code and model-written programs are isolated (`[sandbox]` in the run config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: BackendName = "bwrap"
    """`bwrap` (bubblewrap namespaces; the default) or `unsandboxed` (rlimits + wall time only,
    no isolation at all; requires `allow_unsandboxed = true`)."""
    allow_unsandboxed: bool = False
    """Permit running without isolation: with `backend = "bwrap"` it is the fallback when bwrap
    is missing or cannot start; a loud warning is logged on every pool creation."""
    bwrap_path: str = "bwrap"
    """The bubblewrap executable (name looked up on PATH, or an absolute path)."""
    python: str = "/usr/bin/python3"
    """Interpreter `run_python` uses; it must be visible inside the sandbox (see `ro_binds`)."""
    ro_binds: tuple[str, ...] = ()
    """Extra absolute host paths bound read-only at the same place (e.g. a virtualenv; `/tmp/x`
    appears at `/work/x`, which `/tmp` links to). Entries may not overlap each other or what
    the sandbox mounts itself; files of a run may not lie inside one."""
    cgroups: CgroupMode = "auto"
    """`auto`: add cgroup memory and pids limits where a writable hierarchy exists; `off`;
    `required`: fail pool creation without one."""
    cpu_seconds: float = Field(default=10.0, gt=0, le=3600)
    """CPU seconds per process."""
    wall_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Wall-clock seconds per run."""
    memory_mb: int = Field(default=1024, ge=16, le=1 << 20)
    """Memory per run in MiB (address space per process; cgroup limit for the whole run)."""
    max_processes: int = Field(default=64, ge=1, le=4096)
    """Processes per run (the sandbox's own helper processes count too)."""
    max_output_bytes: int = Field(default=1 << 20, ge=0, le=1 << 30)
    """stdout + stderr bytes per run."""
    tmpfs_mb: int = Field(default=64, ge=1, le=1 << 16)
    """Work-dir tmpfs size in MiB."""
    max_concurrency: int = Field(default=8, ge=1, le=4096)
    """Runs in flight at once per pool; further runs wait for a slot."""

    @model_validator(mode="after")
    def _unsandboxed_is_explicit(self) -> SandboxConfig:
        if self.backend == "unsandboxed" and not self.allow_unsandboxed:
            raise ValueError(
                'sandbox.backend = "unsandboxed" runs code with no isolation; '
                "set sandbox.allow_unsandboxed = true to confirm"
            )
        checked_binds(self.ro_binds)
        return self

    def limits(self) -> Limits:
        """The default per-run limits this config describes."""
        return Limits(
            cpu_seconds=self.cpu_seconds,
            wall_seconds=self.wall_seconds,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            max_output_bytes=self.max_output_bytes,
            tmpfs_mb=self.tmpfs_mb,
        )


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run. Hitting a limit is reported here, never raised."""

    exit_code: int | None
    """The command's exit status (128 + N when killed by signal N); `None` when the sandbox
    killed it (wall time, output limit, caller cancelled)."""
    stdout: str
    """Captured stdout, UTF-8 with replacement characters, at most the output budget."""
    stderr: str
    """Captured stderr, same rules."""
    timed_out: bool
    """The wall-time limit was hit."""
    killed_reason: KilledReason | None
    """Which limit stopped the run, if one did."""
    duration_s: float
    """Wall-clock seconds from spawn to the last process gone."""
    truncated: bool
    """Output was cut at the budget."""

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0."""
        return self.exit_code == 0 and self.killed_reason is None


class Sandbox(Protocol):
    """A place to run an argv in isolation. Implementations must be safe to call concurrently."""

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `argv` in a fresh work dir holding `files` (relative paths); never reuse state."""
        ...
