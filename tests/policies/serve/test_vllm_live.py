"""A live vLLM CPU engine behind the sidecar: real trainer versions arrive as patches, and the
engine serves each one exactly as a fresh engine started on it would.

Marked slow: it builds (once, cached outside the clone) the vLLM engine env and starts vLLM
twice (≈ 40 s each on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from structlog.testing import capture_logs

from policies.board import Board, failpoints
from policies.serve.backends.base import free_port
from policies.serve.backends.vllm import VLLMBackend
from policies.serve.backends.vllm_inplace import VLLMInplaceBackend
from policies.serve.backends.vllm_launch import engine_python, vllm_server
from policies.serve.options import VLLMUpdate
from policies.train.config import TrainerConfig
from policies.train.trainer import Trainer
from policies.wire.lane import GenerateRequest
from staleness.config import StalenessConfig
from tests.support.lane import generate, metric, policy, standalone, wait_metric, wait_version
from tests.support.vllm import PROMPTS, head_dim_32, samples
from tests.support.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


async def _damaged_version_is_never_activated(
    url: str,
    board: Board,
    trainer: Trainer,
    before: list[dict[str, Any]],
    bodies: list[dict[str, Any]],
) -> None:
    """Every patch of version 4, and its anchor when the board writes one (these steps move most
    values), is damaged on its way to the board: it is refused, and version 3 keeps serving,
    bit for bit."""
    rules = [
        {"site": "board.write", "match": f"*/versions/00000004/{name}", "action": "corrupt"}
        for name in ("*.patch", "model.safetensors")
    ]
    os.environ[failpoints.ENV] = json.dumps([{**rule, "times": 9} for rule in rules])
    failpoints.reset()
    try:
        await anyio.to_thread.run_sync(trainer.step, samples(3))
    finally:
        del os.environ[failpoints.ENV]
        failpoints.reset()
    await wait_metric(url, "sprawl_version_failures_total", 1, timeout_s=60)
    assert (await policy(url))["applied_version"] == 3
    again = [(await generate(url, b))[1] for b in bodies]
    assert [r["choices"][0] for r in again] == [r["choices"][0] for r in before]


async def _weight_version(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/weight_info") as r:
        return (await r.json())["weight_version"]


class _Restartable:
    """The live engine, which the test kills and starts again on the same port."""

    def __init__(
        self, python: Path, model: Path, logs: Path, port: int, update: VLLMUpdate
    ) -> None:
        self.python, self.model, self.logs, self.port = python, model, logs, port
        self.update = update
        self.stack = contextlib.ExitStack()
        self.starts = 0

    @contextlib.contextmanager
    def start(self) -> Iterator[str]:
        with self.stack:
            yield self.restart()

    def restart(self) -> str:
        self.stack.close()
        self.starts += 1
        log = self.logs / f"live-{self.starts}.log"
        return self.stack.enter_context(
            vllm_server(
                self.python, self.model, log, port=self.port, max_model_len=512, update=self.update
            )
        )


async def _restart_engine(
    url: str,
    engine: _Restartable,
    before: list[dict[str, Any]],
    bodies: list[dict[str, Any]],
) -> None:
    """The engine dies mid-request (503), comes back on its startup weights, and the sidecar
    puts the live version back before it serves again: the same tokens as before."""
    async with anyio.create_task_group() as tg:
        results: list[int] = []

        async def long() -> None:
            """Long generations back to back (one may end early on EOS) until one fails."""
            body = {"prompt_token_ids": PROMPTS[1], "max_tokens": 400, "temperature": 1.0}
            while not results or results[-1] == 200:
                results.append((await generate(url, body))[0])

        tg.start_soon(long)
        await until(lambda: metric(url, "sprawl_lane_inflight"), "a long generation in flight")
        engine.stack.close()  # SIGTERM to the whole process group, mid-generation
    assert results[-1] == 503
    status, _ = await generate(url, bodies[0])
    assert status == 503
    await anyio.to_thread.run_sync(engine.restart)  # on v0's weights, as a restarted engine is

    async def serves() -> bool:
        return (await generate(url, bodies[0]))[0] == 200

    await until(serves, "the restarted engine serving", timeout_s=60, every_s=0.2)
    again = [(await generate(url, b))[1] for b in bodies]
    assert [r["choices"][0] for r in again] == [r["choices"][0] for r in before]


@pytest.mark.parametrize("update", ["inplace", "reload"])
async def test_trainer_versions_through_the_sidecar_serve_like_a_fresh_engine(
    tmp_path: Path, tiny_model_dir: Path, update: VLLMUpdate
) -> None:
    """``inplace``: each version reaches vLLM as an engine patch through its weight-transfer
    API (the island writes and reads about the patch, vLLM's ``/weight_info`` names the
    version); ``reload``: the whole view, reloaded (the fallback)."""
    python = await anyio.to_thread.run_sync(engine_python)
    model = head_dim_32(tiny_model_dir, tmp_path / "model")
    board = Board(str(tmp_path / "board"), "run")
    config = TrainerConfig(lr=3e-2, served_view="bfloat16")
    trainer = Trainer(
        model,
        board,
        config,
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=4,
        seed=0,
    )
    trainer.publish()
    v0 = board.materialize(0, tmp_path / "v0")
    bodies = [{"prompt_token_ids": p, "max_tokens": 12, "temperature": 0.0} for p in PROMPTS]
    sampled = {"prompt_token_ids": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 7}

    port = free_port()
    engine_cm = _Restartable(python, v0, tmp_path, port, update)
    with engine_cm.start() as engine:
        async with standalone(
            board,
            "vllm",
            engine,
            poll_interval_s=0.1,
            activation="pause",
            materialize_dir=tmp_path / "island",
            model="m",
            vllm_update=update,
        ) as url:
            await wait_version(url, 0, timeout_s=120)
            greedy_v0 = [(await generate(url, b))[1] for b in bodies]
            with capture_logs() as logs:
                for step in range(3):
                    before = await metric(url, "sprawl_board_bytes_read_total")
                    await anyio.to_thread.run_sync(trainer.step, samples(step))
                    await wait_version(url, step + 1, timeout_s=120)
                    read = await metric(url, "sprawl_board_bytes_read_total") - before
                    patch = board.manifest(step + 1).patches[0].bytes
                    assert 0 < read <= 2 * patch + 4096, (read, patch)  # the patch, not the ckpt
            if update == "reload":
                reloads = [e for e in logs if e["event"] == "vllm.reloaded"]
                assert [e["version"] for e in reloads] == [1, 2, 3]
                assert all(e["prepared"] for e in reloads), reloads  # read while serving
            else:
                patched = [e for e in logs if e["event"] == "vllm.patched"]
                assert [e["version"] for e in patched] == [1, 2, 3]
                for e in patched:  # the island wrote and read about the patch, no more
                    board_patch = board.manifest(e["version"]).patches[0].bytes
                    assert e["island_bytes"] <= 3 * board_patch, (e, board_patch)
                assert await _weight_version(engine) == "3"
            live = [(await generate(url, b))[1] for b in [*bodies, sampled]]
            assert all(r["policy_version"] == {"start": 3, "end": 3} for r in live)
            # through the token route, whose weight_versions spans agreed with the stamps
            assert "POST /inference/v1/generate" in (tmp_path / "live-1.log").read_text()
            assert await metric(url, "sprawl_version_stamp_mismatch_total") == 0
            assert [r["choices"][0]["token_ids"] for r in live[:3]] != [
                r["choices"][0]["token_ids"] for r in greedy_v0
            ]  # the versions really changed what is served

            status, conflict = await generate(url, {**bodies[0], "policy_version": {"max": 2}})
            assert status == 409
            assert conflict["error"]["type"] == "policy_version_unavailable"
            status, long = await generate(
                url, {"prompt_token_ids": [5] * 600, "max_tokens": 4}
            )  # the engine runs with --max-model-len 512, whatever the board's config says
            assert status == 400, long
            pause_count = await metric(url, "sprawl_activation_pause_seconds_count")
            pause_sum = await metric(url, "sprawl_activation_pause_seconds_sum")
            assert pause_count == 4
            await _damaged_version_is_never_activated(url, board, trainer, live, [*bodies, sampled])
            if update == "inplace":  # a reload after a restart is the reload of every version
                await _restart_engine(url, engine_cm, live, [*bodies, sampled])

    v3 = board.materialize(3, tmp_path / "v3")
    with vllm_server(python, v3, tmp_path / "fresh.log", max_model_len=512, update=update) as fresh:
        backend_cls = VLLMInplaceBackend if update == "inplace" else VLLMBackend
        backend = backend_cls(fresh, work_dir=tmp_path / "unused", model="m", max_context=512)
        try:
            await backend.connect()  # in place: serves unpacked weights, as the live engine
            for body, got in zip([*bodies, sampled], live, strict=True):
                req = GenerateRequest.model_validate(body)
                fresh_sample = await backend.generate_one(req, req.seed)
                assert got["choices"][0]["token_ids"] == fresh_sample.token_ids
                # bit for bit, as JSON floats
                assert got["choices"][0]["logprobs"] == fresh_sample.logprobs
        finally:
            await backend.aclose()
    (tmp_path / "pause.json").write_text(json.dumps({"n": pause_count, "sum_s": pause_sum}))
