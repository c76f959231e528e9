"""SGLang in place (``--sglang-update inplace``), against a scripted SGLang whose workers are a tiny
SGLang-like model and whose ``/update_weights_from_tensor`` runs sprawl's real loader: the request
shapes, versions bit for bit on every tensor-parallel rank, all-or-nothing (a damaged engine
patch, a rank that fails), and a restarted engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from policies.board import Board
from policies.errors import BoardError
from policies.serve.backends.base import EngineUnavailable
from policies.serve.backends.sglang import SGLangBackend
from policies.serve.backends.sglang_inplace import SGLangInplaceBackend
from policies.serve.backends.sglang_loader import (
    LOADER,
    read_command,
)
from policies.serve.backends.standalone import build_parser, make_backend
from policies.serve.options import SidecarOptions
from policies.wire.flags import parse_flags
from tests.support.boards import adam_like_step, tiny_board
from tests.support.lane import generate, standalone, wait_metric, wait_version
from tests.support.sglang import FakeSGLang, rank_tensors, sglang_server
from tests.support.sglang_model import shard

pytestmark = pytest.mark.anyio
UPDATE = "/update_weights_from_tensor"
CONTROL = (
    "/pause_generation",
    UPDATE,
    "/update_weight_version",
    "/continue_generation",
    "/model_info",
)


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


def _engine(board: Board, tmp_path: Path, **kw: Any) -> FakeSGLang:
    """A scripted SGLang started on the board's version 0 (materialized, as islands start)."""
    return FakeSGLang(startup=board.materialize(0, tmp_path / "startup"), **kw)


def _same(fake: FakeSGLang, view: dict[str, torch.Tensor]) -> bool:
    """Every rank holds its slice of ``view``, bit for bit."""
    return all(
        set(held) == set(view)
        and all(
            torch.equal(held[n].view(torch.int16), shard(n, t, rank, fake.tp).view(torch.int16))
            for n, t in view.items()
        )
        for rank, held in enumerate(fake.held())
    )


def _commands(fake: FakeSGLang, rank: int = 0) -> list[dict[str, Any]]:
    entries = [b["serialized_named_tensors"][rank] for b in fake.bodies(UPDATE)]
    return [read_command(rank_tensors(e)) for e in entries]


def _control(fake: FakeSGLang) -> list[str]:
    return [p for p in fake.paths() if p in CONTROL]


def _publish_step(board: Board, version: int, density: float = 0.02) -> None:
    _, view = board.load(version - 1)
    board.publish(version, adam_like_step(view, version, density), view_name="bfloat16")


@asynccontextmanager
async def _serving(
    board: Board, tmp_path: Path, fake: FakeSGLang, at: int = 0, **kw: Any
) -> AsyncIterator[str]:
    """An SGLang sidecar (pause mode unless ``kw`` says) over ``fake``, once it serves version
    ``at`` (versions after 0 published as Adam-like steps)."""
    kw.setdefault("activation", "pause")
    async with (
        sglang_server(fake) as engine,
        standalone(board, "sglang", engine, materialize_dir=tmp_path / "island", **kw) as url,
    ):
        for version in range(at + 1):
            if version:
                _publish_step(board, version)
            await wait_version(url, version)
        yield url


async def test_versions_are_patched_in_place_through_update_weights_from_tensor(
    board: Board, tmp_path: Path
) -> None:
    fake = _engine(board, tmp_path)
    island = tmp_path / "island"
    with capture_logs() as logs:
        async with _serving(board, tmp_path, fake) as url:
            assert fake.paths()[:4] == ["/v1/models", "/get_server_info", "/model_info", UPDATE]
            for v in (1, 2, 3):
                _publish_step(board, v)
                await wait_version(url, v)
                assert _same(fake, board.load(v)[1])  # bit for bit
                assert fake.weight_version == str(v)
                assert not list(island.glob("*.enginepatch"))
                assert not list(island.glob("u-*"))  # nor any rank's result
            status, body = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
            assert status == 200
            assert body["policy_version"] == {"start": 3, "end": 3}
    assert fake.crashed is None
    assert [c["op"] for c in _commands(fake)] == ["init", "apply", "apply", "apply", "apply"]
    assert _commands(fake)[1]["checkpoint"] == str(tmp_path / "startup")
    for body in fake.bodies(UPDATE):
        assert body["load_format"] == LOADER
        assert body["abort_all_requests"] is False
        assert "weight_version" not in body  # the label moves once every rank said ok
        assert len(body["serialized_named_tensors"]) == 1
    assert [b["flush_cache"] for b in fake.bodies(UPDATE)] == [False, True, True, True, True]
    assert fake.bodies("/update_weight_version") == [
        {"new_version": str(v), "abort_all_requests": False} for v in range(4)
    ]
    assert fake.bodies("/pause_generation") == [{"mode": "retract"}] * 4
    assert _control(fake)[-5:] == list(CONTROL)  # the label, then continue, then the check
    assert "/update_weights_from_disk" not in fake.paths()
    assert not list(island.glob("*.safetensors"))  # no checkpoint directory per version
    patched = [e for e in logs if e["event"] == "sglang.patched"]
    assert [e["version"] for e in patched] == [0, 1, 2, 3]
    for e in patched[1:]:  # the patch written once and read once, and two small results
        assert 2 * e["engine_patch_bytes"] < e["island_bytes"] < 2 * e["engine_patch_bytes"] + 2048


async def test_each_tensor_parallel_rank_writes_its_slice(board: Board, tmp_path: Path) -> None:
    fake = _engine(board, tmp_path, tp=2)
    async with _serving(board, tmp_path, fake, at=2):
        assert _same(fake, board.load(2)[1])
    assert fake.crashed is None
    assert all(len(b["serialized_named_tensors"]) == 2 for b in fake.bodies(UPDATE))
    assert [c["rank"] for c in _commands(fake, 1)] == [1] * 4
    assert (
        len({c["result"] for c in _commands(fake, 1)} & {c["result"] for c in _commands(fake)}) == 0
    )


async def test_a_tensor_the_map_cannot_place_is_reloaded_whole_through_the_models_loader(
    board: Board, tmp_path: Path
) -> None:
    converted = "model.layers.0.post_attention_layernorm.weight"
    fake = _engine(board, tmp_path, converted=frozenset({converted}))
    with capture_logs() as logs:
        async with _serving(board, tmp_path, fake) as url:
            for v in (1, 2):
                _, view = board.load(v - 1)
                board.publish(v, adam_like_step(view, v, 0.5), view_name="bfloat16")
                await wait_version(url, v)
                assert _same(fake, board.load(v)[1])
    mapped = [e for e in logs if e["event"] == "sglang_loader.weights_mapped"]
    assert mapped[0]["unmapped"] == [converted]
    assert not torch.equal(board.load(0)[1][converted], board.load(2)[1][converted])


async def test_a_damaged_engine_patch_leaves_the_old_version_serving_bit_for_bit(
    board: Board, tmp_path: Path
) -> None:
    fake = _engine(board, tmp_path)
    async with _serving(board, tmp_path, fake, at=1) as url:
        fake.damage = 1
        before = len(fake.paths())
        _publish_step(board, 2)
        await wait_metric(url, "sprawl_activation_failures_total", 1)
        assert _same(fake, board.load(1)[1])
        assert fake.weight_version == "1"
        failed = [p for p in fake.paths()[before:] if p in CONTROL]
        assert failed[:5] == [  # undone (and labelled as before) inside the pause
            "/pause_generation",
            UPDATE,
            UPDATE,
            "/update_weight_version",
            "/continue_generation",
        ]
        assert [c["op"] for c in _commands(fake)[-2:]] == ["apply", "undo"]
        await wait_version(url, 2, timeout_s=30)  # retried (the patch written again), and it holds
        assert _same(fake, board.load(2)[1])
    assert fake.crashed is None


async def test_an_engine_that_cannot_be_put_back_stays_paused_until_written_whole(
    board: Board, tmp_path: Path
) -> None:
    fake = _engine(board, tmp_path)
    async with _serving(board, tmp_path, fake, at=1) as url:
        fake.damage, fake.refuse_undo = 1, True
        before = len(fake.paths())
        _publish_step(board, 2)
        await wait_metric(url, "sprawl_activation_failures_total", 1)
        await wait_version(url, 2, timeout_s=30)  # restored whole, then version 2 retried
        assert _same(fake, board.load(2)[1])
    control = [p for p in fake.paths()[before:] if p in CONTROL]
    resumed = control.index("/continue_generation")
    # the retracted requests stayed paused until the live view was written whole and labelled
    assert control[:resumed] == [
        "/pause_generation",
        UPDATE,  # the damaged patch: refused
        UPDATE,  # the undo: refused too
        "/model_info",  # the next reconcile
        UPDATE,  # init (learnt already: a no-op)
        UPDATE,  # the live view whole
        "/update_weight_version",  # "1" again
    ]
    assert fake.bodies("/update_weight_version")[-2] == {
        "new_version": "1",
        "abort_all_requests": False,
    }
    ops = [(c["op"], Path(c.get("path", "-")).name) for c in _commands(fake)]
    assert ops[-5:] == [
        ("apply", "v00000002.enginepatch"),  # damaged
        ("undo", "-"),  # refused: broken
        ("init", "-"),  # the next reconcile: learnt already, a no-op
        ("apply", "restore.enginepatch"),  # version 1 whole
        ("apply", "v00000002.enginepatch"),  # retried, and it lands
    ]
    assert fake.crashed is None


async def test_a_rank_that_fails_is_undone_on_the_others(board: Board, tmp_path: Path) -> None:
    fake = _engine(board, tmp_path, tp=2)
    with capture_logs() as logs:
        async with _serving(board, tmp_path, fake, at=1) as url:
            fake.fail_rank = 1
            _publish_step(board, 2)
            await wait_metric(url, "sprawl_activation_failures_total", 1)
            assert _same(fake, board.load(1)[1])  # rank 0 wrote version 2 and took it back
            assert fake.weight_version == "1"
            await wait_version(url, 2, timeout_s=30)
            assert _same(fake, board.load(2)[1])
    undone = [e for e in logs if e["event"] == "sglang.update_undone"]
    assert [e["version"] for e in undone] == [2]
    assert "rank 1:" in undone[0]["error"]
    assert "rank 0:" not in undone[0]["error"]
    assert fake.crashed is None


async def test_an_engine_that_restarted_learns_again_and_gets_the_live_version_whole(
    board: Board, tmp_path: Path
) -> None:
    fake = _engine(board, tmp_path)
    async with _serving(board, tmp_path, fake, at=1) as url:
        fake.restart()  # its startup weights, weight_version "default", nothing learnt
        with anyio.fail_after(10):  # the sidecar asks /model_info at least once a second
            while fake.weight_version != "1":
                await fake.labelled.wait()
        assert _same(fake, board.load(1)[1])
        status, _ = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
        assert status == 200
    assert [c["op"] for c in _commands(fake)].count("init") == 2
    assert fake.crashed is None


async def test_wait_mode_drains_instead_of_pausing(board: Board, tmp_path: Path) -> None:
    fake = _engine(board, tmp_path)
    async with _serving(board, tmp_path, fake, at=1, activation="wait"):
        assert _same(fake, board.load(1)[1])
    assert "/pause_generation" not in fake.paths()
    assert "/continue_generation" not in fake.paths()
    assert fake.bodies(UPDATE)[-1]["flush_cache"] is True


async def test_an_engine_without_the_loader_is_refused_before_any_update(
    board: Board, tmp_path: Path
) -> None:
    fake = _engine(board, tmp_path, loaders=[])
    async with sglang_server(fake) as url:
        backend = SGLangInplaceBackend(
            url, materialize_dir=tmp_path / "island", model="m", max_context=64
        )
        try:
            with pytest.raises(EngineUnavailable, match="--custom-weight-loader"):
                await backend.connect()
        finally:
            await backend.aclose()
    assert UPDATE not in fake.paths()


def test_the_in_place_way_is_the_default_and_keep_is_refused(tmp_path: Path) -> None:
    board = Board(str(tmp_path / "board"), "r")
    common: dict[str, Any] = {
        "board": board, "model": "m", "max_context": 64, "api_key": None,
        "materialize_dir": tmp_path, "version": None, "tokenizer": None,
    }  # fmt: skip
    assert type(make_backend("sglang", "http://127.0.0.1:1", **common)) is SGLangInplaceBackend
    disk = make_backend("sglang", "http://127.0.0.1:1", sglang_update="disk", **common)
    assert type(disk) is SGLangBackend
    with pytest.raises(BoardError, match="--kv-on-update keep"):
        make_backend("sglang", "http://127.0.0.1:1", kv_on_update="keep", **common)
    args = ["--engine-kind", "sglang", "--board", "b", "--engine-url", "http://127.0.0.1:1"]
    assert parse_flags(build_parser(), SidecarOptions, args).sglang_update == "inplace"
    disk_args = [*args, "--sglang-update", "disk"]
    assert parse_flags(build_parser(), SidecarOptions, disk_args).sglang_update == "disk"
