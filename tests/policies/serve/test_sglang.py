"""The SGLang backend with ``--sglang-update disk`` (and its generation, which both update ways
share): a real sidecar and board in front of the scripted SGLang server. The in-place way is
``test_sglang_inplace.py``.

Versions are real (published to a board of the tiny model); the fake loads the materialized
directory as SGLang's loader would, so each activation is checked bit for bit against the board.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from structlog.testing import capture_logs

from policies.board import Board
from policies.serve.backends.sglang import INDEX
from policies.serve.types import QuiesceMode
from policies.wire.routing import decode_routing
from tests.support.boards import publish_scaled, tiny_board
from tests.support.lane import generate, policy, standalone, wait_metric, wait_version
from tests.support.sglang import FakeSGLang, expert_of, load_model_dir, sglang_server
from tests.support.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


def bump(board: Board, version: int, names: list[str]) -> None:
    """Publish ``version``: the previous one with one bf16 value of each of ``names`` 1 ulp away."""
    _, view = board.load(version - 1)
    view = {k: v.clone() for k, v in view.items()}
    for name in names:
        view[name].view(torch.int16).reshape(-1)[version] += 1
    board.publish(version, view, view_name="bfloat16")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(bits(a[k]) == bits(b[k]) for k in a)


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


async def test_each_version_reaches_sglang_as_its_changed_tensors(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeSGLang()
    shared = tmp_path / "shared"
    names = sorted(board.manifest(0).tensors)
    changes = {1: names[:2], 2: names[1:4], 3: names[5:6]}
    with capture_logs() as logs:
        async with (
            sglang_server(fake) as engine,
            standalone(
                board, "sglang", engine, sglang_update="disk", materialize_dir=shared
            ) as url,
        ):
            await wait_version(url, 0)
            inodes = {p.name: p.stat().st_ino for p in shared.glob("t-*.safetensors")}
            for version, changed in changes.items():
                written = [e for e in logs if e["event"] == "sglang_staged"]
                bump(board, version, changed)
                await wait_version(url, version)
                staged = [e for e in logs if e["event"] == "sglang_staged"][len(written)]
                assert staged["tensors_written"] == len(changed)  # only what changed
                assert staged["changed"] == len(changed)
                now = {p.name: p.stat().st_ino for p in shared.glob("t-*.safetensors")}
                kept = set(now) & set(inodes)
                assert len(kept) == len(names) - len(changed)  # untouched files: same inodes
                assert all(now[n] == inodes[n] for n in kept)
                assert len(now) == len(names)  # the previous version's files are collected
                inodes = now
    updates = fake.bodies("/update_weights_from_disk")
    assert [u["weight_version"] for u in updates] == ["0", "1", "2", "3"]
    for update, (loaded_version, tensors) in zip(updates, fake.loaded, strict=True):
        assert update["model_path"] == str(shared)
        assert update["load_format"] == "safetensors"
        assert update["flush_cache"] is True
        _, want = board.load(int(str(loaded_version)))
        assert same_bits(tensors, want)  # what SGLang loaded is the version, bit for bit
    assert (shared / INDEX).exists()
    assert (shared / "config.json").exists()
    reads = [e["board_bytes_read"] for e in logs if e["event"] == "sglang_staged"]
    full = board.manifest(0).full_bytes
    assert reads[0] >= full  # the first version needs the anchor
    for version, read in zip(changes, reads[1:], strict=True):
        patch = board.manifest(version).bytes
        assert patch <= read < patch + 16_384 < full / 4  # the patch and manifests, no more


async def test_a_failed_update_is_put_back_then_retried(board: Board, tmp_path: Path) -> None:
    fake = FakeSGLang()
    shared = tmp_path / "shared"
    names = sorted(board.manifest(0).tensors)
    async with (
        sglang_server(fake) as engine,
        standalone(board, "sglang", engine, sglang_update="disk", materialize_dir=shared) as url,
    ):
        await wait_version(url, 0)
        fake.fail_updates = 1
        bump(board, 1, names[:3])
        await wait_metric(url, "sprawl_activation_failures_total", 1)
        # put back: the engine reloaded version 0 from the directory before serving again
        assert [b["weight_version"] for b in fake.bodies("/update_weights_from_disk")][:3] == [
            "0",
            "1",
            "0",
        ]
        _, v0 = board.load(0)
        assert fake.loaded[1][0] == "0"
        assert same_bits(fake.loaded[1][1], v0)
        await wait_version(url, 1)  # retried with backoff, and then it lands
    assert same_bits(fake.loaded[-1][1], board.load(1)[1])
    assert same_bits(load_model_dir(shared), board.load(1)[1])


@pytest.mark.parametrize("mode", ["wait", "pause"])
async def test_an_engine_that_cannot_be_put_back_is_503_until_a_version_lands(
    board: Board, tmp_path: Path, mode: QuiesceMode
) -> None:
    fake = FakeSGLang()
    async with (
        sglang_server(fake) as engine,
        standalone(
            board,
            "sglang",
            engine,
            sglang_update="disk",
            materialize_dir=tmp_path / "s",
            activation=mode,
        ) as url,
    ):
        await wait_version(url, 0)
        fake.fail_updates = 2  # the update and the put-back
        bump(board, 1, sorted(board.manifest(0).tensors)[:1])
        await wait_metric(url, "sprawl_activation_failures_total", 1)
        status, body = await generate(url, {"prompt_token_ids": [1], "max_tokens": 2})
        if status != 200:  # the retry may already have landed
            assert status == 503
            assert body["error"]["type"] == "engine_unavailable"
        await wait_version(url, 1)
        status, body = await generate(url, {"prompt_token_ids": [1], "max_tokens": 2})
        assert status == 200
        assert body["policy_version"] == {"start": 1, "end": 1}
    if mode == "pause":  # retracted requests stayed paused while no version was loaded
        control = [p for p in fake.paths() if p not in ("/generate", "/v1/models")]
        failed = control.index("/pause_generation", 3)
        assert control[failed : failed + 4] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/update_weights_from_disk",
            "/pause_generation",
        ]
        assert control[-1] == "/continue_generation"


async def test_a_first_version_the_engine_refuses_is_409_meanwhile(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeSGLang(fail_updates=1)
    async with (
        sglang_server(fake) as engine,
        standalone(
            board, "sglang", engine, sglang_update="disk", materialize_dir=tmp_path / "s"
        ) as url,
    ):
        state = await _get(f"{url}/v1/policy")
        if state["applied_version"] is None:
            status, body = await generate(url, {"prompt_token_ids": [1]})
            assert status == 409
            assert body["error"]["type"] == "policy_version_unavailable"
        await wait_version(url, 0)


async def test_every_sampling_field_is_sent_and_log_probs_are_of_what_was_sampled(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeSGLang(context_len=333)
    async with (
        sglang_server(fake) as engine,
        standalone(
            board, "sglang", engine, sglang_update="disk", materialize_dir=tmp_path / "s"
        ) as url,
    ):
        await wait_version(url, 0)
        models = await _get(f"{url}/v1/models")
        assert models["data"][0]["max_model_len"] == 333  # the engine's, not the board config's
        plain = {"prompt_token_ids": [1, 2], "max_tokens": 3, "seed": 4, "stop_token_ids": [9]}
        status, body = await generate(url, plain)
        assert status == 200
        assert body["choices"][0]["token_ids"] == [7, 8, 9]
        assert body["choices"][0]["logprobs"] == [-0.25, -0.5, -0.75]
        truncated = {**plain, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
        status, body = await generate(url, truncated)
        assert status == 200
        assert body["choices"][0]["logprobs"] == [-0.125, -0.25, -0.375]  # renormalized
        fake.sampling_logprobs = False  # an SGLang without return_sampling_mask
        status, body = await generate(url, truncated)
        assert status == 503
    first, second, _ = fake.bodies("/generate")
    assert first["input_ids"] == [1, 2]
    assert first["return_logprob"] is True
    assert "return_sampling_mask" not in first
    assert first["sampling_params"] == {
        "max_new_tokens": 3,
        "min_new_tokens": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stop": [],
        "stop_token_ids": [9],
        "ignore_eos": False,
        "n": 1,
        "sampling_seed": 4,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    assert second["return_sampling_mask"] is True
    sp = second["sampling_params"]
    assert (sp["temperature"], sp["top_k"], sp["top_p"]) == (0.7, 5, 0.9)


def _activating(url: str, version: int) -> Callable[[], Awaitable[bool]]:
    """Whether the sidecar activates ``version`` now (or already did: then the test's
    assertions, not this wait, say what went wrong)."""

    async def activating() -> bool:
        state = await policy(url)
        return bool(state["state"] == "activating" or state["applied_version"] == version)

    return activating


@pytest.mark.parametrize("mode", ["wait", "pause"])
async def test_activation_modes(
    board: Board, tiny_model_dir: Path, tmp_path: Path, mode: QuiesceMode
) -> None:
    fake = FakeSGLang(hold=anyio.Event())  # a choice lasts until the test lets it end
    async with (
        sglang_server(fake) as engine,
        standalone(
            board,
            "sglang",
            engine,
            sglang_update="disk",
            materialize_dir=tmp_path / "s",
            activation=mode,
        ) as url,
    ):
        await wait_version(url, 0)
        result: dict[str, Any] = {}

        async def call() -> None:
            result["out"] = await generate(
                url, {"prompt_token_ids": [1, 2], "max_tokens": 3, "seed": 4, "n": 2}
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await until(lambda: fake.generating, "the first choice at the engine")
            publish_scaled(board, 1, tiny_model_dir, scale=0.5)
            if mode == "wait":  # the update waits for the choice in flight: let it end
                await until(_activating(url, 1), "the sidecar activating version 1")
                fake.hold.set()
            await wait_version(url, 1)
            fake.hold.set()  # the choice in flight ends after the update ("pause")
        status, body = result["out"]
    assert status == 200
    seeds = [b["sampling_params"]["sampling_seed"] for b in fake.bodies("/generate")]
    assert seeds == [4, 5]  # choice i is its own request seeded seed + i
    update = next(
        c
        for c in fake.calls
        if c[0] == "/update_weights_from_disk" and c[1]["weight_version"] == "1"
    )
    if mode == "wait":
        assert body["policy_version"] == {"start": 0, "end": 0}  # drained first
        assert "/pause_generation" not in fake.paths()
        first_gen = fake.calls[fake.paths().index("/generate")]
        assert first_gen[3] <= update[2]
    else:
        assert body["policy_version"] == {"start": 0, "end": 1}
        order = [p for p in fake.paths() if p not in ("/generate", "/v1/models")]
        assert order[-3:] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert fake.bodies("/pause_generation")[-1] == {"mode": "retract"}


async def test_an_moe_models_routing_comes_back_in_the_lanes_form(
    tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    board = tiny_board(tmp_path, tiny_moe_model_dir)
    fake = FakeSGLang(routing=(2, 2, 8))  # the tiny MoE model: 2 layers, top-2 of 8 experts
    prompt = [1, 2, 3, 4, 5]
    async with (
        sglang_server(fake) as engine,
        standalone(
            board, "sglang", engine, sglang_update="disk", materialize_dir=tmp_path / "s"
        ) as url,
    ):
        await wait_version(url, 0)
        req = {"prompt_token_ids": prompt, "max_tokens": 3, "routed_experts_prompt_start": 2}
        status, body = await generate(url, req)
        status_full, full = await generate(url, {**req, "routed_experts_prompt_start": 0})
        status_past, past = await generate(url, {**req, "routed_experts_prompt_start": 6})
        fake.routing = (3, 2, 8)  # a server whose routing is not the run's model's
        status_other, _ = await generate(url, req)
    assert (status, status_full, status_past, status_other) == (200, 200, 400, 503)
    assert past["error"]["param"] == "routed_experts_prompt_start"
    sent = fake.bodies("/generate")
    assert sent[0]["return_routed_experts"] is True
    assert sent[0]["routed_experts_start_len"] == 2
    assert "routed_experts_start_len" not in sent[1]  # 0: SGLang's default, any release
    # prompt + 3 sampled tokens, less the last one (never forwarded), from position 2 on
    routed = decode_routing(body["choices"][0]["routed_experts"])
    positions = range(2, len(prompt) + 3 - 1)
    expected = [[[expert_of(p, lay, k, 8) for k in (0, 1)] for lay in (0, 1)] for p in positions]
    assert routed.tolist() == expected
    assert decode_routing(full["choices"][0]["routed_experts"]).shape == (len(prompt) + 2, 2, 2)


async def test_routing_is_asked_only_for_an_moe_model_of_a_server_that_returns_it(
    board: Board, tmp_path: Path
) -> None:
    fake = FakeSGLang(routing=(2, 2, 8))  # the server could, but the run's model is dense
    async with (
        sglang_server(fake) as engine,
        standalone(
            board, "sglang", engine, sglang_update="disk", materialize_dir=tmp_path / "s"
        ) as url,
    ):
        await wait_version(url, 0)
        status, body = await generate(url, {"prompt_token_ids": [1, 2], "max_tokens": 2})
    assert status == 200
    assert body["choices"][0]["routed_experts"] is None
    assert "return_routed_experts" not in fake.bodies("/generate")[0]
