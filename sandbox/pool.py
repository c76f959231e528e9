"""The entry point environments use: a pool that builds the configured backend and caps concurrency.

Guarantees: at most `sandbox.max_concurrency` runs are in flight per pool (further callers
wait, in FIFO order, for a slot); building a pool either yields a working isolating backend or
raises `SandboxUnavailableError` naming the config key to change — the only way to get the
unsandboxed backend is `sandbox.allow_unsandboxed = true`, and then a warning is logged at
every pool creation. Each run logs one `sandbox.run` line.

    pool = SandboxPool(SandboxConfig())
    result = await pool.run_python("print(2 + 2)")
    assert result.stdout == "4\\n"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import structlog

from sandbox.bwrap import BwrapSandbox
from sandbox.errors import SandboxRequestError, SandboxUnavailableError
from sandbox.local import UnsandboxedSandbox
from sandbox.types import ExecResult, FileContent, Limits, Sandbox, SandboxConfig

log = structlog.get_logger(__name__)

PYTHON_MAIN = "_main.py"
"""Name `run_python` gives the code in the work dir."""


def build_backend(config: SandboxConfig) -> Sandbox:
    """The backend `config` asks for, with the fallback rules of the module docstring."""
    if config.backend == "unsandboxed":
        return UnsandboxedSandbox.create(config)
    try:
        return BwrapSandbox.create(config)
    except SandboxUnavailableError as exc:
        if not config.allow_unsandboxed:
            raise
        log.warning("sandbox.bwrap_unavailable", reason=str(exc))
        return UnsandboxedSandbox.create(config)


class SandboxPool:
    """Runs commands in the configured sandbox, at most `max_concurrency` at a time."""

    def __init__(self, config: SandboxConfig, *, backend: Sandbox | None = None) -> None:
        """Build the backend from `config` (or use `backend`, e.g. a remote sandbox client)."""
        self.config = config
        self.backend: Sandbox = backend if backend is not None else build_backend(config)
        self._slots = anyio.CapacityLimiter(config.max_concurrency)
        if isinstance(self.backend, UnsandboxedSandbox):
            log.warning(
                "sandbox.UNSANDBOXED",
                detail="model-written code runs WITHOUT isolation: no namespaces and no seccomp "
                "filter, so it can read host files, use the network, make any system call and "
                "signal host processes; only rlimits and wall time apply "
                "(sandbox.allow_unsandboxed = true)",
            )

    @property
    def in_flight(self) -> int:
        """Runs holding a slot right now."""
        return int(self._slots.borrowed_tokens)

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `argv` once a slot is free. Limits hit are on the result, not raised."""
        async with self._slots:
            result = await self.backend.run(argv, files=files, stdin=stdin, limits=limits)
        log.info(
            "sandbox.run",
            argv0=argv[0],
            exit_code=result.exit_code,
            killed_reason=result.killed_reason,
            duration_s=round(result.duration_s, 3),
            stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr),
        )
        return result

    async def run_python(
        self,
        code: str,
        *,
        args: Sequence[str] = (),
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `code` as a script with `sandbox.python`; `files` sit beside it and import."""
        if files is not None and PYTHON_MAIN in files:
            raise SandboxRequestError(f"{PYTHON_MAIN} is reserved for the code run_python runs")
        merged = {**(files or {}), PYTHON_MAIN: code}
        argv = [self.config.python, "-B", "-E", "-s", PYTHON_MAIN, *args]
        return await self.run(argv, files=merged, stdin=stdin, limits=limits)
