"""The reference engine's HTTP server: the request lane over aiohttp, with the sidecar embedded.

Routes: ``POST /v1/generate``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``policies.serve.openai_routes``), ``GET /v1/models``, ``GET /v1/policy``, ``POST
/v1/policy/notify``, ``GET /health``, ``GET /metrics`` (Prometheus). Every route except ``/health``
requires ``Authorization: Bearer <token>`` when a token is set (compared in constant time; a
header with non-ASCII bytes is a wrong token). Every bad request (malformed JSON, JSON nested too
deep, an integer of more than 64 digits, a lone surrogate in a string, a field out of range, an
unknown field, an over-long prompt, an invalid tool schema) gets a 4xx JSON error naming the field
(:mod:`policies.serve.http_body`), and the server keeps running; version
conflicts get 409 ``policy_version_unavailable`` with ``Retry-After``. TLS is optional
(:func:`tls_context` from a PEM certificate and key).

Abandoned work is cancelled: when a client disconnects before its answer, aiohttp cancels the
request's handler (``handler_cancellation``), which cancels the generation: the reference engine
drops its rows and their KV cache at the next decode-step boundary, and the sidecar's HTTP
backends close their engine request, which vLLM, SGLang and llama.cpp abort when the connection
goes. Each such request is counted (``sprawl_lane_abandoned_total{route}``) and logged
(``request_abandoned``). Handlers hold no state that a cancellation could leave half-changed:
activations run in the sidecar's own task, never in a request's.

Slow and idle clients are bounded by :class:`~policies.serve.connections.LaneLimits` (header,
idle and body deadlines, a cap on open connections; :mod:`policies.serve.connections`).

:func:`serve_board` follows a board; :func:`serve_model` serves a plain model dir as the fixed
version 0. The same server fronts the standalone sidecar (``policies.serve.backends``):
:func:`run_lane` serves any :class:`Sidecar` whose backend is an external engine.
"""

from __future__ import annotations

import re
import ssl
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from policies.board import Board
from policies.codec.views import quantized_kind
from policies.errors import BadRequest, BoardError, EngineError
from policies.serve.adapters import is_lora_version
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.connections import ConnectionLimiter, LaneLimits, LaneSite
from policies.serve.engine import Engine
from policies.serve.http_body import bearer_matches, read_json
from policies.serve.openai_routes import OpenAIRoutes, parse_body
from policies.serve.sidecar import Sidecar
from policies.serve.types import QuiesceMode, VersionNotServed
from policies.wire.lane import (
    VERSION_UNAVAILABLE,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    GenerateRequest,
)

log = structlog.get_logger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(
    status: int,
    type_: str,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: int | None,
) -> web.Response:
    body = ErrorBody(type=type_, message=message, param=param, **extra)
    return web.json_response(
        {"error": body.model_dump(exclude_none=True)}, status=status, headers=headers
    )


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2+) from PEM files."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except OSError as exc:  # a missing file, or not a PEM certificate and key (ssl.SSLError)
        raise EngineError(
            f"TLS certificate {cert} with key {key} cannot be loaded: {exc.strerror or exc}"
        ) from None
    return ctx


class LaneServer:
    """Binds a :class:`Sidecar` (and its engine) to the lane's routes."""

    def __init__(
        self,
        sidecar: Sidecar,
        *,
        token: str | None,
        registry: CollectorRegistry,
        tokenizer: PreTrainedTokenizerBase | None = None,
        limits: LaneLimits | None = None,
    ):
        self.sidecar = sidecar
        self.token = token
        self.registry = registry
        self.limits = limits or LaneLimits()
        self.connections = ConnectionLimiter(self.limits, registry)
        self.openai = OpenAIRoutes(sidecar, tokenizer) if tokenizer is not None else None
        self.requests = Counter(
            "sprawl_lane_requests",
            "Lane requests by route and status",
            ["route", "status"],
            registry=registry,
        )
        self.abandoned = Counter(
            "sprawl_lane_abandoned",
            "Requests whose client went away before the answer (their generation is cancelled)",
            ["route"],
            registry=registry,
        )
        self.inflight = Gauge("sprawl_lane_inflight", "Requests being served", registry=registry)
        self.app = web.Application(
            middlewares=[self.connections.middleware, self._auth, self._count]
        )
        routes = [
            web.post("/v1/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/v1/policy", self.policy),
            web.post("/v1/policy/notify", self.notify),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ]
        if self.openai is not None:
            routes += [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
            ]
        self.app.add_routes(routes)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if (
            self.token is not None
            and request.path != "/health"
            and not bearer_matches(given, self.token)
        ):
            return error_response(401, "unauthorized", "missing or wrong bearer token")
        return await handler(request)

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        label = route.canonical if route is not None else "unmatched"
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            self.requests.labels(label, str(exc.status)).inc()
            raise
        except anyio.get_cancelled_exc_class():  # the client went away (or the server stops)
            self.abandoned.labels(label).inc()
            log.info("request_abandoned", route=label)
            raise
        self.requests.labels(label, str(resp.status)).inc()
        return resp

    async def _answer(
        self, request: web.Request, serve: Callable[[Any], Awaitable[BaseModel]]
    ) -> web.Response:
        """Parse JSON, serve it, and map every failure to its JSON error."""
        try:
            with anyio.fail_after(self.limits.body_timeout_s):
                payload = await read_json(request)
        except BadRequest as exc:
            return error_response(400, "invalid_request_error", str(exc), param=exc.param)
        except TimeoutError:
            message = (
                f"request body not received within {self.limits.body_timeout_s} s (--body-timeout)"
            )
            late = error_response(408, "request_timeout", message)
            late.force_close()  # no keep-alive: the rest of this body may never come
            return late
        self.inflight.inc()
        try:
            answer = await serve(payload)
        except VersionNotServed as exc:
            return error_response(
                409,
                VERSION_UNAVAILABLE,
                str(exc),
                headers={"Retry-After": "1"},
                applied_version=exc.applied,
                staged_version=exc.staged,
            )
        except BadRequest as exc:
            return error_response(400, "invalid_request_error", str(exc), param=exc.param)
        except EngineError as exc:
            return error_response(503, "engine_unavailable", str(exc))
        finally:
            self.inflight.dec()
        return web.json_response(answer.model_dump())

    async def generate(self, request: web.Request) -> web.Response:
        async def serve(payload: Any) -> BaseModel:
            req = parse_body(GenerateRequest, payload)
            return await self.sidecar.generate(req, f"gen-{uuid.uuid4().hex[:16]}")

        return await self._answer(request, serve)

    async def chat(self, request: web.Request) -> web.Response:
        assert self.openai is not None
        openai = self.openai

        async def serve(payload: Any) -> BaseModel:
            return await openai.chat(parse_body(ChatCompletionRequest, payload))

        return await self._answer(request, serve)

    async def completions(self, request: web.Request) -> web.Response:
        assert self.openai is not None
        openai = self.openai

        async def serve(payload: Any) -> BaseModel:
            return await openai.complete(parse_body(CompletionRequest, payload))

        return await self._answer(request, serve)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.sidecar.board.run,
                        "object": "model",
                        "owned_by": "sprawl",
                        "max_model_len": self.sidecar.backend.max_context,
                    }
                ],
            }
        )

    async def policy(self, _request: web.Request) -> web.Response:
        return web.json_response(self.sidecar.policy_state().model_dump())

    async def notify(self, _request: web.Request) -> web.Response:
        self.sidecar.notify()
        return web.json_response({"ok": True})

    async def health(self, _request: web.Request) -> web.Response:
        ready = self.sidecar.applied_version is not None
        return web.json_response(
            {"status": "ok" if ready else "starting"}, status=200 if ready else 503
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


async def run_lane(
    sidecar: Sidecar,
    *,
    host: str,
    port: int,
    token: str | None,
    registry: CollectorRegistry,
    tokenizer: PreTrainedTokenizerBase | None,
    tls: ssl.SSLContext | None = None,
    wait_for_version: bool = True,
    limits: LaneLimits | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Reconcile ``sidecar`` and serve its lane until cancelled; ``started`` with the port.

    ``wait_for_version``: bind only once a version is applied (the reference engine's fleet
    waits for that); otherwise bind at once, and until the first activation ``/health`` and
    ``GET /v1/policy`` answer (state ``starting``) and requests get 409 with ``Retry-After``.
    ``limits``: the connection deadlines and cap (:class:`LaneLimits`; its defaults if None)."""
    server = LaneServer(sidecar, token=token, registry=registry, tokenizer=tokenizer, limits=limits)
    runner = web.AppRunner(
        server.app,
        access_log=None,
        shutdown_timeout=2.0,
        handler_cancellation=True,  # a client that goes away cancels its generation
        keepalive_timeout=server.limits.idle_timeout_s,
    )
    await runner.setup()
    try:
        async with anyio.create_task_group() as tg:
            if wait_for_version:
                await tg.start(sidecar.run)
            else:
                tg.start_soon(sidecar.run)
            site = LaneSite(runner, host, port, server.connections, ssl_context=tls)
            await site.start()
            bound = int(runner.addresses[0][1])
            log.info(
                "lane_ready",
                port=bound,
                version=sidecar.applied_version,
                tls=tls is not None,
                auth=token is not None,
                **server.limits.model_dump(),
            )
            task_status.started(bound)
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
            await sidecar.backend.aclose()


async def serve_board(
    board_url: str,
    run: str,
    *,
    host: str,
    port: int,
    device: str,
    token: str | None,
    poll_interval_s: float,
    activation: QuiesceMode = "wait",
    tls: ssl.SSLContext | None = None,
    limits: LaneLimits | None = None,
    base_model: Path | None = None,
    max_adapters: int = 4,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the board's newest version until cancelled; ``started`` with the bound port.

    A run of LoRA versions (``trainer.lora``) needs ``base_model``, the model directory whose
    weights its adapters adapt; the engine keeps ``max_adapters`` of them resident."""
    board = Board(board_url, run)
    with tempfile.TemporaryDirectory(prefix="sprawl-engine-") as tmp:
        model_dir = Path(tmp) / run
        model_dir.mkdir()
        latest = await _wait_for_board(board)
        base = await anyio.to_thread.run_sync(board.base_files)  # every version must record them
        for name, data in base.items():
            (model_dir / name).write_bytes(data)
        dtype = await anyio.to_thread.run_sync(_served_dtype, board, latest)
        if base_model is None and await anyio.to_thread.run_sync(is_lora_version, board, latest):
            raise EngineError(
                f"version {latest} of run {run!r} is a LoRA version (an adapter, "
                "trainer.lora): serve it with --base-model DIR, the model it adapts"
            )
        engine = await anyio.to_thread.run_sync(
            lambda: Engine(
                model_dir,
                device=device,
                dtype=dtype,
                base_weights=base_model,
                max_adapters=max_adapters,
            )
        )
        registry = engine_registry(engine)
        sidecar = Sidecar(
            ReferenceBackend(engine),
            board,
            poll_interval_s=poll_interval_s,
            registry=registry,
            activation=activation,
        )
        await run_lane(
            sidecar,
            host=host,
            port=port,
            token=token,
            registry=registry,
            tokenizer=engine.tokenizer,
            tls=tls,
            limits=limits,
            task_status=task_status,
        )


async def serve_model(
    model_dir: Path,
    *,
    host: str,
    port: int,
    device: str,
    token: str | None,
    tls: ssl.SSLContext | None = None,
    limits: LaneLimits | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a plain HF model dir as the fixed version 0 (no board) until cancelled.

    The weights (every ``*.safetensors`` in the dir, in their stored dtype) are copied into the
    engine once; the sidecar is in fixed-version mode, so it never polls, every response is
    stamped 0 and bounds excluding 0 get 409. Its board is an empty private directory that is
    never read; it only names the run in ``/v1/models`` and responses: the dir's name, with
    what a run name cannot hold (:func:`policies.board.types.check_run_name`) replaced by ``-``.
    """

    def load() -> Engine:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise EngineError(f"{model_dir} holds no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(f))
        floats = {t.dtype for t in weights.values() if t.is_floating_point()}
        dtype = floats.pop() if len(floats) == 1 else torch.float32
        engine = Engine(model_dir, device=device, dtype=dtype)
        engine.activate(weights, version=0)
        return engine

    engine = await anyio.to_thread.run_sync(load)
    with tempfile.TemporaryDirectory(prefix="sprawl-fixed-") as tmp:
        registry = engine_registry(engine)
        sidecar = Sidecar(
            ReferenceBackend(engine),
            Board(tmp, _run_name_of(model_dir)),
            poll_interval_s=3600.0,
            registry=registry,
            fixed_version=0,
        )
        await run_lane(
            sidecar,
            host=host,
            port=port,
            token=token,
            registry=registry,
            tokenizer=engine.tokenizer,
            tls=tls,
            limits=limits,
            task_status=task_status,
        )


def engine_registry(engine: Engine) -> CollectorRegistry:
    """A metrics registry holding the reference engine's batch gauges."""
    registry = CollectorRegistry()
    rows = Gauge(
        "sprawl_engine_active_rows",
        "Sequences decoding in the batch (one per choice of each running request)",
        registry=registry,
    )
    rows.set_function(lambda: engine.batcher.active_rows)
    queued = Gauge(
        "sprawl_engine_queued_requests", "Requests waiting to join the batch", registry=registry
    )
    queued.set_function(lambda: engine.batcher.queued)
    return registry


def _run_name_of(model_dir: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model_dir.resolve().name)
    name = re.sub(r"\.{2,}", ".", name).lstrip("._-")[:128]
    return name or "model"


async def _wait_for_board(board: Board) -> int:
    """The pointer's version, once there is one (a malformed pointer is logged and waited out:
    the next publish repairs it)."""
    while True:
        try:
            latest = await anyio.to_thread.run_sync(board.latest)
        except BoardError as exc:
            log.warning("board_unreadable", error=str(exc))
            latest = None
        if latest is not None:
            return latest
        await anyio.sleep(0.2)


def _served_dtype(board: Board, latest: int) -> torch.dtype:
    """The engine's dtype: that of the newest version whose manifest reads (the sidecar starts
    on the newest version that verifies, at or below ``latest``); float32 for a quantized view,
    so the live weights are ``dequantize``'s fp32 weights, bit for bit."""
    dtypes: set[str] = set()
    for version in reversed(board.versions()):
        if version > latest:
            continue
        try:
            manifest = board.manifest(version)
        except BoardError:
            continue
        if quantized_kind(manifest.view) is not None:
            return torch.float32
        dtypes = {e.dtype for e in manifest.tensors.values()}
        break
    floats = [d for d in dtypes if d in ("bfloat16", "float16", "float32")]
    return getattr(torch, floats[0]) if len(floats) == 1 else torch.float32
