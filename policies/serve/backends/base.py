"""The shared part of every external-engine backend: version gating, stamps, HTTP calls.

An adapter subclasses :class:`HttpBackend` and implements :meth:`HttpBackend.generate_one` (one
choice, one seed: a :class:`Sample`) and, for engines that take new weights,
:meth:`HttpBackend.stage` and :meth:`HttpBackend.apply`.

Guarantees (the sidecar proxies every request, so it knows what is in flight):

- a request is checked against its ``policy_version`` bounds when it is admitted, at the version
  applied then; its stamp is that version and the version applied when it finished;
- during an activation new requests wait at the gate; mode ``"wait"`` also waits for every
  in-flight request to finish before weights change (so ``start == end``); mode ``"pause"``
  lets the adapter pause the engine at a step boundary instead (responses may span versions);
- ``n`` choices are ``n`` engine requests seeded ``seed + i`` (the lane's seed semantics, which
  engines' own ``n`` does not give);
- a prompt that does not fit the engine's context (:attr:`HttpBackend.max_context`, which
  :meth:`HttpBackend.connect` may read from the engine) is a 400 naming ``prompt_token_ids``;
  ``max_tokens`` is cut to the room left, as the reference engine does;
- a ``routed_experts_prompt_start`` past the prompt is a 400 naming it (as the reference
  engine answers); an engine that reports MoE routing returns it per choice in the lane's form
  (:mod:`policies.wire.routing`), one that does not returns None;
- an engine that stamps versions itself (vLLM's ``weight_versions``) is cross-checked: a choice
  whose spans disagree with the sidecar's stamps is served all the same (the sidecar's stamps
  stand), logged as ``version_stamp_mismatch`` and counted;
- engine errors become :class:`EngineUnavailable` (HTTP 503 on the lane), never a crash; the
  sidecar's bearer token and the board's credentials are never sent in logs.
"""

from __future__ import annotations

import json
import socket
from typing import Any, NamedTuple

import aiohttp
import anyio
import structlog

from policies.board import Board
from policies.errors import BadRequest, EngineError
from policies.serve.types import Generation, OutOfBounds, QuiesceMode, check_routing_start
from policies.wire.lane import FinishReason, GenerateChoice, GenerateRequest, choice_seed

log = structlog.get_logger(__name__)


class Sample(NamedTuple):
    """One choice as an adapter read it from its engine."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: str | None = None
    """The lane's form (:mod:`policies.wire.routing`); None when the engine reports none."""
    engine_versions: list[tuple[str, int, int]] | None = None
    """The engine's own stamps, ``(version, first token, end token)`` spans over the output
    (vLLM's ``weight_versions``); None when the engine reports none."""


def stamps_agree(sample: Sample, start: int | None, end: int | None) -> bool:
    """Whether the engine's own version spans, if any, cover the output with versions from
    ``start`` to ``end`` (the first span ``start``, the last ``end``), in order (true when the
    sidecar has no version to check them against)."""
    spans = sample.engine_versions
    if spans is None or not sample.token_ids or start is None or end is None:
        return True  # nothing to check, or no sprawl version served yet to check against
    covered = 0
    allowed = [str(v) for v in range(start, end + 1)]
    for version, first, stop in spans:
        if first != covered or stop <= first or version not in allowed:
            return False
        covered = stop
    return covered == len(sample.token_ids) and (spans[0][0], spans[-1][0]) == (
        str(start),
        str(end),
    )


def free_port() -> int:
    """A TCP port free on loopback now (for an engine this process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineUnavailable(EngineError):
    """The external engine answered with an error or could not be reached."""


STATUS_EVERY_S = 1.0
"""How often a serving engine is asked which version it holds (a restart takes tens of seconds)."""


class HttpBackend:
    """Gating, stamps and fan-out shared by the HTTP adapters."""

    kind = "http"

    def __init__(
        self,
        url: str,
        *,
        model: str,
        max_context: int,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = model
        self.max_context = max_context
        self.version: int | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._gate: anyio.Event | None = None
        self._inflight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.lost = False  # the engine went away: it may come back on its startup weights
        self._asked = -STATUS_EVERY_S

    def _status_due(self) -> bool:
        """Whether to ask the engine which version it holds now: at once after it went away,
        else at most every :data:`STATUS_EVERY_S`."""
        now = anyio.current_time()
        if not self.lost and now - self._asked < STATUS_EVERY_S:
            return False
        self._asked = now
        return True

    # -- HTTP -----------------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self._session

    async def call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` (or GET when None) to the engine; return its JSON (or None if empty)."""
        method = "GET" if body is None else "POST"
        try:
            async with self.session.request(method, f"{self.url}{path}", json=body) as r:
                text = await r.text()
                if r.status >= 400:
                    raise EngineUnavailable(f"{self.kind} {path} answered {r.status}: {text[:300]}")
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.kind} {path} unreachable: {exc}") from exc
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- what adapters implement ----------------------------------------------------------------
    async def connect(self) -> None:
        """Learn what the engine serves (e.g. its context length) before the lane opens."""

    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        raise NotImplementedError

    async def recover(self) -> None:
        """Engines that serve a fixed version (or reload by themselves) have nothing to put back."""

    async def stage(self, board: Board, version: int) -> None:
        raise EngineError(f"{self.kind} engines serve a fixed version")

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        raise EngineError(f"{self.kind} engines serve a fixed version")

    # -- the Backend protocol -------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> Generation:
        room = self.max_context - len(req.prompt_token_ids)
        if room <= 0:  # the engine's own answer would be a 4xx the lane turns into a 503
            raise BadRequest(
                f"prompt has {len(req.prompt_token_ids)} tokens; the engine's context is "
                f"{self.max_context}",
                "prompt_token_ids",
            )
        check_routing_start(req)
        if req.max_tokens > room:  # as the reference engine does (and vLLM does silently)
            req = req.model_copy(update={"max_tokens": room})
        while self._gate is not None:
            await self._gate.wait()
        start = self.version
        if start is not None and not req.policy_version.admits(start):
            raise OutOfBounds(start)
        self._inflight += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        samples: list[Sample] = []
        try:
            for i in range(req.n):
                seed = choice_seed(req.seed, i)
                samples.append(await self.generate_one(req, seed))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        end = self.version
        choices = [
            GenerateChoice(
                index=i,
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                routed_experts=s.routed_experts,
            )
            for i, s in enumerate(samples)
        ]
        wrong = [s.engine_versions for s in samples if not stamps_agree(s, start, end)]
        if wrong:
            log.warning("version_stamp_mismatch", engine=self.url, start=start, end=end, got=wrong)
        return Generation(choices, start, end, stamp_mismatches=len(wrong))

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        gate = anyio.Event()
        self._gate = gate
        try:
            if mode == "wait" and self._inflight:
                await self._idle.wait()
            t0 = anyio.current_time()
            await self.apply(version, mode)
            self.version = version
            return anyio.current_time() - t0
        finally:
            self._gate = None
            gate.set()
