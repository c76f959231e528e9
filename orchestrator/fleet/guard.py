"""``python -m orchestrator.fleet.guard CMD …``: an engine whose processes die with the
orchestrator.

vLLM's API server forks an engine core and workers that do not notice when the server is
killed. The local fleet therefore starts such an engine under this guard, in a new session (the
guard leads the process group, CMD and its children join it) and with a pipe on the guard's
stdin. The guard runs CMD and waits for the first of:

- CMD exits by itself: the guard exits with its code;
- stdin closes (the orchestrator went away, SIGKILL included), SIGINT or SIGTERM: the guard sends
  SIGTERM to CMD and gives it :data:`GRACE_S` seconds to shut its children down.

Either way it then SIGKILLs every process still in its group but itself (an engine core left
behind), so the group is empty when the guard exits. A guard SIGKILLed itself cannot do that:
CMD is started under ``setpriv --pdeathsig TERM`` (where util-linux has it), so it gets SIGTERM
then — Ray, stopping an island's actor, SIGKILLs the actor's child processes by pid, and the
vLLM server under the guard had outlived every test run of a Ray island.

Not covered: a descendant that moved to a session or group of its own, and a guard SIGKILLed in
the milliseconds before setpriv has set the death signal (CMD then outlives it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys

import anyio
import psutil

from policies.wire.lifetime import stdin_closed

GRACE_S = 20.0
"""Seconds CMD has to exit after SIGTERM (the fleet waits longer before it SIGKILLs the group)."""


async def guard(cmd: list[str]) -> int:
    """Run ``cmd`` until it exits or the parent goes; sweep the group; CMD's exit status."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # CMD gets SIGTERM should this guard be SIGKILLed itself
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        proc = await anyio.open_process(cmd, stdin=subprocess.DEVNULL, stdout=None, stderr=None)
        async with anyio.create_task_group() as tg:

            async def parent_gone() -> None:
                await stdin_closed()
                tg.cancel_scope.cancel()

            async def signalled() -> None:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(parent_gone)
            tg.start_soon(signalled)
            await proc.wait()
            tg.cancel_scope.cancel()
    # the fleet sends one SIGTERM; a second must not cut the teardown short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if proc.returncode is None:
        proc.terminate()
        with anyio.move_on_after(GRACE_S):
            await proc.wait()
    _sweep_group()
    code = await proc.wait()
    return code if code >= 0 else 128 - code


def _sweep_group() -> None:
    """SIGKILL every process of this process group but this one."""
    me = os.getpid()
    group = os.getpgid(0)
    for pid in psutil.pids():
        if pid == me:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == group:
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m orchestrator.fleet.guard CMD [ARG ...]\n")
        return 2
    return anyio.run(guard, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
