"""The lane client: HTTP calls from the orchestrator to rollout endpoints.

:class:`HttpTransport` implements :class:`orchestrator.types.Transport` over aiohttp. It converts
every third-party failure at this edge: transport errors, timeouts, 5xx and malformed answers
become :class:`EndpointError` (retryable), 429/503 become :class:`Overloaded`, 409 becomes
:class:`VersionUnavailable`, other 4xx become non-retryable :class:`EndpointError`. A response
stamped with a version outside the request's bounds is refused as malformed.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from pydantic import ValidationError

from orchestrator.errors import EndpointError, Overloaded, VersionUnavailable
from orchestrator.types import EndpointRef
from policies.wire.lane import GenerateRequest, GenerateResponse, PolicyState


class HttpTransport:
    """The request lane over one shared aiohttp session: ``POST /v1/generate``,
    ``GET /v1/policy``, ``POST /v1/policy/notify``, with the connect and whole-call timeouts
    (``timeouts.connect_s``, ``timeouts.call_s``) and every failure converted (module
    docstring)."""

    def __init__(self, session: aiohttp.ClientSession, *, connect_s: float, call_s: float) -> None:
        self.session = session
        self.call_timeout = aiohttp.ClientTimeout(total=call_s, sock_connect=connect_s)
        self.probe_timeout = aiohttp.ClientTimeout(total=min(call_s, 5.0), sock_connect=connect_s)

    @staticmethod
    def _headers(ep: EndpointRef) -> dict[str, str]:
        return {"Authorization": f"Bearer {ep.token}"} if ep.token else {}

    async def generate(self, ep: EndpointRef, req: GenerateRequest) -> GenerateResponse:
        headers = {**self._headers(ep), "Content-Type": "application/json"}
        try:
            async with self.session.post(
                f"{ep.url}/v1/generate",
                data=req.model_dump_json(),
                headers=headers,
                timeout=self.call_timeout,
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointError(ep.id, f"{type(exc).__name__}: {exc}") from exc
        if status == 200:
            try:  # the hot path: validate straight from bytes
                resp = GenerateResponse.model_validate_json(raw)
            except ValidationError as exc:
                raise EndpointError(ep.id, f"malformed response: {exc.errors()[0]['msg']}") from exc
            if not req.policy_version.admits(resp.policy_version.start):
                raise EndpointError(
                    ep.id,
                    f"served version {resp.policy_version.start} outside the request's bounds",
                )
            return resp
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw[:200].decode(errors="replace")
        err = payload.get("error", {}) if isinstance(payload, dict) else {}
        if status == 409:
            raise VersionUnavailable(ep.id, str(err.get("message")), err.get("applied_version"))
        if status in (429, 503):
            raise Overloaded(ep.id, f"HTTP {status}: {err.get('message')}")
        if status >= 500:
            raise EndpointError(ep.id, f"HTTP {status}: {payload}")
        raise EndpointError(ep.id, f"HTTP {status}: {payload}", retryable=False)

    async def policy(self, ep: EndpointRef) -> PolicyState:
        try:
            async with self.session.get(
                f"{ep.url}/v1/policy", headers=self._headers(ep), timeout=self.probe_timeout
            ) as r:
                return PolicyState.model_validate(await r.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError, ValidationError) as exc:
            raise EndpointError(ep.id, f"policy probe failed: {exc}") from exc

    async def notify(self, ep: EndpointRef) -> None:
        try:
            async with self.session.post(
                f"{ep.url}/v1/policy/notify", headers=self._headers(ep), timeout=self.probe_timeout
            ):
                pass
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointError(ep.id, f"notify failed: {exc}") from exc
