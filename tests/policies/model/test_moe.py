"""MoE routing: the tiny-moe model, recording routed experts, replaying them, their wire form."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from policies.model.moe import RoutingRecorder, replay_routing, routers, top_k
from policies.wire.routing import decode_routing, encode_routing, join_routing


def test_tiny_moe_is_a_qwen3_moe_model_transformers_loads(tiny_moe_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert len(routers(model)) == 2
    assert top_k(model) == 2
    assert model.config.num_experts == 8


def test_replay_forces_the_recorded_experts_and_keeps_the_router_differentiable(
    tiny_moe_model_dir: Path,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir)
    ids = torch.tensor([[5, 9, 11, 40, 7, 3]])
    recorder = RoutingRecorder(model)
    with torch.no_grad():
        own = model(input_ids=ids).logits
    natural = recorder.take()
    assert natural.shape == (6, 2, 2)

    with torch.no_grad(), replay_routing(model, natural[None]):
        same = model(input_ids=ids).logits
    assert torch.equal(recorder.take(), natural)
    torch.testing.assert_close(same, own, rtol=0, atol=0)  # replaying itself changes nothing

    forced = natural.clone()
    forced[2:] = torch.tensor([6, 7])  # other experts from position 2 on
    forced[0] = -1  # position 0 routes by the router
    with replay_routing(model, forced[None]):
        loss = model(input_ids=ids).logits.sum()
    seen = recorder.take()
    assert torch.equal(seen[2:], forced[2:])
    assert torch.equal(seen[0], natural[0])
    loss.backward()
    weight = routers(model)[0].weight
    assert isinstance(weight, torch.Tensor)
    grad = weight.grad
    assert grad is not None
    assert bool(grad[6].abs().sum() > 0)
    assert bool(grad[7].abs().sum() > 0)
    recorder.close()


def test_replay_refuses_routing_that_does_not_fit_the_model(tiny_moe_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir)
    wrong = torch.zeros(1, 4, 3, 2, dtype=torch.long)  # 3 layers
    with (
        pytest.raises(ValueError, match=r"2 MoE layers of top-2 routing"),
        replay_routing(model, wrong),
    ):
        pass


def test_the_wire_form_is_vllms_npy_in_base64() -> None:
    ids = np.array([[[1, 7], [0, 3]], [[2, 5], [6, 4]]])
    text = encode_routing(ids, experts=8)
    raw = np.load(io.BytesIO(base64.b64decode(text)))  # how a vLLM client decodes it
    assert raw.dtype == np.uint8
    assert raw.shape == (2, 2, 2)
    assert np.array_equal(decode_routing(text), ids)
    assert np.load(io.BytesIO(base64.b64decode(encode_routing(ids, 300)))).dtype == np.uint16
    with pytest.raises(ValueError, match=r"seg\.routed_experts: not a base64 \.npy array"):
        decode_routing("not base64!", "seg.routed_experts")
    flat = encode_routing(np.zeros((3, 2, 2), dtype=np.int64), 8)
    assert np.array_equal(decode_routing(flat), np.zeros((3, 2, 2)))


def test_calls_join_into_one_routing_only_when_they_tile_the_sequence() -> None:
    a, b = np.ones((4, 2, 2), dtype=np.int64), np.full((3, 2, 2), 5, dtype=np.int64)
    joined = join_routing([(0, encode_routing(a, 8)), (4, encode_routing(b, 8))])
    assert joined is not None
    assert np.array_equal(decode_routing(joined), np.concatenate([a, b]))
    assert join_routing([(0, encode_routing(a, 8)), (5, encode_routing(b, 8))]) is None  # gap
    assert join_routing([(0, encode_routing(a, 8)), (4, None)]) is None  # a call without
    assert join_routing([]) is None
