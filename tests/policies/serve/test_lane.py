"""The reference engine + embedded sidecar, over real HTTP on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from policies.board import Board
from tests.support.boards import engine, publish_scaled, tiny_board
from tests.support.logs import Logged
from tests.support.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


async def _post(
    s: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    kw: dict[str, Any] = {"data": body} if isinstance(body, str) else {"json": body}
    async with s.post(url, headers=headers, **kw) as r:
        return r.status, await r.json(), dict(r.headers)


def bounded_request(**kw: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "max_tokens": 8, "seed": 7, **kw}


async def _wait_version(s: aiohttp.ClientSession, url: str, version: int) -> None:
    async def applied() -> bool:
        async with s.get(f"{url}/v1/policy") as r:
            return bool((await r.json())["applied_version"] == version)

    await until(applied, f"version {version} applied")


async def test_generate_returns_tokens_logprobs_and_stamps(board: Board) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        status, body, _ = await _post(s, f"{url}/v1/generate", bounded_request(n=2))
        assert status == 200
        assert body["policy_version"] == {"start": 0, "end": 0}
        assert body["prompt_token_ids"] == [1, 2, 3]
        assert len(body["choices"]) == 2
        for choice in body["choices"]:
            assert 1 <= len(choice["token_ids"]) == len(choice["logprobs"]) <= 8
            assert all(lp <= 0.0 for lp in choice["logprobs"])
        _, again, _ = await _post(s, f"{url}/v1/generate", bounded_request(n=2))
        assert again["choices"] == body["choices"]  # the same seed samples the same tokens
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["max_context"] == 2048  # the tiny model's positions


async def test_version_bounds_409_and_activation(board: Board, tiny_model_dir: Path) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        status, body, headers = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"min": 1, "max": None})
        )
        assert status == 409
        assert body["error"]["type"] == "policy_version_unavailable"
        assert body["error"]["applied_version"] == 0
        assert headers["Retry-After"] == "1"

        publish_scaled(board, 1, tiny_model_dir, scale=0.5)
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 1)
        status, body, _ = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"min": 1, "max": 1})
        )
        assert status == 200
        assert body["policy_version"] == {"start": 1, "end": 1}
        status, body, _ = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"min": 0, "max": 0})
        )
        assert status == 409


async def test_catch_up_from_ten_versions_behind(board: Board, tiny_model_dir: Path) -> None:
    async with engine(board, poll_interval_s=3600) as url, aiohttp.ClientSession() as s:
        for v in range(1, 11):
            publish_scaled(board, v, tiny_model_dir, scale=1.0 - v / 100)
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 10)
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_activations_total 2.0" in await r.text()  # v0, then v10
        status, body, _ = await _post(
            s, f"{url}/v1/generate", bounded_request(policy_version={"min": 10, "max": 10})
        )
        assert (status, body["policy_version"]) == (200, {"start": 10, "end": 10})


async def test_corrupted_version_is_never_served(board: Board, tiny_model_dir: Path) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        publish_scaled(board, 1, tiny_model_dir, scale=0.5)
        vdir = Path(board.root) / "versions" / "00000001"
        data = [f for f in vdir.rglob("*") if f.is_file() and f.name != "manifest.json"]
        assert data
        for f in data:
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(raw))
        logged = Logged()
        with capture_logs(processors=[logged]):
            await _post(s, f"{url}/v1/policy/notify", {})
            await logged.until("version_refused", version=1)  # the sidecar's verdict
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_failures_total 1.0" in await r.text()
        status, body, _ = await _post(s, f"{url}/v1/generate", bounded_request())
        assert (status, body["policy_version"]["start"]) == (200, 0)


async def test_a_dangling_pointer_is_not_refused_for_good(
    board: Board, tiny_model_dir: Path
) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        board.store.write(f"{board.root}/POINTER", b'{"version": 2}')  # names a missing version
        logged = Logged()
        with capture_logs(processors=[logged]):
            await _post(s, f"{url}/v1/policy/notify", {})
            await logged.until("version_unavailable", version=2)  # tried, to be tried again
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
        publish_scaled(Board(board.url, board.run), 1, tiny_model_dir, scale=0.5)
        publish_scaled(Board(board.url, board.run), 2, tiny_model_dir, scale=0.25)
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 2)  # it exists now and is applied, though it was missing
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_failures_total 0.0" in await r.text()


@pytest.mark.parametrize("pointer", [b'{"version": 1e400}', b'{"version": true}', b"{"])
async def test_a_malformed_pointer_is_logged_and_the_replica_keeps_serving(
    board: Board, tiny_model_dir: Path, pointer: bytes
) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        logged = Logged()
        with capture_logs(processors=[logged]) as logs:
            board.store.write(f"{board.root}/POINTER", pointer)
            await _post(s, f"{url}/v1/policy/notify", {})
            await logged.until("board_unreadable")  # the sidecar read it
            async with s.get(f"{url}/v1/policy") as r:
                assert (await r.json())["applied_version"] == 0
            status, body, _ = await _post(s, f"{url}/v1/generate", bounded_request())
            assert (status, body["policy_version"]["start"]) == (200, 0)
        assert any(
            e["event"] == "board_unreadable" and "POINTER is malformed" in e["error"] for e in logs
        )
        publish_scaled(Board(board.url, board.run), 1, tiny_model_dir, scale=0.5)  # repairs it
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 1)


async def test_odd_sampling_fields_never_fail_the_requests_beside_them(board: Board) -> None:
    odd = [
        bounded_request(temperature=1e-300),
        bounded_request(top_p=1e-300),
        bounded_request(seed=2**64),
        bounded_request(seed=-(2**63) - 1),
    ]
    good = [bounded_request(seed=i, max_tokens=16, temperature=1.0) for i in range(4)]
    answers: dict[int, tuple[int, Any]] = {}
    async with engine(board) as url, aiohttp.ClientSession() as s:

        async def send(i: int, body: dict[str, Any]) -> None:
            status, got, _ = await _post(s, f"{url}/v1/generate", body)
            answers[i] = (status, got)

        async with anyio.create_task_group() as tg:
            for i, body in enumerate(good + odd):
                tg.start_soon(send, i, body)
        assert [answers[i][0] for i in range(len(good))] == [200] * len(good)
        assert [answers[len(good) + i][0] for i in range(len(odd))] == [200, 200, 400, 400]
        assert {answers[len(good) + i][1]["error"]["param"] for i in (2, 3)} == {"seed"}
        async with s.get(f"{url}/health") as r:
            assert r.status == 200


async def test_auth_required_except_health(board: Board) -> None:
    async with engine(board, token="s3cret") as url, aiohttp.ClientSession() as s:
        status, body, _ = await _post(s, f"{url}/v1/generate", bounded_request())
        assert status == 401
        assert body["error"]["type"] == "unauthorized"
        status, _, _ = await _post(
            s, f"{url}/v1/generate", bounded_request(), headers={"Authorization": "Bearer wrong"}
        )
        assert status == 401
        status, _, _ = await _post(
            s, f"{url}/v1/generate", bounded_request(), headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ({"max_tokens": 4}, "prompt_token_ids"),
        (bounded_request(temperature=-1), "temperature"),
        (bounded_request(top_p=0), "top_p"),
        (bounded_request(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (bounded_request(prompt_token_ids=[1] * 5000), "prompt_token_ids"),
        (bounded_request(policy_version={"min": 3, "max": 1}), "policy_version"),
        (bounded_request(unknown_field=1), "unknown_field"),
        ("[1, 2, 3]", None),
        (bounded_request(n=0), "n"),
        (bounded_request(max_tokens=0), "max_tokens"),
        (bounded_request(stop_token_ids=[-1]), "stop_token_ids"),
        (bounded_request(seed="x"), "seed"),
        (bounded_request(policy_version={"min": -1}), "policy_version.min"),
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
        status, _, _ = await _post(s, f"{url}/v1/generate", bounded_request())
        assert status == 200  # the server keeps serving


def _nudged(view: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``view`` with 1% of its bf16 values moved by one unit in the last place."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in view.items():
        bits = t.clone().view(torch.int16).reshape(-1)
        bits[torch.randint(0, bits.numel(), (max(1, bits.numel() // 100),), generator=gen)] += 1
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


async def test_a_failed_patch_falls_back_to_the_nearest_anchor(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "board"), "run", anchor_every=2)
    board.create(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    v0 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    board.publish(0, v0, view_name="bfloat16")
    async with engine(board, poll_interval_s=3600) as url, aiohttp.ClientSession() as s:
        v1 = _nudged(v0, 1)
        assert board.publish(1, v1, view_name="bfloat16").kind == "delta"
        await _post(s, f"{url}/v1/policy/notify", {})
        await _wait_version(s, url, 1)
        assert board.publish(2, _nudged(v1, 2), view_name="bfloat16").kind == "anchor"
        patches = list((Path(board.root) / "versions" / "00000002").rglob("*.patch"))
        assert patches  # an anchor also stores the patch from the previous version
        for f in patches:
            f.write_bytes(b"garbage")
        with capture_logs() as logs:
            await _post(s, f"{url}/v1/policy/notify", {})
            await _wait_version(s, url, 2)  # served from the anchor instead
        assert "patch_failed_reloading_anchor" in {e["event"] for e in logs}
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_failures_total 0.0" in await r.text()
