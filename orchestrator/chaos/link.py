"""A faulty link: an HTTP proxy on loopback in front of one rollout endpoint.

The chaos harness puts it between the orchestrator and a real engine to make that island
misbehave without changing the engine. Every route is forwarded unchanged (health and policy
probes still succeed, as they would for an island whose generation path is broken) except
``POST /v1/generate``, which the ``mode`` damages:

- ``error`` — answers ``500`` with a JSON error body;
- ``garbage`` — answers ``200`` with a body that is not a valid response: bytes that are not
  JSON, a real response cut in half, and a JSON object without the lane's fields, in turn;
- ``slow`` — forwards after ``delay_s`` (a slow, distant link).
"""

from __future__ import annotations

import itertools
from typing import Literal

import aiohttp
import anyio
from aiohttp import web

LinkMode = Literal["error", "garbage", "slow"]
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


class FaultyLink:
    def __init__(self, upstream: str, mode: LinkMode, *, delay_s: float = 0.5) -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self.delay_s = delay_s
        self.damaged = 0
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Serve on a free loopback port; return the link's base URL."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> tuple[int, bytes, str]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.rel_url}",
            data=await request.read(),
            headers=headers,
        ) as r:
            return r.status, await r.read(), r.content_type

    async def _handle(self, request: web.Request) -> web.Response:
        generate = request.method == "POST" and request.path == "/v1/generate"
        if generate and self.mode == "error":
            self.damaged += 1
            return web.json_response(
                {"error": {"type": "internal", "message": "injected failure"}}, status=500
            )
        if generate and self.mode == "slow":
            self.damaged += 1
            await anyio.sleep(self.delay_s)
        try:
            status, body, ctype = await self._forward(request)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"upstream: {exc}"}}, status=502)
        if generate and self.mode == "garbage" and status == 200:
            self.damaged += 1
            body = [b"\x00\xffnot json", body[: len(body) // 2], b'{"id": "x"}'][
                next(self._turn) % 3
            ]
        return web.Response(status=status, body=body, content_type=ctype)
