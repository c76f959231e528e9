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
  sidecar's bearer token and the board's credentials are never sent in logs;
- a choice whose engine request fails is answered as failed (``finish_reason`` ``"error"``, no
  tokens, its error) beside the request's other choices (once the engine cannot be reached, the
  choices left fail alike, untried); only a request none of whose choices was sampled fails,
  with the first choice's error: 400 when the engine refused the request itself (``400``,
  ``413`` or ``422``: :func:`choice_failure`), else 503.
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
from policies.serve.types import (
    Generation,
    OutOfBounds,
    QuiesceMode,
    check_routing_start,
    failure,
)
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
    """The external engine answered with an error (``status``, its HTTP status) or could not be
    reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


REFUSED = frozenset({400, 413, 422})
"""Engine statuses that say the request itself is bad: a choice refused so is the client's
error (400 on the lane), not the engine's (503)."""


def choice_failure(exc: EngineError) -> EngineError:
    """What a choice the engine failed with ``exc`` answers: a :class:`BadRequest` when the
    engine refused the request itself (:data:`REFUSED`), else ``exc``."""
    if isinstance(exc, EngineUnavailable) and exc.status in REFUSED:
        return BadRequest(f"the engine refused the request: {exc}")
    return exc


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
                    raise EngineUnavailable(
                        f"{self.kind} {path} answered {r.status}: {text[:300]}", r.status
                    )
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
        if room <= 0:  # refused before the engine is asked, naming the context
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
        try:
            samples = await self._sample(req)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        failed = [s for s in samples if isinstance(s, EngineError)]
        if len(failed) == req.n:
            raise failed[0]  # no choice was sampled: the request has failed
        end = self.version
        choices = [_choice(i, s) for i, s in enumerate(samples)]
        wrong = [
            s.engine_versions
            for s in samples
            if isinstance(s, Sample) and not stamps_agree(s, start, end)
        ]
        if wrong:
            log.warning("version_stamp_mismatch", engine=self.url, start=start, end=end, got=wrong)
        return Generation(choices, start, end, stamp_mismatches=len(wrong))

    async def _sample(self, req: GenerateRequest) -> list[Sample | EngineError]:
        """Each choice's sample, or the error its engine request failed with. Once the engine
        cannot be reached, the choices left fail with that error untried."""
        samples: list[Sample | EngineError] = []
        for i in range(req.n):
            try:
                samples.append(await self.generate_one(req, choice_seed(req.seed, i)))
            except EngineError as exc:  # this choice's failure; the others are answered
                log.warning("choice_failed", engine=self.url, choice=i, error=str(exc))
                samples.append(choice_failure(exc))
                if isinstance(exc, EngineUnavailable) and exc.status is None:
                    return samples + [exc] * (req.n - i - 1)
        return samples

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


def _choice(index: int, sample: Sample | EngineError) -> GenerateChoice:
    """Choice ``index`` of a request: the sample, or the error it failed with."""
    if isinstance(sample, EngineError):
        error = failure(sample)[1]
        return GenerateChoice(
            index=index, token_ids=[], logprobs=[], finish_reason="error", error=error
        )
    return GenerateChoice(
        index=index,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        finish_reason=sample.finish_reason,
        routed_experts=sample.routed_experts,
    )
