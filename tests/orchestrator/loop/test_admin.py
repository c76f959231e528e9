"""Elastic fleet membership through the admin API and its CLI client."""

from __future__ import annotations

import argparse
import json
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest

from orchestrator.errors import SprawlError
from orchestrator.fleet.cli import AdminAddress, _call, admin_address
from orchestrator.loop.admin import serve_admin
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef
from policies.serve.connections import LaneLimits
from policies.wire.lane import GenerateRequest, VersionBounds
from tests.support.fakes import ScriptedTransport

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def admin(
    pool: Pool, run_dir: Path, token: str | None = None, limits: LaneLimits | None = None
) -> AsyncIterator[str]:
    """The admin API, its ``admin.json`` in ``run_dir``; its URL."""
    async with anyio.create_task_group() as tg:
        url = await tg.start(
            lambda task_status: serve_admin(
                pool,
                host="127.0.0.1",
                port=0,
                token=token,
                admin_file=run_dir / "admin.json",
                limits=limits,
                task_status=task_status,
            )
        )
        yield url
        tg.cancel_scope.cancel()


def _args(admin_url: str, action: str, **kw: object) -> argparse.Namespace:
    base = dict(
        orchestrator=admin_url, token=None, id=None, url=None, endpoint_token=None, weight=1.0
    )
    base.update(kw)
    return argparse.Namespace(action=action, **base)


async def test_add_list_remove_while_serving(tmp_path: Path) -> None:
    t = ScriptedTransport({"a": 0, "b": 3})
    pool = Pool(t, version_wait_s=5.0, poll_interval_s=1.0)
    pool.add(EndpointRef(id="a", url="http://a"))
    await pool.refresh_all()
    async with admin(pool, tmp_path):
        url = str(tmp_path)  # the run directory: its admin.json gives the URL and the token
        added = await _call(_args(url, "add", id="b", url="http://b/", weight=2.0))
        assert (added["id"], added["applied_version"], added["healthy"]) == ("b", 3, True)
        listed = await _call(_args(url, "list"))
        assert [e["id"] for e in listed["endpoints"]] == ["a", "b"]
        # the new endpoint takes calls that need its version
        _, ep, _ = await pool.generate(
            GenerateRequest(prompt_token_ids=[1], policy_version=VersionBounds(min=3))
        )
        assert ep.id == "b"
        await _call(_args(url, "remove", id="b"))
        assert [e["id"] for e in (await _call(_args(url, "list")))["endpoints"]] == ["a"]
        with pytest.raises(SprawlError, match="no endpoint 'zzz'"):
            await _call(_args(url, "remove", id="zzz"))
        with pytest.raises(SprawlError, match="HTTP 400: url"):
            await _call(_args(url, "add", id="c", url="ftp://c"))


async def test_admin_requires_its_token(tmp_path: Path) -> None:
    pool = Pool(ScriptedTransport({}), version_wait_s=5.0, poll_interval_s=1.0)
    async with admin(pool, tmp_path, token="t0k") as url:
        with pytest.raises(SprawlError, match=r"HTTP 401.*--token"):
            await _call(_args(url, "list"))
        assert await _call(_args(url, "list", token="t0k")) == {"endpoints": []}
        # the configured token is the one admin.json gives the fleet commands
        assert await _call(_args(str(tmp_path), "list")) == {"endpoints": []}


async def test_without_a_configured_token_one_is_made_and_written_owner_only(
    tmp_path: Path,
) -> None:
    pool = Pool(ScriptedTransport({"b": 0}), version_wait_s=5.0, poll_interval_s=1.0)
    async with admin(pool, tmp_path) as url:
        written = json.loads((tmp_path / "admin.json").read_text())
        assert stat.S_IMODE((tmp_path / "admin.json").stat().st_mode) == 0o600
        assert written["url"] == url
        assert len(written["token"]) >= 32
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                for method, path in (("GET", "/v1/fleet"), ("DELETE", "/v1/fleet/a")):
                    async with s.request(method, f"{url}{path}", headers=headers) as r:
                        assert r.status == 401
                        assert (await r.json())["error"]["type"] == "unauthorized"
                async with s.post(
                    f"{url}/v1/fleet", json={"id": "x", "url": "http://x"}, headers=headers
                ) as r:
                    assert r.status == 401
            async with s.get(f"{url}/health") as r:
                assert r.status == 200  # health checks need no token
        assert pool.live() == []  # nothing was added without the token
        # the documented command, given the run directory, finds URL and token itself
        added = await _call(_args(str(tmp_path), "add", id="b", url="http://b"))
        assert added["id"] == "b"
        with pytest.raises(SprawlError, match="HTTP 401"):
            await _call(_args(str(tmp_path), "list", token="wrong"))  # --token wins


def test_run_dir_names_the_admin_url_and_token(tmp_path: Path) -> None:
    (tmp_path / "admin.json").write_text('{"url": "http://127.0.0.1:9/", "token": "t"}')
    assert admin_address(str(tmp_path)) == AdminAddress("http://127.0.0.1:9", "t")
    assert admin_address("https://h:1/") == AdminAddress("https://h:1")
    with pytest.raises(SprawlError, match=r"admin\.json is unreadable"):
        admin_address(str(tmp_path / "nope"))


async def test_hostile_bodies_and_headers_get_4xx_json_errors(tmp_path: Path) -> None:
    import json

    from tests.support.raw_http import raw_http, raw_post

    pool = Pool(ScriptedTransport({}), version_wait_s=5.0, poll_interval_s=1.0)
    hostile = [
        (b'{"id": "a", "url": "http://a"}', b"Bearer \xff\xfe\xc3", 401, None),
        (b"[" * 200_000 + b"]" * 200_000, b"Bearer tok", 400, None),
        (
            b'{"id": "a", "url": "http://a", "weight": ' + b"7" * 5000 + b"}",
            b"Bearer tok",
            400,
            None,
        ),
        (b'{"id": "a", "url": "http://a", "token": "\\ud800"}', b"Bearer tok", 400, "token"),
        (b'{"id": "a", "url": "http://a\\udfff"}', b"Bearer tok", 400, "url"),
    ]
    got = []
    async with admin(pool, tmp_path, token="tok") as url:
        for body, auth, _, _ in hostile:
            status, headers, raw = await raw_http(url, raw_post("/v1/fleet", body, auth))
            kind = headers.get("content-type", "").split(";")[0]
            error = json.loads(raw)["error"] if kind == "application/json" else {}
            got.append((status, kind, error.get("param")))
    assert got == [(s, "application/json", param) for _, _, s, param in hostile]
    assert pool.live() == []


async def _answer(sock: anyio.abc.SocketStream) -> bytes:
    data = b""
    with anyio.fail_after(10):
        while True:
            try:
                data += await sock.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return data


async def test_a_flood_of_silent_connections_is_refused_not_held(tmp_path: Path) -> None:
    """The admin API is bounded like the lane: a header deadline, a cap, a share per client. A
    client flooding it from one address leaves room for another; silent sockets are closed."""
    pool = Pool(ScriptedTransport({}), version_wait_s=5.0, poll_interval_s=1.0)
    limits = LaneLimits(header_timeout_s=1.0, max_connections=6, max_connections_per_client=3)
    async with admin(pool, tmp_path, token="tok", limits=limits) as url:
        host, port = url.removeprefix("http://").split(":")
        silent = [await anyio.connect_tcp(host, int(port)) for _ in range(3)]
        flood = [await anyio.connect_tcp(host, int(port)) for _ in range(20)]
        refused = [await _answer(sock) for sock in flood]
        assert all(a.startswith(b"HTTP/1.1 503 ") for a in refused)
        assert b"3 connections from 127.0.0.1 (the admin max_connections_per_client)" in refused[0]
        async with await anyio.connect_tcp(host, int(port), local_host="127.0.0.2") as other:
            await other.send(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await _answer(other)).startswith(b"HTTP/1.1 200 ")
        for sock in silent:  # past the header deadline: 408, closed
            assert (await _answer(sock)).startswith(b"HTTP/1.1 408 ")
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            assert r.status == 200
        for sock in [*silent, *flood]:
            await sock.aclose()
