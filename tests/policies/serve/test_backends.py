"""The standalone sidecar in front of scripted vLLM / OpenAI-compatible fakes.

SGLang has its own file, ``test_sglang.py`` (its fake lives in ``tests/support/sglang.py``).

Each fake is a real aiohttp server on loopback that answers in the engine's JSON shape and
records every call (path, body, time), so the tests check what the sidecar asked of the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from policies.board import Board, BoardReader, ShardedPublisher
from policies.serve.backends.vllm_worker import SprawlWorkerExtension
from policies.wire.routing import decode_routing, encode_routing
from tests.support.boards import publish_scaled, tiny_board
from tests.support.lane import generate, loopback, standalone, wait_metric, wait_version

pytestmark = pytest.mark.anyio
Reply = Callable[[dict[str, Any]], Awaitable[Any]]


@dataclass
class Fake:
    """A scripted engine: ``replies`` maps a path to a coroutine building the JSON answer."""

    replies: dict[str, Reply]
    calls: list[tuple[str, Any, float, float]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    def bodies(self, path: str) -> list[Any]:
        return [c[1] for c in self.calls if c[0] == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        t0 = time.monotonic()
        reply = await self.replies[request.path](body or {})
        self.calls.append((request.path, body, t0, time.monotonic()))
        if isinstance(reply, web.StreamResponse):
            return reply
        return web.json_response(reply)

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """This engine on loopback; its base URL."""
        app = web.Application()
        for path in self.replies:
            app.router.add_route("*", path, self.handle)
        async with loopback(app) as url:
            yield url


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


async def _wait_failures(url: str, n: int) -> None:
    await wait_metric(url, "sprawl_version_failures_total", n)


async def _text(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(f"{url}/metrics") as r:
        return await r.text()


def vllm_fake(
    loaded: Callable[[str], list[dict[str, Any]]],
    routing: list[int] | None = None,
    *,
    prepares: bool = True,
) -> Fake:
    """vLLM 0.32's shapes: ``/v1/models`` with ``max_model_len``, the dev routes, and
    ``/collective_rpc`` answering one result per worker (``loaded(digest)`` for an activation;
    ``sprawl_prepare`` started, or, unless ``prepares``, the 500 of a worker extension without
    that method). With ``routing``
    (a list the test may change), it is an engine started with ``--enable-return-routed-experts``
    for a model of 2 MoE layers, top-2: each choice has ``routed_experts`` with one row per
    forwarded position from ``routed_experts_prompt_start`` on, plus ``routing[0]`` rows."""

    async def models(_: dict[str, Any]) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 64}]}

    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        ids = [11, 12]
        choice = {
            "index": 0,
            "text": "ab",
            "finish_reason": "stop",
            "stop_reason": 12,
            "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {
                "tokens": [f"token_id:{i}" for i in ids],
                "token_logprobs": [-0.1, -0.2],
                "top_logprobs": [{f"token_id:{i}": -0.1} for i in ids],
                "text_offset": [0, 1],
            },
            "routed_experts": None,
        }
        if routing is not None:
            start = body.get("routed_experts_prompt_start", 0)
            rows = len(body["prompt"]) + len(ids) - 1 - start + routing[0]
            routed = np.arange(rows * 4).reshape(rows, 2, 2) % 8
            choice["routed_experts"] = encode_routing(routed, 8)
        return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}

    current: list[str | None] = [None]  # what the (two) workers serve: None = startup weights
    prepared: set[tuple[str, str]] = set()

    async def rpc(body: dict[str, Any]) -> dict[str, Any] | web.Response:
        if body["method"] == "sprawl_status":
            return {"results": [{"current": current[0]}, {"current": current[0]}]}
        path, digest = body["args"]
        assert _staged(Path(path).parent)  # the staged version, island-local
        if body["method"] == "sprawl_prepare":  # started, then done when asked again
            if not prepares:
                error = "AttributeError: 'Worker' object has no attribute 'sprawl_prepare'"
                return web.json_response({"error": error}, status=500)
            started = (path, digest) not in prepared
            prepared.add((path, digest))
            return {"results": [{"ok": True, "started": started, "done": not started}] * 2}
        results = loaded(digest)
        if all(r.get("ok") and r.get("digest") == digest for r in results):
            current[0] = path
        return {"results": results}

    async def ok(_: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok"}

    async def world(_: dict[str, Any]) -> dict[str, Any]:
        return {"world_size": 2}  # the two workers answering every RPC

    return Fake(
        {
            "/v1/models": models,
            "/v1/completions": completions,
            "/collective_rpc": rpc,
            "/reset_prefix_cache": ok,
            "/update_weight_version": ok,
            "/get_world_size": world,
            "/pause": ok,
            "/resume": ok,
        }
    )


def _staged(work: Path) -> list[str]:
    """The staged version files the vLLM backend keeps in its island-local directory."""
    return sorted(f.name for f in work.glob("*.safetensors"))


def _ok(digest: str) -> list[dict[str, Any]]:
    return [{"ok": True, "digest": digest}, {"ok": True, "digest": digest}]


@asynccontextmanager
async def _at_version_1(
    fake: Fake, board: Board, work: Path, model_dir: Path
) -> AsyncIterator[str]:
    """A vLLM sidecar (pause mode) over ``fake``, once it serves version 1, published from 0."""
    async with (
        fake.serve() as engine,
        standalone(
            board,
            "vllm",
            engine,
            model="m",
            activation="pause",
            materialize_dir=work,
            vllm_update="reload",
        ) as url,
    ):
        await wait_version(url, 0)
        publish_scaled(board, 1, model_dir, scale=0.5)
        await wait_version(url, 1)
        yield url


async def test_vllm_activates_staged_files_by_rpc_and_sends_every_sampling_field(
    board: Board, tmp_path: Path, tiny_model_dir: Path
) -> None:
    fake = vllm_fake(_ok)
    async with _at_version_1(fake, board, tmp_path, tiny_model_dir) as url:
        status, body = await generate(
            url, {"prompt_token_ids": [3, 4], "max_tokens": 2, "seed": 9, "top_k": 5}
        )
        status_long, long = await generate(url, {"prompt_token_ids": [3] * 64})
        top = 2**63 - 1  # the largest seed the lane takes: its second choice wraps around
        status_n, _ = await generate(url, {"prompt_token_ids": [3], "seed": top, "n": 2})
    assert status_n == 200
    assert [b["seed"] for b in fake.bodies("/v1/completions")[-2:]] == [top, -(2**63)]
    activation = [
        path
        for path, body, _, _ in fake.calls
        if path not in ("/v1/completions", "/v1/models")
        and (body or {}).get("method") != "sprawl_status"  # asked at every reconcile
    ]
    assert activation[-7:] == [
        "/collective_rpc",  # sprawl_prepare: the workers read the staged file while serving
        "/collective_rpc",  # asked again: done, so the pause holds only the reload
        "/pause",
        "/collective_rpc",  # sprawl_activate
        "/update_weight_version",  # /weight_info then names the sprawl version
        "/reset_prefix_cache",
        "/resume",
    ]
    rpcs = [b for b in fake.bodies("/collective_rpc") if b["method"] != "sprawl_status"][-3:]
    assert [b["method"] for b in rpcs] == ["sprawl_prepare", "sprawl_prepare", "sprawl_activate"]
    assert rpcs[2]["args"][1] == board.manifest(1).digest
    assert rpcs[0]["args"] == rpcs[1]["args"] == rpcs[2]["args"]
    assert _staged(tmp_path) == ["v00000001.safetensors"]
    assert status == 200
    assert body["policy_version"] == {"start": 1, "end": 1}
    assert body["choices"][0]["token_ids"] == [11, 12]
    assert body["choices"][0]["logprobs"] == [-0.1, -0.2]
    sent = fake.bodies("/v1/completions")[0]
    assert sent["prompt"] == [3, 4]
    assert (sent["seed"], sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == (9, 5, 0, 1)
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["n"]) == (0, 0, 1)
    assert sent["return_tokens_as_token_ids"] is True
    assert sent["logprobs"] == 0
    assert status_long == 400  # the engine's max_model_len (64), not the board's config
    assert long["error"]["param"] == "prompt_token_ids"


async def test_vllm_workers_that_cannot_prepare_still_activate_every_version(
    board: Board, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """An engine env built before ``sprawl_prepare`` answers it with a 500: the sidecar logs
    it, and the activation checks and reads the file itself, as it did before."""
    fake = vllm_fake(_ok, prepares=False)
    async with _at_version_1(fake, board, tmp_path, tiny_model_dir) as url:
        status, body = await generate(url, {"prompt_token_ids": [3, 4], "max_tokens": 2})
    assert (status, body["policy_version"]) == (200, {"start": 1, "end": 1})
    methods = [b["method"] for b in fake.bodies("/collective_rpc")]
    assert methods.count("sprawl_prepare") == 2  # once at each staging: refused, not retried
    assert methods.count("sprawl_activate") == 2  # versions 0 and 1


async def test_vllm_routing_of_an_moe_model_is_passed_on_when_it_covers_every_position(
    board: Board, tmp_path: Path
) -> None:
    extra = [0]
    fake = vllm_fake(_ok, routing=extra)
    req = {"prompt_token_ids": [3, 4, 5, 6], "max_tokens": 2, "routed_experts_prompt_start": 1}
    async with (
        fake.serve() as engine,
        standalone(
            board, "vllm", engine, model="m", materialize_dir=tmp_path, vllm_update="reload"
        ) as url,
    ):
        await wait_version(url, 0)
        status, body = await generate(url, req)
        extra[0] = 1  # one row too many: not the positions the request asked for
        status_more, _ = await generate(url, req)
    assert (status, status_more) == (200, 503)
    assert fake.bodies("/v1/completions")[0]["routed_experts_prompt_start"] == 1
    routed = decode_routing(body["choices"][0]["routed_experts"])
    assert routed.tolist() == (np.arange(4 * 4).reshape(4, 2, 2) % 8).tolist()


async def test_vllm_workers_that_fail_or_disagree_keep_the_old_version(
    board: Board, tmp_path: Path, tiny_model_dir: Path
) -> None:
    answers = itertools.chain(
        [_ok],
        itertools.cycle(
            [
                lambda d: [{"ok": True, "digest": d}, {"ok": True, "digest": "other"}],
                lambda d: [{"ok": False, "changed": True, "rolled_back": True, "error": "x"}],
            ]
        ),
    )
    fake = vllm_fake(lambda digest: next(answers)(digest))
    async with (
        fake.serve() as engine,
        standalone(
            board, "vllm", engine, model="m", materialize_dir=tmp_path, vllm_update="reload"
        ) as url,
    ):
        await wait_version(url, 0)
        publish_scaled(board, 1, tiny_model_dir, scale=0.5)
        await _wait_failures(url, 2)
        async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
        status, body = await generate(url, {"prompt_token_ids": [3], "max_tokens": 2})
        assert (status, body["policy_version"]) == (200, {"start": 0, "end": 0})
    assert fake.paths().count("/reset_prefix_cache") == 1
    assert _staged(tmp_path) == ["v00000000.safetensors"]


def llama_fake() -> Fake:
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "index": 0,
                    "text": "hi",
                    "finish_reason": "length",
                    "logprobs": {
                        "content": [
                            {
                                "id": 21,
                                "token": "h",
                                "logprob": -1.5,
                                "bytes": [104],
                                "top_logprobs": [],
                            },
                            {
                                "id": 22,
                                "token": "i",
                                "logprob": -0.5,
                                "bytes": [105],
                                "top_logprobs": [],
                            },
                        ]
                    },
                }
            ]
        }

    return Fake({"/v1/completions": completions})


async def test_openai_endpoint_serves_its_fixed_version(board: Board) -> None:
    fake = llama_fake()
    async with fake.serve() as engine, standalone(board, "openai", engine, version=5) as url:
        status, body = await generate(url, {"prompt_token_ids": [1], "max_tokens": 2})
        assert status == 200
        assert body["policy_version"] == {"start": 5, "end": 5}
        assert body["choices"][0]["token_ids"] == [21, 22]
        assert body["choices"][0]["logprobs"] == [-1.5, -0.5]
        assert body["choices"][0]["finish_reason"] == "length"
        status, err = await generate(
            url, {"prompt_token_ids": [1], "policy_version": {"min": 6, "max": None}}
        )
        assert status == 409
        assert err["error"]["applied_version"] == 5
    assert len(fake.calls) == 1  # the refused request never reached the engine


async def test_engine_errors_are_503_and_the_sidecar_keeps_serving(board: Board) -> None:
    state = {"fail": True}

    async def completions(body: dict[str, Any]) -> Any:
        if state["fail"]:
            return web.json_response({"error": "boom"}, status=500)
        return await llama_fake().replies["/v1/completions"](body)

    fake = Fake({"/v1/completions": completions})
    async with fake.serve() as engine, standalone(board, "openai", engine, version=1) as url:
        status, body = await generate(url, {"prompt_token_ids": [1]})
        assert status == 503
        assert body["error"]["type"] == "engine_unavailable"
        state["fail"] = False
        status, _ = await generate(url, {"prompt_token_ids": [1]})
        assert status == 200


async def test_a_choice_the_engine_fails_is_answered_beside_the_others(board: Board) -> None:
    """One of ``n`` engine requests failing fails that choice alone (#42 defect 5: the whole
    request was 503); a request whose every choice the engine refused as bad is 400."""
    answered = llama_fake().replies["/v1/completions"]

    async def completions(body: dict[str, Any]) -> Any:
        if body["seed"] == 101:
            return web.json_response({"error": "boom"}, status=500)
        if body["seed"] >= 500:
            return web.json_response({"error": "stop_token_ids: 9999 is no token"}, status=400)
        return await answered(body)

    fake = Fake({"/v1/completions": completions})
    async with fake.serve() as engine, standalone(board, "openai", engine, version=1) as url:
        status, body = await generate(url, {"prompt_token_ids": [1], "seed": 100, "n": 3})
        assert status == 200
        ok, failed, other = body["choices"]
        assert ok == other | {"index": 0}
        assert ok["token_ids"] == [21, 22]
        assert (failed["index"], failed["finish_reason"], failed["token_ids"]) == (1, "error", [])
        assert failed["error"]["type"] == "engine_unavailable"
        assert "answered 500" in failed["error"]["message"]
        assert "error" not in ok  # a choice that did not fail carries no error field
        status, body = await generate(url, {"prompt_token_ids": [1], "seed": 500, "n": 2})
        assert status == 400
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("the engine refused the request: openai")
        status, body = await generate(url, {"prompt_token_ids": [1], "seed": 101})
        assert (status, body["error"]["type"]) == (503, "engine_unavailable")


class _Model(torch.nn.Module):
    """Stands in for a vLLM model whose parameters hold HF-named tensors."""

    def __init__(self, template: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterDict(
            {
                k.replace(".", "__"): torch.nn.Parameter(torch.zeros_like(v), requires_grad=False)
                for k, v in template.items()
            }
        )


class _Worker(SprawlWorkerExtension):
    """A scripted vLLM worker: ``reload_weights`` copies the weights it is given in place."""

    def __init__(self, model_dir: Path, model: _Model) -> None:
        self.model = model
        self.model_runner = type("Runner", (), {"get_model": lambda _: model})()
        hf = type("HF", (), {"tie_word_embeddings": True})()
        config = type("C", (), {"model": str(model_dir), "dtype": torch.bfloat16, "hf_config": hf})
        self.vllm_config = type("V", (), {"model_config": config})()
        self.reloads = 0

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        for name, t in weights_iterator:
            self.model.weights[name.replace(".", "__")].data.copy_(t)
        self.reloads += 1


async def test_vllm_worker_extension_checks_before_it_loads(board: Board, tmp_path: Path) -> None:
    from policies.serve.backends.vllm import write_view

    manifest, view = board.load(0)
    write_view(view, tmp_path / "start" / "model.safetensors")
    worker = _Worker(tmp_path / "start", _Model(view))
    write_view(view, tmp_path / "v0.safetensors")
    out = worker.sprawl_activate(str(tmp_path / "v0.safetensors"), manifest.digest)
    assert out["ok"] is True
    assert out["digest"] == manifest.digest
    for name, t in view.items():
        assert torch.equal(worker.model.weights[name.replace(".", "__")], t)

    wrong = worker.sprawl_activate(str(tmp_path / "v0.safetensors"), "not-the-digest")
    assert (wrong["ok"], wrong["changed"]) == (False, False)
    bad = {**view, "model.norm.weight": view["model.norm.weight"][:-1].clone()}
    write_view(bad, tmp_path / "bad.safetensors")
    shape = worker.sprawl_activate(str(tmp_path / "bad.safetensors"), manifest.digest)
    assert (shape["ok"], shape["changed"]) == (False, False)
    assert "model.norm.weight" in shape["error"]
    assert worker.reloads == 1  # refused files never reached vLLM's loader


async def test_vllm_workers_read_a_prepared_file_while_serving_and_only_reload_it_after(
    board: Board, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from policies.serve.backends import vllm_worker
    from policies.serve.backends.vllm import write_view

    manifest, view = board.load(0)
    write_view(view, tmp_path / "start" / "model.safetensors")
    worker = _Worker(tmp_path / "start", _Model(view))
    path = str(tmp_path / "v0.safetensors")
    write_view(view, Path(path))
    assert worker.sprawl_prepare(path, manifest.digest) == {
        "ok": True,
        "path": path,
        "rank": 0,
        "started": True,
        "done": False,
    }
    worker._sprawl()["prepared"].tensors.result()  # read and checked while the engine serves
    asked = worker.sprawl_prepare(path, manifest.digest)
    assert (asked["ok"], asked["started"], asked["done"]) == (True, False, True)

    def no_reads(_: str) -> dict[str, torch.Tensor]:
        raise AssertionError("the activation read the file again")

    monkeypatch.setattr(vllm_worker, "_read", no_reads)
    out = worker.sprawl_activate(path, manifest.digest)
    assert (out["ok"], out["prepared"], out["digest"]) == (True, True, manifest.digest)
    for name, t in view.items():
        assert torch.equal(worker.model.weights[name.replace(".", "__")], t)
    monkeypatch.undo()

    # a preparation serves only its own file, as it still is, for its digest
    write_view(view, Path(path))  # the same bytes, written in its place
    assert worker.sprawl_prepare(path, manifest.digest)["ok"]
    worker._sprawl()["prepared"].tensors.result()
    write_view(view, Path(path))
    again = worker.sprawl_activate(path, manifest.digest)
    assert (again["ok"], again["prepared"]) == (True, False)  # read again: another file now
    assert worker.sprawl_prepare(path, "not-the-digest")["ok"]  # checked on the reader thread
    refused = worker.sprawl_activate(path, "not-the-digest")
    assert (refused["ok"], refused["changed"], refused["prepared"]) == (False, False, True)
    assert "digest" in refused["error"]
    assert worker.sprawl_prepare(str(tmp_path / "missing.safetensors"), manifest.digest)[
        "error"
    ].startswith("FileNotFoundError")
    assert worker.reloads == 2  # the refused file never reached vLLM's loader


async def test_vllm_workers_check_a_sharded_version_against_its_whole_tensors(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A sharded version's manifest digest covers its pieces; the workers digest whole tensors,
    so the sidecar hands them the digest of the view it assembled and verified."""
    from policies.serve.backends.vllm import file_digest, write_view

    pub = ShardedPublisher(str(tmp_path / "board"), "run")  # a world of one: format 3, 1 shard
    pub.create(tiny_model_dir)
    weights = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    pub.publish(0, {k: v for k, v in weights.items() if k != "lm_head.weight"}, view_name="bf16")
    manifest, view = BoardReader(str(tmp_path / "board"), "run").load(0)
    assert manifest.shards
    write_view(view, tmp_path / "start" / "model.safetensors")
    worker = _Worker(tmp_path / "start", _Model(view))
    write_view(view, tmp_path / "v0.safetensors")
    assert manifest.digest != file_digest(manifest, view)
    refused = worker.sprawl_activate(str(tmp_path / "v0.safetensors"), manifest.digest)
    assert refused["ok"] is False
    out = worker.sprawl_activate(str(tmp_path / "v0.safetensors"), file_digest(manifest, view))
    assert out["ok"] is True
    unsharded, plain = tiny_board(tmp_path / "plain", tiny_model_dir).load(0)
    assert file_digest(unsharded, plain) == unsharded.digest
