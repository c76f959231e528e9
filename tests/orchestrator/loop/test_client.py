"""The lane client converts every answer at the edge into a response or a typed error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from orchestrator.errors import EndpointError, Overloaded, VersionUnavailable
from orchestrator.loop.client import HttpTransport
from orchestrator.types import EndpointRef
from policies.wire.lane import GenerateRequest, VersionBounds

pytestmark = pytest.mark.anyio

OK = {
    "id": "x",
    "model": "m",
    "prompt_token_ids": [1],
    "choices": [{"index": 0, "token_ids": [2], "logprobs": [-0.1], "finish_reason": "stop"}],
    "policy_version": {"start": 2, "end": 2},
    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
}


@asynccontextmanager
async def server(status: int, body: Any) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers.get("Authorization"), "body": await request.json()})
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    app = web.Application()
    app.add_routes([web.post("/v1/generate", generate)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


async def _call(status: int, body: Any, lo: int | None = 1) -> Any:
    async with server(status, body) as (url, seen), aiohttp.ClientSession() as s:
        t = HttpTransport(s, connect_s=2, call_s=5)
        ep = EndpointRef(id="e", url=url, token="tok")
        req = GenerateRequest(prompt_token_ids=[1], policy_version=VersionBounds(min=lo))
        try:
            return await t.generate(ep, req), seen
        except EndpointError as exc:
            return exc, seen


async def test_ok_is_validated_and_sends_the_lane_request() -> None:
    resp, seen = await _call(200, OK)
    assert resp.policy_version.start == 2
    assert seen[0]["auth"] == "Bearer tok"
    assert seen[0]["body"]["policy_version"] == {"min": 1, "max": None}


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable", "needle"),
    [
        (
            409,
            {
                "error": {
                    "type": "policy_version_unavailable",
                    "message": "behind",
                    "applied_version": 0,
                }
            },
            VersionUnavailable,
            True,
            "behind",
        ),
        (503, {"error": {"message": "busy"}}, Overloaded, True, "busy"),
        (429, {"error": {"message": "slow down"}}, Overloaded, True, "slow down"),
        (500, "boom", EndpointError, True, "HTTP 500: boom"),
        (400, {"error": {"message": "bad"}}, EndpointError, False, "HTTP 400"),
        (200, {"nope": 1}, EndpointError, True, "malformed response"),
        (200, "not json", EndpointError, True, "malformed response"),
    ],
)
async def test_failures_become_typed_errors(
    status: int, body: Any, kind: type[Exception], retryable: bool, needle: str
) -> None:
    exc, _ = await _call(status, body)
    assert type(exc) is kind
    assert exc.retryable is retryable
    assert needle in str(exc)
    if isinstance(exc, VersionUnavailable):
        assert exc.applied_version == 0


async def test_a_stamp_outside_the_bounds_is_refused() -> None:
    exc, _ = await _call(200, OK, lo=3)
    assert isinstance(exc, EndpointError)
    assert "outside the request's bounds" in str(exc)
