"""A scripted vLLM 0.32 with sprawl's weight-transfer backend: the RL routes in vLLM's JSON
shapes, engine patches really read ahead and applied to an in-memory copy of its weights by the
worker's own code (:class:`~policies.serve.backends.engine_apply.Updates`, each checkpoint tensor
one parameter), so a test compares them bit for bit with the board; failures on cue."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from aiohttp import web

from policies.serve.backends.engine_apply import EngineWeights, Updates
from policies.serve.backends.param_map import Box, ParamMap
from tests.support.lane import loopback


@dataclass
class FakeTransferVLLM:
    """``weights``: what it serves; ``fail_after``: that many updates are applied and then answer
    500, as an engine one of whose other workers failed."""

    startup: dict[str, torch.Tensor]
    fail_after: int = 0
    tito: bool = True
    """Serve ``/inference/v1/generate`` (as with ``--enable-scale-out``)."""
    label: str | None = None
    """What ``weight_versions`` says sampled the tokens (None: ``weight_version``)."""
    weight_version: str = "default"
    initialised: bool = False
    updating: bool = False
    calls: list[tuple[str, Any, float]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    prepared: list[str] = field(default_factory=list)
    """Every request's path with its query string."""
    finished: anyio.Event = field(default_factory=anyio.Event)
    """Set (and replaced) whenever an update finishes."""

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """As a restarted engine: its startup weights, no version, nothing initialised."""
        params = {k: v.clone().reshape(-1) for k, v in self.startup.items()}
        boxes = {
            k: [Box(k, (0,) * v.dim(), tuple(v.shape), 0, tuple(v.stride()))]
            for k, v in self.startup.items()
        }
        shapes = {k: tuple(v.shape) for k, v in self.startup.items()}
        self.engine = EngineWeights(ParamMap(params, boxes, shapes), {}, _no_loader)
        expected = {
            k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in self.startup.items()
        }
        self.updates = Updates(self.engine, expected)
        self.weight_version, self.initialised, self.updating = "default", False, False

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: self.engine.map.params[k].view(v.shape) for k, v in self.startup.items()}

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _update(self, info: dict[str, Any]) -> None:
        if info.get("undo") is not None:
            self.updates.undo(int(info["undo"]))
            return
        if info.get("parts") is None:  # the worker reads it ahead on a thread; returns at once
            self.prepared.append(info["path"])
            self.updates.prepare(int(info["part"]), info["path"], info["digest"])
            return
        self.updates.write([(p, d) for p, d in info["parts"]])
        if self.fail_after:
            self.fail_after -= 1
            raise RuntimeError("another worker's loader raised")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        self.calls.append((path, body, time.monotonic()))
        self.urls.append(str(request.rel_url))
        ok: dict[str, Any] = {"message": "ok"}
        if path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
        if path == "/get_world_size":
            return web.json_response({"world_size": 1})
        if path == "/weight_info":
            return web.json_response({"weight_version": self.weight_version})
        if path == "/init_weight_transfer_engine":
            self.initialised = True
        elif path == "/start_weight_update":
            if not self.initialised:
                return _error("Weight transfer not initialized")
            if self.updating:  # vLLM's words
                return _error(
                    "start_weight_update called while a weight update is already active. Call "
                    "finish_weight_update first."
                )
            self.updating = True
        elif path == "/update_weights":
            try:
                self._update(body["update_info"])
            except (RuntimeError, ValueError) as exc:
                self.updating = False  # as vLLM's worker: the session ends with the error
                return _error(str(exc))
        elif path == "/finish_weight_update":
            if not self.updating:
                return _error("finish_weight_update without start_weight_update")
            self.updating = False
            if body.get("weight_version") is not None:  # as vLLM: None keeps the label
                self.weight_version = str(body["weight_version"])
            self.finished.set()
            self.finished = anyio.Event()
        elif path == "/v1/completions":
            return web.json_response(_completion())
        elif path == "/inference/v1/generate" and self.tito:
            if "token_ids" not in body:
                return web.json_response({"error": "token_ids: field required"}, status=422)
            return web.json_response(_tito(self.label or self.weight_version))
        elif path not in ("/pause", "/resume", "/reset_prefix_cache"):
            return web.Response(status=404)
        return web.json_response(ok)


def _no_loader(tensors: list[Any]) -> None:
    raise AssertionError("every tensor is mapped")


def _error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": 500}}, status=500)


def _completion() -> dict[str, Any]:
    ids = [11, 12]
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.1, -0.2]},
            }
        ]
    }


def _tito(label: str) -> dict[str, Any]:
    ids = [11, 12]
    content = [{"token_id": i, "logprob": lp} for i, lp in zip(ids, [-0.1, -0.2], strict=True)]
    span = {"version": label, "start": 0, "end": len(ids)}
    choice = {"index": 0, "finish_reason": "stop", "token_ids": ids, "weight_versions": [span]}
    return {"choices": [{**choice, "logprobs": {"content": content}}]}


@asynccontextmanager
async def transfer_vllm(fake: FakeTransferVLLM) -> AsyncIterator[str]:
    """Serve ``fake`` on loopback; its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    async with loopback(app) as url:
        yield url
