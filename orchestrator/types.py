"""The orchestrator's vocabulary: what an episode, a segment, a group and a batch are.

No I/O and no torch: every other orchestrator module depends on this, and this depends only on
the request lane's models. Episodes are pydantic models because they are written to the
trajectory log as they are.

An episode's tokens are one growing sequence: the initial prompt, then for each model call its
sampled tokens followed by the environment's reply tokens. Segment ``k`` sampled
``token_ids`` starting at offset ``prompt_len`` of that sequence, so the prompt of call ``k + 1``
is exactly the tokens of call ``k`` plus its sampled tokens plus the new environment tokens —
never re-tokenized text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from policies.wire.lane import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    VersionBounds,
    VersionStamp,
)

StopReason = Literal[
    "done",  # the environment ended the episode
    "max_turns",  # environment.max_turns model calls were made
    "context",  # the sequence reached the context limit (model.max_context, the engines')
    "episode_timeout",  # timeouts.episode_s elapsed; the partial trajectory is kept
    "env_error",  # user environment code raised; the error is recorded
    "orchestrator_error",  # sprawl's own turn logic raised (a bug of ours); the error is recorded
    "model_error",  # every endpoint failed the call (after retry)
    "interrupted",  # the run was shut down while the episode was in flight
]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Record):
    """The sampling parameters of one model call, as sent on the lane."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None = None


class Segment(_Record):
    """One model call of an episode."""

    turn: int
    prompt_len: int = Field(description="offset in the episode's token sequence of token_ids[0]")
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: VersionStamp
    bounds: VersionBounds = Field(
        default_factory=VersionBounds, description="the policy versions the request accepted"
    )
    endpoint: str
    latency_s: float
    attempts: int = 1
    sampling: SamplingParams
    routed_experts: str | None = Field(
        default=None,
        description="MoE engines: the experts positions [routed_experts_start, prompt_len + "
        "len(token_ids) - 1) of the episode's sequence were routed to, vLLM's routed_experts "
        "(policies.wire.routing); None when the endpoint does not report routing",
    )
    routed_experts_start: int = Field(
        default=0, ge=0, description="the first position routed_experts covers"
    )


class ErrorRecord(_Record):
    """An error captured as data: where it happened, its type and message."""

    where: Literal["environment", "model", "tool", "orchestrator"]
    type: str
    message: str


class ToolCallRecord(_Record):
    name: str
    arguments: str
    result: str
    error: str | None = None


class Episode(_Record):
    """A finished (or ended) rollout: the trajectory the trainer and the log see."""

    id: str
    group_id: str
    task_id: str
    environment: str
    token_ids: list[int] = Field(description="prompt + every turn's sampled and env tokens")
    prompt_len: int = Field(description="length of the initial prompt")
    segments: list[Segment] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    rewards: dict[str, float] = Field(default_factory=dict)
    reward: float = 0.0
    stop_reason: StopReason
    error: ErrorRecord | None = None
    history_rewritten: bool = Field(
        default=False,
        description="the chat template re-renders earlier turns differently from the tokens "
        "the model saw (their reasoning is left out); the tokens are what is trained on",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="the environment's own facts about the episode (Environment.metadata), "
        "as JSON values",
    )
    admitted_at_version: int = Field(description="trainer version when the group was admitted")
    started_at: float
    finished_at: float
    overlong_penalty: float = Field(
        default=0.0,
        le=0,
        description="staleness.overlong = 'soft_penalty': DAPO's length penalty, added to reward "
        "for training (trained_reward); reward stays the environment's",
    )
    overlong_masked: bool = Field(
        default=False,
        description="staleness.overlong = 'mask': the episode is truncated and none of its "
        "tokens carries loss (its reward still counts in its group's advantages)",
    )

    @property
    def n_sampled(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def truncated(self) -> bool:
        """Cut by a length limit: its last model call stopped at its token limit
        (``finish_reason == "length"``), or the sequence reached the context limit."""
        return self.stop_reason == "context" or (
            bool(self.segments) and self.segments[-1].finish_reason == "length"
        )

    @property
    def trained_reward(self) -> float:
        """The reward the trainer's advantages are computed from: ``reward`` plus
        ``overlong_penalty``."""
        return self.reward + self.overlong_penalty

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at


class Group(_Record):
    """``group_size`` episodes of one task, scored relative to each other (GRPO)."""

    id: str
    task_id: str
    episodes: list[Episode]


Decision = Literal["kept", "dropped"]


class GroupDecision(_Record):
    """What the staleness policy decided for a group when a batch was formed."""

    group_id: str
    decision: Decision
    reason: str
    max_lag: int


class Batch(_Record):
    """Groups handed to the trainer for one optimizer step (trainer version
    ``trained_at_version`` → +1; the trajectory log's batch records say the same)."""

    trained_at_version: int
    groups: list[Group]
    decisions: list[GroupDecision]
    filtered: int = Field(
        default=0,
        ge=0,
        description="groups dynamic sampling dropped (scheduler.dynamic_sampling) while this "
        "batch formed",
    )


@dataclass(frozen=True)
class EndpointRef:
    """How to reach one rollout endpoint."""

    id: str
    url: str
    token: str | None = None
    weight: float = 1.0


class Transport(Protocol):
    """The calls the pool makes to an endpoint (HTTP in production, scripted in tests).

    ``generate`` raises :class:`orchestrator.errors.EndpointError` (or a subclass) on failure.
    """

    async def generate(self, ep: EndpointRef, req: GenerateRequest) -> GenerateResponse: ...

    async def policy(self, ep: EndpointRef) -> PolicyState: ...

    async def notify(self, ep: EndpointRef) -> None: ...


@dataclass
class Endpoint:
    """The pool's live view of one endpoint (what routing reads, and what events record)."""

    ref: EndpointRef
    max_inflight: int = 4
    applied_version: int | None = None
    max_context: int | None = None  # as the endpoint reports it (GET /v1/policy)
    healthy: bool = False
    outstanding: int = 0
    limit: float = 1.0
    failures: int = 0
    open_until: float = 0.0
    removed: bool = False
    served: dict[int, int] = field(default_factory=dict)  # version -> calls served

    @property
    def id(self) -> str:
        return self.ref.id

    def qualifies(self, bounds: VersionBounds, now: float) -> bool:
        return (
            self.healthy
            and not self.removed
            and now >= self.open_until
            and self.applied_version is not None
            and bounds.admits(self.applied_version)
            and self.outstanding < max(1, int(self.limit))
        )

    def state(self, now: float) -> dict[str, Any]:
        """The routing-relevant state at ``now``, as a ``route`` event records it."""
        return {
            "id": self.id,
            "weight": self.ref.weight,
            "healthy": self.healthy,
            "open": now < self.open_until,
            "applied_version": self.applied_version,
            "outstanding": self.outstanding,
            "limit": self.limit,
            "max_inflight": self.max_inflight,
        }


class EventSink(Protocol):
    """Where the pool, the scheduler, the clock and the trajectory log send events (each gets one
    in its constructor): the run's :class:`~orchestrator.record.events.EventLog`, teed with
    the metrics and the live view; :data:`NULL_EVENTS` does nothing."""

    def emit(self, kind: str, **fields: Any) -> None: ...

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None: ...

    def endpoint(self, ep: Endpoint) -> None: ...

    def close(self) -> None: ...


class NullEvents:
    """An event sink that ignores everything; subclass it to handle only some events."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        pass

    def endpoint(self, ep: Endpoint) -> None:
        pass

    def close(self) -> None:
        pass


NULL_EVENTS: EventSink = NullEvents()
