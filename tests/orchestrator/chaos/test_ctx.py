"""The trial's admin client: a refused connect to a running orchestrator is tried again, noted."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import pytest
from aiohttp import web

from orchestrator.chaos.ctx import ChaosError, Ctx, Tracked
from tests.support.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def alive() -> Iterator[subprocess.Popen[bytes]]:
    """A process that runs (as the orchestrator does) until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def gone() -> subprocess.Popen[bytes]:
    """A process that has exited (as the orchestrator does at the end of a run)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc


def _ctx(tmp_path: Path, orchestrator: subprocess.Popen[bytes]) -> tuple[Ctx, int]:
    with socket.socket() as s:  # a port nothing listens on (yet)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    (tmp_path / "admin.json").write_text(json.dumps({"url": url, "token": "t"}))
    ctx = Ctx(
        cfg=cast(Any, SimpleNamespace(run_dir=tmp_path)),
        config_path=None,
        overrides={},
        env={},
        board=cast(Any, None),
        tracked=Tracked(),
        log_dir=tmp_path,
        orchestrator=orchestrator,
    )
    return ctx, port


async def test_a_refused_connect_while_the_orchestrator_runs_is_tried_again(
    tmp_path: Path, alive: subprocess.Popen[bytes]
) -> None:
    ctx, port = _ctx(tmp_path, alive)

    async def fleet(_request: web.Request) -> web.Response:
        return web.json_response({"endpoints": []})

    app = web.Application()
    app.router.add_get("/v1/fleet", fleet)
    runner = web.AppRunner(app)
    await runner.setup()
    async with anyio.create_task_group() as tg:

        async def listen_once_refused() -> None:
            await until(lambda: ctx.notes, "the first connect refused")
            await web.TCPSite(runner, "127.0.0.1", port).start()

        tg.start_soon(listen_once_refused)
        assert await ctx.admin("GET", "/v1/fleet") == {"endpoints": []}
    await runner.cleanup()
    assert "tried again" in ctx.notes[0]


async def test_a_refused_connect_after_the_orchestrator_exited_is_the_trial_s_end(
    tmp_path: Path, gone: subprocess.Popen[bytes]
) -> None:
    ctx, _ = _ctx(tmp_path, gone)
    with pytest.raises(ChaosError, match="admin API GET /v1/fleet"):
        await ctx.admin("GET", "/v1/fleet")
    assert ctx.notes == []
