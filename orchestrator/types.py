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

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from policies.lane import (
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
    "context_length",  # the next prompt would not fit the model's context
    "episode_timeout",  # timeouts.episode_s elapsed; the partial trajectory is kept
    "env_error",  # user environment code raised; the error is recorded
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
    admitted_at_version: int = Field(description="trainer version when the group was admitted")
    started_at: float
    finished_at: float

    @property
    def n_sampled(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

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
    """Groups handed to the trainer for one optimizer step (trainer version ``version`` → +1)."""

    version: int
    groups: list[Group]
    decisions: list[GroupDecision]


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
