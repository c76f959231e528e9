"""A scripted SGLang server for the tests: SGLang does not run on this CPU.

It answers in the JSON shapes of SGLang's HTTP server (``sgl-project/sglang``
``entrypoints/http_server.py`` and ``managers/io_struct.py``, 0.5.x) and records every call.
``/update_weights_from_disk`` reads ``model_path`` the way SGLang's ``DefaultModelLoader`` does —
the ``*.safetensors`` files that ``model.safetensors.index.json`` names, or every one without an
index — and keeps what it loaded, so a test compares it with the board's version bit for bit.
``fail_updates`` makes the next updates answer ``400 {"success": false, …}`` as SGLang does.
``routing`` = (layers, top_k, experts) makes it a server started with
``--enable-return-routed-experts``: ``/get_server_info`` says so, and a request with
``return_routed_experts`` gets ``meta_info.routed_experts`` as SGLang encodes it (base64 of
``int32`` ids for positions ``routed_experts_start_len … prompt + completion − 2``; id
:func:`expert_of`); without it, such a request is a 400.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from aiohttp import web
from safetensors.torch import load_file

from tests.support.lane import loopback

SAMPLING_FIELDS = {
    # SamplingParams' API fields (sampling/sampling_params.py); anything else is a TypeError there
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
UPDATE_FIELDS = {
    # UpdateWeightFromDiskReqInput (managers/io_struct.py)
    "model_path",
    "load_format",
    "abort_all_requests",
    "weight_version",
    "is_async",
    "torch_empty_cache",
    "keep_pause",
    "recapture_cuda_graph",
    "token_step",
    "flush_cache",
    "manifest",
}


def expert_of(position: int, layer: int, k: int, experts: int) -> int:
    """The expert the fake routes ``position`` to in ``layer``, choice ``k``."""
    return (3 * position + 5 * layer + k) % experts


def load_model_dir(path: Path) -> dict[str, torch.Tensor]:
    """What SGLang's safetensors loader reads from ``path`` (index-filtered, top level only)."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        named = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in named]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


@dataclass
class FakeSGLang:
    """The scripted engine; ``calls`` holds (path, body, start, end) for every request."""

    context_len: int = 512
    delay: float = 0.0
    tokens: list[int] = field(default_factory=lambda: [7, 8, 9])
    sampling_logprobs: bool = True
    fail_updates: int = 0
    calls: list[tuple[str, Any, float, float]] = field(default_factory=list)
    loaded: list[tuple[str | None, dict[str, torch.Tensor]]] = field(default_factory=list)
    """(weight_version, tensors) per successful update, in order."""
    weight_version: str | None = None
    paused: bool = False
    routing: tuple[int, int, int] | None = None

    def bodies(self, path: str) -> list[Any]:
        return [c[1] for c in self.calls if c[0] == path]

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    async def _generate(self, body: dict[str, Any]) -> web.Response:
        params = body["sampling_params"]
        unknown = set(params) - SAMPLING_FIELDS
        if unknown:
            return web.json_response({"error": {"message": f"unknown {unknown}"}}, status=400)
        await anyio.sleep(self.delay)
        ids = self.tokens[: params["max_new_tokens"]]
        meta: dict[str, Any] = {
            "id": "rid",
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)],
        }
        if body.get("return_sampling_mask") and self.sampling_logprobs:
            meta["output_token_sampling_mask"] = [[t] for t in ids]
            meta["output_token_sampling_logprobs"] = [-0.125 * (i + 1) for i in range(len(ids))]
        if body.get("return_routed_experts"):
            if self.routing is None:
                msg = "return_routed_experts needs --enable-return-routed-experts"
                return web.json_response({"error": {"message": msg}}, status=400)
            layers, top_k, experts = self.routing
            start = body.get("routed_experts_start_len", 0)
            rows = range(start, len(body["input_ids"]) + len(ids) - 1)
            routed = np.array(
                [[[expert_of(p, lay, k, experts) for k in range(top_k)] for lay in range(layers)]
                 for p in rows],
                dtype="<i4",
            )  # fmt: skip
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
        return web.json_response({"text": "xyz", "output_ids": ids, "meta_info": meta})

    async def _update(self, body: dict[str, Any]) -> web.Response:
        unknown = set(body) - UPDATE_FIELDS
        if unknown:
            return web.json_response({"detail": f"unknown {unknown}"}, status=422)
        if self.fail_updates > 0:
            self.fail_updates -= 1
            out = {"success": False, "message": "Failed to update weights: boom.\nRolling back."}
            return web.json_response({**out, "num_paused_requests": 0}, status=400)
        tensors = load_model_dir(Path(body["model_path"]))
        self.loaded.append((body.get("weight_version"), tensors))
        self.weight_version = body.get("weight_version")
        message = "Succeeded to update model weights."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body: Any = await request.json() if request.can_read_body else None
        t0 = time.monotonic()
        path = request.path
        reply: web.StreamResponse
        if path == "/generate":
            reply = await self._generate(body)
        elif path == "/update_weights_from_disk":
            reply = await self._update(body)
        elif path == "/pause_generation":
            self.paused = True
            reply = web.json_response(
                {"message": "Generation paused successfully.", "status": "ok"}
            )
        elif path == "/continue_generation":
            self.paused = False
            reply = web.json_response(
                {"message": "Generation continued successfully.", "status": "ok"}
            )
        elif path == "/v1/models":
            card = {"id": "m", "object": "model", "root": "m", "max_model_len": self.context_len}
            reply = web.json_response({"object": "list", "data": [card]})
        elif path == "/get_server_info":
            reply = web.json_response(
                {"enable_return_routed_experts": self.routing is not None, "version": "0.5.9"}
            )
        elif path == "/get_model_info":
            reply = web.json_response(
                {"model_path": "m", "is_generation": True, "weight_version": self.weight_version}
            )
        else:
            reply = web.Response(status=404)
        self.calls.append((path, body, t0, time.monotonic()))
        return reply


@asynccontextmanager
async def sglang_server(fake: FakeSGLang) -> AsyncIterator[str]:
    """Serve ``fake`` on loopback; its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    async with loopback(app) as url:
        yield url
