"""Talking to a sidecar's lane from tests, and serving scripted engines on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
from aiohttp import web

from policies.board import Board
from policies.serve.backends.standalone import serve_sidecar
from tests.support.waiting import until


@asynccontextmanager
async def loopback(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` (a scripted engine) on loopback; its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def standalone(
    board: Board, kind: str, engine_url: str = "", **kw: Any
) -> AsyncIterator[str]:
    """``orchestrate sidecar --engine-kind KIND`` in this process, following ``board`` on
    loopback (``poll_interval_s`` 0.05 unless given); its base URL."""
    kw.setdefault("poll_interval_s", 0.05)
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            lambda task_status: serve_sidecar(
                engine_url=engine_url,
                engine_kind=kind,
                board_url=board.url,
                run=board.run,
                host="127.0.0.1",
                port=0,
                token=None,
                task_status=task_status,
                **kw,
            )
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def generate(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``POST /v1/generate``: the status and the JSON answer."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/generate", json=body) as r:
        return r.status, await r.json()


async def policy(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/policy") as r:
        answer: dict[str, Any] = await r.json()
        return answer


async def wait_version(url: str, version: int, timeout_s: float = 20.0) -> None:
    """Until the sidecar serves ``version``."""

    async def applied() -> bool:
        return bool((await policy(url))["applied_version"] == version)

    await until(applied, f"{url} serving version {version}", timeout_s=timeout_s)


async def metric(url: str, name: str) -> float:
    """One sample of the sidecar's ``/metrics`` (0 when absent)."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    return 0.0


async def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 20.0) -> None:
    """Until the sidecar's ``name`` is at least ``at_least``."""

    async def reached() -> bool:
        return await metric(url, name) >= at_least

    await until(reached, f"{name} >= {at_least:g}", timeout_s=timeout_s)
