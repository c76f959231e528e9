"""Scripted fakes for the orchestrator's seams: they record the calls made to them."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from orchestrator.errors import EndpointError, VersionUnavailable
from orchestrator.types import EndpointRef
from policies.wire.lane import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    Usage,
    VersionStamp,
)


@dataclass
class ScriptedTransport:
    """A fleet in memory: per-endpoint applied versions, latencies and failures.

    Each call samples ``tokens`` ids derived from the prompt length (deterministic), then the
    EOS id ``eos`` if set. ``dead`` endpoints raise like a dropped connection; ``fail_after``
    makes an endpoint die after that many successful calls.
    """

    versions: dict[str, int | None]
    latency: dict[str, float] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    broken: set[str] = field(default_factory=set)
    fail_after: dict[str, int] = field(default_factory=dict)
    tokens: int = 3
    replies: list[list[int]] = field(default_factory=list)  # scripted samples, used in order
    eos: int | None = None
    calls: list[tuple[str, GenerateRequest]] = field(default_factory=list)
    served: list[tuple[str, GenerateRequest, GenerateResponse]] = field(default_factory=list)

    async def generate(self, ep: EndpointRef, req: GenerateRequest) -> GenerateResponse:
        self.calls.append((ep.id, req))
        await anyio.sleep(self.latency.get(ep.id, 0.01))
        if ep.id in self.dead:
            raise EndpointError(ep.id, "connection reset")
        if ep.id in self.broken:
            raise EndpointError(ep.id, "HTTP 500: internal error")
        if ep.id in self.fail_after:
            if self.fail_after[ep.id] <= 0:
                self.dead.add(ep.id)
                raise EndpointError(ep.id, "connection reset")
            self.fail_after[ep.id] -= 1
        version = self.versions[ep.id]
        if version is None or not req.policy_version.admits(version):
            raise VersionUnavailable(ep.id, "outside bounds", version)
        n = len(req.prompt_token_ids)
        if self.replies:
            ids = self.replies.pop(0)
        else:
            ids = [(n + i) % 50 + 10 for i in range(min(self.tokens, req.max_tokens))]
            if self.eos is not None:
                ids.append(self.eos)
        resp = GenerateResponse(
            id=f"r{len(self.calls)}",
            model="fake",
            prompt_token_ids=req.prompt_token_ids,
            choices=[
                GenerateChoice(
                    index=0, token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop"
                )
            ],
            policy_version=VersionStamp(start=version, end=version),
            usage=Usage(prompt_tokens=n, completion_tokens=len(ids)),
        )
        self.served.append((ep.id, req, resp))
        return resp

    async def policy(self, ep: EndpointRef) -> PolicyState:
        if ep.id in self.dead:
            raise EndpointError(ep.id, "connection refused")
        v = self.versions[ep.id]
        return PolicyState(applied_version=v, staged_version=None, state="serving", run="fake")

    async def notify(self, ep: EndpointRef) -> None:
        if ep.id in self.dead:
            raise EndpointError(ep.id, "connection refused")
