"""The orchestrator's admin API: elastic fleet membership while a run goes on.

Routes (JSON; every route but ``/health`` requires ``Authorization: Bearer <token>``, always:
``admin.token``, or when that is unset a random token made for this run):

- ``GET /v1/fleet`` — every endpoint: id, url, weight, applied version, health, outstanding
  calls, concurrency limit, breaker state, calls served per version;
- ``POST /v1/fleet`` ``{"id", "url", "token"?, "weight"?}`` — add an endpoint (it serves once a
  health check passes);
- ``DELETE /v1/fleet/{id}`` — stop routing to an endpoint (its in-flight calls finish);
- ``GET /v1/fleet/ray`` — the run's Ray islands (``[fleet.ray]``): the target count and each
  island's state; ``POST /v1/fleet/ray`` ``{"islands": N}`` — scale them (202: the change
  happens in the background, :mod:`orchestrator.fleet.ray_scale`); both 404 in a run without
  ``[fleet.ray]``;
- ``GET /health``; ``GET /metrics`` (Prometheus: calls, failures, 409s, latency, versions and
  health per endpoint, trainer version, admissions, decisions — see
  :mod:`orchestrator.observe.metrics`).

Every refused request gets a 4xx JSON body ``{"error": {"type", "message", "param"}}``: a
missing, wrong or undecodable token (401 ``unauthorized``), a body that is not usable JSON (not
UTF-8, nested too deep, an integer of more than 64 digits, a lone surrogate in a string) or a bad
field (400).

Connections are bounded as the lane's are (:mod:`policies.serve.connections`, its defaults): a
header, idle and body deadline, at most 512 connections and 256 from one client address, so a
flood of slow or silent sockets is refused (``408``/``503``) and counted
(``sprawl_admin_connections``, ``sprawl_admin_connections_refused_total{reason}``), never left to
exhaust the run's file descriptors.

Once it listens, :func:`serve_admin` writes ``admin.json`` (``{"url", "token"}``) into the run
directory, readable by its owner only (mode 0600, replaced atomically): that file is how
``orchestrate fleet add|remove|list|up|scale|down --orchestrator RUN_DIR`` (the client,
:mod:`orchestrator.fleet.cli`) finds the API and its token.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
from aiohttp import web
from aiohttp.typedefs import Middleware
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.loop.pool import Pool
from orchestrator.types import Endpoint, EndpointRef
from policies.errors import BadRequest
from policies.serve.connections import ConnectionLimiter, LaneLimits, LaneSite
from policies.serve.http_body import bearer_matches, read_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)


class Exposition(Protocol):
    """What ``GET /metrics`` serves: the run's :class:`~orchestrator.observe.metrics.RunMetrics`."""

    registry: CollectorRegistry

    def exposition(self) -> bytes: ...


class AddEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    url: str = Field(pattern=r"^https?://")
    token: str | None = None
    weight: float = Field(default=1.0, gt=0)


def describe(ep: Endpoint) -> dict[str, Any]:
    return {
        "id": ep.id,
        "url": ep.ref.url,
        "weight": ep.ref.weight,
        "applied_version": ep.applied_version,
        "healthy": ep.healthy,
        "outstanding": ep.outstanding,
        "limit": round(ep.limit, 2),
        "breaker_open": anyio.current_time() < ep.open_until,
        "served": {str(v): n for v, n in sorted(ep.served.items())},
    }


def error_response(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
) -> web.Response:
    body = {"error": {"type": type_, "message": message, "param": param}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


def write_admin_file(path: Path, url: str, token: str) -> None:
    """``{"url", "token"}`` into ``path``, mode 0600 from the start, replacing it atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "token": token}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def bearer_auth(token: str, where: str) -> Middleware:
    """Middleware: every route but ``/health`` needs ``Authorization: Bearer <token>``; a request
    without it is a 401 saying the token is in ``where``."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if request.path != "/health" and not bearer_matches(given, token):
            return error_response(
                401, f"missing or wrong bearer token (see {where})", type_="unauthorized"
            )
        return await handler(request)

    return auth


async def _body(model: type[M], request: web.Request) -> M | web.Response:
    """The request's JSON as ``model``, or the 400 that says what is wrong with it."""
    try:
        return model.model_validate(await read_json(request))
    except BadRequest as exc:
        return error_response(400, str(exc), exc.param)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        return error_response(400, f"{param}: {err['msg']}", param)


class Islands(Protocol):
    """The run's Ray islands (:class:`orchestrator.fleet.ray_scale.Scaler`)."""

    def scale(self, target: int) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...


class ScaleIslands(BaseModel):
    model_config = ConfigDict(extra="forbid")
    islands: int = Field(ge=0, le=1024)


class AdminApp:
    """The routes, behind the bearer ``token``."""

    def __init__(
        self,
        pool: Pool,
        token: str,
        metrics: Exposition | None = None,
        islands: Islands | None = None,
    ) -> None:
        self.pool = pool
        self.token = token
        self.metrics = metrics
        self.islands = islands
        self.app = web.Application(middlewares=[bearer_auth(token, "admin.json")])
        self.app.add_routes(
            [
                web.get("/v1/fleet", self.list),
                web.post("/v1/fleet", self.add),
                web.get("/v1/fleet/ray", self.ray_islands),
                web.post("/v1/fleet/ray", self.scale),
                web.delete("/v1/fleet/{id}", self.remove),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
            ]
        )

    async def list(self, _request: web.Request) -> web.Response:
        return web.json_response({"endpoints": [describe(e) for e in self.pool.live()]})

    async def add(self, request: web.Request) -> web.Response:
        body = await _body(AddEndpoint, request)
        if isinstance(body, web.Response):
            return body
        ref = EndpointRef(
            id=body.id, url=body.url.rstrip("/"), token=body.token, weight=body.weight
        )
        ep = self.pool.add(ref)
        await self.pool.refresh(ep)
        return web.json_response(describe(ep), status=201)

    async def ray_islands(self, _request: web.Request) -> web.Response:
        if self.islands is None:
            return error_response(404, "this run has no Ray islands ([fleet.ray])", "islands")
        return web.json_response(self.islands.describe())

    async def scale(self, request: web.Request) -> web.Response:
        if self.islands is None:
            return error_response(404, "this run has no Ray islands ([fleet.ray])", "islands")
        body = await _body(ScaleIslands, request)
        if isinstance(body, web.Response):
            return body
        return web.json_response(self.islands.scale(body.islands), status=202)

    async def remove(self, request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        try:
            self.pool.remove(endpoint_id)
        except KeyError:
            return error_response(404, f"no endpoint {endpoint_id!r}", "id")
        return web.json_response({"removed": endpoint_id})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, _request: web.Request) -> web.Response:
        body = self.metrics.exposition() if self.metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve_admin(
    pool: Pool,
    *,
    host: str,
    port: int,
    token: str | None,
    admin_file: Path,
    metrics: Exposition | None = None,
    islands: Islands | None = None,
    limits: LaneLimits | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API until cancelled; ``started`` with its base URL once ``admin_file``
    names it and its token (``token``, or a random one when None). ``limits``: its connection
    bounds (:class:`LaneLimits`' defaults if None)."""
    token = token or secrets.token_urlsafe(32)
    await serve_app(
        AdminApp(pool, token, metrics, islands).app,
        host=host,
        port=port,
        token=token,
        address_file=admin_file,
        server="admin",
        registry=metrics.registry if metrics is not None else None,
        limits=limits,
        task_status=task_status,
    )


async def serve_app(
    app: web.Application,
    *,
    host: str,
    port: int,
    token: str,
    address_file: Path,
    server: str,
    registry: CollectorRegistry | None = None,
    limits: LaneLimits | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled, its connections bounded by ``limits`` (module docstring;
    :class:`LaneLimits`' defaults if None), counted in ``registry`` as ``server``'s; ``started``
    with its base URL once ``address_file`` (:func:`write_admin_file`) names it and ``token``."""
    limits = limits or LaneLimits()
    limiter = ConnectionLimiter(
        limits, registry or CollectorRegistry(), server, setting=lambda key: f"the {server} {key}"
    )
    app.middlewares[:0] = [limiter.middleware, limiter.body_deadline]
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=limits.idle_timeout_s
    )
    await runner.setup()
    try:
        site = LaneSite(runner, host, port, limiter)
        await site.start()
        url = f"http://{host}:{runner.addresses[0][1]}"
        await anyio.to_thread.run_sync(write_admin_file, address_file, url, token)
        task_status.started(url)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
