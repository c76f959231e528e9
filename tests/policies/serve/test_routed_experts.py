"""The reference engine reports MoE routing per choice in vLLM's ``routed_experts`` shape, on the
lane too."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from policies.errors import BadRequest
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest
from policies.wire.routing import decode_routing
from tests.support.boards import engine, tiny_board


def _engine(model_dir: Path) -> Engine:
    engine = Engine(model_dir)
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    engine.activate({k: v.to(torch.bfloat16) for k, v in state.items()}, version=0)
    return engine


def test_each_choice_has_the_routing_of_every_forwarded_position(
    tiny_moe_model_dir: Path,
) -> None:
    engine = _engine(tiny_moe_model_dir)
    try:
        prompt = [5, 9, 11, 40, 7, 3, 12]
        req = GenerateRequest(prompt_token_ids=prompt, max_tokens=6, n=2, seed=1)
        full = engine.generate(req)
        start = engine.generate(req.model_copy(update={"routed_experts_prompt_start": 4}))
    finally:
        engine.close()
    for choice, trimmed in zip(full, start, strict=True):
        assert choice.routed_experts is not None
        assert trimmed.routed_experts is not None
        routed = decode_routing(choice.routed_experts)
        # prompt + sampled tokens, less the last sampled one (never forwarded)
        assert routed.shape == (len(prompt) + len(choice.token_ids) - 1, 2, 2)
        assert ((routed >= 0) & (routed < 8)).all()
        assert (routed[:, :, 0] != routed[:, :, 1]).all()  # top-2: two distinct experts
        assert np.array_equal(decode_routing(trimmed.routed_experts), routed[4:])
    # the choices share the prompt's prefill
    assert full[0].routed_experts is not None
    assert full[1].routed_experts is not None
    a, b = decode_routing(full[0].routed_experts), decode_routing(full[1].routed_experts)
    assert np.array_equal(a[: len(prompt)], b[: len(prompt)])


def test_a_prompt_start_past_the_prompt_is_a_bad_request(tiny_moe_model_dir: Path) -> None:
    engine = _engine(tiny_moe_model_dir)
    try:
        req = GenerateRequest(prompt_token_ids=[1, 2, 3], routed_experts_prompt_start=4)
        with pytest.raises(BadRequest, match="routed_experts_prompt_start 4 is past") as err:
            engine.generate(req)
        assert err.value.param == "routed_experts_prompt_start"
    finally:
        engine.close()


def test_a_dense_model_reports_no_routing(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    try:
        (choice,) = engine.generate(GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=3))
    finally:
        engine.close()
    assert choice.routed_experts is None


@pytest.mark.anyio
async def test_the_lane_returns_routed_experts_as_vllm_does(
    tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    board = tiny_board(tmp_path, tiny_moe_model_dir)
    body = {"prompt_token_ids": [5, 9, 11, 40], "max_tokens": 5, "seed": 3, "n": 2}
    async with (
        engine(board) as url,
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/generate", json={**body, "routed_experts_prompt_start": 1}) as r,
    ):
        assert r.status == 200
        answer = await r.json()
    for choice in answer["choices"]:
        # what a vLLM client does with the field
        routed = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        assert routed.dtype == np.uint8
        assert routed.shape == (4 + len(choice["token_ids"]) - 1 - 1, 2, 2)
