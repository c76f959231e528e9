"""The reference engine's HTTP server: the request lane over aiohttp, with the sidecar embedded.

Routes: ``POST /v1/generate``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``policies.serve.openai_routes``), ``GET /v1/models``, ``GET /v1/policy``, ``POST
/v1/policy/notify``, ``GET /health``, ``GET /metrics`` (Prometheus). Every route except ``/health``
requires ``Authorization: Bearer <token>`` when a token is set (compared in constant time; a
header with non-ASCII bytes is a wrong token). Every bad request (malformed JSON, JSON nested too
deep, an integer of more than 64 digits, a lone surrogate in a string, a field out of range, an
unknown field, an over-long prompt, an invalid tool schema) gets a 4xx JSON error naming the field
(:mod:`policies.serve.http_body`), and the server keeps running; a body over
``max_body_bytes`` (``--max-body-bytes``) gets 413 ``request_too_large``, unread past the limit;
version conflicts get 409 ``policy_version_unavailable`` with ``Retry-After``; an engine that
fails, 503 ``engine_unavailable`` (:func:`~policies.serve.types.failure`). A request of ``n``
choices one of which failed alone is answered 200, that choice carrying its error
(``finish_reason`` ``"error"``); only a request none of whose choices was sampled gets the error
status. A refused request's memory is freed with its answer (:func:`refusal`). TLS is optional
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

:func:`run_lane` serves any :class:`Sidecar`: the reference engine's
(:mod:`policies.serve.reference_server`: from a board, or a model dir as the fixed version 0) and
the standalone sidecar's, whose backend is an external engine (``policies.serve.backends``).
"""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from policies.errors import BadRequest, EngineError
from policies.serve.connections import ConnectionLimiter, LaneLimits, LaneSite
from policies.serve.http_body import bearer_matches, read_json
from policies.serve.openai_routes import OpenAIRoutes, parse_body
from policies.serve.sidecar import Sidecar
from policies.serve.types import VersionNotServed, failure
from policies.wire.lane import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    GenerateRequest,
)

log = structlog.get_logger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(
    status: int, type_: str, message: str, *, param: str | None = None
) -> web.Response:
    return web.json_response(
        {"error": ErrorBody(type=type_, message=message, param=param).model_dump()},
        status=status,
    )


def refusal(exc: EngineError) -> web.Response:
    """The JSON answer to a request that failed with ``exc`` (:func:`failure`).

    ``exc``'s tracebacks are dropped first: their frames (the tokenizer thread's, the JSON
    parser's) hold the request's body, messages and prompt text, and the exception is in a
    reference cycle with them (a frame holds the future that holds the exception), which only
    the cyclic garbage collector frees, long after the answer: four refused megabyte requests
    held 200 MB so."""
    status, body = failure(exc)
    cause: BaseException | None = exc
    while cause is not None:
        cause.__traceback__ = None
        cause = cause.__context__
    headers = {"Retry-After": "1"} if isinstance(exc, VersionNotServed) else None
    return web.json_response({"error": body.model_dump()}, status=status, headers=headers)


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
            client_max_size=self.limits.max_body_bytes,
            middlewares=[self.connections.middleware, self._auth, self._count],
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
        limit = self.limits.max_body_bytes
        try:
            if (request.content_length or 0) > limit:  # refused unread
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=0)
            with anyio.fail_after(self.limits.body_timeout_s):
                payload = await read_json(request)
        except BadRequest as exc:
            return refusal(exc)
        except web.HTTPRequestEntityTooLarge:
            message = f"request body is over {limit} bytes (--max-body-bytes)"
            large = error_response(413, "request_too_large", message)
            large.force_close()  # the rest of the body is never read
            return large
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
        except EngineError as exc:  # a bad request (400), a version conflict (409), the engine
            return refusal(exc)
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
