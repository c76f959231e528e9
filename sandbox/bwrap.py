"""The bubblewrap backend: each run in fresh Linux namespaces with a read-only system.

What a run sees: every namespace unshared (user, pid, net, ipc, uts, cgroup) — the network
namespace has only its own loopback, so no host service, no other machine and no DNS is
reachable; the pid namespace shows only the run's own processes; uid/gid 65534 with every
capability dropped and no_new_privs set (setuid binaries and `sudo` cannot raise privileges);
/usr (and the /bin, /sbin, /lib* links or binds) plus a few loader files of /etc read-only,
a synthesized /etc/passwd and /etc/group, a fresh /proc and a minimal /dev, all three
read-only; the work dir /work is a tmpfs capped at `tmpfs_mb` (/tmp links to it) holding only
the run's files, with the `ro_binds` mounted after it (so binds under /work and /tmp show); an
empty environment apart from PATH, HOME, TMPDIR and LANG. Nothing else of the host is mounted:
not /root, /home, /work of the host, /tmp, /etc/shadow or /sys.

Limits: rlimits (CPU, AS, NPROC, FSIZE, NOFILE, CORE) are applied by `prlimit` inside the
namespace, so RLIMIT_NPROC counts only this run's processes; bwrap itself starts under the CPU,
AS, FSIZE and CORE ones (`prepare.init_rlimits`), so the namespace's init has them too. Every
process of the run, init included, is under the seccomp filter of `syscalls.py` (no ptrace,
no keyrings, no memfd or SysV shm without a cgroup, ...), and /proc is read-only, so the init —
same uid, dumpable — cannot be attached to or written through /proc/1/mem. Optional cgroups
(see `cgroups.py`) cap the whole run's memory and processes; wall time and output size are
enforced by `process.supervise`, which also guarantees no process outlives the run. When we are
root on the host, bwrap itself is started as uid 65534 (unprivileged user namespace), so
sandboxed processes are nobody on the host too and RLIMIT_NPROC binds.

Requests: bwrap's options travel in a memfd (`--args`), so only the command's argv counts
against the kernel's argument limits (checked before start, `prepare.checked_argv`); a run that
bwrap could not set up (its `--json-status-fd` never reports the command's exit) raises
`SandboxRequestError` with bwrap's message.

Detected at `create` and refused or reported, never silently weakened: bwrap missing, too old
(no `--json-status-fd`) or unable to start (error naming `sandbox.backend` /
`sandbox.allow_unsandboxed`), a `ro_binds` entry missing on the host, libseccomp missing,
user namespaces unavailable to uid 65534 (then bwrap runs as the calling user, logged), no
`--size` support (tmpfs uncapped, only RLIMIT_FSIZE per file; logged), no `--disable-userns`
(nested user namespaces possible; logged).

Not covered: kernel exploits through the syscalls the filter allows, CPU/side-channel attacks,
resource use of the shared kernel (page cache, inode tables, socket and pipe buffers), and
anything `ro_binds` exposes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog

from sandbox.cgroups import CgroupHost, RunCgroup, detect
from sandbox.errors import SandboxUnavailableError
from sandbox.prepare import (
    NOBODY,
    SANDBOX_PATH,
    checked_argv,
    checked_files,
    host_identity,
    init_rlimits,
    parent_dirs,
    prlimit_args,
)
from sandbox.process import Launch, reap_announced_init, supervise
from sandbox.syscalls import SyscallFilterError, compile_filter, denied
from sandbox.types import (
    ETC_ENTRIES,
    SYSTEM_DIRS,
    WORKDIR,
    ExecResult,
    FileContent,
    Limits,
    SandboxConfig,
    bind_target,
    checked_source,
)

log = structlog.get_logger(__name__)

_PASSWD = f"root:x:0:0:root:/:/usr/sbin/nologin\nnobody:x:{NOBODY}:{NOBODY}:nobody:/work:/bin/sh\n"
_GROUP = f"root:x:0:\nnogroup:x:{NOBODY}:\n"
_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BwrapFeatures:
    """What this bwrap binary and this host allow, found once at pool creation."""

    path: str
    size: bool
    perms: bool
    disable_userns: bool
    host_identity: tuple[int, int] | None
    prlimit: str


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("sprawl-sandbox")
    try:
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class BwrapSandbox:
    """`Sandbox` implemented with bubblewrap. Build with `create`; `run` is concurrency-safe."""

    def __init__(
        self,
        config: SandboxConfig,
        features: BwrapFeatures,
        cgroups: CgroupHost | None,
        seccomp: bytes,
    ) -> None:
        self.config = config
        self.features = features
        self.cgroups = cgroups
        self.seccomp = seccomp
        """The compiled syscall filter every process of a run is under (`syscalls.py`)."""
        self.bind_sources = {path: os.path.realpath(path) for path in config.ro_binds}
        """Each `ro_binds` entry's source resolved through its symlinks, checked here and
        mounted as resolved (a link changed afterwards is not followed)."""
        for path, source in self.bind_sources.items():
            try:
                checked_source(path, source)
            except ValueError as exc:
                raise SandboxUnavailableError(str(exc)) from None
        self._work_binds = [
            str(PurePosixPath(target).relative_to(WORKDIR))
            for target in map(bind_target, config.ro_binds)
            if PurePosixPath(target).is_relative_to(WORKDIR)
        ]

    @classmethod
    def create(cls, config: SandboxConfig) -> BwrapSandbox:
        """Find bwrap, check it can start a sandbox here, detect cgroups; raise if unusable."""
        for path in config.ro_binds:
            if not os.path.exists(path):
                raise SandboxUnavailableError(
                    f"sandbox.ro_binds entry {path!r} does not exist on this host"
                )
        features = _detect_features(config)
        cgroups = detect() if config.cgroups != "off" else None
        if cgroups is None and config.cgroups == "required":
            raise SandboxUnavailableError(
                "no writable cgroup hierarchy with memory and pids controllers; "
                'set sandbox.cgroups = "auto" to run with rlimits only'
            )
        try:
            bounded = cgroups is not None
            seccomp = compile_filter(denied(cgroup=bounded), cap_socket_buffers=not bounded)
        except SyscallFilterError as exc:
            raise SandboxUnavailableError(
                f"the sandbox's syscall filter cannot be built: {exc}; install the Debian "
                "package libseccomp2 (scripts/install-system-deps.sh) and the pyseccomp "
                'package, or set sandbox.backend = "unsandboxed" with '
                "sandbox.allow_unsandboxed = true to run without isolation"
            ) from exc
        sandbox = cls(config, features, cgroups, seccomp)
        sandbox._probe()
        log.info(
            "sandbox.bwrap_ready",
            bwrap=features.path,
            cgroups=None if cgroups is None else f"v{cgroups.version}",
            host_uid=None if features.host_identity is None else features.host_identity[0],
            tmpfs_capped=features.size,
            nested_userns_blocked=features.disable_userns,
        )
        return sandbox

    def _probe(self) -> None:
        launch = self._launch(["true"], [], self.config.limits(), cgroup=None)
        try:
            done = subprocess.run(
                launch.command(),
                env=dict(launch.env),
                pass_fds=launch.pass_fds,
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        finally:
            for fd in launch.pass_fds:
                os.close(fd)
            if launch.status_fd is not None:
                reap_announced_init(launch.status_fd, _PROBE_TIMEOUT_S)
        if done.returncode != 0:
            cause = (
                "an entry of sandbox.ro_binds may not be readable by uid 65534, or user "
                "namespaces may be disabled"
                if self.config.ro_binds
                else "user namespaces may be disabled"
            )
            raise SandboxUnavailableError(
                f"bubblewrap at {self.features.path} cannot start a sandbox here "
                f"(exit {done.returncode}: {done.stderr.decode(errors='replace').strip()}); "
                f"{cause} (sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces, "
                "AppArmor restrict_unprivileged_userns). Fix the host or the config, "
                'or set sandbox.backend = "unsandboxed" with sandbox.allow_unsandboxed = true '
                "to run without isolation"
            )

    def _launch(
        self,
        argv: Sequence[str],
        files: list[tuple[PurePosixPath, bytes]],
        limits: Limits,
        *,
        cgroup: RunCgroup | None,
    ) -> Launch:
        """The launch spec; it owns every descriptor it opened (none is left on failure).

        bwrap's options travel in a memfd (`--args`), so only the command's own argv counts
        against the kernel's argument limits."""
        feats = self.features
        fds: list[int] = []
        status_r: int | None = None
        try:
            opts = ["--unshare-all", "--unshare-user", "--unshare-net"]
            opts += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
            opts += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
            for name in SYSTEM_DIRS:
                if os.path.islink(name):
                    opts += ["--symlink", os.readlink(name), name]
                elif os.path.isdir(name):
                    opts += ["--ro-bind", name, name]
            opts += ["--dir", "/etc"]
            for entry in ETC_ENTRIES:
                if os.path.exists(f"/etc/{entry}"):
                    opts += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
            for target, text in (("/etc/passwd", _PASSWD), ("/etc/group", _GROUP)):
                fds.append(_memfd(text.encode()))
                opts += ["--ro-bind-data", str(fds[-1]), target]
            opts += ["--proc", "/proc", "--dev", "/dev"]
            if feats.perms:
                opts += ["--perms", "0700"]
            if feats.size:
                opts += ["--size", str(limits.tmpfs_mb << 20)]
            opts += ["--tmpfs", WORKDIR, "--symlink", WORKDIR, "/tmp"]
            for directory in parent_dirs([path for path, _ in files]):
                opts += ["--dir", f"{WORKDIR}/{directory}"]
            for relative, data in files:
                fds.append(_memfd(data))
                opts += ["--file", str(fds[-1]), f"{WORKDIR}/{relative}"]
            # After the work-dir tmpfs, so binds under /work and /tmp are not hidden by it.
            for bind, source in self.bind_sources.items():
                opts += ["--ro-bind", source, bind_target(bind)]
            # /proc read-only: /proc/1/mem of the namespace's init cannot be written.
            opts += ["--remount-ro", "/", "--remount-ro", "/dev", "--remount-ro", "/proc"]
            opts += ["--chdir", WORKDIR]
            env = {"PATH": SANDBOX_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
            for key, value in env.items():
                opts += ["--setenv", key, value]
            if feats.disable_userns:
                opts += ["--disable-userns"]
            fds.append(_memfd(self.seccomp))
            opts += ["--seccomp", str(fds[-1])]
            status_r, status_w = os.pipe()
            fds.append(status_w)
            opts += ["--json-status-fd", str(status_w)]
            fds.append(_memfd(b"".join(os.fsencode(opt) + b"\0" for opt in opts)))
            args = [feats.path, "--args", str(fds[-1]), "--"]
            args += [feats.prlimit, *prlimit_args(limits), "--", *argv]
        except BaseException:
            for fd in fds if status_r is None else [*fds, status_r]:
                os.close(fd)
            raise
        uid, gid = feats.host_identity or (None, None)
        return Launch(
            argv=args,
            env={"PATH": SANDBOX_PATH},
            uid=uid,
            gid=gid,
            rlimits=init_rlimits(limits),
            pass_fds=fds,
            status_fd=status_r,
            cgroup=cgroup,
        )

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `argv` (looked up on the sandbox's PATH) in a fresh sandbox."""
        argv = checked_argv(argv)
        limits = limits or self.config.limits()
        checked = checked_files(files, limits, binds=self._work_binds)
        cgroup = RunCgroup(self.cgroups, limits) if self.cgroups is not None else None
        try:
            launch = self._launch(argv, checked, limits, cgroup=cgroup)
        except BaseException:
            if cgroup is not None:
                await cgroup.close()
            raise
        return await supervise(launch, limits, stdin)


def _help_text(path: str) -> str:
    try:
        done = subprocess.run([path, "--help"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailableError(f"bubblewrap at {path} does not run: {exc}") from exc
    return (done.stdout + done.stderr).decode(errors="replace")


def _userns_as_nobody(path: str) -> bool:
    """Whether bwrap can create a user namespace when started as uid 65534."""
    try:
        done = subprocess.run(
            [path, "--unshare-user", "--ro-bind", "/", "/", "true"],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _detect_features(config: SandboxConfig) -> BwrapFeatures:
    path = shutil.which(config.bwrap_path)
    if path is None:
        raise SandboxUnavailableError(
            f"bubblewrap ({config.bwrap_path!r}, sandbox.bwrap_path) is not installed; install "
            "the Debian package `bubblewrap` (scripts/install-system-deps.sh), or set "
            'sandbox.backend = "unsandboxed" with sandbox.allow_unsandboxed = true to run '
            "without isolation"
        )
    prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
    if prlimit is None or not Path(prlimit).resolve().is_relative_to("/usr"):
        raise SandboxUnavailableError(
            "util-linux `prlimit` is not under /usr, so rlimits cannot be applied inside "
            "the sandbox; install util-linux"
        )
    helptext = _help_text(path)
    if "--json-status-fd" not in helptext:
        raise SandboxUnavailableError(
            f"bubblewrap at {path} is too old (no --json-status-fd); upgrade it, "
            'or set sandbox.backend = "unsandboxed" with sandbox.allow_unsandboxed = true to '
            "run without isolation"
        )
    identity = host_identity()
    if identity is not None and not _userns_as_nobody(path):
        log.warning(
            "sandbox.bwrap_runs_as_root",
            detail="uid 65534 cannot create user namespaces here, so bwrap runs as root; "
            "sandboxed processes map to host uid 0 and RLIMIT_NPROC does not bind them "
            "(cgroup pids.max still does where available)",
        )
        identity = None
    features = BwrapFeatures(
        path=path,
        size="--size" in helptext,
        perms="--perms" in helptext,
        disable_userns="--disable-userns" in helptext,
        host_identity=identity,
        prlimit=prlimit,
    )
    if not features.size:
        log.warning(
            "sandbox.tmpfs_uncapped",
            detail="bwrap lacks --size (needs >= 0.7); the work dir is bounded only by "
            "RLIMIT_FSIZE per file and the cgroup memory limit",
        )
    if not features.disable_userns:
        log.warning(
            "sandbox.nested_userns_allowed",
            detail="bwrap lacks --disable-userns (needs >= 0.8); sandboxed code can create "
            "nested user namespaces",
        )
    return features
