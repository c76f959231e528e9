"""The standalone sidecar in front of scripted SGLang / vLLM / OpenAI-compatible fakes.

Each fake is a real aiohttp server on loopback that answers in the engine's JSON shape and
records every call (path, body, time), so the tests check what the sidecar asked of the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from aiohttp import web

from policies.board import Board
from policies.serve.backends.standalone import serve_sidecar
from policies.serve.backends.vllm_worker import SprawlWorkerExtension
from policies.serve.decode import QuiesceMode
from tests.support.boards import publish_scaled, tiny_board

pytestmark = pytest.mark.anyio
Reply = Callable[[dict[str, Any]], Awaitable[Any]]


@dataclass
class Fake:
    """A scripted engine: ``replies`` maps a path to a coroutine building the JSON answer."""

    replies: dict[str, Reply]
    calls: list[tuple[str, Any, float, float]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    def bodies(self, path: str) -> list[Any]:
        return [c[1] for c in self.calls if c[0] == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        t0 = time.monotonic()
        reply = await self.replies[request.path](body or {})
        self.calls.append((request.path, body, t0, time.monotonic()))
        if isinstance(reply, web.StreamResponse):
            return reply
        return web.json_response(reply)


@asynccontextmanager
async def fake_server(fake: Fake) -> AsyncIterator[str]:
    app = web.Application()
    for path in fake.replies:
        app.router.add_route("*", path, fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sidecar(engine_url: str, kind: str, board: Board, **kw: Any) -> AsyncIterator[str]:
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
                poll_interval_s=0.05,
                task_status=task_status,
                **kw,
            )
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


async def _generate(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/generate", json=body) as r:
        return r.status, await r.json()


async def _wait_version(url: str, version: int) -> None:
    async with aiohttp.ClientSession() as s:
        with anyio.fail_after(20):
            while True:
                async with s.get(f"{url}/v1/policy") as r:
                    if (await r.json())["applied_version"] == version:
                        return
                await anyio.sleep(0.02)


async def _wait_failures(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        with anyio.fail_after(20):
            while True:
                for line in (await _text(s, url)).splitlines():
                    if (
                        line.startswith("sprawl_version_failures_total ")
                        and float(line.split()[1]) >= n
                    ):
                        return
                await anyio.sleep(0.02)


async def _text(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(f"{url}/metrics") as r:
        return await r.text()


async def _ok(_: dict[str, Any]) -> dict[str, Any]:
    return {"success": True, "message": "ok"}


def sglang_fake(delay: float = 0.0) -> Fake:
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        await anyio.sleep(delay)
        ids = [7, 8, 9][: body["sampling_params"]["max_new_tokens"]]
        return {
            "text": "xyz",
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "length"},
                "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)],
            },
        }

    return Fake(
        {
            "/generate": generate,
            "/update_weights_from_disk": _ok,
            "/pause_generation": _ok,
            "/continue_generation": _ok,
        }
    )


@pytest.mark.parametrize("mode", ["wait", "pause"])
async def test_sglang_materializes_and_reloads_from_disk(
    board: Board, tiny_model_dir: Path, tmp_path: Path, mode: QuiesceMode
) -> None:
    fake = sglang_fake(delay=0.6)
    shared = tmp_path / "shared"
    async with (
        fake_server(fake) as engine,
        sidecar(engine, "sglang", board, materialize_dir=shared, activation=mode) as url,
    ):
        (first,) = fake.bodies("/update_weights_from_disk")
        v0 = Path(first["model_path"])
        assert first["weight_version"] == "0"
        assert await anyio.Path(v0 / "model.safetensors").exists()
        assert await anyio.Path(v0 / "config.json").exists()
        result: dict[str, Any] = {}

        async def call() -> None:
            result["out"] = await _generate(
                url, {"prompt_token_ids": [1, 2], "max_tokens": 3, "seed": 4, "n": 2}
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.sleep(0.2)  # the first choice is in flight at the engine
            publish_scaled(board, 1, tiny_model_dir, scale=0.5)
            await _wait_version(url, 1)
        status, body = result["out"]
    assert status == 200
    assert [c["token_ids"] for c in body["choices"]] == [[7, 8, 9], [7, 8, 9]]
    assert body["choices"][0]["logprobs"] == [-0.25, -0.5, -0.75]
    seeds = [b["sampling_params"]["sampling_seed"] for b in fake.bodies("/generate")]
    assert seeds == [4, 5]  # choice i is its own request seeded seed + i
    assert fake.bodies("/generate")[0]["input_ids"] == [1, 2]
    update = next(
        c
        for c in fake.calls
        if c[0] == "/update_weights_from_disk" and c[1]["weight_version"] == "1"
    )
    assert not await anyio.Path(v0).exists()  # the old materialized version is cleaned up
    if mode == "wait":
        # drained: the in-flight request finished before the weights changed
        assert body["policy_version"] == {"start": 0, "end": 0}
        assert "/pause_generation" not in fake.paths()
        first_gen = fake.calls[fake.paths().index("/generate")]
        assert first_gen[3] <= update[2]
    else:
        assert body["policy_version"] == {"start": 0, "end": 1}
        order = [p for p in fake.paths() if p != "/generate"]
        assert order[-3:] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert fake.bodies("/pause_generation")[-1] == {"mode": "retract"}


def vllm_fake(digest: Callable[[], list[str]]) -> Fake:
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        ids = [11, 12]
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": "ab",
                    "finish_reason": "stop",
                    "logprobs": {
                        "tokens": [f"token_id:{i}" for i in ids],
                        "token_logprobs": [-0.1, -0.2],
                        "top_logprobs": None,
                        "text_offset": [0, 1],
                    },
                }
            ],
        }

    async def rpc(_: dict[str, Any]) -> dict[str, Any]:
        return {"results": digest()}

    async def reset(_: dict[str, Any]) -> web.Response:
        return web.Response(status=200)

    return Fake(
        {"/v1/completions": completions, "/collective_rpc": rpc, "/reset_prefix_cache": reset}
    )


async def test_vllm_loads_versions_by_rpc_and_resets_the_prefix_cache(board: Board) -> None:
    fake = vllm_fake(lambda: ["d", "d"])
    async with fake_server(fake) as engine, sidecar(engine, "vllm", board, model="m") as url:
        status, body = await _generate(
            url, {"prompt_token_ids": [3, 4], "max_tokens": 2, "seed": 9, "top_k": 5}
        )
    assert fake.paths()[:2] == ["/collective_rpc", "/reset_prefix_cache"]
    (rpc,) = fake.bodies("/collective_rpc")
    assert rpc == {"method": "sprawl_load_version", "args": [board.url, "run", "0"]}
    assert status == 200
    assert body["choices"][0]["token_ids"] == [11, 12]
    assert body["choices"][0]["logprobs"] == [-0.1, -0.2]
    sent = fake.bodies("/v1/completions")[0]
    assert sent["prompt"] == [3, 4]
    assert sent["seed"] == 9
    assert sent["top_k"] == 5
    assert sent["return_tokens_as_token_ids"] is True
    assert sent["logprobs"] == 0


async def test_vllm_workers_that_disagree_keep_the_old_version(
    board: Board, tiny_model_dir: Path
) -> None:
    answers = itertools.chain([["a", "a"]], itertools.repeat(["a", "b"]))
    fake = vllm_fake(lambda: next(answers))
    async with fake_server(fake) as engine, sidecar(engine, "vllm", board) as url:
        publish_scaled(board, 1, tiny_model_dir, scale=0.5)
        await _wait_failures(url, 1)
        async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
    assert fake.paths().count("/reset_prefix_cache") == 1


def llama_fake() -> Fake:
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "index": 0,
                    "text": "hi",
                    "finish_reason": "length",
                    "logprobs": {
                        "content": [
                            {
                                "id": 21,
                                "token": "h",
                                "logprob": -1.5,
                                "bytes": [104],
                                "top_logprobs": [],
                            },
                            {
                                "id": 22,
                                "token": "i",
                                "logprob": -0.5,
                                "bytes": [105],
                                "top_logprobs": [],
                            },
                        ]
                    },
                }
            ]
        }

    return Fake({"/v1/completions": completions})


async def test_openai_endpoint_serves_its_fixed_version(board: Board) -> None:
    fake = llama_fake()
    async with fake_server(fake) as engine, sidecar(engine, "openai", board, version=5) as url:
        status, body = await _generate(url, {"prompt_token_ids": [1], "max_tokens": 2})
        assert status == 200
        assert body["policy_version"] == {"start": 5, "end": 5}
        assert body["choices"][0]["token_ids"] == [21, 22]
        assert body["choices"][0]["logprobs"] == [-1.5, -0.5]
        assert body["choices"][0]["finish_reason"] == "length"
        status, err = await _generate(
            url, {"prompt_token_ids": [1], "policy_version": {"min": 6, "max": None}}
        )
        assert status == 409
        assert err["error"]["applied_version"] == 5
    assert len(fake.calls) == 1  # the refused request never reached the engine


async def test_engine_errors_are_503_and_the_sidecar_keeps_serving(board: Board) -> None:
    state = {"fail": True}

    async def completions(body: dict[str, Any]) -> Any:
        if state["fail"]:
            return web.json_response({"error": "boom"}, status=500)
        return await llama_fake().replies["/v1/completions"](body)

    fake = Fake({"/v1/completions": completions})
    async with fake_server(fake) as engine, sidecar(engine, "openai", board, version=1) as url:
        status, body = await _generate(url, {"prompt_token_ids": [1]})
        assert status == 503
        assert body["error"]["type"] == "engine_unavailable"
        state["fail"] = False
        status, _ = await _generate(url, {"prompt_token_ids": [1]})
        assert status == 200


class _Model(torch.nn.Module):
    """Stands in for a vLLM model: its ``load_weights`` copies HF-named tensors in place."""

    def __init__(self, template: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterDict(
            {
                k.replace(".", "__"): torch.nn.Parameter(torch.zeros_like(v), requires_grad=False)
                for k, v in template.items()
            }
        )

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, t in weights:
            self.weights[name.replace(".", "__")].data.copy_(t)
            loaded.add(name)
        return loaded


async def test_vllm_worker_extension_loads_the_verified_view(board: Board) -> None:
    _, view = board.load(0)
    ext = SprawlWorkerExtension()
    model = _Model(view)
    ext.model_runner = type("Runner", (), {"model": model})()
    digest = ext.sprawl_load_version(board.url, board.run, "0")
    assert digest == board.manifest(0).digest
    for name, t in view.items():
        assert torch.equal(model.weights[name.replace(".", "__")], t)
