"""A scripted vLLM 0.32 with sprawl's weight-transfer backend: the RL routes in vLLM's JSON
shapes, engine patches really applied to an in-memory copy of its weights (so a test compares
them bit for bit with the board), failures on cue."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from aiohttp import web

from policies.serve.backends.engine_patch import read
from tests.support.lane import loopback


@dataclass
class FakeTransferVLLM:
    """``weights``: what it serves (checkpoint names, flat); ``fail_midway``: that many updates
    write half their tensors and then answer 500, as a worker whose loader raised."""

    startup: dict[str, torch.Tensor]
    fail_midway: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_version: str = "default"
    initialised: bool = False
    updating: bool = False
    calls: list[tuple[str, Any, float]] = field(default_factory=list)
    finished: anyio.Event = field(default_factory=anyio.Event)
    """Set (and replaced) whenever an update finishes."""

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """As a restarted engine: its startup weights, no version, nothing initialised."""
        self.weights = {k: v.clone() for k, v in self.startup.items()}
        self.weight_version, self.initialised, self.updating = "default", False, False

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _update(self, info: dict[str, Any]) -> None:
        expected = {
            k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in self.startup.items()
        }
        _, tensors = read(info["path"], info["digest"], expected)
        for i, t in enumerate(tensors):
            if self.fail_midway and i == len(tensors) // 2:
                self.fail_midway -= 1
                raise RuntimeError("the loader raised midway")
            flat = self.weights[t.name].reshape(-1)
            if t.positions is None:
                flat.copy_(t.values)
            else:
                flat[t.positions] = t.values

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        self.calls.append((path, body, time.monotonic()))
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
            if self.updating or not self.initialised:
                return _error("start_weight_update while one is active, or not initialised")
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
            self.updating, self.weight_version = False, str(body["weight_version"])
            self.finished.set()
            self.finished = anyio.Event()
        elif path == "/v1/completions":
            return web.json_response(_completion())
        elif path not in ("/pause", "/resume", "/reset_prefix_cache"):
            return web.Response(status=404)
        return web.json_response(ok)


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


@asynccontextmanager
async def transfer_vllm(fake: FakeTransferVLLM) -> AsyncIterator[str]:
    """Serve ``fake`` on loopback; its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    async with loopback(app) as url:
        yield url
