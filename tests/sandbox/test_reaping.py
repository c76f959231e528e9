"""An orchestrator that is PID 1 of its container or a subreaper inherits each run's namespace
init when bwrap's outer process exits first: it must reap them, not collect zombies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUBREAPER = """
import ctypes, os, sys, anyio
from sandbox.errors import SandboxUnavailableError
from sandbox.pool import SandboxPool
from sandbox.types import SandboxConfig

PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

def zombies():
    kids = []
    for task in os.listdir("/proc/self/task"):
        kids += open(f"/proc/self/task/{task}/children").read().split()
    states = []
    for pid in kids:
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except FileNotFoundError:
            continue
        states.append(stat[stat.rindex(")") + 2])
    return states.count("Z")

async def main():
    try:
        pool = SandboxPool(SandboxConfig(wall_seconds=5, cpu_seconds=2, memory_mb=256))
    except SandboxUnavailableError as exc:
        print("skip", exc)
        return
    for _ in range(5):
        result = await pool.run(["true"])
        assert result.ok, result
    print("zombies", zombies())

anyio.run(main)
"""


def test_a_subreaper_collects_no_zombie_per_sandbox_run() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SUBREAPER], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    words = done.stdout.strip().splitlines()[-1].split()  # log lines come first
    if words[0] == "skip":
        pytest.skip(done.stdout)
    assert words == ["zombies", "0"], done.stdout
