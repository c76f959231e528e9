"""vLLM through its weight-transfer API (``--vllm-update inplace``), against a scripted engine that
really applies the engine patches it is sent: the sidecar's calls, the bytes on the island, and
all-or-nothing when the engine fails midway or restarts."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from policies.board import Board, failpoints
from tests.support.boards import adam_like_step, tiny_board
from tests.support.lane import (
    generate,
    metric,
    policy,
    standalone,
    wait_metric,
    wait_version,
)
from tests.support.vllm_transfer import FakeTransferVLLM, transfer_vllm

pytestmark = pytest.mark.anyio
ROUTES = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update"]


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


def _same(weights: dict[str, torch.Tensor], view: dict[str, torch.Tensor]) -> bool:
    return set(weights) == set(view) and all(
        torch.equal(weights[k].view(torch.int16), view[k].view(torch.int16)) for k in view
    )


@asynccontextmanager
async def _serving(
    board: Board, tmp_path: Path, fake: FakeTransferVLLM, at: int = 0, **kw: Any
) -> AsyncIterator[str]:
    """A vLLM sidecar (pause mode unless ``kw`` says) over ``fake``, once it serves version
    ``at`` (versions after 0 published as Adam-like steps)."""
    kw.setdefault("activation", "pause")
    async with (
        transfer_vllm(fake) as engine,
        standalone(board, "vllm", engine, model="m", materialize_dir=tmp_path / "i", **kw) as url,
    ):
        for version in range(at + 1):
            if version:
                _publish_step(board, version)
            await wait_version(url, version)
        yield url


def _publish_step(board: Board, version: int, density: float = 0.02) -> None:
    _, view = board.load(version - 1)
    board.publish(version, adam_like_step(view, version, density), view_name="bfloat16")


async def test_versions_are_patched_in_place_through_the_weight_transfer_routes(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    async with _serving(board, tmp_path, fake) as url:
        assert fake.paths()[:4] == [
            "/v1/models",
            "/inference/v1/generate",  # is the token route there?
            "/get_world_size",
            "/init_weight_transfer_engine",
        ]
        for v in (1, 2, 3):
            _publish_step(board, v)
            await wait_version(url, v)
            assert _same(fake.weights, board.load(v)[1])  # bit for bit
            assert fake.weight_version == str(v)
            sent = [c for c in fake.calls if c[0] == "/update_weights"][-1][1]["update_info"]
            for path, _ in sent["parts"]:  # the island keeps no engine patch once it is live
                assert not await anyio.Path(path).exists()
        status, body = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
        assert status == 200
        assert body["policy_version"] == {"start": 3, "end": 3}
    order = [p for p in fake.paths() if p in (*ROUTES, "/resume", "/reset_prefix_cache")]
    # one session a version: opened as its first part is read ahead, finished with its label
    assert order[-5:] == ["/pause", *ROUTES[2:], "/reset_prefix_cache", "/resume"]
    assert fake.paths().count("/start_weight_update") == 4
    assert order[-6] == "/update_weights"  # the last part, read ahead before the pause
    assert fake.calls[-1][0] != "/collective_rpc"
    assert "/collective_rpc" not in fake.paths()  # no private hook: vLLM's own routes
    updates = [b["update_info"] for p, b, _ in fake.calls if p == "/update_weights"]
    writes = [u["parts"] for u in updates if "parts" in u]
    assert len(writes) == 4  # version 0 whole, then 1, 2 and 3
    read_ahead = [u["path"] for u in updates if "path" in u]  # as they landed, serving
    assert [path for parts in writes for path, _ in parts] == read_ahead


async def test_an_update_that_fails_midway_is_undone_before_generation_resumes(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    async with _serving(board, tmp_path, fake, at=1) as url:
        fake.fail_after = 1
        _publish_step(board, 2)
        await wait_metric(url, "sprawl_version_failures_total", 1)
        # every worker took the update back, under version 1's weight_version, before /resume
        assert _same(fake.weights, board.load(1)[1])
        assert fake.weight_version == "1"
        finished = [
            b["weight_version"]
            for p, b, _ in fake.calls
            if p == "/finish_weight_update" and "weight_version" in b
        ]
        assert finished == ["0", "1", "1"]  # 0 came whole; the undo went in as 1 again
        undo = [b["update_info"] for p, b, _ in fake.calls if p == "/update_weights"][-1]
        assert undo == {"undo": 2}
        paths = fake.paths()
        undone = max(i for i, (p, b, _) in enumerate(fake.calls) if b == {"update_info": undo})
        # the failed write, then the undo in a session of its own, inside the pause
        assert paths[undone - 3 : undone + 3] == [*ROUTES[::2], *ROUTES[1:], "/resume"]
        await wait_version(url, 2, timeout_s=30)  # retried, and then it holds
        assert _same(fake.weights, board.load(2)[1])


async def test_a_damaged_version_is_refused_and_the_live_one_keeps_serving(
    board: Board, tmp_path: Path
) -> None:
    """Every patch of version 2 is damaged on its way to the board: the stage fails (as the
    sidecar's failure to count, not as a crash of the parts handed on meanwhile) and version 1
    stays on the engine, bit for bit; version 3 then goes through."""
    fake = FakeTransferVLLM(board.load(0)[1])
    async with _serving(board, tmp_path, fake, at=1) as url:
        rules = [
            {"site": "board.write", "match": f"*/versions/00000002/{name}", "action": "corrupt"}
            for name in ("*.patch", "model.safetensors")
        ]
        os.environ[failpoints.ENV] = json.dumps([{**rule, "times": 9} for rule in rules])
        failpoints.reset()
        view = adam_like_step(board.load(1)[1], 2, 0.02)
        try:
            board.publish(2, view, view_name="bfloat16")
        finally:
            del os.environ[failpoints.ENV]
            failpoints.reset()
        await wait_metric(url, "sprawl_version_failures_total", 1)
        assert (await policy(url))["applied_version"] == 1
        assert _same(fake.weights, board.load(1)[1])
        assert fake.weight_version == "1"
        board.publish(3, adam_like_step(view, 3, 0.02), view_name="bfloat16")  # from 2's view
        await wait_version(url, 3)
        assert _same(fake.weights, board.load(3)[1])


async def test_a_session_left_open_by_a_stopped_sidecar_is_closed_and_updates_go_on(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    fake.initialised = fake.updating = True  # a sidecar stopped while parts were read ahead
    async with _serving(board, tmp_path, fake) as url:
        _publish_step(board, 1)
        await wait_version(url, 1)
        assert _same(fake.weights, board.load(1)[1])
    assert fake.weight_version == "1"


async def test_an_engine_that_restarted_gets_the_live_version_back_whole(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    async with _serving(board, tmp_path, fake, at=1) as url:
        fake.restart()  # its startup weights, weight_version "default"
        with anyio.fail_after(10):  # the sidecar asks /weight_info at least once a second
            while fake.weight_version != "1":
                await fake.finished.wait()
        status, _ = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
        assert status == 200
        assert fake.paths().count("/init_weight_transfer_engine") == 2
        assert fake.weight_version == "1"
        assert _same(fake.weights, board.load(1)[1])
        assert (await policy(url))["applied_version"] == 1


@pytest.mark.parametrize("kv", ["recompute", "keep"])
async def test_the_running_requests_kv_is_recomputed_unless_kept(
    board: Board, tmp_path: Path, kv: str
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    with capture_logs() as logs:
        async with _serving(board, tmp_path, fake, kv_on_update=kv) as url:
            _publish_step(board, 1)
            await wait_version(url, 1)
    resets = [u for u in fake.urls if u.startswith("/reset_prefix_cache")]
    want = "/reset_prefix_cache" + ("?reset_running_requests=true" if kv == "recompute" else "")
    assert resets == [want, want]
    kept = [e["version"] for e in logs if e["event"] == "vllm.kv_kept"]
    assert kept == ([] if kv == "recompute" else [0, 1])


async def test_generation_goes_through_the_token_route_and_its_stamps_are_cross_checked(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1])
    async with _serving(board, tmp_path, fake, activation="wait") as url:
        body = {"prompt_token_ids": [3, 4], "max_tokens": 2, "temperature": 0.7, "seed": 5}
        status, answer = await generate(url, body)
        assert status == 200
        assert answer["choices"][0]["token_ids"] == [11, 12]
        assert await metric(url, "sprawl_version_stamp_mismatch_total") == 0
        fake.label = "7"  # the engine says another version sampled it
        status, answer = await generate(url, body)
        assert status == 200
        assert answer["policy_version"] == {"start": 0, "end": 0}  # the sidecar's stamps stand
        assert await metric(url, "sprawl_version_stamp_mismatch_total") == 1
    sent = [b for p, b, _ in fake.calls if p == "/inference/v1/generate" and b][-1]
    assert sent["token_ids"] == [3, 4]
    assert sent["output_mode"] == "tokens"
    params = sent["sampling_params"]
    assert (params["temperature"], params["seed"], params["top_k"], params["min_p"]) == (
        0.7,
        5,
        -1,
        0.0,
    )
    assert "/v1/completions" not in fake.paths()


async def test_a_failed_first_activation_is_taken_back_and_retried(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeTransferVLLM(board.load(0)[1], fail_after=1)  # version 0's update fails once
    async with _serving(board, tmp_path, fake) as url:  # the engine is not left broken
        status, _ = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
        assert status == 200
    undo = [b for p, b, _ in fake.calls if p == "/update_weights" and "undo" in b["update_info"]]
    assert [u["update_info"] for u in undo] == [{"undo": 0}]
    assert fake.weight_version == "0"
    assert _same(fake.weights, board.load(0)[1])
