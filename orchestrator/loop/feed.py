"""The batch feed: an external trainer pulls its batches from the orchestrator over HTTP.

``trainer.mode = "feed"``. The trainer (a torchrun job, ``orchestrate train``, anything) runs
this loop against the routes below (JSON; every route but ``/health`` requires
``Authorization: Bearer <token>``, always: ``trainer.feed.token``, or when unset a random token
made for this run):

- ``GET /v1/batches/next?wait_s=S`` — the batch (a :class:`~policies.wire.batches.BatchFile`)
  for the trainer's next version, ``200``; or ``204`` when none is ready within ``S`` seconds
  (a long poll; default :data:`DEFAULT_WAIT_S`, at most :data:`MAX_WAIT_S`);
- ``POST /v1/batches/{version}/ack`` ``{"metrics": {name: float}}`` (the body is optional) — the
  step on batch ``version`` is done *and* version ``version + 1`` is on the board; the metrics
  are logged with the step, as ``batch-*.metrics.json`` are in ``external`` mode;
- ``GET /health``.

The board pointer stays the announcement of a version: the trainer publishes ``v + 1``, then
acknowledges batch ``v``. An acknowledgement before the board shows ``v + 1`` is refused (409).

Guarantees (:class:`BatchFeed`), across trainer restarts:

- exactly once: a batch that was not acknowledged is delivered again, the same bytes, to whoever
  asks next (a restarted trainer); an acknowledged batch is never delivered again;
- a trainer that published ``v + 1`` but died before acknowledging ``v``: its next request
  finds the board at ``v + 1`` and batch ``v`` counts as acknowledged (without metrics; the
  step's ``reward_mean`` is still logged); so does a delivered batch whose ``v + 1`` the board
  has shown for :data:`ACK_GRACE_S` with no acknowledgement (one lost on the way, the last
  step's above all, which no later request would settle), logged ``feed_acked_by_board``;
- acknowledging a batch twice is harmless (``"duplicate": true``, its metrics not logged again);
  acknowledging one ahead of the trainer's version is refused with 409 naming that version, and
  so is one of the trainer's version that was not delivered while the board does not show
  ``v + 1``; a malformed body or metric, 400 naming it;
- bounded: the feed holds at most ``capacity`` unacknowledged batches
  (``trainer.feed.max_batches``, default one), offered in version order; the run's sink
  (:class:`~orchestrator.loop.feed_sink.FeedTrainer`) waits for room before it hands over the
  next, so while the trainer steps, the scheduler's stream fills and admission stops:
  backpressure end to end.

Across an orchestrator restart (``run.resume``; :mod:`orchestrator.record.resume`): the feed
starts at the board's version, and batches that were offered but not acknowledged are offered
again, re-formed from the trajectory log (the batcher is FIFO, so they hold the same groups).
A trainer that took batch ``v`` from the feed before the restart and acknowledges it after
(having published ``v + 1``) is accepted even though this feed never delivered it, also before
the restarted run has offered it again (the acknowledgement then waits in the feed, with its
metrics, for that offer): the board showing ``v + 1`` is what an acknowledgement asserts.

Once it listens, :func:`serve_feed` writes ``feed.json`` (``{"url", "token"}``, mode 0600,
replaced atomically) into the run directory: that file (or ``$SPRAWL_FEED_URL`` and
``$SPRAWL_FEED_TOKEN``) is how a trainer finds the feed (:class:`policies.wire.feed.FeedClient`);
a restarted orchestrator writes it again (a new port unless ``trainer.feed.port`` is set, a new
token unless ``trainer.feed.token`` is): a trainer that cannot reach the feed reads it again.

Not covered: TLS (put a proxy in front for a network you do not trust).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog
from aiohttp import web
from anyio.abc import TaskStatus

from orchestrator.errors import FeedRefused
from orchestrator.loop.admin import Handler, bearer_auth, error_response, serve_app
from policies.errors import BadRequest, BoardError
from policies.serve.http_body import read_json
from policies.wire.batches import BatchFile

log = structlog.get_logger(__name__)

DEFAULT_WAIT_S = 20.0
"""How long ``GET /v1/batches/next`` waits for a batch when the request names no ``wait_s``."""
MAX_WAIT_S = 300.0
"""The longest long poll a request may ask for."""
ACK_GRACE_S = 30.0
"""How long the board may show ``v + 1`` of a delivered batch ``v`` before it counts as the
acknowledgement: the trainer acknowledges right after it publishes, so an acknowledgement this
late was lost (its metrics are then the trainer's log's only)."""


@dataclass
class _Held:
    batch: BatchFile
    body: bytes  # what every delivery sends: a redelivery is the same bytes
    delivered: bool = False


@dataclass(frozen=True)
class Ack:
    """What an acknowledgement did: ``duplicate`` when the batch was acknowledged before."""

    version: int
    duplicate: bool


@dataclass
class BatchFeed:
    """The feed's state: batches offered by the run, delivered to and acknowledged by a trainer.

    ``version`` is the trainer's version: the batch it trains on next is batch ``version``.
    ``board_latest`` reads the board's pointer (a blocking call, run in a worker thread).
    """

    version: int
    board_latest: Callable[[], int | None]
    capacity: int = 1
    ack_grace_s: float = ACK_GRACE_S
    _held: dict[int, _Held] = field(default_factory=dict)
    _done: dict[int, dict[str, float]] = field(default_factory=dict)
    _early: dict[int, dict[str, float]] = field(default_factory=dict)  # at most the next version
    _changed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def held(self) -> int:
        """Batches offered and not yet acknowledged."""
        return len(self._held)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def offer(self, batch: BatchFile) -> None:
        """Hold ``batch`` for the trainer; waits while the feed holds ``capacity`` batches.
        Batches are offered in version order, from the trainer's version on."""
        if batch.version != self.version + len(self._held):
            msg = (
                f"batch {batch.version} offered out of order (the trainer is at {self.version}, "
                f"{len(self._held)} batches held)"
            )
            raise ValueError(msg)
        while len(self._held) >= self.capacity:
            await self._changed.wait()
        body = await anyio.to_thread.run_sync(lambda: batch.model_dump_json().encode())
        self._held[batch.version] = _Held(batch, body)
        log.info("feed_offered", version=batch.version, held=len(self._held))
        early = self._early.pop(batch.version, None)
        if early is not None:  # trained from an earlier feed's delivery (module doc)
            self._complete(batch.version, early)
        self._notify()

    async def next(self, wait_s: float) -> bytes | None:
        """The JSON of batch ``version`` (marked delivered), or None if none within ``wait_s``."""
        deadline = anyio.current_time() + wait_s
        while True:
            await self._settle()
            held = self._held.get(self.version)
            if held is not None:
                held.delivered = True
                log.info("feed_delivered", version=self.version)
                return held.body
            with anyio.move_on_after(deadline - anyio.current_time()) as waited:
                await self._changed.wait()
            if waited.cancelled_caught:
                return None

    async def ack(self, version: int, metrics: dict[str, float]) -> Ack:
        """Batch ``version`` is trained and version ``version + 1`` published (see module doc)."""
        if version < self.version:
            return Ack(version, duplicate=True)
        if version > self.version:
            raise FeedRefused(
                409,
                "batch_not_out",
                f"batch {version} is not out for training: the trainer's next batch is for "
                f"version {self.version}",
                "version",
            )
        latest = await self._latest()
        if version != self.version:  # acknowledged meanwhile (the board read yields)
            return Ack(version, duplicate=True)
        held = self._held.get(version)
        published = latest is not None and latest > version
        if published and held is None:  # delivered by the feed before a restart, not offered yet
            self._early[version] = metrics
        elif published:
            self._complete(version, metrics)
        elif held is None or not held.delivered:
            raise FeedRefused(
                409,
                "batch_not_out",
                f"batch {version} is not out for training: the trainer's next batch is for "
                f"version {self.version} and has not been delivered yet",
                "version",
            )
        else:
            raise FeedRefused(
                409,
                "version_not_published",
                f"version {version + 1} is not on the board (its pointer is at {latest}): "
                f"publish it before acknowledging batch {version}",
                "version",
            )
        return Ack(version, duplicate=False)

    async def done(self, version: int) -> dict[str, float]:
        """Wait until batch ``version`` is acknowledged; the metrics it came with. Batch
        ``version`` delivered and ``version + 1`` on the board for ``ack_grace_s`` with no
        acknowledgement: it counts as acknowledged, without metrics (module doc)."""
        shown_since: float | None = None
        while version not in self._done:
            with anyio.move_on_after(self.ack_grace_s / 3):
                await self._changed.wait()
            held = self._held.get(version)
            if version != self.version or held is None or not held.delivered:
                continue
            latest = await self._latest()
            if latest is None or latest <= version:
                shown_since = None
            elif shown_since is None:
                shown_since = anyio.current_time()
            elif anyio.current_time() - shown_since >= self.ack_grace_s and version in self._held:
                log.warning("feed_acked_by_board", version=version, board_version=latest)
                self._complete(version, {})
        return self._done.pop(version)

    async def _latest(self) -> int | None:
        try:
            return await anyio.to_thread.run_sync(self.board_latest)
        except BoardError as exc:
            log.warning("board_unreadable", error=str(exc))
            return None

    async def _settle(self) -> None:
        """A held batch whose next version the board already shows was trained by a trainer that
        died before acknowledging it: it counts as acknowledged."""
        if self.version not in self._held:
            return
        latest = await self._latest()
        if latest is not None and latest > self.version:
            log.warning("feed_acked_by_board", version=self.version, board_version=latest)
            self._complete(self.version, {})

    def _complete(self, version: int, metrics: dict[str, float]) -> None:
        del self._held[version]
        self._done[version] = metrics
        self.version = version + 1
        self._notify()


def _metrics(payload: object) -> dict[str, float]:
    """The ack body's ``metrics``: a flat object of finite numbers; BadRequest naming a bad one."""
    if payload is None:
        return {}
    if not isinstance(payload, dict) or set(payload) - {"metrics"}:
        raise BadRequest('body must be {"metrics": {name: number}} or empty', "metrics")
    metrics = payload.get("metrics", {})
    if not isinstance(metrics, dict):
        raise BadRequest("metrics: must be an object of name: number", "metrics")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"metrics.{name}: must be a number, got {value!r}", f"metrics.{name}")
        if not math.isfinite(value):
            raise BadRequest(f"metrics.{name}: must be finite, got {value!r}", f"metrics.{name}")
        out[name] = float(value)
    return out


class FeedApp:
    """The feed's routes, behind the bearer ``token``."""

    def __init__(self, feed: BatchFeed, token: str) -> None:
        self.feed = feed
        self.token = token
        self.app = web.Application(middlewares=[bearer_auth(token, "feed.json"), self._refusals])
        self.app.add_routes(
            [
                web.get("/v1/batches/next", self.next),
                web.post("/v1/batches/{version}/ack", self.ack),
                web.get("/health", self.health),
            ]
        )

    @web.middleware
    async def _refusals(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        except FeedRefused as exc:
            return error_response(exc.status, str(exc), exc.param, type_=exc.type)

    async def next(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("wait_s")
        try:
            wait_s = DEFAULT_WAIT_S if raw is None else float(raw)
        except ValueError:
            raise BadRequest(f"wait_s: not a number: {raw!r}", "wait_s") from None
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise BadRequest(f"wait_s: must lie in [0, {MAX_WAIT_S:g}], got {raw}", "wait_s")
        body = await self.feed.next(wait_s)
        if body is None:
            return web.Response(status=204)
        return web.Response(body=body, content_type="application/json")

    async def ack(self, request: web.Request) -> web.Response:
        raw = request.match_info["version"]
        if not raw.isdigit() or len(raw) > 20:
            raise BadRequest(f"version: not a version number: {raw!r}", "version")
        payload = await read_json(request) if await request.read() else None
        result = await self.feed.ack(int(raw), _metrics(payload))
        return web.json_response({"version": result.version, "duplicate": result.duplicate})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "trainer_version": self.feed.version})


async def serve_feed(
    feed: BatchFeed,
    *,
    host: str,
    port: int,
    token: str | None,
    feed_file: Path,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the batch feed until cancelled; ``started`` with its base URL once ``feed_file``
    names it and its token (``token``, or a random one when None)."""
    token = token or secrets.token_urlsafe(32)
    await serve_app(
        FeedApp(feed, token).app,
        host=host,
        port=port,
        token=token,
        address_file=feed_file,
        server="feed",
        task_status=task_status,
    )
