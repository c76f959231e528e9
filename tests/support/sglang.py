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

With ``startup`` (the checkpoint it started from) it is an SGLang started with
``--custom-weight-loader policies.serve.backends.sglang_loader.apply_engine_patch`` and
``--tp-size tp``: ``tp`` workers of a tiny SGLang-like model (:mod:`tests.support.sglang_model`),
and ``/update_weights_from_tensor`` does what SGLang's does — each rank's entry of
``serialized_named_tensors`` base64-decoded and loaded with SGLang's allow-list unpickler, checked
to be ``(name, tensor)`` pairs, the ``load_format`` refused unless registered, and the loader
imported by name and called, unguarded, as ``loader(model, named_tensors)`` on every rank — then
flushes and sets ``weight_version`` as SGLang does. ``damage`` / ``fail_rank`` damage the next
engine patch / one rank's command on cue.
"""

from __future__ import annotations

import base64
import importlib
import io
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

from policies.serve.backends.sglang_loader import COMMAND, LOADER, read_command
from tests.support.lane import loopback
from tests.support.sglang_model import AllowListUnpickler, SGLangLikeModel

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
TENSOR_FIELDS = {
    # UpdateWeightsFromTensorReqInput (managers/io_struct.py)
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "disable_draft_model",
    "torch_empty_cache",
}
PAUSE_MODES = ("abort", "retract", "in_place")


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
    hold: anyio.Event | None = None
    """Set, every ``/generate`` waits for it: the test decides how long a generation lasts."""
    generating: int = 0
    """``/generate`` requests at the engine now."""
    tokens: list[int] = field(default_factory=lambda: [7, 8, 9])
    sampling_logprobs: bool = True
    fail_updates: int = 0
    calls: list[tuple[str, Any, float, float]] = field(default_factory=list)
    loaded: list[tuple[str | None, dict[str, torch.Tensor]]] = field(default_factory=list)
    """(weight_version, tensors) per successful update, in order."""
    weight_version: str | None = None
    paused: bool = False
    routing: tuple[int, int, int] | None = None
    startup: Path | None = None
    """The checkpoint it started from: set, it takes in-place updates (module docstring)."""
    tp: int = 1
    converted: frozenset[str] = frozenset()
    """Tensors its model loads through a converted copy (sprawl's loader cannot map them)."""
    loaders: list[str] = field(default_factory=lambda: [LOADER])
    """``--custom-weight-loader``."""
    damage: int = 0
    """That many upcoming ``apply`` commands find their engine patch damaged (a byte flipped)."""
    fail_rank: int | None = None
    """The next ``apply`` command reaches this rank with another digest (it refuses it)."""
    refuse_undo: bool = False
    """The next ``undo`` command is answered 400 without reaching the workers."""
    crashed: str | None = None
    """A loader's exception: SGLang's scheduler would have ended."""
    flushes: int = 0
    workers: list[SGLangLikeModel] = field(default_factory=list)
    labelled: anyio.Event = field(default_factory=anyio.Event)
    """Set (and replaced) whenever ``weight_version`` is set."""

    def __post_init__(self) -> None:
        if self.startup is not None:
            self.restart()

    def restart(self) -> None:
        """As a restarted SGLang: new workers on the startup checkpoint, label ``default``."""
        assert self.startup is not None
        self.workers = [
            SGLangLikeModel(self.startup, r, self.tp, self.converted) for r in range(self.tp)
        ]
        self.weight_version = "default"

    def _server_info(self) -> dict[str, Any]:
        """Some of SGLang's server arguments, as ``/get_server_info`` lists them."""
        return {
            "enable_return_routed_experts": self.routing is not None,
            "version": "0.5.9",
            "model_path": str(self.startup) if self.startup is not None else "m",
            "tp_size": self.tp,
            "pp_size": 1,
            "dp_size": 1,
            "custom_weight_loader": self.loaders if self.startup is not None else [],
        }

    def bodies(self, path: str) -> list[Any]:
        return [c[1] for c in self.calls if c[0] == path]

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]

    async def _generate(self, body: dict[str, Any]) -> web.Response:
        params = body["sampling_params"]
        unknown = set(params) - SAMPLING_FIELDS
        if unknown:
            return web.json_response({"error": {"message": f"unknown {unknown}"}}, status=400)
        self.generating += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
        finally:
            self.generating -= 1
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

    def _from_tensor(self, body: dict[str, Any]) -> web.Response:
        unknown = set(body) - TENSOR_FIELDS
        if unknown:
            return web.json_response({"detail": f"unknown {unknown}"}, status=422)
        fmt = body.get("load_format")
        entries = body["serialized_named_tensors"]
        if fmt not in self.loaders or not self.workers or len(entries) < len(self.workers):
            message = f"Invalid update_weights_from_tensor payload: load_format={fmt}"
            return web.json_response({"success": False, "message": message}, status=400)
        module, name = str(fmt).rsplit(".", 1)
        loader = getattr(importlib.import_module(module), name)
        named = [rank_tensors(entry) for entry in entries[: len(self.workers)]]
        if self.refuse_undo and read_command(named[0]).get("op") == "undo":
            self.refuse_undo = False
            return web.json_response({"success": False, "message": "boom"}, status=400)
        self._tamper(named)
        for worker, tensors in zip(self.workers, named, strict=True):
            try:
                loader(worker, tensors)
            except Exception as exc:  # SGLang does not catch it: its scheduler ends
                self.crashed = repr(exc)
                return web.json_response({"detail": "scheduler died"}, status=500)
        if body.get("flush_cache", True):
            self.flushes += 1
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Success"})

    def _tamper(self, named: list[list[tuple[str, torch.Tensor]]]) -> None:
        command = read_command(named[0])
        if command.get("op") != "apply":
            return
        if self.damage > 0:
            self.damage -= 1
            path = Path(command["path"])
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        if self.fail_rank is not None:
            wrong = {**read_command(named[self.fail_rank]), "digest": "0" * 32}
            raw = bytearray(json.dumps(wrong).encode())
            named[self.fail_rank] = [(COMMAND, torch.frombuffer(raw, dtype=torch.uint8))]
            self.fail_rank = None

    def held(self) -> list[dict[str, torch.Tensor]]:
        """What every rank holds, in checkpoint form (its slices)."""
        return [w.held() for w in self.workers]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body: Any = await request.json() if request.can_read_body else None
        t0 = time.monotonic()
        path = request.path
        reply: web.StreamResponse
        if path == "/generate":
            reply = await self._generate(body)
        elif path == "/update_weights_from_disk":
            reply = await self._update(body)
        elif path == "/update_weights_from_tensor":
            reply = self._from_tensor(body)
        elif path == "/update_weight_version":
            self.weight_version = body["new_version"]
            self.labelled.set()
            self.labelled = anyio.Event()
            message = f"Weight version updated to {body['new_version']}"
            reply = web.json_response(
                {"success": True, "message": message, "new_version": body["new_version"]}
            )
        elif path == "/pause_generation" and (body or {}).get("mode", "abort") not in PAUSE_MODES:
            reply = web.json_response({"detail": "mode"}, status=422)
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
            reply = web.json_response(self._server_info())
        elif path in ("/model_info", "/get_model_info"):
            reply = web.json_response(
                {"model_path": "m", "is_generation": True, "weight_version": self.weight_version}
            )
        else:
            reply = web.Response(status=404)
        self.calls.append((path, body, t0, time.monotonic()))
        return reply


def rank_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry as SGLang reads it: base64, then its allow-list unpickler."""
    named = AllowListUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    if not all(
        isinstance(p, tuple | list)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("Invalid update_weights_from_tensor payload: (name, tensor) pairs")
    return [(n, t) for n, t in named]


@asynccontextmanager
async def sglang_server(fake: FakeSGLang) -> AsyncIterator[str]:
    """Serve ``fake`` on loopback; its base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    async with loopback(app) as url:
        yield url
