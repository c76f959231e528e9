"""The request lane: the wire contract between the orchestrator and any rollout endpoint.

Every rollout endpoint (the reference engine with its embedded sidecar, or a standalone sidecar in
front of vLLM / SGLang / llama.cpp) speaks OpenAI-compatible HTTP plus the token endpoint
``POST /v1/generate`` defined here. The one extension is ``policy_version``:

- request: ``{"policy_version": {"min": int | null, "max": int | null}}`` — the versions this
  request accepts; absent means any; ``min == max`` pins one version.
- response: ``{"policy_version": {"start": int, "end": int}}`` — the version applied when
  generation started and when it ended (they differ only if an update landed mid-generation).
- ``409 Conflict`` with an :class:`ErrorBody` of type ``policy_version_unavailable`` and a
  ``Retry-After`` header when no version inside the bounds is applied (the sidecar may be catching
  up).
- ``GET /v1/policy`` returns :class:`PolicyState`.

These models are the only place the field names are spelled; both sides import them. Importing
this module does not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a choice ended: a stop token, its token budget, its request abandoned, or a failure of its
own (the choice then carries an ``error``; the request's other choices are answered)."""
SidecarState = Literal["serving", "staging", "activating", "catching_up", "starting", "failed"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _absent(value: object) -> bool:
    """Whether an optional field is left out of the JSON (an unset field of an error body, a
    choice's ``error`` when it has none)."""
    return value is None


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
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="an int64")
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(default=1, ge=1, le=64)
    policy_version: VersionBounds = Field(default_factory=VersionBounds)
    routed_experts_prompt_start: int = Field(
        default=0,
        ge=0,
        description="MoE engines: leave the routing of the first this many prompt tokens out of "
        "routed_experts (vLLM's field; a multi-turn caller sets it to the positions it has)",
    )


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i`` of a request seeded ``seed``: ``seed + i``, wrapped into int64
    (the seed's range), so a request may carry any int64 seed whatever its ``n``."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


class ErrorBody(_Wire):
    """The body of every 4xx/5xx answer: ``{"error": ErrorBody}``."""

    type: str
    message: str
    param: str | None = Field(default=None, exclude_if=_absent)
    applied_version: int | None = Field(default=None, exclude_if=_absent)
    staged_version: int | None = Field(default=None, exclude_if=_absent)


class GenerateChoice(_Wire):
    """One sampled continuation with the log prob of each sampled token.

    ``routed_experts`` (MoE engines that report routing; None otherwise): the experts every
    position was routed to, in vLLM 0.32's form, base64 ``.npy`` ``[len(prompt) + len(token_ids)
    - 1 - routed_experts_prompt_start, layers, top_k]`` (:mod:`policies.wire.routing`).

    A choice that failed alone (``finish_reason`` ``"error"``) carries its ``error`` and the
    tokens it had sampled before it failed; the request's other choices are whole."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routed_experts: str | None = None
    error: ErrorBody | None = Field(default=None, exclude_if=_absent)


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
    max_context: int | None = None
    """The longest sequence (prompt + sampled tokens) the engine serves; None: not reported."""


VERSION_UNAVAILABLE = "policy_version_unavailable"


# -- OpenAI-compatible routes -------------------------------------------------------------------
# Requests name every accepted field (so an unknown or unsupported one is a 400 naming it);
# fields OpenAI clients send by default and that change nothing here are accepted as documented.

_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Open(BaseModel):
    """Nested OpenAI objects: unknown keys are kept (clients add vendor fields)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class FunctionSpec(_Wire):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, object] = Field(default_factory=lambda: dict[str, object](type="object"))
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> FunctionSpec:
        kind = self.parameters.get("type", "object")
        if kind != "object":
            raise ValueError(
                f'function parameters must be a JSON schema of type "object", got {kind!r}'
            )
        props = self.parameters.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ValueError("function parameters.properties must map names to JSON schemas")
        required = self.parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("function parameters.required must be a list of names")
        return self


class ToolSpec(_Wire):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, object] = "{}"


class MessageToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, object]] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _Sampling(_Wire):
    """Sampling fields shared by both OpenAI routes (plus the lane's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="an int64")
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: Literal[False] = False
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="only 0")
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="only 0")
    policy_version: VersionBounds = Field(default_factory=VersionBounds)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)
    logprobs: bool = False
    top_logprobs: Literal[0] | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, not one of the tools"
                )
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs tools')
        return self


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt or a token-id prompt."""

    prompt: str | list[int] = Field(min_length=1)
    logprobs: Literal[0, 1] | None = None
    echo: Literal[False] = False


class TokenLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, object]] = Field(default_factory=list)


class ChatLogprobs(_Wire):
    content: list[TokenLogprob]


class ChatChoice(_Wire):
    index: int
    message: dict[str, object]
    finish_reason: str
    logprobs: ChatLogprobs | None
    token_ids: list[int]
    error: ErrorBody | None = Field(default=None, exclude_if=_absent)


class CompletionLogprobs(_Wire):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(_Wire):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None
    token_ids: list[int]
    error: ErrorBody | None = Field(default=None, exclude_if=_absent)


class OpenAIUsage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    prompt_token_ids: list[int]
    policy_version: VersionStamp


class CompletionResponse(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage
    prompt_token_ids: list[int]
    policy_version: VersionStamp
