"""Abandoned work and slow clients: what a lane server owes the requests beside them.

A client that disconnects cancels its generation (reference engine and sidecar alike); CPU work on
a request (tokenization) never stalls the event loop; header, idle and body deadlines and a cap on
connections bound what idle or slow sockets hold.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from structlog.testing import capture_logs
from transformers import PreTrainedTokenizerBase

from policies.board import Board
from policies.serve.connections import LaneLimits
from policies.serve.options import ServeOptions
from policies.wire.flags import add_flags, parse_flags
from tests.support.boards import engine, tiny_board
from tests.support.lane import metric, standalone
from tests.support.raw_http import raw_http
from tests.support.waiting import until

pytestmark = pytest.mark.anyio
ABANDONED = 'sprawl_lane_abandoned_total{route="/v1/generate"}'


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


def _post(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def _until(url: str, name: str, check: Any, timeout_s: float = 20.0) -> float:
    """Poll ``/metrics`` until ``check(value of name)``; the value."""

    async def value() -> tuple[float] | None:
        got = await metric(url, name)
        return (got,) if check(got) else None  # a tuple: a value of 0 may be the one asked for

    found = await until(value, f"{name} as asked", timeout_s=timeout_s)
    assert found is not None
    return found[0]


# -- abandoned work -----------------------------------------------------------------------------
async def test_a_client_that_disconnects_cancels_its_generation(board: Board) -> None:
    big = {"prompt_token_ids": [1, 2, 3], "n": 16, "max_tokens": 2000, "seed": 1}
    with capture_logs() as logs:
        async with engine(board) as url:
            host, port = url.removeprefix("http://").split(":")
            clients = [await anyio.connect_tcp(host, int(port)) for _ in range(2)]
            for client in clients:
                await client.send(_post("/v1/generate", big))
            # both requests decode (one holds at most 16 rows), then their clients go away
            await _until(url, "sprawl_engine_active_rows", lambda rows: rows > 16)
            for client in clients:
                await client.aclose()
            await _until(url, ABANDONED, lambda n: n == 2)
            assert await _until(url, "sprawl_engine_active_rows", lambda rows: rows == 0) == 0
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{url}/v1/generate", json={"prompt_token_ids": [4], "max_tokens": 4}) as r,
            ):
                assert r.status == 200  # the short request is served, not queued behind them
                assert len((await r.json())["choices"][0]["token_ids"]) <= 4
    cancelled = [e for e in logs if e["event"] == "generation_cancelled"]
    assert len(cancelled) == 2
    for event in cancelled:  # rows freed long before their budget of tokens was spent
        assert 1 <= event["rows"] <= 16
        assert event["tokens"] < event["rows"] * 2000
    assert [e["route"] for e in logs if e["event"] == "request_abandoned"] == ["/v1/generate"] * 2


@asynccontextmanager
async def _stuck_engine() -> AsyncIterator[tuple[str, list[str], anyio.Event, anyio.Event]]:
    """An OpenAI-compatible engine whose completions never finish, served the way vLLM and
    llama.cpp serve: a request whose connection closes is cancelled. Yields its URL, what it saw
    (``started``, ``aborted``) and events set when a request starts and when one aborts."""
    seen: list[str] = []
    started, aborted = anyio.Event(), anyio.Event()

    async def completions(request: web.Request) -> web.Response:
        await request.json()
        seen.append("started")
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            seen.append("aborted")
            aborted.set()
        raise AssertionError("unreachable")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen, started, aborted
    finally:
        await runner.cleanup()


async def test_a_client_that_disconnects_cancels_the_sidecars_engine_request(
    board: Board,
) -> None:
    async with (
        _stuck_engine() as (engine_url, seen, started, aborted),
        standalone(board, "openai", engine_url, version=3) as url,
    ):
        host, port = url.removeprefix("http://").split(":")
        client = await anyio.connect_tcp(host, int(port))
        await client.send(_post("/v1/generate", {"prompt_token_ids": [1], "n": 3}))
        with anyio.fail_after(20):
            await started.wait()
        await client.aclose()
        with anyio.fail_after(20):
            await aborted.wait()  # the engine saw its request's connection close
        # counted once the request's handler has unwound: no choice can be asked for after it
        assert await _until(url, ABANDONED, lambda n: n == 1) == 1
        assert seen == ["started", "aborted"]  # and the two other choices were never asked for


# -- CPU work off the event loop ------------------------------------------------------------------
@pytest.fixture
def slow_tokenizer(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> Iterator[threading.Event]:
    """Encoding a text holding ``SLOW`` takes until the returned event is set (as a megabyte
    prompt takes a second): the test decides how long tokenization lasts."""
    release = threading.Event()
    encode = type(tokenizer).encode

    def slow_encode(self: PreTrainedTokenizerBase, text: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(text, str) and "SLOW" in text:
            release.wait(30)
        return encode(self, text, *args, **kw)

    monkeypatch.setattr(type(tokenizer), "encode", slow_encode)
    yield release
    release.set()


async def test_tokenizing_a_prompt_does_not_block_the_server(
    board: Board, slow_tokenizer: threading.Event
) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        answers: list[int] = []

        async def complete() -> None:
            body = {"prompt": "SLOW to encode", "max_tokens": 2}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                answers.append(r.status)

        async with anyio.create_task_group() as tg:
            tg.start_soon(complete)
            with anyio.fail_after(10):  # answered while the prompt is still being encoded
                for _ in range(3):
                    async with s.get(f"{url}/health") as r:
                        assert r.status == 200
                    async with s.post(
                        f"{url}/v1/generate", json={"prompt_token_ids": [5], "max_tokens": 2}
                    ) as r:
                        assert r.status == 200
            assert answers == []  # still tokenizing
            slow_tokenizer.set()
        assert answers == [200]


# -- connection limits --------------------------------------------------------------------------
async def test_a_client_slow_to_send_its_headers_is_disconnected(board: Board) -> None:
    async with engine(board, limits=LaneLimits(header_timeout_s=0.3)) as url:
        status, headers, body = await raw_http(url, b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert (status, headers["content-type"]) == (408, "application/json")
        error = json.loads(body)["error"]
        assert error["type"] == "request_timeout"
        assert "--header-timeout" in error["message"]
        # one that sends nothing at all is closed too, and prompt clients are served
        status, _, _ = await raw_http(url, b"")
        assert status == 408
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            assert r.status == 200
        refused = 'sprawl_lane_connections_refused_total{reason="header_timeout"}'
        assert await metric(url, refused) == 2


async def test_a_later_request_slow_to_send_its_headers_is_disconnected(board: Board) -> None:
    """On a keep-alive connection the header deadline holds for every request, not the first."""
    async with engine(board, limits=LaneLimits(header_timeout_s=0.5, idle_timeout_s=60)) as url:
        host, port = url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as sock:
            await sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            with anyio.fail_after(10):
                while not first.endswith(b"}"):
                    first += await sock.receive()
            assert first.startswith(b"HTTP/1.1 200 ")
            await sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
            answer = b""
            with anyio.fail_after(10):
                while b"}}" not in answer:
                    answer += await sock.receive()
        assert answer.startswith(b"HTTP/1.1 408 ")
        refused = 'sprawl_lane_connections_refused_total{reason="header_timeout"}'
        assert await metric(url, refused) == 1


async def test_an_idle_keep_alive_connection_is_closed(board: Board) -> None:
    async with engine(board, limits=LaneLimits(idle_timeout_s=0.3)) as url:
        # one keep-alive request answered, then nothing: the server closes the connection
        status, _, body = await raw_http(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert json.loads(body) == {"status": "ok"}


async def test_a_body_slower_than_the_body_timeout_gets_408(board: Board) -> None:
    async with engine(board, limits=LaneLimits(body_timeout_s=0.3)) as url:
        head = (
            b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        host, port = url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as sock:
            await sock.send(head + b'{"prompt_token_ids": [1')  # and the rest never comes
            answer = b""
            with anyio.fail_after(10):
                while b"}}" not in answer:
                    answer += await sock.receive()
        assert answer.startswith(b"HTTP/1.1 408 ")
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert (error["type"], "--body-timeout" in error["message"]) == ("request_timeout", True)


async def test_connections_over_the_cap_are_refused(board: Board) -> None:
    with capture_logs() as logs:
        async with engine(board, limits=LaneLimits(max_connections=2)) as url:
            host, port = url.removeprefix("http://").split(":")
            held = [await anyio.connect_tcp(host, int(port)) for _ in range(2)]
            for sock in held:  # both are open on the server's side
                await sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await sock.receive()).startswith(b"HTTP/1.1 200")
            for _ in range(2):
                status, headers, body = await raw_http(
                    url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                assert (status, headers["retry-after"]) == (503, "1")
                error = json.loads(body)["error"]
                assert error["type"] == "too_many_connections"
                assert "--max-connections" in error["message"]
            for sock in held:
                await sock.aclose()
            refused = 'sprawl_lane_connections_refused_total{reason="max_connections"}'
            assert await _until(url, refused, lambda n: n >= 1) == 2
            async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
                assert r.status == 200  # served again once connections have closed
    # reaching the cap is logged once; the connections refused after it are only counted
    assert [e["reason"] for e in logs if e["event"] == "lane_connection_refused"] == [
        "max_connections"
    ]


def test_limit_flags_have_the_models_defaults_and_refuse_bad_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="orchestrate serve")
    add_flags(parser, ServeOptions)
    assert parse_flags(parser, ServeOptions, ["--board", "b"]).limits() == LaneLimits()
    given = ["--header-timeout", "2", "--max-connections", "64", "--max-connections-per-client"]
    given += ["8", "--max-body-bytes", "65536"]
    options = parse_flags(parser, ServeOptions, ["--board", "b", *given])
    assert options.limits() == LaneLimits(
        header_timeout_s=2.0,
        max_connections=64,
        max_connections_per_client=8,
        max_body_bytes=65536,
    )
    with pytest.raises(SystemExit) as exit_:
        parse_flags(parser, ServeOptions, ["--board", "b", "--max-connections", "0"])
    assert exit_.value.code == 2
    assert (
        "argument --max-connections: 0: Input should be greater than or equal to 1"
        in capsys.readouterr().err
    )
