"""The seccomp filter of a bwrap run: syscalls a run never needs fail with EPERM.

bwrap loads the filter (`--seccomp FD`, a classic-BPF program compiled here by libseccomp) into
the namespace's init and into the command just before `exec`, so every process of the run is
under it and no descendant can lift it. Everything not listed is allowed: this narrows the
kernel surface a run reaches, it is not an allow-list.

Denied always: another process's memory, registers and descriptors (`ptrace`,
`process_vm_readv`/`writev`, `pidfd_getfd`: the namespace's init shares the run's uid, so without
this the run could take it over and escape its rlimits); the kernel keyrings (`keyctl`, `add_key`,
`request_key`: the orchestrator's session keyring is inherited, so runs could read its keys and
leave keys for the next run); and kernel interfaces with a record of exploits and no use in a run
(`bpf`, `perf_event_open`, `userfaultfd`, io_uring, module and kexec loading, mounts, swap,
`reboot`, `acct`, `quotactl`, `syslog`, file handles, `memfd_secret`).

Denied when the run has no cgroup: memory that no rlimit bounds — `memfd_create` and SysV shared
memory (`shmget`) pages are not address space, so without a cgroup memory limit a run could hold
gigabytes in them; and raising a socket's buffers (`setsockopt` of `SO_SNDBUF`, `SO_RCVBUF` and
their `FORCE` forms at `SOL_SOCKET`, matched on those arguments), which let one process hold
941 MiB of kernel memory at `memory_mb = 256`: each socket keeps the host's default buffers. With
a cgroup all of it is charged to the run and stays allowed.

Not covered: every other rule matches the syscall number only, never arguments; the architecture
is the host's (a syscall of another ABI, e.g. 32-bit `int 0x80` on x86_64, kills the process).
"""

from __future__ import annotations

import errno
import socket
import tempfile
from typing import Final

ALWAYS_DENIED: Final = (
    *("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"),
    *("keyctl", "add_key", "request_key"),
    *("bpf", "perf_event_open", "userfaultfd"),
    *("io_uring_setup", "io_uring_enter", "io_uring_register"),
    *("kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module"),
    *("mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig"),
    *("fsmount", "fspick", "mount_setattr", "swapon", "swapoff", "reboot", "acct"),
    *("quotactl", "quotactl_fd", "syslog", "open_by_handle_at", "name_to_handle_at"),
    "memfd_secret",
)
"""Syscalls no run may make."""

UNBOUNDED_WITHOUT_CGROUP: Final = ("memfd_create", "shmget")
"""Syscalls whose memory only a cgroup bounds; denied to runs without one."""

SO_SNDBUFFORCE: Final = 32
SO_RCVBUFFORCE: Final = 33
BUFFER_OPTIONS: Final = (socket.SO_SNDBUF, socket.SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE)
"""`setsockopt` options at `SOL_SOCKET` that raise a socket's buffers; denied without a cgroup."""


class SyscallFilterError(RuntimeError):
    """libseccomp is missing or cannot compile the filter (the message says which)."""


def denied(*, cgroup: bool) -> tuple[str, ...]:
    """The syscalls a run with (or without) a cgroup may not make."""
    return ALWAYS_DENIED if cgroup else (*ALWAYS_DENIED, *UNBOUNDED_WITHOUT_CGROUP)


def compile_filter(names: tuple[str, ...], *, cap_socket_buffers: bool = False) -> bytes:
    """The BPF program denying `names` with EPERM for the host's architecture, and with
    `cap_socket_buffers` each `setsockopt` of :data:`BUFFER_OPTIONS`.

    A name this libseccomp does not know raises, so a filter is never silently narrower than
    documented."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError) as exc:  # RuntimeError: the library is not installed
        raise SyscallFilterError(f"libseccomp cannot be loaded ({exc})") from exc
    native = pyseccomp.Arch.NATIVE
    unknown = [name for name in names if pyseccomp.resolve_syscall(native, name) == -1]
    if unknown:
        raise SyscallFilterError(f"this libseccomp does not know the syscalls {unknown}")
    program = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    program.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    for name in names:
        program.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    for option in BUFFER_OPTIONS if cap_socket_buffers else ():
        level = pyseccomp.Arg(1, pyseccomp.EQ, socket.SOL_SOCKET)
        program.add_rule(
            pyseccomp.ERRNO(errno.EPERM),
            "setsockopt",
            level,
            pyseccomp.Arg(2, pyseccomp.EQ, option),
        )
    with tempfile.TemporaryFile() as sink:
        program.export_bpf(sink)
        sink.seek(0)
        return sink.read()
