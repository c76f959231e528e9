"""The reference engine + embedded sidecar, over real HTTP on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from policies.board import Board
from policies.server import serve_board

pytestmark = pytest.mark.anyio


def _publish(board: Board, version: int, model_dir: Path, scale: float = 1.0) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    view = {
        k: (v * scale).to(torch.bfloat16)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    board.publish(version, view, view_name="bfloat16")


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    b = Board(str(tmp_path / "board"), "run")
    b.create(tiny_model_dir)
    _publish(b, 0, tiny_model_dir)
    return b


@asynccontextmanager
async def engine(board: Board, token: str | None = None) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            lambda task_status: serve_board(
                board.url,
                board.run,
                host="127.0.0.1",
                port=0,
                device="cpu",
                token=token,
                poll_interval_s=0.05,
                task_status=task_status,
            )
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def _post(
    s: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    kw: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
    async with s.post(url, headers=headers, **kw) as r:
        return r.status, await r.json(), dict(r.headers)


def _req(**kw: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "max_tokens": 8, "seed": 7, **kw}


async def _wait_version(s: aiohttp.ClientSession, url: str, version: int) -> None:
    with anyio.fail_after(20):
        while True:
            async with s.get(f"{url}/v1/policy") as r:
                if (await r.json())["applied_version"] == version:
                    return
            await anyio.sleep(0.05)


async def test_generate_returns_tokens_logprobs_and_stamps(board: Board) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        status, body, _ = await _post(s, f"{url}/v1/generate", _req(n=2))
        assert status == 200
        assert body["policy_version"] == {"start": 0, "end": 0}
        assert body["prompt_token_ids"] == [1, 2, 3]
        assert len(body["choices"]) == 2
        for choice in body["choices"]:
            assert 1 <= len(choice["token_ids"]) == len(choice["logprobs"]) <= 8
            assert all(lp <= 0.0 for lp in choice["logprobs"])
        _, again, _ = await _post(s, f"{url}/v1/generate", _req(n=2))
        assert again["choices"] == body["choices"]  # the same seed samples the same tokens


async def test_version_bounds_409_and_activation(board: Board, tiny_model_dir: Path) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        status, body, headers = await _post(
            s, f"{url}/v1/generate", _req(policy_version={"min": 1, "max": None})
        )
        assert status == 409
        assert body["error"]["type"] == "policy_version_unavailable"
        assert body["error"]["applied_version"] == 0
        assert headers["Retry-After"] == "1"

        _publish(board, 1, tiny_model_dir, scale=0.5)
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 1)
        status, body, _ = await _post(
            s, f"{url}/v1/generate", _req(policy_version={"min": 1, "max": 1})
        )
        assert status == 200
        assert body["policy_version"] == {"start": 1, "end": 1}
        status, body, _ = await _post(
            s, f"{url}/v1/generate", _req(policy_version={"min": 0, "max": 0})
        )
        assert status == 409


async def test_corrupted_version_is_never_served(board: Board, tiny_model_dir: Path) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        _publish(board, 1, tiny_model_dir, scale=0.5)
        weights = Path(board.root) / "versions" / "00000001" / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        weights.write_bytes(bytes(raw))
        await _post(s, f"{url}/v1/policy/notify", {})
        await anyio.sleep(0.5)
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_failures_total 1.0" in await r.text()
        status, body, _ = await _post(s, f"{url}/v1/generate", _req())
        assert (status, body["policy_version"]["start"]) == (200, 0)


async def test_auth_required_except_health(board: Board) -> None:
    async with engine(board, token="s3cret") as url, aiohttp.ClientSession() as s:
        status, body, _ = await _post(s, f"{url}/v1/generate", _req())
        assert status == 401
        assert body["error"]["type"] == "unauthorized"
        status, _, _ = await _post(
            s, f"{url}/v1/generate", _req(), headers={"Authorization": "Bearer wrong"}
        )
        assert status == 401
        status, _, _ = await _post(
            s, f"{url}/v1/generate", _req(), headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ({"max_tokens": 4}, "prompt_token_ids"),
        (_req(temperature=-1), "temperature"),
        (_req(top_p=0), "top_p"),
        (_req(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (_req(prompt_token_ids=[1] * 5000), "prompt_token_ids"),
        (_req(policy_version={"min": 3, "max": 1}), "policy_version"),
        (_req(unknown_field=1), "unknown_field"),
    ],
)
async def test_bad_requests_get_4xx_naming_the_field(
    board: Board, body: Any, param: str | None
) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        status, answer, _ = await _post(s, f"{url}/v1/generate", body)
        assert status == 400
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"].get("param") == param
        status, _, _ = await _post(s, f"{url}/v1/generate", _req())
        assert status == 200  # the server keeps serving
