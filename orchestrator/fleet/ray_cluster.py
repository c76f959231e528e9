"""A one-machine Ray cluster on loopback, for ``orchestrate bench fleet`` and the fleet tests: a
head node started with ``ray start --head --block`` in a process group of its own (so stopping
it stops every Ray process it started), its temp dir short (Ray's socket paths must fit in 107
bytes) and removed afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RayHead:
    address: str
    """``127.0.0.1:PORT``, for ``ray.init(address=…)`` and ``fleet.ray.address``."""
    temp_dir: Path
    """Ray's session files and every Ray process's logs."""


@contextmanager
def ray_head(log_dir: Path, num_cpus: int = 2) -> Iterator[RayHead]:
    """A head node serving until the block ends; its own log is ``<log_dir>/ray-head.log``."""
    port = _free_port()
    ray = Path(sys.executable).with_name("ray")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    log = (log_dir / "ray-head.log").open("wb")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    argv = [
        str(ray), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
        "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ray head did not start; see {log_dir / 'ray-head.log'}"
                    ) from None
                time.sleep(0.5)
        yield RayHead(address, Path(temp))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)  # ray start --block takes its time; its process group goes anyway
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
