"""Sandbox config, request validation, the pool, both backends' normal paths, fallback rules."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from structlog.testing import capture_logs

from sandbox.errors import SandboxRequestError, SandboxUnavailableError
from sandbox.local import UnsandboxedSandbox
from sandbox.pool import SandboxPool, build_backend
from sandbox.prepare import checked_files, parent_dirs, prlimit_args, rlimits
from sandbox.types import ExecResult, FileContent, Limits, Sandbox, SandboxConfig

REPO = Path(__file__).resolve().parents[2]
SMALL = SandboxConfig(wall_seconds=3, cpu_seconds=2, memory_mb=256, tmpfs_mb=8, max_processes=32)


@pytest.fixture(scope="module")
def pool() -> SandboxPool:
    try:
        return SandboxPool(SMALL)
    except SandboxUnavailableError as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc}")


def test_config_defaults_bounds_and_forbid_extra() -> None:
    config = SandboxConfig()
    assert config.backend == "bwrap"
    assert not config.allow_unsandboxed
    assert config.limits().wall_seconds == config.wall_seconds
    with pytest.raises(ValidationError):
        SandboxConfig(wall_secs=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValidationError, match=r"sandbox\.allow_unsandboxed"):
        SandboxConfig(backend="unsandboxed")
    with pytest.raises(ValidationError, match="absolute"):
        SandboxConfig(ro_binds=("relative/path",))
    with pytest.raises(ValueError, match="wall_seconds"):
        dataclasses.replace(config.limits(), wall_seconds=0)


def test_importing_sandbox_does_not_import_torch() -> None:
    code = "import sys, sandbox.types, sandbox.pool; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


@given(st.dictionaries(st.text(min_size=1, max_size=12), st.binary(max_size=8), max_size=6))
def test_checked_files_never_leave_the_work_dir(files: dict[str, bytes]) -> None:
    limits = SMALL.limits()
    try:
        checked = checked_files(files, limits)
    except SandboxRequestError:
        return
    for path, data in checked:
        assert not path.is_absolute()
        assert ".." not in path.parts
        assert files[str(path)] == data
    for directory in parent_dirs([path for path, _ in checked]):
        assert not directory.is_absolute()
        assert ".." not in directory.parts


def test_checked_files_rejects_escapes_and_oversize() -> None:
    limits = SMALL.limits()
    for bad in ("/etc/passwd", "../x", "a/../../x", "a//b", "./x", "", "nul\0"):
        with pytest.raises(SandboxRequestError):
            checked_files({bad: "x"}, limits)
    with pytest.raises(SandboxRequestError, match=r"sandbox\.tmpfs_mb"):
        checked_files({"big": b"\0" * ((limits.tmpfs_mb << 20) + 1)}, limits)
    assert parent_dirs([PurePosixPath("a/b/c.txt"), PurePosixPath("a/d.txt")]) == [
        PurePosixPath("a"),
        PurePosixPath("a/b"),
    ]


def test_rlimits_follow_limits() -> None:
    limits = Limits(1.2, 5, 100, 7, 10, 3)
    table = rlimits(limits, with_nproc=True)
    assert table["RLIMIT_CPU"] == (2, 3)
    assert table["RLIMIT_AS"] == (100 << 20, 100 << 20)
    assert table["RLIMIT_NPROC"] == (7, 7)
    assert table["RLIMIT_FSIZE"] == (3 << 20, 3 << 20)
    assert "RLIMIT_NPROC" not in rlimits(limits, with_nproc=False)
    assert "--nproc=7:7" in prlimit_args(limits)


def test_missing_bwrap_names_the_config_keys() -> None:
    config = SandboxConfig(bwrap_path="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailableError) as info:
        build_backend(config)
    message = str(info.value)
    assert "sandbox.backend" in message
    assert "sandbox.allow_unsandboxed" in message
    assert "bubblewrap" in message


def test_fallback_only_when_allowed_and_warns_every_time() -> None:
    config = SandboxConfig(bwrap_path="/nonexistent/bwrap", allow_unsandboxed=True)
    for _ in range(2):
        with capture_logs() as logs:
            pool = SandboxPool(config)
        assert isinstance(pool.backend, UnsandboxedSandbox)
        events = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
        assert events == ["sandbox.bwrap_unavailable", "sandbox.UNSANDBOXED"]
        assert "no seccomp filter" in logs[-1]["detail"]  # said loudly, not left implied
    with pytest.raises(SandboxUnavailableError, match="allow_unsandboxed"):
        UnsandboxedSandbox(SandboxConfig(), None)


@pytest.mark.anyio
async def test_files_stdin_args_and_imports(pool: SandboxPool) -> None:
    files: dict[str, FileContent] = {"pkg/helper.py": "VALUE = 41\n", "data.bin": b"\x00\xff"}
    code = (
        "import sys\nfrom pkg.helper import VALUE\n"
        "print(VALUE + 1, open('data.bin','rb').read().hex(), sys.stdin.read(), sys.argv[1:])"
    )
    result = await pool.run_python(code, files=files, stdin=b"piped", args=["a", "b"])
    assert result.ok, result
    assert result.stdout == "42 00ff piped ['a', 'b']\n"
    failing = await pool.run(["sh", "-c", "echo oops >&2; exit 3"])
    assert failing.exit_code == 3
    assert failing.stderr == "oops\n"
    assert not failing.ok
    missing = await pool.run(["no-such-command-here"])
    assert missing.exit_code not in (0, None)
    with pytest.raises(SandboxRequestError, match="reserved"):
        await pool.run_python("1", files={"_main.py": "2"})


@pytest.mark.anyio
async def test_runs_are_fresh(pool: SandboxPool) -> None:
    first = await pool.run(["sh", "-c", "echo x > left.txt; ls"])
    second = await pool.run(["ls", "-A"])
    assert first.stdout == "left.txt\n"
    assert second.stdout == ""


class RecordingSandbox:
    """Wraps a real backend and records how many runs overlap."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner
        self.active = 0
        self.peak = 0

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self.inner.run(argv, files=files, stdin=stdin, limits=limits)
        finally:
            self.active -= 1


@pytest.mark.anyio
async def test_pool_caps_concurrency(pool: SandboxPool) -> None:
    recorder = RecordingSandbox(pool.backend)
    capped = SandboxPool(SMALL.model_copy(update={"max_concurrency": 2}), backend=recorder)
    results: list[ExecResult] = []

    async def one() -> None:
        results.append(await capped.run(["sleep", "0.3"]))

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert recorder.peak == 2
    assert len(results) == 5
    assert all(r.ok for r in results)
    assert time.monotonic() - started >= 0.9  # three waves of 0.3 s
    assert capped.in_flight == 0


@pytest.mark.anyio
async def test_unsandboxed_backend_applies_limits_and_cleans_up() -> None:
    config = SMALL.model_copy(update={"backend": "unsandboxed", "allow_unsandboxed": True})
    with capture_logs() as logs:
        local = SandboxPool(config)
    assert any(entry["event"] == "sandbox.UNSANDBOXED" for entry in logs)
    result = await local.run(
        ["sh", "-c", "cat f.txt; ulimit -t; ulimit -v; pwd; env | sort | cut -d= -f1"],
        files={"f.txt": "hello\n"},
    )
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[:3] == ["hello", "2", str(256 * 1024)]
    workdir = Path(lines[3])
    assert workdir.name.startswith("sprawl-sbx-")
    assert not await anyio.Path(workdir).exists()
    assert set(lines[4:]) <= {"HOME", "LANG", "PATH", "PWD", "TMPDIR", "SHLVL", "_"}
    if os.geteuid() == 0:
        uid = await local.run(["id", "-u"])
        assert uid.stdout == "65534\n"
    limits = dataclasses.replace(config.limits(), wall_seconds=0.5)
    slow = await local.run(["sleep", "10"], limits=limits)
    assert slow.killed_reason == "wall_time"
    assert slow.duration_s < 2
