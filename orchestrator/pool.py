"""The endpoint pool: which rollout endpoint serves each model call.

Routing: among healthy endpoints whose applied version satisfies the request's bounds and that
have a free slot, the one with the least outstanding calls per unit of weight, preferring the
episode's previous endpoint (prefix-cache affinity) when it still qualifies. When none
qualifies the call waits on a condition that is signalled when a slot frees, a version changes
or an endpoint recovers — never a spin loop — for at most ``timeouts.version_wait_s``.

Failover: a transport error, a 5xx or a timeout marks the endpoint unhealthy until its next good
health check, and the call is retried once on another qualifying endpoint (the caller sends the
same token prefix, so the episode continues bit-exactly). A 409 updates the endpoint's known
version and re-routes.

The pool learns versions from response stamps, 409 bodies and a reconcile task that reads
``GET /v1/policy`` from every endpoint every ``poll_interval_s``.

Not covered yet: adaptive concurrency limits, circuit breakers with half-open probing, elastic
join/leave through an admin API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import aiohttp
import anyio
import structlog
from pydantic import ValidationError

from orchestrator.errors import EndpointError, VersionUnavailable
from policies.lane import GenerateRequest, GenerateResponse, PolicyState, VersionBounds

log = structlog.get_logger(__name__)


@dataclass
class Endpoint:
    id: str
    url: str
    token: str | None = None
    weight: float = 1.0
    max_inflight: int = 4
    applied_version: int | None = None
    healthy: bool = False
    outstanding: int = 0
    served: dict[int, int] = field(default_factory=dict)  # version -> calls served

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def qualifies(self, bounds: VersionBounds) -> bool:
        return (
            self.healthy
            and self.applied_version is not None
            and bounds.admits(self.applied_version)
            and self.outstanding < self.max_inflight
        )


class Pool:
    def __init__(
        self,
        endpoints: list[Endpoint],
        session: aiohttp.ClientSession,
        *,
        call_timeout_s: float,
        version_wait_s: float,
        poll_interval_s: float,
    ) -> None:
        self.endpoints = {e.id: e for e in endpoints}
        self.session = session
        self.call_timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self.version_wait_s = version_wait_s
        self.poll_interval_s = poll_interval_s
        self._changed = anyio.Condition()

    async def _signal(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- routing --------------------------------------------------------------------------------
    def _pick(
        self, bounds: VersionBounds, affinity: str | None, exclude: set[str]
    ) -> Endpoint | None:
        ok = [e for e in self.endpoints.values() if e.id not in exclude and e.qualifies(bounds)]
        if not ok:
            return None
        if affinity is not None:
            for e in ok:
                if e.id == affinity:
                    return e
        return min(ok, key=lambda e: (e.outstanding / e.weight, e.id))

    async def _acquire(
        self, bounds: VersionBounds, affinity: str | None, exclude: set[str]
    ) -> Endpoint:
        try:
            with anyio.fail_after(self.version_wait_s):
                async with self._changed:
                    while (ep := self._pick(bounds, affinity, exclude)) is None:
                        await self._changed.wait()
        except TimeoutError:
            raise EndpointError(
                "pool",
                f"no endpoint served a version in [{bounds.min}, {bounds.max}] within "
                f"{self.version_wait_s}s (timeouts.version_wait_s)",
                retryable=False,
            ) from None
        ep.outstanding += 1
        return ep

    async def _release(self, ep: Endpoint) -> None:
        ep.outstanding -= 1
        await self._signal()

    async def generate(
        self, req: GenerateRequest, affinity: str | None = None
    ) -> tuple[GenerateResponse, Endpoint, int]:
        """Serve ``req`` on a qualifying endpoint; retry once elsewhere on failure.

        Returns the response, the endpoint that served it and the number of attempts.
        """
        failed: set[str] = set()
        attempts = 0
        while True:
            ep = await self._acquire(req.policy_version, affinity, failed)
            attempts += 1
            try:
                resp = await self._call(ep, req)
            except VersionUnavailable as exc:
                ep.applied_version = exc.applied_version
                await self._signal()
                continue  # route again: another endpoint may qualify, or this one catches up
            except EndpointError as exc:
                ep.healthy = False
                failed.add(ep.id)
                log.warning("endpoint_failed", endpoint=ep.id, error=str(exc), attempt=attempts)
                if len(failed) > 1 or not exc.retryable:
                    raise
                affinity = None
                continue
            finally:
                await self._release(ep)
            ep.applied_version = max(ep.applied_version or 0, resp.policy_version.end)
            ep.served[resp.policy_version.start] = ep.served.get(resp.policy_version.start, 0) + 1
            return resp, ep, attempts

    async def _call(self, ep: Endpoint, req: GenerateRequest) -> GenerateResponse:
        body = req.model_dump(exclude_defaults=False)
        try:
            async with self.session.post(
                f"{ep.url}/v1/generate", json=body, headers=ep.headers, timeout=self.call_timeout
            ) as r:
                payload = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EndpointError(ep.id, f"{type(exc).__name__}: {exc}") from exc
        if status == 409:
            err = payload.get("error", {}) if isinstance(payload, dict) else {}
            raise VersionUnavailable(ep.id, str(err.get("message")), err.get("applied_version"))
        if status >= 500:
            raise EndpointError(ep.id, f"HTTP {status}: {payload}")
        if status != 200:
            raise EndpointError(ep.id, f"HTTP {status}: {payload}", retryable=False)
        try:
            resp = GenerateResponse.model_validate(payload)
        except ValidationError as exc:
            raise EndpointError(ep.id, f"malformed response: {exc.errors()[0]['msg']}") from exc
        if not req.policy_version.admits(resp.policy_version.start):
            raise EndpointError(
                ep.id, f"served version {resp.policy_version.start} outside the request's bounds"
            )
        return resp

    # -- reconcile ------------------------------------------------------------------------------
    async def refresh(self, ep: Endpoint) -> None:
        """Read one endpoint's policy state; mark it healthy or not."""
        try:
            async with self.session.get(
                f"{ep.url}/v1/policy", headers=ep.headers, timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                state = PolicyState.model_validate(await r.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError, ValidationError):
            changed = ep.healthy
            ep.healthy = False
        else:
            changed = (not ep.healthy) or state.applied_version != ep.applied_version
            ep.healthy = state.applied_version is not None
            ep.applied_version = state.applied_version
        if changed:
            await self._signal()

    async def watch(self) -> None:
        """Refresh every endpoint forever, every ``poll_interval_s``."""
        while True:
            async with anyio.create_task_group() as tg:
                for ep in list(self.endpoints.values()):
                    tg.start_soon(self.refresh, ep)
            await anyio.sleep(self.poll_interval_s)

    async def notify_all(self) -> None:
        """Tell every endpoint's sidecar to check the board now (best effort)."""

        async def one(ep: Endpoint) -> None:
            try:
                async with self.session.post(
                    f"{ep.url}/v1/policy/notify",
                    headers=ep.headers,
                    timeout=aiohttp.ClientTimeout(total=2),
                ):
                    pass
            except (aiohttp.ClientError, TimeoutError):
                log.debug("notify_failed", endpoint=ep.id)

        async with anyio.create_task_group() as tg:
            for ep in list(self.endpoints.values()):
                tg.start_soon(one, ep)

    def min_version(self) -> float:
        versions = [
            e.applied_version for e in self.endpoints.values() if e.applied_version is not None
        ]
        return min(versions) if versions else math.nan
