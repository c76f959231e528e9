"""Host-side launcher: join cgroups, set rlimits, drop privileges, exec the backend.

Run as `python -I -S _launch.py SPEC_JSON ARGV...`, never imported by the package at run time
(it must work without the package installed, so it uses the standard library only). Doing these
steps in a fresh process before `exec` is what makes them race-free: the process is inside its
cgroups and under its limits before it can create a single child, and it gives up root before any
untrusted code exists.

SPEC_JSON: {"cgroup_procs": [path, ...], "rlimits": {"RLIMIT_X": [soft, hard], ...},
            "uid": int | null, "gid": int | null}
ARGV: the executable (on PATH) and its arguments, each its own argument, so the kernel's limit
on one argument applies to each of them rather than to the whole command.
Any failure exits with status 125 and one line on stderr, before the command starts.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

LAUNCH_FAILED = 125


def launch(spec: dict[str, object], argv: list[str]) -> None:
    """Apply `spec` to this process and exec `argv` (returns only by raising)."""
    procs = spec.get("cgroup_procs", [])
    rlimits = spec.get("rlimits", {})
    uid, gid = spec.get("uid"), spec.get("gid")
    assert isinstance(procs, list)
    assert isinstance(rlimits, dict)
    for path in procs:
        with open(str(path), "w") as handle:
            handle.write(str(os.getpid()))
    # Resolve before dropping root: the interpreter's own files may be unreadable afterwards.
    executable = _which(str(argv[0]))
    for name, (soft, hard) in rlimits.items():
        resource.setrlimit(getattr(resource, str(name)), (int(soft), int(hard)))
    if isinstance(gid, int):
        os.setgroups([])
        os.setgid(gid)
    if isinstance(uid, int):
        os.setuid(uid)
    # Python ignores SIGPIPE and SIGXFSZ; the command must get the default actions back.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    os.execv(executable, argv)


def _which(name: str) -> str:
    if "/" in name:
        return name
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"{name!r} not found on PATH")


def main() -> None:
    try:
        launch(json.loads(sys.argv[1]), sys.argv[2:])
    except (OSError, ValueError, KeyError, AssertionError, IndexError) as exc:
        sys.stderr.write(f"sandbox launcher: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(LAUNCH_FAILED) from None


if __name__ == "__main__":
    main()
