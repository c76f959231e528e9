"""The request lane: the wire contract between the orchestrator and any rollout endpoint.

Every rollout endpoint (the reference engine with its embedded sidecar, or a standalone sidecar in
front of vLLM / SGLang / llama.cpp) speaks OpenAI-compatible HTTP plus the token endpoint
``POST /v1/generate`` defined here. The one extension is ``policy_version``:

- request: ``{"policy_version": {"min": int | null, "max": int | null}}`` — the versions this
  request accepts; absent means any; ``min == max`` pins one version.
- response: ``{"policy_version": {"start": int, "end": int}}`` — the version applied when
  generation started and when it ended (they differ only if an update landed mid-generation).
- ``409 Conflict`` with :class:`VersionUnavailable` as ``{"error": {...}}`` and a ``Retry-After``
  header when no version inside the bounds is applied (the sidecar may be catching up).
- ``GET /v1/policy`` returns :class:`PolicyState`.

These models are the only place the field names are spelled; both sides import them. Importing
this module does not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]
SidecarState = Literal["serving", "staging", "activating", "catching_up", "starting"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VersionBounds(_Wire):
    """The policy versions a request accepts (inclusive); ``None`` leaves that side open."""

    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> VersionBounds:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"policy_version.min ({self.min}) > policy_version.max ({self.max})")
        return self

    def admits(self, version: int) -> bool:
        """Whether ``version`` lies inside these bounds."""
        if self.min is not None and version < self.min:
            return False
        return self.max is None or version <= self.max


class VersionStamp(_Wire):
    """The versions applied when a generation started and when it ended."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)


class GenerateRequest(_Wire):
    """``POST /v1/generate``: token ids in, token ids and log probs out."""

    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=1, le=32768)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(default=1, ge=1, le=64)
    policy_version: VersionBounds = Field(default_factory=VersionBounds)


class GenerateChoice(_Wire):
    """One sampled continuation with the log prob of each sampled token."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int


class GenerateResponse(_Wire):
    """Answer to :class:`GenerateRequest`, stamped with the versions that produced it."""

    id: str
    model: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    policy_version: VersionStamp
    usage: Usage


class PolicyState(_Wire):
    """``GET /v1/policy``: what the sidecar serves now and what it is preparing."""

    applied_version: int | None
    staged_version: int | None
    state: SidecarState
    run: str


class ErrorBody(_Wire):
    """The body of every 4xx/5xx answer: ``{"error": ErrorBody}``."""

    type: str
    message: str
    param: str | None = None
    applied_version: int | None = None
    staged_version: int | None = None


VERSION_UNAVAILABLE = "policy_version_unavailable"
