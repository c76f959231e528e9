"""The faulty link forwards everything but damages generate calls as its mode says."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import aiohttp
import anyio
import pytest
from aiohttp import web

from orchestrator.chaos.link import FaultyLink, LinkMode
from orchestrator.errors import EndpointError
from orchestrator.loop.client import HttpTransport
from orchestrator.types import EndpointRef
from policies.wire.lane import GenerateRequest, VersionBounds

pytestmark = pytest.mark.anyio

RESPONSE = {
    "id": "gen-1",
    "model": "tiny",
    "prompt_token_ids": [1, 2],
    "choices": [{"index": 0, "token_ids": [3], "logprobs": [-0.5], "finish_reason": "stop"}],
    "policy_version": {"start": 1, "end": 1},
    "usage": {"prompt_tokens": 2, "completion_tokens": 1},
}


@asynccontextmanager
async def _upstream() -> AsyncIterator[str]:
    async def generate(_r: web.Request) -> web.Response:
        return web.json_response(RESPONSE)

    async def policy(_r: web.Request) -> web.Response:
        return web.json_response({"applied_version": 1, "staged_version": None})

    app = web.Application()
    app.add_routes([web.post("/v1/generate", generate), web.get("/v1/policy", policy)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _link(mode: str, delay_s: float = 0.5) -> AsyncIterator[tuple[FaultyLink, str]]:
    async with _upstream() as up:
        link = FaultyLink(up, cast(LinkMode, mode), delay_s=delay_s)
        url = await link.start()
        try:
            yield link, url
        finally:
            await link.close()


def bounded_request() -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2], max_tokens=1, policy_version=VersionBounds())


async def test_probes_pass_through_every_mode() -> None:
    for mode in ("error", "garbage", "slow"):
        async with (
            _link(mode) as (_, url),
            aiohttp.ClientSession() as s,
            s.get(f"{url}/v1/policy") as r,
        ):
            assert (r.status, (await r.json())["applied_version"]) == (200, 1)


async def test_error_mode_answers_500_and_the_client_sees_a_retryable_failure() -> None:
    async with _link("error") as (link, url), aiohttp.ClientSession() as s:
        transport = HttpTransport(s, connect_s=2, call_s=5)
        with pytest.raises(EndpointError, match="HTTP 500") as err:
            await transport.generate(EndpointRef(id="x", url=url), bounded_request())
        assert err.value.retryable
        assert link.damaged == 1


async def test_garbage_mode_cycles_through_malformed_bodies_the_client_refuses() -> None:
    async with _link("garbage") as (link, url), aiohttp.ClientSession() as s:
        transport = HttpTransport(s, connect_s=2, call_s=5)
        for _ in range(3):
            with pytest.raises(EndpointError, match="malformed response"):
                await transport.generate(EndpointRef(id="x", url=url), bounded_request())
        assert link.damaged == 3


async def test_slow_mode_delays_but_delivers_the_real_answer() -> None:
    async with _link("slow", delay_s=0.3) as (link, url), aiohttp.ClientSession() as s:
        t0 = anyio.current_time()
        async with s.post(f"{url}/v1/generate", data=json.dumps({})) as r:
            body = await r.json()
        assert anyio.current_time() - t0 >= 0.3
        assert body["choices"][0]["token_ids"] == [3]
        assert link.damaged == 1
