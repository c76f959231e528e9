"""The endpoint pool: which rollout endpoint serves each model call.

Routing: among endpoints that are healthy, not tripped, inside the request's version bounds and
below their concurrency limit, the one with the least outstanding calls per unit of weight —
preferring the episode's previous endpoint (prefix-cache affinity) when it still qualifies.

Waiting: a call that finds no qualifying endpoint joins a priority queue (oldest episode first, so
long episodes are not starved by new ones). Whenever the pool's state changes — a slot frees, a
version changes, an endpoint recovers, joins or leaves — waiters are served in priority order.
Nobody polls; a waiter gives up after ``version_wait_s`` with a non-retryable error naming
``timeouts.version_wait_s``.

Per endpoint:

- concurrency limit, adapted AIMD-style: +1/limit per success, halved on 429/503 or a timeout,
  within ``[1, max_inflight]``;
- circuit breaker: ``breaker_failures`` consecutive failures open it for ``breaker_cooldown_s``;
  afterwards one probe (a successful health check or call) closes it;
- health: a reconcile task reads ``GET /v1/policy`` from every endpoint every ``poll_interval_s``;
  :meth:`Pool.unhealthy_for` says how long an endpoint's checks have been failing and
  :meth:`Pool.checked` waits for its next one (what the supervisor of the local fleet,
  :mod:`orchestrator.fleet.supervisor`, acts on).

Failover: a failed call marks its endpoint unhealthy and is retried once on another endpoint
(the caller sends the same token prefix, so the episode continues bit-exactly). A 409 updates
the endpoint's known version and re-routes. Endpoints can join and leave while the run goes on;
a removed endpoint finishes its in-flight calls but gets no new ones; one added again under
its id starts afresh (unhealthy until a health check passes) but keeps its count of calls
served.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import anyio
import structlog

from orchestrator.errors import EndpointError, Overloaded, VersionUnavailable
from orchestrator.types import NULL_EVENTS, Endpoint, EndpointRef, EventSink, Transport
from policies.wire.lane import GenerateRequest, GenerateResponse, VersionBounds

log = structlog.get_logger(__name__)


@dataclass(order=True)
class _Waiter:
    priority: float
    seq: int
    bounds: VersionBounds = field(compare=False)
    affinity: str | None = field(compare=False)
    exclude: frozenset[str] = field(compare=False)
    event: anyio.Event = field(compare=False, default_factory=anyio.Event)
    endpoint: Endpoint | None = field(compare=False, default=None)
    gone: bool = field(compare=False, default=False)


class Pool:
    """The rollout endpoints and which one serves each model call (see the module docstring).

    Use: :meth:`add` / :meth:`remove` endpoints, run :meth:`watch` beside the loop (health and
    applied versions every ``poll_interval_s``), and :meth:`generate` each call with its
    version bounds; :meth:`pick` is the routing rule itself (pure over the endpoints' state, so
    the event log's decisions can be re-simulated). Every decision goes to ``events``.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        version_wait_s: float,
        poll_interval_s: float,
        max_inflight: int = 4,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 10.0,
        events: EventSink = NULL_EVENTS,
    ) -> None:
        self.transport = transport
        self.events = events
        self.endpoints: dict[str, Endpoint] = {}
        self.version_wait_s = version_wait_s
        self.poll_interval_s = poll_interval_s
        self.max_inflight = max_inflight
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._unhealthy_since: dict[str, float] = {}
        self._checked: dict[str, anyio.Event] = {}

    # -- membership -----------------------------------------------------------------------------
    def add(self, ref: EndpointRef) -> Endpoint:
        """Add an endpoint (or bring back a removed one); it serves once a health check passes."""
        ep = self.endpoints.get(ref.id)
        if ep is None or ep.removed:
            served = dict(ep.served) if ep is not None else {}
            ep = Endpoint(
                ref=ref,
                max_inflight=self.max_inflight,
                limit=float(self.max_inflight),
                served=served,
            )
            self.endpoints[ref.id] = ep
            self._unhealthy_since.pop(ref.id, None)
            log.info("endpoint_added", endpoint=ref.id, url=ref.url)
        return ep

    def remove(self, endpoint_id: str) -> None:
        """Stop routing to an endpoint; its in-flight calls finish."""
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            raise KeyError(endpoint_id)
        ep.removed = True
        log.info("endpoint_removed", endpoint=endpoint_id)
        self._dispatch()

    def live(self) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if not e.removed]

    def max_context(self) -> int | None:
        """The smallest context a live endpoint reports (None: none reports one), so that a
        prompt fits wherever the call is routed."""
        reported = [e.max_context for e in self.live() if e.max_context is not None]
        return min(reported, default=None)

    # -- routing --------------------------------------------------------------------------------
    def pick(
        self, bounds: VersionBounds, affinity: str | None, exclude: frozenset[str]
    ) -> Endpoint | None:
        now = anyio.current_time()
        ok = [e for e in self.live() if e.id not in exclude and e.qualifies(bounds, now)]
        if not ok:
            return None
        for e in ok:
            if e.id == affinity:
                return e
        return min(ok, key=lambda e: (e.outstanding / e.ref.weight, e.id))

    def _dispatch(self) -> None:
        """Serve waiters in priority order with whatever capacity there is now."""
        if not self._waiters:
            return
        keep: list[_Waiter] = []
        for w in sorted(self._waiters):
            if w.gone:
                continue
            ep = self.pick(w.bounds, w.affinity, w.exclude)
            self.events.route(self.live(), w.bounds, w.affinity, w.exclude, ep)
            if ep is None:
                keep.append(w)
                continue
            ep.outstanding += 1
            w.endpoint = ep
            w.event.set()
        heapq.heapify(keep)
        self._waiters = keep

    async def _acquire(
        self, bounds: VersionBounds, affinity: str | None, exclude: frozenset[str], priority: float
    ) -> Endpoint:
        if not self._waiters:
            ep = self.pick(bounds, affinity, exclude)
            self.events.route(self.live(), bounds, affinity, exclude, ep)
            if ep is not None:
                ep.outstanding += 1
                return ep
        w = _Waiter(priority, next(self._seq), bounds, affinity, exclude)
        heapq.heappush(self._waiters, w)
        self._dispatch()
        try:
            with anyio.fail_after(self.version_wait_s):
                await w.event.wait()
        except BaseException as exc:
            w.gone = True
            if w.endpoint is not None:  # assigned just as we gave up: hand the slot back
                self._release(w.endpoint)
            if isinstance(exc, TimeoutError):
                raise EndpointError(
                    "pool",
                    f"no endpoint served a version in [{bounds.min}, {bounds.max}] within "
                    f"{self.version_wait_s}s (timeouts.version_wait_s)",
                    retryable=False,
                ) from None
            raise
        assert w.endpoint is not None
        return w.endpoint

    def _release(self, ep: Endpoint) -> None:
        ep.outstanding -= 1
        self._dispatch()

    # -- calls ----------------------------------------------------------------------------------
    async def generate(
        self, req: GenerateRequest, affinity: str | None = None, priority: float = 0.0
    ) -> tuple[GenerateResponse, Endpoint, int]:
        """Serve ``req`` on a qualifying endpoint; retry once elsewhere on failure.

        ``priority``: lower is served first (the episode's start time). Returns the response,
        the endpoint that served it and the number of attempts.
        """
        failed: set[str] = set()
        attempts = 0
        while True:
            ep = await self._acquire(req.policy_version, affinity, frozenset(failed), priority)
            attempts += 1
            t0 = anyio.current_time()
            try:
                resp = await self.transport.generate(ep.ref, req)
            except VersionUnavailable as exc:
                ep.applied_version = exc.applied_version
                self.events.emit(
                    "version_unavailable", endpoint=ep.id, applied_version=ep.applied_version
                )
                self._release(ep)
                continue  # route again: another endpoint may qualify, or this one catches up
            except EndpointError as exc:
                self._on_failure(ep, exc)
                self._release(ep)
                failed.add(ep.id)
                self.events.emit(
                    "call_failed",
                    endpoint=ep.id,
                    error=str(exc),
                    attempt=attempts,
                    failover=len(failed) == 1 and exc.retryable,
                )
                log.warning("call_failed", endpoint=ep.id, error=str(exc), attempt=attempts)
                if len(failed) > 1 or not exc.retryable:
                    raise
                affinity = None
                continue
            except BaseException:
                self._release(ep)
                raise
            self._on_success(ep, anyio.current_time() - t0)
            ep.applied_version = max(ep.applied_version or 0, resp.policy_version.end)
            start = resp.policy_version.start
            ep.served[start] = ep.served.get(start, 0) + 1
            self.events.emit(
                "served",
                endpoint=ep.id,
                start=start,
                end=resp.policy_version.end,
                latency_s=anyio.current_time() - t0,
                attempt=attempts,
            )
            self.events.endpoint(ep)
            self._release(ep)
            return resp, ep, attempts

    def _on_success(self, ep: Endpoint, _latency: float) -> None:
        ep.failures = 0
        ep.limit = min(float(ep.max_inflight), ep.limit + 1.0 / max(ep.limit, 1.0))

    def _on_failure(self, ep: Endpoint, exc: EndpointError) -> None:
        ep.limit = max(1.0, ep.limit / 2)
        if isinstance(exc, Overloaded):
            return  # overloaded, not broken: shed load but keep it in rotation
        ep.healthy = False
        ep.failures += 1
        if ep.failures >= self.breaker_failures:
            ep.open_until = anyio.current_time() + self.breaker_cooldown_s
            log.warning("breaker_open", endpoint=ep.id, cooldown_s=self.breaker_cooldown_s)

    # -- reconcile ------------------------------------------------------------------------------
    async def refresh(self, ep: Endpoint) -> None:
        """Read one endpoint's policy state; mark it healthy or not."""
        try:
            state = await self.transport.policy(ep.ref)
        except EndpointError:
            ep.healthy = False
        else:
            ep.healthy = state.applied_version is not None
            ep.applied_version = state.applied_version
            ep.max_context = state.max_context
        if ep.healthy:
            self._unhealthy_since.pop(ep.id, None)
        else:
            self._unhealthy_since.setdefault(ep.id, anyio.current_time())
        checked = self._checked.pop(ep.id, None)
        if checked is not None:
            checked.set()
        self.events.endpoint(ep)
        self._dispatch()

    async def checked(self, endpoint_id: str) -> None:
        """Return after the next health check of ``endpoint_id`` (none runs while it is
        removed)."""
        event = self._checked.get(endpoint_id)
        if event is None:
            event = self._checked[endpoint_id] = anyio.Event()
        await event.wait()

    def unhealthy_for(self, endpoint_id: str) -> float:
        """Seconds since the first of the health checks of ``endpoint_id`` that have failed in a
        row (0.0 when the last one passed, or none ran since it was added)."""
        since = self._unhealthy_since.get(endpoint_id)
        return 0.0 if since is None else anyio.current_time() - since

    async def refresh_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for ep in self.live():
                tg.start_soon(self.refresh, ep)

    async def watch(self) -> None:
        """Refresh every endpoint forever, every ``poll_interval_s``."""
        while True:
            await self.refresh_all()
            await anyio.sleep(self.poll_interval_s)

    async def notify_all(self) -> None:
        """Tell every endpoint's sidecar to check the board now (best effort)."""

        async def one(ep: Endpoint) -> None:
            try:
                await self.transport.notify(ep.ref)
            except EndpointError as exc:
                log.debug("notify_failed", endpoint=ep.id, error=str(exc))

        async with anyio.create_task_group() as tg:
            for ep in self.live():
                tg.start_soon(one, ep)
