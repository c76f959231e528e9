"""The bubblewrap backend: each run in fresh Linux namespaces with a read-only system.

What a run sees: every namespace unshared (user, pid, net, ipc, uts, cgroup) — the network
namespace has only its own loopback, so no host service, no other machine and no DNS is
reachable; the pid namespace shows only the run's own processes; uid/gid 65534 with every
capability dropped and no_new_privs set (setuid binaries and `sudo` cannot raise privileges);
/usr (and the /bin, /sbin, /lib* links or binds) plus a few loader files of /etc read-only,
a synthesized /etc/passwd and /etc/group, a fresh /proc and a minimal /dev, both read-only
roots; the work dir /work is a tmpfs capped at `tmpfs_mb` (/tmp links to it) holding only the
run's files; an empty environment apart from PATH, HOME, TMPDIR and LANG. Nothing else of the
host is mounted: not /root, /home, /work of the host, /tmp, /etc/shadow or /sys.

Limits: rlimits (CPU, AS, NPROC, FSIZE, NOFILE, CORE) are applied by `prlimit` inside the
namespace, so RLIMIT_NPROC counts only this run's processes; optional cgroups (see
`cgroups.py`) cap the whole run's memory and processes; wall time and output size are enforced
by `process.supervise`, which also guarantees no process outlives the run. When we are root on
the host, bwrap itself is started as uid 65534 (unprivileged user namespace), so sandboxed
processes are nobody on the host too and RLIMIT_NPROC binds.

Detected at `create` and refused or reported, never silently weakened: bwrap missing or unable
to start (error naming `sandbox.backend` / `sandbox.allow_unsandboxed`), user namespaces
unavailable to uid 65534 (then bwrap runs as the calling user, logged), no `--size` support
(tmpfs uncapped, only RLIMIT_FSIZE per file; logged), no `--disable-userns` (nested user
namespaces possible; logged).

Not covered: kernel exploits (no seccomp filter is installed), CPU/side-channel attacks,
resource use of the shared kernel (page cache, inode tables), and anything `ro_binds` exposes.
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
    checked_files,
    host_identity,
    parent_dirs,
    prlimit_args,
)
from sandbox.process import Launch, supervise
from sandbox.types import ExecResult, FileContent, Limits, SandboxConfig

log = structlog.get_logger(__name__)

WORKDIR = "/work"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
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


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name, 0)
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
        self, config: SandboxConfig, features: BwrapFeatures, cgroups: CgroupHost | None
    ) -> None:
        self.config = config
        self.features = features
        self.cgroups = cgroups

    @classmethod
    def create(cls, config: SandboxConfig) -> BwrapSandbox:
        """Find bwrap, check it can start a sandbox here, detect cgroups; raise if unusable."""
        features = _detect_features(config)
        cgroups = detect() if config.cgroups != "off" else None
        if cgroups is None and config.cgroups == "required":
            raise SandboxUnavailableError(
                "no writable cgroup hierarchy with memory and pids controllers; "
                'set sandbox.cgroups = "auto" to run with rlimits only'
            )
        sandbox = cls(config, features, cgroups)
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
        launch, fds = self._launch(["true"], [], self.config.limits(), info_w=None, cgroup=None)
        try:
            done = subprocess.run(
                launch.command(),
                env=dict(launch.env),
                pass_fds=fds,
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        finally:
            for fd in fds:
                os.close(fd)
        if done.returncode != 0:
            raise SandboxUnavailableError(
                f"bubblewrap at {self.features.path} cannot start a sandbox here "
                f"(exit {done.returncode}: {done.stderr.decode(errors='replace').strip()}); "
                "user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone, "
                "user.max_user_namespaces, AppArmor restrict_unprivileged_userns). Fix the host, "
                'or set sandbox.backend = "unsandboxed" with sandbox.allow_unsandboxed = true '
                "to run without isolation"
            )

    def _launch(
        self,
        argv: Sequence[str],
        files: list[tuple[PurePosixPath, bytes]],
        limits: Limits,
        *,
        info_w: int | None,
        cgroup: RunCgroup | None,
    ) -> tuple[Launch, list[int]]:
        """The launch spec and the descriptors it consumes (caller closes them on failure)."""
        feats = self.features
        fds: list[int] = []
        try:
            args = [feats.path, "--unshare-all", "--unshare-user", "--unshare-net"]
            args += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
            args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
            for name in _SYSTEM_DIRS:
                if os.path.islink(name):
                    args += ["--symlink", os.readlink(name), name]
                elif os.path.isdir(name):
                    args += ["--ro-bind", name, name]
            args += ["--dir", "/etc"]
            for entry in _ETC_ENTRIES:
                if os.path.exists(f"/etc/{entry}"):
                    args += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
            for target, text in (("/etc/passwd", _PASSWD), ("/etc/group", _GROUP)):
                fds.append(_memfd(text.encode(), target))
                args += ["--ro-bind-data", str(fds[-1]), target]
            for bind in self.config.ro_binds:
                args += ["--ro-bind", bind, bind]
            args += ["--proc", "/proc", "--dev", "/dev"]
            if feats.perms:
                args += ["--perms", "0700"]
            if feats.size:
                args += ["--size", str(limits.tmpfs_mb << 20)]
            args += ["--tmpfs", WORKDIR, "--symlink", WORKDIR, "/tmp"]
            for directory in parent_dirs([path for path, _ in files]):
                args += ["--dir", f"{WORKDIR}/{directory}"]
            for relative, data in files:
                fds.append(_memfd(data, relative.name))
                args += ["--file", str(fds[-1]), f"{WORKDIR}/{relative}"]
            args += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", WORKDIR]
            env = {"PATH": SANDBOX_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
            for key, value in env.items():
                args += ["--setenv", key, value]
            if feats.disable_userns:
                args += ["--disable-userns"]
            if info_w is not None:
                fds.append(info_w)
                args += ["--info-fd", str(info_w)]
            args += ["--", feats.prlimit, *prlimit_args(limits), "--", *argv]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        uid, gid = feats.host_identity or (None, None)
        launch = Launch(
            argv=args,
            env={"PATH": SANDBOX_PATH},
            uid=uid,
            gid=gid,
            pass_fds=fds,
            cgroup=cgroup,
        )
        return launch, fds

    async def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `argv` (looked up on the sandbox's PATH) in a fresh sandbox."""
        if not argv:
            raise ValueError("argv must not be empty")
        limits = limits or self.config.limits()
        checked = checked_files(files, limits)
        cgroup = RunCgroup(self.cgroups, limits) if self.cgroups is not None else None
        info_r, info_w = os.pipe()
        try:
            launch, _ = self._launch(argv, checked, limits, info_w=info_w, cgroup=cgroup)
        except BaseException:
            os.close(info_r)
            if cgroup is not None:
                await cgroup.close()
            raise
        launch.info_fd = info_r
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
