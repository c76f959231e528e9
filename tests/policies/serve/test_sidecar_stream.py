"""A sidecar stages a version while it is being streamed and serves it only once published."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry

from policies.board import Board, stream_publish
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.sidecar import Sidecar
from tests.support.boards import adam_like_step, tiny_board
from tests.support.stream import AskedTogether, Gate

pytestmark = pytest.mark.anyio


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


@contextlib.asynccontextmanager
async def _serving_v0(
    tmp_path: Path, model: Path
) -> AsyncIterator[tuple[Board, Board, Sidecar, Engine]]:
    """A publisher's board holding version 0 of ``model``, and the board and sidecar of a
    reference engine serving it."""
    pub = tiny_board(tmp_path, model)
    engine = Engine(model, dtype=torch.bfloat16)
    board = Board(pub.url, pub.run)
    sidecar = Sidecar(
        ReferenceBackend(engine), board, poll_interval_s=3600, registry=CollectorRegistry()
    )
    try:
        await sidecar.reconcile()
        assert sidecar.applied_version == 0
        yield pub, board, sidecar, engine
    finally:
        engine.close()


async def test_a_sidecar_stages_a_streamed_version_and_activates_it_once_published(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_publish, "CHUNK_VIEW_BYTES", 1)  # one tensor per chunk
    async with _serving_v0(tmp_path, tiny_model_dir) as (pub, board, sidecar, engine):
        v1 = adam_like_step(pub.load(0)[1], seed=1, density=0.05)
        last = len(stream_publish.plan_chunks(v1)) - 1
        gate = Gate(pub, at=last)
        publish = threading.Thread(target=pub.publish, args=(1, v1), kwargs={"view_name": "bf16"})
        publish.start()
        assert await anyio.to_thread.run_sync(gate.reached.wait, 30)
        fetched = threading.Event()
        read = board._read

        def spy(path: str, limit: int) -> bytes:
            data = read(path, limit)
            if path.endswith("/from-00000000/00000.patch"):
                fetched.set()
            return data

        board._read = spy  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(sidecar.reconcile)
            # chunk 0 is fetched while the last one is not written yet
            assert await anyio.to_thread.run_sync(fetched.wait, 30)
            assert sidecar.state == "staging"
            assert sidecar.staged_version == 1
            assert sidecar.applied_version == 0  # not served: the version is not published
            assert sidecar.policy_state().applied_version == 0
            gate.go.set()
        await anyio.to_thread.run_sync(publish.join, 30)
        assert sidecar.applied_version == 1
        live = engine.live_tensors()
        assert all(torch.equal(_bits(live[k]), _bits(t)) for k, t in v1.items() if k in live)


async def test_a_sidecar_asks_for_the_pointer_and_the_stream_together(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A serving sidecar learns of a version being streamed from the pointer (nothing newer
    published) and ``STREAM``: asked one after the other, a board a round trip away costs two
    at every version."""
    async with _serving_v0(tmp_path, tiny_model_dir) as (pub, board, sidecar, _):
        v1 = adam_like_step(pub.load(0)[1], seed=1, density=0.05)
        gate = Gate(pub, at=0)  # streaming, and nothing of version 1 written yet
        publish = threading.Thread(target=pub.publish, args=(1, v1), kwargs={"view_name": "bf16"})
        publish.start()
        assert await anyio.to_thread.run_sync(gate.reached.wait, 30)
        together = AskedTogether(board)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sidecar.reconcile)
            assert await anyio.to_thread.run_sync(together.both.wait, 30)
            gate.go.set()
        await anyio.to_thread.run_sync(publish.join, 30)
        assert sidecar.applied_version == 1
