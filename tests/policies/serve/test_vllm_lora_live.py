"""LoRA versions on a live vLLM CPU engine behind the sidecar: the trainer's adapters are loaded at
run time beside the base weights, several resident, and each request runs through the adapter
its bounds pick, stamped with it; its log probs are those the trainer computes for that version.

Marked slow: it starts vLLM once (≈ 1.5–2 min on 2 cores)."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest

from policies.board import Board
from policies.serve.backends.vllm_launch import engine_python, vllm_server
from policies.train.config import LoraConfig, TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from staleness.config import NoCorrection, StalenessConfig
from tests.support.lane import generate, standalone, wait_version
from tests.support.vllm import head_dim_32

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
PROMPT = [1, 17, 300, 42, 99, 7]


def _samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(4):
        ids = [rng.randrange(3, 2000) for _ in range(12)]
        out.append(TrainSample(ids, [False] * 6 + [True] * 6, [0.0] * 6 + [-7.0] * 6, float(i % 2)))
    return out


def _logprobs(trainer: Trainer, tokens: list[int]) -> list[float]:
    ids = PROMPT + tokens
    logp, _ = trainer.logprobs([TrainSample(ids, [True] * len(ids), [0.0] * len(ids), 0.0)])
    return logp[0, len(PROMPT) - 1 :].tolist()


async def test_vllm_serves_each_request_the_lora_version_its_bounds_pick(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    python = await anyio.to_thread.run_sync(engine_python)
    model = head_dim_32(tiny_model_dir, tmp_path / "model")
    board = Board(str(tmp_path / "board"), "run")
    config = TrainerConfig(
        lr=5e-2, served_view="bfloat16", checkpoint=False, lora=LoraConfig(rank=4)
    )
    staleness = StalenessConfig(correction=NoCorrection())
    trainer = Trainer(model, board, config, staleness=staleness, temperature=1.0, group_size=4)
    trainer.publish()
    body = {"prompt_token_ids": PROMPT, "max_tokens": 8, "temperature": 0.0}
    want: dict[int, list[float]] = {}
    lora = (2, 8)  # two adapters resident, rank ≤ 8
    with vllm_server(python, model, tmp_path / "vllm.log", max_model_len=512, lora=lora) as url:
        async with standalone(
            board,
            "vllm",
            url,
            poll_interval_s=0.1,
            materialize_dir=tmp_path / "island",
            model="m",
            max_adapters=2,
        ) as lane:
            await wait_version(lane, 0, timeout_s=120)
            served: dict[int, dict[str, object]] = {}
            for version in (0, 1):
                if version:
                    await anyio.to_thread.run_sync(trainer.step, _samples(version))
                    await wait_version(lane, version, timeout_s=120)
                status, served[version] = await generate(lane, body)
                assert status == 200
                assert served[version]["policy_version"] == {"start": version, "end": version}
                tokens = served[version]["choices"][0]["token_ids"]  # type: ignore[index]
                want[version] = _logprobs(trainer, tokens)
                got = served[version]["choices"][0]["logprobs"]  # type: ignore[index]
                assert got == pytest.approx(want[version], abs=0.05)  # bf16 base and adapter

            # both resident: a request pinned to v0 still runs through v0's adapter
            status, again = await generate(lane, {**body, "policy_version": {"max": 0}})
            assert status == 200
            assert again["policy_version"] == {"start": 0, "end": 0}
            assert again["choices"] == served[0]["choices"]
            assert served[1]["choices"] != served[0]["choices"]  # the adapter moved the output

            await anyio.to_thread.run_sync(trainer.step, _samples(2))
            await wait_version(lane, 2, timeout_s=120)  # evicts v1, the least recently used
            status, conflict = await generate(
                lane, {**body, "policy_version": {"min": 1, "max": 1}}
            )
            assert status == 409
            assert "no resident adapter version (0, 2)" in conflict["error"]["message"]
            status, newest = await generate(lane, body)
            assert newest["policy_version"] == {"start": 2, "end": 2}
