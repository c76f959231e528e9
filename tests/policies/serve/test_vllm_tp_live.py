"""A tensor-parallel vLLM CPU engine (``--tensor-parallel-size 2``, one CPU per rank) behind the
sidecar: real trainer versions arrive as engine patches through sprawl's weight-transfer backend,
each rank writes only the positions of its own slice, and the engine serves each version exactly
as a fresh tensor-parallel engine started on it does.

Marked slow: it builds (once, cached outside the clone) the vLLM engine env and starts vLLM
twice with two workers (≈ 30 s each on 2 cores).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from safetensors import safe_open
from structlog.testing import capture_logs

from policies.board import Board
from policies.serve.backends.vllm_inplace import VLLMInplaceBackend
from policies.serve.backends.vllm_launch import engine_python, vllm_server
from policies.train.config import TrainerConfig
from policies.train.trainer import Trainer
from policies.wire.lane import GenerateRequest
from staleness.config import StalenessConfig
from tests.support.lane import generate, policy, standalone, wait_version
from tests.support.vllm import PROMPTS, head_dim_32, samples

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
TP = 2
SPARSE_LR, DENSE_LR = 3e-6, 3e-2
"""A step of the first moves a few percent of the bf16 values (the board stores a delta, the
engine patch carries positions); one of the second moves nearly all of them (the board stores an
anchor, the engine patch whole tensors)."""


def _replicated(name: str) -> bool:
    """What every rank holds whole: the norms, and k and v (the model has one KV head, fewer than
    ranks, so vLLM gives each rank a copy). Every other tensor (q, o, gate, up, down, their
    biases, the vocab-parallel embedding) is split in two."""
    return "norm" in name or ".k_proj." in name or ".v_proj." in name


async def _footprints(engine: str) -> list[dict[str, Any]]:
    """Each worker's ``sprawl_footprint``, in rank order."""
    body = {"method": "sprawl_footprint"}
    async with aiohttp.ClientSession() as s, s.post(f"{engine}/collective_rpc", json=body) as r:
        assert r.status == 200, await r.text()
        results: list[dict[str, Any]] = (await r.json())["results"]
    assert [f["rank"] for f in results] == list(range(TP))
    assert all(f["mapped"] for f in results)
    return results


def _each_rank_held_its_slice(ranks: list[dict[str, Any]], sizes: dict[str, int]) -> None:
    for name, n in sizes.items():
        held = [f["held"][name] for f in ranks]
        assert held == ([n] * TP if _replicated(name) else [n // TP] * TP), (name, held, n)


def _each_rank_wrote_its_slice(ranks: list[dict[str, Any]], version: int) -> None:
    """Every rank read the whole engine patch of ``version`` and wrote the positions it holds:
    a sharded tensor's positions once over the ranks, a replicated one's on every rank."""
    offered = ranks[0]["offered"]
    assert offered
    assert all(f["version"] == version and f["offered"] == offered for f in ranks)
    for name, n in offered.items():
        written = [f["written"].get(name, 0) for f in ranks]
        if _replicated(name):
            assert written == [n] * TP, (name, written, n)
        else:
            assert sum(written) == n, (name, written, n)
    for f in ranks:  # no rank wrote the whole patch
        assert sum(f["written"].values()) < sum(offered.values())


async def test_tensor_parallel_ranks_take_their_slice_of_each_version(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    python = await anyio.to_thread.run_sync(engine_python)
    model = head_dim_32(tiny_model_dir, tmp_path / "model")
    board = Board(str(tmp_path / "board"), "run")
    config = TrainerConfig(lr=SPARSE_LR, served_view="bfloat16")
    trainer = Trainer(
        model, board, config, staleness=StalenessConfig(), temperature=1.0, group_size=4, seed=0
    )
    trainer.publish()
    v0 = board.materialize(0, tmp_path / "v0")
    with safe_open(str(v0 / "model.safetensors"), framework="pt") as f:
        numels = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    bodies = [{"prompt_token_ids": p, "max_tokens": 12, "temperature": 0.0} for p in PROMPTS]
    sampled = {"prompt_token_ids": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 7}

    live_log = tmp_path / "live.log"
    with vllm_server(python, v0, live_log, max_model_len=512, tensor_parallel_size=TP) as engine:
        async with standalone(
            board,
            "vllm",
            engine,
            poll_interval_s=0.1,
            activation="pause",
            materialize_dir=tmp_path / "island",
            model="m",
            vllm_update="inplace",
        ) as url:
            await wait_version(url, 0, timeout_s=120)
            _each_rank_held_its_slice(await _footprints(engine), numels)
            greedy_v0 = [(await generate(url, b))[1] for b in bodies]
            footprints = []
            with capture_logs() as logs:
                for step, lr in enumerate([SPARSE_LR, SPARSE_LR, DENSE_LR]):
                    trainer.config = config.model_copy(update={"lr": lr})
                    await anyio.to_thread.run_sync(trainer.step, samples(step))
                    await wait_version(url, step + 1, timeout_s=120)
                    footprints.append(await _footprints(engine))
                    _each_rank_wrote_its_slice(footprints[-1], step + 1)
                    offered = sum(footprints[-1][0]["offered"].values())
                    if lr == SPARSE_LR:  # positions: a sparse patch's slices
                        assert 0 < offered < sum(numels.values()) // 4, offered
                    else:  # whole tensors
                        assert footprints[-1][0]["offered"] == numels
            (tmp_path / "footprints.json").write_text(json.dumps(footprints))
            patched = [e for e in logs if e["event"] == "vllm.patched"]
            assert [e["version"] for e in patched] == [1, 2, 3]
            for e in patched:  # written once, read by each of the two workers
                assert e["island_bytes"] == (1 + TP) * e["engine_patch_bytes"], e
            live = [(await generate(url, b))[1] for b in [*bodies, sampled]]
            assert all(r["policy_version"] == {"start": 3, "end": 3} for r in live)
            assert (await policy(url))["applied_version"] == 3
            assert [r["choices"][0]["token_ids"] for r in live[:3]] != [
                r["choices"][0]["token_ids"] for r in greedy_v0
            ]  # the versions really changed what is served
    assert "tensor_parallel_size=2" in live_log.read_text()

    v3 = board.materialize(3, tmp_path / "v3")
    with vllm_server(
        python, v3, tmp_path / "fresh.log", max_model_len=512, tensor_parallel_size=TP
    ) as fresh:
        backend = VLLMInplaceBackend(
            fresh, work_dir=tmp_path / "unused", model="m", max_context=512
        )
        try:
            await backend.connect()  # serves unpacked weights, as the live engine
            for body, got in zip([*bodies, sampled], live, strict=True):
                req = GenerateRequest.model_validate(body)
                fresh_sample = await backend.generate_one(req, req.seed)
                assert got["choices"][0]["token_ids"] == fresh_sample.token_ids
                assert got["choices"][0]["logprobs"] == fresh_sample.logprobs  # bit for bit
        finally:
            await backend.aclose()
