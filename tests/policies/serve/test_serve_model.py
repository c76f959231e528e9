"""``orchestrate serve --model DIR``: a plain model dir served as the fixed version 0."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from safetensors.torch import load_file

from policies.errors import EngineError
from policies.serve.engine import Engine
from policies.serve.reference_server import serve_model
from policies.wire.lane import GenerateRequest

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def served(model_dir: Path, token: str | None = None) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            lambda task_status: serve_model(
                model_dir,
                host="127.0.0.1",
                port=0,
                device="cpu",
                token=token,
                task_status=task_status,
            )
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


def bounded_request(**kw: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "max_tokens": 8, "seed": 7, "temperature": 1.0, **kw}


async def test_model_dir_is_served_as_fixed_version_zero(tiny_model_dir: Path) -> None:
    async with served(tiny_model_dir) as url, aiohttp.ClientSession() as s:
        status, body = await _post(s, f"{url}/v1/generate", bounded_request())
        assert status == 200
        assert body["policy_version"] == {"start": 0, "end": 0}
        status, err = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"min": 1})
        )
        assert status == 409
        assert err["error"]["type"] == "policy_version_unavailable"
        assert err["error"]["applied_version"] == 0
        status, ok = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"max": 0})
        )
        assert status == 200
        assert ok["choices"] == body["choices"]
        async with s.get(f"{url}/v1/policy") as r:
            policy = await r.json()
        assert (policy["applied_version"], policy["state"]) == (0, "serving")
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == tiny_model_dir.name
        status, chat = await _post(
            s,
            f"{url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "2+2"}], "max_tokens": 4, "seed": 1},
        )
        assert status == 200
        assert chat["policy_version"] == {"start": 0, "end": 0}

    # the served weights are the dir's, bit for bit: same tokens and log probs as a direct load
    engine = Engine(tiny_model_dir, dtype=torch.float32)
    try:
        engine.activate(load_file(tiny_model_dir / "model.safetensors"), version=0)
        req = GenerateRequest.model_validate(bounded_request())
        direct = engine.batcher.submit(req, *engine.validate(req)).result()
    finally:
        engine.close()
    assert [c.token_ids for c in direct.choices] == [c["token_ids"] for c in body["choices"]]
    assert [c.logprobs for c in direct.choices] == [c["logprobs"] for c in body["choices"]]


async def test_model_dir_without_weights_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    with pytest.raises(EngineError, match=r"no \*\.safetensors"):
        await serve_model(empty, host="127.0.0.1", port=0, device="cpu", token=None)


async def test_a_model_dir_whose_name_is_no_run_name_is_served(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    odd = tmp_path / "my model (v2)"
    shutil.copytree(tiny_model_dir, odd)
    async with served(odd) as url, aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "my-model-v2-"
        status, _ = await _post(s, f"{url}/v1/generate", bounded_request())
        assert status == 200
