"""The engine guard: what it runs dies with it, even when the guard is SIGKILLed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from tests.support.waiting import until_sync


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_a_sigkilled_guard_takes_its_command_with_it() -> None:
    """(a vLLM server outlived its guard whenever Ray SIGKILLed the guard by pid: re-parented
    to PID 1, it ran on after every test run of a Ray island)"""
    guard = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.fleet.guard", "sleep", "600"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        # the command once it runs: setpriv sets the death signal before it execs ``sleep``,
        # so a guard killed while its child is still python or setpriv proves nothing
        (command,) = until_sync(
            lambda: [p for p in psutil.Process(guard.pid).children() if p.name() == "sleep"],
            "the guard's command, exec'd",
            timeout_s=30,
        )
        os.kill(guard.pid, signal.SIGKILL)
        guard.wait(timeout=10)
        command.wait(timeout=10)  # psutil.TimeoutExpired if it outlived the guard
    finally:
        for p in psutil.process_iter():  # whatever is left of the guard's group
            try:
                if p.pid != os.getpid() and os.getpgid(p.pid) == guard.pid:
                    p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        assert guard.stdin is not None
        guard.stdin.close()
