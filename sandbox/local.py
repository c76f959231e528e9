"""The unsandboxed fallback: a plain subprocess under rlimits and the wall-time limit.

This is NOT isolation. The command sees the host's filesystem, network, processes and
services with the permissions of the user it runs as. It exists for hosts where bubblewrap
cannot run and for trusted code, and is only built when `sandbox.allow_unsandboxed = true`;
the pool logs a warning every time one is created.

What it still guarantees: a fresh private work dir (removed afterwards) holding only the run's
files, an environment of PATH/HOME/TMPDIR/LANG only, rlimits on CPU, address space, file size,
open files and core dumps, wall time and output size as in `process.supervise`, the run's
cgroup (if any) capping memory and processes, and — when we are root — the command runs as
uid 65534 so RLIMIT_NPROC binds and it cannot write root's files. Without root, RLIMIT_NPROC
is not set (it would count every process of the calling user) and nothing caps processes
unless cgroups are available. Processes that leave the session (`setsid`) are only caught by
the cgroup; without one they can outlive the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import anyio
import structlog

from sandbox.cgroups import CgroupHost, RunCgroup, detect
from sandbox.errors import SandboxUnavailableError
from sandbox.prepare import SANDBOX_PATH, checked_argv, checked_files, host_identity, rlimits
from sandbox.process import Launch, supervise
from sandbox.types import ExecResult, FileContent, Limits, SandboxConfig

log = structlog.get_logger(__name__)


class UnsandboxedSandbox:
    """`Sandbox` without isolation; see the module docstring before using it."""

    def __init__(self, config: SandboxConfig, cgroups: CgroupHost | None) -> None:
        if not config.allow_unsandboxed:
            raise SandboxUnavailableError(
                "the unsandboxed backend needs sandbox.allow_unsandboxed = true"
            )
        self.config = config
        self.cgroups = cgroups
        self.identity = host_identity()

    @classmethod
    def create(cls, config: SandboxConfig) -> UnsandboxedSandbox:
        """Build the fallback, with cgroups when `sandbox.cgroups` allows and one is writable."""
        cgroups = detect() if config.cgroups != "off" else None
        if cgroups is None and config.cgroups == "required":
            raise SandboxUnavailableError(
                "no writable cgroup hierarchy with memory and pids controllers; "
                'set sandbox.cgroups = "auto" to run with rlimits only'
            )
        return cls(config, cgroups)

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `argv` in a fresh temporary directory, without isolation."""
        argv = checked_argv(argv)
        limits = limits or self.config.limits()
        checked = checked_files(files, limits)
        workdir = Path(await anyio.to_thread.run_sync(tempfile.mkdtemp, None, "sprawl-sbx-"))
        try:
            await anyio.to_thread.run_sync(self._populate, workdir, checked)
            cgroup = RunCgroup(self.cgroups, limits) if self.cgroups is not None else None
            uid, gid = self.identity or (None, None)
            launch = Launch(
                argv=argv,
                env={"PATH": SANDBOX_PATH, "HOME": str(workdir), "TMPDIR": str(workdir)}
                | {"LANG": "C.UTF-8"},
                cwd=str(workdir),
                uid=uid,
                gid=gid,
                rlimits=rlimits(limits, with_nproc=self.identity is not None),
                cgroup=cgroup,
            )
            return await supervise(launch, limits, stdin)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)

    def _populate(self, workdir: Path, files: list[tuple[PurePosixPath, bytes]]) -> None:
        for relative, data in files:
            target = workdir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if self.identity is not None:
            uid, gid = self.identity
            for root, dirs, names in os.walk(workdir):
                for name in [*dirs, *names]:
                    os.chown(os.path.join(root, name), uid, gid)
            os.chown(workdir, uid, gid)
