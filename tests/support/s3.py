"""An S3-compatible server (moto) on loopback for board tests, and its test credentials."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

KEY, SECRET = "AKIDSPRAWLTEST0001", "sprawl-test-secret-do-not-log-1234"


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server's endpoint URL, with ``AWS_*`` set to the test credentials meanwhile."""
    from moto.server import ThreadedMotoServer

    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_options(endpoint: str) -> dict[str, object]:
    # every Board gets its own filesystem object and caches, as in separate processes
    return {
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
