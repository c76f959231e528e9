"""Hardening of the bubblewrap backend (#19 items 1-5): each test is an attack or a bad request.

Like the escape suite, every test checks what the sandboxed code observed and the host side.
The namespace's init must be as bounded as the command (no ptrace, no /proc/1/mem, rlimits),
syscalls a run never needs are denied, runs share no keyring, memory held in memfds is bounded
without cgroups, `ro_binds` land where they are asked for (or are refused), and every bad request
raises `SandboxRequestError` without leaking a descriptor. docs/sandbox.md reports the results.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pyseccomp
import pytest
from pydantic import ValidationError

from sandbox.errors import SandboxRequestError, SandboxUnavailableError
from sandbox.pool import SandboxPool
from sandbox.types import SandboxConfig
from tests.support.sandbox import verdict

TIGHT = SandboxConfig(
    wall_seconds=4,
    cpu_seconds=1,
    memory_mb=256,
    max_processes=32,
    max_output_bytes=64 * 1024,
    tmpfs_mb=8,
    max_concurrency=4,
)
NO_CGROUPS = TIGHT.model_copy(update={"cgroups": "off"})


def make_pool(config: SandboxConfig) -> SandboxPool:
    try:
        return SandboxPool(config)
    except SandboxUnavailableError as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc}")


@pytest.fixture(scope="module")
def pool() -> SandboxPool:
    return make_pool(TIGHT)


@pytest.fixture(scope="module")
def bare_pool() -> SandboxPool:
    """No cgroups: rlimits (and the syscall filter) are all that bound a run."""
    return make_pool(NO_CGROUPS)


def syscall_number(name: str) -> int:
    number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    assert isinstance(number, int)
    if number < 0:
        pytest.skip(f"no {name} syscall on this architecture")
    return number


def leaked(before: set[tuple[str, str]], runs: int) -> set[tuple[str, str]]:
    """Descriptors open now that were not ``before`` and look like ``runs`` runs' leak: any
    that is not a socket (the sandbox opens pipes and files), or as many sockets as runs. A
    socket something else in the test process replaced meanwhile (an event loop's wake-up pair
    from an earlier test, collected) is not one: CI saw one such."""
    new = open_fds() - before
    sockets = {f for f in new if f[1].startswith("socket:")}
    return new - sockets if len(sockets) < runs else new


def open_fds() -> set[tuple[str, str]]:
    """Each open descriptor with what it points at: a leak is an entry not there before (a
    descriptor something else in the process closed meanwhile is not one)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
    return fds


@pytest.mark.anyio
async def test_namespace_init_cannot_be_taken_over(bare_pool: SandboxPool) -> None:
    code = """
import ctypes, json, os
out = {}
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH to the namespace's init
out["ptrace"] = "attached" if rc == 0 else os.strerror(ctypes.get_errno())
try:
    open("/proc/1/mem", "r+b").close()
    out["mem"] = "opened for writing"
except OSError as e:
    out["mem"] = os.strerror(e.errno)
limits = {}
for line in open("/proc/1/limits").read().splitlines()[1:]:
    name, soft = line[:26].strip(), line[26:47].strip()
    limits[name] = soft
out["as"] = limits["Max address space"]
out["cpu"] = limits["Max cpu time"]
out["core"] = limits["Max core file size"]
print(json.dumps(out))
"""
    seen = verdict(await bare_pool.run_python(code))
    assert seen["ptrace"] == "Operation not permitted"
    assert seen["mem"] == "Read-only file system"
    assert seen["as"] == str(TIGHT.memory_mb << 20)
    assert seen["cpu"] == "1"
    assert seen["core"] == "0"


@pytest.mark.anyio
async def test_syscalls_a_run_never_needs_are_denied(pool: SandboxPool) -> None:
    names = [
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "pidfd_getfd",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "kexec_load",
        "init_module",
    ]
    numbers = {name: syscall_number(name) for name in names}
    code = f"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {{}}
for name, nr in {numbers!r}.items():
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0),
                      ctypes.c_long(0), ctypes.c_long(0))
    out[name] = "ok" if rc >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps(out))
"""
    seen = verdict(await pool.run_python(code))
    assert seen == dict.fromkeys(names, "Operation not permitted")


def _keys(nr_request_key: int, description: str) -> int:
    """Serial of a `user` key named `description` in this process's keyrings, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(nr_request_key), b"user", description.encode(), None, ctypes.c_long(0)
    )
    return int(rc) if rc >= 0 else -ctypes.get_errno()


@pytest.mark.anyio
async def test_runs_share_no_session_keyring(pool: SandboxPool) -> None:
    add_key, request_key = syscall_number("add_key"), syscall_number("request_key")
    host_key, planted = f"sprawl-host-{uuid.uuid4().hex}", f"sprawl-run-{uuid.uuid4().hex}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    secret = b"host-keyring-secret"
    serial = libc.syscall(
        ctypes.c_long(add_key), b"user", host_key.encode(), secret, len(secret), -3
    )  # KEY_SPEC_SESSION_KEYRING of the orchestrator (this test process)
    if serial < 0:
        pytest.skip(f"cannot add a key here: {os.strerror(ctypes.get_errno())}")
    probe = f"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {{}}
rc = libc.syscall(ctypes.c_long({request_key}), b"user", sys.argv[1].encode(), None, 0)
out["read_host_key"] = "found" if rc >= 0 else os.strerror(ctypes.get_errno())
rc = libc.syscall(ctypes.c_long({add_key}), b"user", sys.argv[2].encode(), b"left", 4, -3)
out["leave_key"] = "added" if rc >= 0 else os.strerror(ctypes.get_errno())
rc = libc.syscall(ctypes.c_long({request_key}), b"user", sys.argv[2].encode(), None, 0)
out["read_left_key"] = "found" if rc >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps(out))
"""
    try:
        first = verdict(await pool.run_python(probe, args=[host_key, planted]))
        second = verdict(await pool.run_python(probe, args=[host_key, f"other-{planted}"]))
    finally:
        libc.syscall(ctypes.c_long(syscall_number("keyctl")), 3, ctypes.c_long(serial))  # REVOKE
    denied = "Operation not permitted"
    assert first == {"read_host_key": denied, "leave_key": denied, "read_left_key": denied}
    assert second == first
    assert _keys(request_key, planted) == -errno.ENOKEY  # nothing was left for the host either


MEMFD_HOARD = """
import json, os
held, fds, error = 0, [], None
while held < (1 << 30):
    try:
        fd = os.memfd_create("hoard")
        os.ftruncate(fd, 4 << 20)
        os.pwrite(fd, b"x" * (4 << 20), 0)
    except OSError as e:
        error = os.strerror(e.errno)
        break
    fds.append(fd)
    held += 4 << 20
print(json.dumps({"held_mb": held >> 20, "error": error}))
"""

SYSV_HOARD = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, error = 0, None
while held < (1 << 30):
    shmid = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if shmid < 0:
        error = os.strerror(ctypes.get_errno())
        break
    address = libc.shmat(shmid, None, 0)
    ctypes.memset(address, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(address))  # the segment stays, outside RLIMIT_AS
    held += 64 << 20
print(json.dumps({"held_mb": held >> 20, "error": error}))
"""


@pytest.mark.anyio
@pytest.mark.parametrize("hoard", [MEMFD_HOARD, SYSV_HOARD], ids=["memfd", "sysv_shm"])
async def test_shared_memory_cannot_outgrow_the_limit_without_cgroups(
    bare_pool: SandboxPool, hoard: str
) -> None:
    limits = dataclasses.replace(NO_CGROUPS.limits(), wall_seconds=10, cpu_seconds=8)
    seen = verdict(await bare_pool.run_python(hoard, limits=limits))
    assert seen == {"held_mb": 0, "error": "Operation not permitted"}


SOCKET_HOARD = """
import json, socket
held, socks = 0, []
for _ in range(120):
    a, b = socket.socketpair()
    a.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        while held < (1 << 30):
            held += a.send(b"x" * 65536)
    except BlockingIOError:
        pass
    socks += [a, b]
print(json.dumps({"held_mb": held >> 20}))
"""


@pytest.mark.anyio
async def test_socket_buffers_cannot_be_raised_without_cgroups(bare_pool: SandboxPool) -> None:
    """The hoard that held 941 MiB at memory_mb = 256: its buffers stay the host's defaults."""
    code = SOCKET_HOARD.replace(
        "    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)\n",
        "    try:\n"
        "        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)\n"
        "    except OSError as e:\n"
        "        refused = e.strerror\n",
    ).replace("held, socks = 0, []", "held, socks, refused = 0, [], None")
    code = code.replace('{"held_mb": held >> 20}', '{"held_mb": held >> 20, "refused": refused}')
    limits = dataclasses.replace(NO_CGROUPS.limits(), wall_seconds=10, cpu_seconds=8)
    seen = verdict(await bare_pool.run_python(code, limits=limits))
    assert seen["refused"] == "Operation not permitted"
    assert seen["held_mb"] <= NO_CGROUPS.memory_mb // 2, seen


@pytest.mark.anyio
@pytest.mark.parametrize("hoard", [MEMFD_HOARD, SOCKET_HOARD], ids=["memfd", "socket_buffers"])
async def test_kernel_memory_is_charged_to_the_run_cgroup(pool: SandboxPool, hoard: str) -> None:
    """With a cgroup, memory outside the address space (memfd pages, socket buffers) is the
    run's too; docs/sandbox.md states what bounds it without one."""
    if getattr(pool.backend, "cgroups", None) is None:
        pytest.skip("no writable cgroup hierarchy here")
    limits = dataclasses.replace(TIGHT.limits(), wall_seconds=10, cpu_seconds=8)
    result = await pool.run_python(hoard, limits=limits)
    if result.killed_reason is None:
        seen = verdict(result)
        assert isinstance(seen["held_mb"], int)
        assert seen["held_mb"] <= TIGHT.memory_mb + TIGHT.tmpfs_mb, seen
    else:
        assert result.killed_reason == "memory", result


@pytest.fixture
def host_dirs() -> Iterator[tuple[Path, Path]]:
    """One host directory under /work and one under /tmp, each holding a marker file."""
    created_work = not Path("/work").exists()
    try:
        Path("/work").mkdir(exist_ok=True)
        under_work = Path(tempfile.mkdtemp(prefix="sprawl-bind-", dir="/work"))
    except OSError as exc:
        pytest.skip(f"cannot create a host directory under /work: {exc}")
    under_tmp = Path(tempfile.mkdtemp(prefix="sprawl-bind-", dir="/tmp"))
    for directory in (under_work, under_tmp):
        (directory / "marker.txt").write_text(directory.name)
        directory.chmod(0o755)
        (directory / "marker.txt").chmod(0o644)
    try:
        yield under_work, under_tmp
    finally:
        shutil.rmtree(under_work, ignore_errors=True)
        shutil.rmtree(under_tmp, ignore_errors=True)
        if created_work:
            Path("/work").rmdir()


@pytest.mark.anyio
async def test_ro_binds_under_work_and_tmp_are_visible(
    pool: SandboxPool, host_dirs: tuple[Path, Path]
) -> None:
    under_work, under_tmp = host_dirs
    pool = SandboxPool(TIGHT.model_copy(update={"ro_binds": (str(under_work), str(under_tmp))}))
    code = f"""
import json, os
out = {{}}
for d in [{str(under_work)!r}, {str(under_tmp)!r}]:
    try:
        out[d] = open(os.path.join(d, "marker.txt")).read()
    except OSError as e:
        out[d] = type(e).__name__
try:
    open({str(under_work)!r} + "/planted", "w")
    out["write"] = "written"
except OSError as e:
    out["write"] = os.strerror(e.errno)
out["own"] = sorted(os.listdir("/work")) == sorted(os.listdir("/tmp"))
print(json.dumps(out))
"""
    seen = verdict(await pool.run_python(code, files={"mine.txt": "x"}))
    assert seen == {
        str(under_work): under_work.name,
        str(under_tmp): under_tmp.name,
        "write": "Read-only file system",
        "own": True,
    }
    assert not (under_work / "planted").exists()
    inside = f"{under_work.relative_to('/work')}/x.py"
    with pytest.raises(SandboxRequestError, match=r"sandbox\.ro_binds"):
        await pool.run(["true"], files={inside: "x"})


@pytest.mark.parametrize(
    ("binds", "complaint"),
    [
        (("/opt/venv", "/opt/venv"), "twice"),
        (("/opt", "/opt/venv"), "inside"),
        (("/tmp/cache", "/work/cache"), "same place"),
        (("/",), "replace"),
        (("/work",), "replace"),
        (("/etc",), "replace"),
        (("/proc/self",), "inside"),
        (("/sys/kernel",), "/sys"),
        (("/usr/lib",), "already"),
        (("/opt/../etc",), "normalized"),
        (("/opt/venv/",), "normalized"),
        (("/opt/\0venv",), "NUL"),
    ],
)
def test_overlapping_or_malformed_ro_binds_are_refused(
    binds: tuple[str, ...], complaint: str
) -> None:
    with pytest.raises(ValidationError, match=r"sandbox\.ro_binds") as caught:
        SandboxConfig(ro_binds=binds)
    assert complaint in str(caught.value)


def test_missing_ro_bind_source_names_the_key() -> None:
    missing = f"/nonexistent-{uuid.uuid4().hex}"
    with pytest.raises(SandboxUnavailableError, match=r"sandbox\.ro_binds") as caught:
        SandboxPool(TIGHT.model_copy(update={"ro_binds": (missing,)}))
    assert missing in str(caught.value)
    assert "user namespaces" not in str(caught.value)


@pytest.mark.parametrize("place", ["/", "/proc", "/etc", "/sys/kernel", "/dev/shm", "/work"])
def test_a_bind_through_a_symlink_to_a_forbidden_place_is_refused(
    tmp_path: Path, place: str
) -> None:
    link = tmp_path / "data"
    link.symlink_to(place)
    with pytest.raises(SandboxUnavailableError, match=r"sandbox\.ro_binds") as caught:
        SandboxPool(TIGHT.model_copy(update={"ro_binds": (str(link),)}))
    assert f"resolves to {os.path.realpath(place)!r}" in str(caught.value)


@pytest.mark.anyio
async def test_a_bind_through_a_symlink_shows_what_it_resolves_to(
    host_dirs: tuple[Path, Path],
) -> None:
    _, real = host_dirs
    link = Path(tempfile.mkdtemp(prefix="sprawl-link-", dir="/tmp")) / "data"
    link.parent.chmod(0o755)
    link.symlink_to(real)
    try:
        pool = SandboxPool(TIGHT.model_copy(update={"ro_binds": (str(link),)}))
        result = await pool.run(["cat", f"{link}/marker.txt"])
    finally:
        shutil.rmtree(link.parent)
    assert (result.exit_code, result.stdout) == (0, real.name)


@pytest.mark.anyio
async def test_long_names_and_bad_requests_raise_cleanly_without_leaking(
    pool: SandboxPool,
) -> None:
    longest = "n" * 255
    result = await pool.run(["sh", "-c", f"cat {longest}"], files={longest: "long name"})
    assert result.stdout == "long name", result
    before = open_fds()
    bad_requests: list[tuple[list[str], dict[str, str], str]] = [
        (["true"], {"n" * 256: "x"}, "255"),
        (["true"], {"d/" * 2100 + "f": "x"}, "4096"),
        (["true"], {"a": "file", "a/b": "under a file"}, "'a'"),
        (["echo", "x" * (128 << 10)], {}, "131072"),
        (["echo", "a\0b"], {}, "NUL"),
        (["echo", *["y" * 100_000] * 40], {}, "argv"),
    ]
    for _ in range(40):
        for argv, files, named in bad_requests:
            with pytest.raises(SandboxRequestError, match=named):
                await pool.run(argv, files=files)
    assert leaked(before, runs=40 * len(bad_requests)) == set()


@pytest.mark.anyio
async def test_large_argv_reaches_the_command(pool: SandboxPool) -> None:
    big = ["x" * 100_000, "y" * 100_000, "z" * 100_000]
    result = await pool.run(["sh", "-c", 'printf %s "$@" | wc -c', "sh", *big])
    assert result.ok, result
    assert int(result.stdout) == 300_000


@pytest.fixture
def vanishing() -> Iterator[Path]:
    """A host directory uid 65534 can read, which the test removes."""
    path = Path(tempfile.mkdtemp(prefix="sprawl-vanishing-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.anyio
async def test_setup_failure_is_a_request_error_not_exit_1(
    pool: SandboxPool, vanishing: Path
) -> None:
    pool = SandboxPool(TIGHT.model_copy(update={"ro_binds": (str(vanishing),)}))
    own_exit = await pool.run(["sh", "-c", "echo 'bwrap: fake' >&2; exit 1"])
    assert own_exit.exit_code == 1  # the command's own failure stays data
    await anyio.Path(vanishing).rmdir()
    before = open_fds()
    for _ in range(5):
        with pytest.raises(SandboxRequestError, match=str(vanishing)):
            await pool.run(["true"])
    assert leaked(before, runs=5) == set()
