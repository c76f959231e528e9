"""Scripted fakes for the orchestrator's seams: they record the calls made to them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from transformers import PreTrainedTokenizerBase

from environments.base import Environment
from orchestrator.errors import EndpointError, VersionUnavailable
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef, Episode, SamplingParams
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    Usage,
    VersionBounds,
    VersionStamp,
)
from policies.wire.tool_parsers import tool_parser


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
    contexts: dict[str, int] = field(default_factory=dict)  # reported max_context per endpoint

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
        return PolicyState(
            applied_version=v,
            staged_version=None,
            state="serving",
            run="fake",
            max_context=self.contexts.get(ep.id),
        )

    async def notify(self, ep: EndpointRef) -> None:
        if ep.id in self.dead:
            raise EndpointError(ep.id, "connection refused")


@dataclass(frozen=True)
class ScriptedEndpoint:
    """What the runner reads of the endpoint that served a call: its id."""

    id: str


class ScriptedPool:
    """Answers each call with the next scripted text (+ end of turn), recording the requests;
    its endpoints report ``max_context`` (None: none)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        texts: Sequence[str],
        max_context: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.context = max_context
        self.requests: list[GenerateRequest] = []
        self.sampled: list[list[int]] = []
        self.endpoint = ScriptedEndpoint(id="scripted")

    async def generate(
        self, req: GenerateRequest, affinity: str | None = None, priority: float = 0.0
    ) -> tuple[GenerateResponse, ScriptedEndpoint, int]:
        self.requests.append(req)
        text = self.texts[len(self.requests) - 1]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        choice = GenerateChoice(
            index=0, token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"
        )
        resp = GenerateResponse(
            id=f"gen-{len(self.requests)}",
            model="scripted",
            prompt_token_ids=req.prompt_token_ids,
            choices=[choice],
            policy_version=VersionStamp(start=3, end=3),
            usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(ids)),
        )
        return resp, self.endpoint, 1

    def max_context(self) -> int | None:
        return self.context


async def run_scripted(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    task: dict[str, Any],
    texts: Sequence[str],
    max_turns: int = 8,
    *,
    parser: str = "hermes",
    engine_context: int | None = None,
    runner_cls: type[EpisodeRunner] = EpisodeRunner,
) -> tuple[Episode, ScriptedPool]:
    """One episode of ``task`` through the real :class:`EpisodeRunner` (or ``runner_cls``), the
    model's turns being ``texts``; the episode and the pool (its recorded requests)."""
    pool = ScriptedPool(tokenizer, texts, engine_context)
    runner = runner_cls(
        env,
        ChatTokens(tokenizer, env.tool_schemas()),
        tool_parser(parser),
        cast(Pool, pool),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32),
        max_turns=max_turns,
        episode_timeout_s=30,
        max_context=2048,
    )
    episode = await runner.run(task, "group-0", lambda: VersionBounds(min=2), admitted_at=3)
    return episode, pool
