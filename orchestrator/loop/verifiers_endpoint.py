"""The model endpoint a verifiers 0.4 environment's train client calls: sprawl's policy, with
every call's version bounds and stamps.

verifiers' train client (``verifiers.v1.clients.train``, ``TrainClientConfig``) renders each
prompt to token ids with the ``renderers`` package and posts them to a vLLM-style token
endpoint: ``POST {base}/inference/v1/generate`` with ``{"model", "token_ids", "sampling_params":
{"max_tokens", "stop_token_ids", "logprobs": 1, ...}}`` and the rollout's trace id in
``X-Session-ID``; it asks ``GET {base}/v1/models`` once for ``max_model_len``. It reads back
``choices[0].token_ids``, ``choices[0].logprobs.content[i] = {"token": "token_id:<id>",
"logprob"}``, ``finish_reason`` and ``prompt_token_ids``. :class:`PolicyEndpoint` serves both
routes on loopback, for every episode of one environment (one client config, so verifiers keeps
one connection pool), and routes each call to its episode by the trace id
(:meth:`PolicyEndpoint.expecting`, fed by ``Env.run_episode(on_trace=...)``).

Guarantees, per call (:class:`EpisodeCalls`):

- it is a model call of sprawl's episode runner (``EpisodeRunner._call``): the episode's version
  bounds at the time of the call, a :class:`~orchestrator.types.Segment` with the version stamps,
  failover and retries of the pool; the answer carries the stamps (``policy_version``);
- the tokens are the engine's: the episode's sequence is the first prompt, then each call's
  sampled tokens and the prompt tokens the renderer added after them. A prompt that does not
  extend the sequence (the renderer re-tokenized earlier turns) is refused, never re-aligned
  (:attr:`EpisodeCalls.refused`); so are calls from a second agent of the episode;
- sampling is the run's ``[sampling]``; ``max_tokens`` is the smaller of the run's and the
  request's, ``stop_token_ids`` the renderer's;
- the call after ``environment.max_turns`` calls and a call with no room under the context limit
  are refused and end the episode (``max_turns``, ``context``) without reaching an engine;
- a pool failure ends the episode as ``model_error`` (:attr:`EpisodeCalls.failure`): the call
  and every later one of the episode are refused;
- hostile input is bounded: bodies over :data:`MAX_BODY` bytes, prompts over
  :data:`MAX_PROMPT_TOKENS` ids, malformed JSON, multimodal inputs, an unknown trace id and a
  missing or wrong bearer token are 4xx answers naming what was wrong. Refusals are 400s, which
  the program's SDK does not retry.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.errors import EndpointError
from orchestrator.types import Segment
from policies.wire.lane import GenerateChoice, VersionBounds

log = structlog.get_logger(__name__)
SESSION_HEADER = "X-Session-ID"
"""verifiers' per-rollout header: the trace id, the same on every call of a rollout."""
API_KEY_VAR = "SPRAWL_VERIFIERS_API_KEY"
"""The prefix of the variable verifiers reads an endpoint's bearer token from, one per endpoint
(:attr:`PolicyEndpoint.key_var`; verifiers' runtimes keep variables named ``*API_KEY*`` from
the programs they start)."""
MAX_BODY = 16 * 2**20
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOP_IDS = 64
Stop = Literal["max_turns", "context"]
Call = Callable[..., Awaitable[GenerateChoice | None]]
"""``EpisodeRunner._call(ids, rec, bounds, seed, *, max_tokens, stop_token_ids)``."""


class Refused(Exception):
    """A call the endpoint answers with 400 and ``message``."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = Field(default=None, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_IDS)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(max_length=256)
    token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    sampling_params: _Sampling = Field(default_factory=_Sampling)


@dataclass
class EpisodeCalls:
    """One episode's model calls (module docstring): the runner's record ``rec`` grows by one
    segment per call; what ended the episode's calls is kept for the runner."""

    rec: dict[str, Any]
    bounds: Callable[[], VersionBounds]
    seed: int | None
    max_turns: int
    call: Call
    caller: str | None = None
    discarded: set[str] = field(default_factory=set)
    stop: Stop | None = None
    failure: EndpointError | None = None
    refused: str | None = None
    """Why the environment's call was refused (its renderer re-tokenized, a second agent)."""

    def discard(self, trace: Any) -> None:
        """verifiers abandoned ``trace`` (an agent's retry): its calls leave the episode."""
        self.discarded.add(trace.id)

    async def generate(
        self, trace_id: str, prompt: list[int], max_tokens: int | None, stop_ids: list[int]
    ) -> tuple[GenerateChoice, Segment]:
        """Sample the next turn after ``prompt`` for the rollout ``trace_id``."""
        ended = self.failure or self.stop or self.refused
        if ended is not None:
            raise Refused(f"the episode's calls have ended ({ended})")
        ids: list[int] = self.rec["token_ids"]
        if self.caller is not None and self.caller != trace_id:
            if self.caller not in self.discarded:
                self.refused = "a second agent called the policy; sprawl trains one per episode"
                raise Refused(self.refused)
            ids.clear()  # a retried agent: its first attempt's calls are not the episode's
            self.rec["segments"].clear()
        if self.caller != trace_id:
            self.caller = trace_id
            ids.extend(prompt)
            self.rec["prompt_len"] = len(prompt)
        elif prompt[: len(ids)] != ids:
            self.refused = (
                "the renderer re-tokenized earlier turns (the prompt does not extend the "
                "tokens the model saw); choose a renderer that bridges turns (renderer = ...)"
            )
            raise Refused(self.refused)
        else:
            ids.extend(prompt[len(ids) :])
        if len(self.rec["segments"]) >= self.max_turns:
            self.stop = "max_turns"
            raise Refused("environment.max_turns model calls were made")
        try:
            choice = await self.call(
                ids,
                self.rec,
                self.bounds,
                self.seed,
                max_tokens=max_tokens,
                stop_token_ids=stop_ids,
            )
        except EndpointError as exc:
            self.failure = exc
            raise Refused(f"the model call failed: {exc}") from exc
        if choice is None:
            self.stop = "context"
            raise Refused("the sequence reached the context limit")
        return choice, self.rec["segments"][-1]


def _answer(body: _Body, choice: GenerateChoice, seg: Segment, rid: str) -> dict[str, Any]:
    """The vLLM-shaped answer, with sprawl's version stamp."""
    n, m = seg.prompt_len, len(choice.token_ids)
    content = [
        {"token": f"token_id:{t}", "logprob": lp}
        for t, lp in zip(choice.token_ids, choice.logprobs, strict=True)
    ]
    return {
        "request_id": rid,
        "model": body.model,
        "prompt_token_ids": body.token_ids,
        "choices": [
            {
                "index": 0,
                "token_ids": choice.token_ids,
                "logprobs": {"content": content},
                "finish_reason": choice.finish_reason,
            }
        ],
        "policy_version": seg.policy_version.model_dump(),
        "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
    }


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"type": "invalid_request_error", "message": message}}, status=status
    )


class PolicyEndpoint:
    """The routes verifiers' train client calls, served on loopback (module docstring)."""

    def __init__(self, model: str, max_context: int) -> None:
        self.model = model
        self.max_context = max_context
        self.token = secrets.token_urlsafe(32)
        self.key_var = f"{API_KEY_VAR}_{secrets.token_hex(4).upper()}"
        """The process variable holding :attr:`token` while :meth:`serve` runs."""
        self.episodes: dict[str, EpisodeCalls] = {}
        """Trace id → the episode it plays in."""

    @contextmanager
    def expecting(self, calls: EpisodeCalls) -> Iterator[Callable[[Any], None]]:
        """While the episode runs: the ``on_trace`` hook that routes a minted trace's calls to
        ``calls``. Its traces are forgotten when it ends."""
        minted: list[str] = []

        def on_trace(trace: Any) -> None:
            minted.append(trace.id)
            self.episodes[trace.id] = calls

        try:
            yield on_trace
        finally:
            for trace_id in minted:
                self.episodes.pop(trace_id, None)

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on 127.0.0.1 (a free port), the token in :attr:`key_var`; yields the base
        URL."""
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        os.environ[self.key_var] = self.token
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            yield f"http://127.0.0.1:{port}"
        finally:
            os.environ.pop(self.key_var, None)
            await runner.cleanup()

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token")
        card = {"id": self.model, "object": "model", "max_model_len": self.max_context}
        return web.json_response({"object": "list", "data": [card]})

    async def _generate(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token")
        calls = self.episodes.get(request.headers.get(SESSION_HEADER, ""))
        if calls is None:
            return _error(404, f"{SESSION_HEADER}: no episode in flight has this rollout")
        try:
            body = _Body.model_validate_json(await request.read())
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            return _error(400, f"{where}: {err['msg']}")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is over {MAX_BODY} bytes")
        if body.model_extra and {"features", "content_parts"} & set(body.model_extra):
            return _error(400, "multimodal prompts are not supported")
        trace_id = request.headers[SESSION_HEADER]
        sampling = body.sampling_params
        try:
            choice, seg = await calls.generate(
                trace_id, body.token_ids, sampling.max_tokens, sampling.stop_token_ids
            )
        except Refused as exc:
            log.info("verifiers.call_refused", episode=calls.rec["id"], reason=str(exc))
            return _error(400, str(exc))
        return web.json_response(_answer(body, choice, seg, f"{calls.rec['id']}:{seg.turn}"))
