"""Vocabulary of serving: a finished generation, how an engine is held for an activation, what
a request outside its bounds gets, and the seam between the sidecar and its engine.

:class:`Generation` is what every engine returns (the reference engine's
:class:`~policies.serve.decode.DecodeBatcher`, each HTTP backend of :mod:`policies.serve.backends`)
and the sidecar stamps; :class:`Backend` is an engine as the sidecar drives it
(:class:`MultiVersion` when it serves several versions at once); :class:`OutOfBounds` is an
engine's refusal of a request its version does not admit, :class:`VersionNotServed` the
sidecar's (the lane answers it with 409). :func:`failure` is how the lane answers each of these
errors, for a whole request or for one of its choices; :func:`check_routing_start` is the one
request check every engine makes alike.

No I/O; it depends only on the wire contract, the error tree and (for :class:`Backend`'s
signature) the board's type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from policies.errors import BadRequest, EngineError
from policies.wire.lane import VERSION_UNAVAILABLE, ErrorBody, GenerateChoice, GenerateRequest

if TYPE_CHECKING:
    from policies.board import Board

QuiesceMode = Literal["wait", "pause"]
"""How an engine is held while a version is applied: ``"wait"`` stops admitting and lets
in-flight requests finish first; ``"pause"`` holds them at a step boundary, to resume on the new
weights."""


@dataclass(frozen=True)
class Generation:
    """A finished request: its choices and the versions applied at its start and end."""

    choices: list[GenerateChoice]
    start: int | None
    end: int | None
    stamp_mismatches: int = 0
    """Choices whose engine-reported version spans (vLLM's ``weight_versions``) disagree with
    ``start`` / ``end`` (the sidecar counts them: ``sprawl_version_stamp_mismatch_total``)."""


class OutOfBounds(EngineError):
    """The version applied when the request would join lies outside its bounds."""

    def __init__(self, version: int | None) -> None:
        super().__init__(f"applied version {version} is outside the request's bounds")
        self.version = version


class VersionNotServed(EngineError):
    """No version inside the request's bounds is applied (answered as 409)."""

    def __init__(self, message: str, applied: int | None, staged: int | None, catching_up: bool):
        super().__init__(message)
        self.applied = applied
        self.staged = staged
        self.catching_up = catching_up


def failure(exc: EngineError) -> tuple[int, ErrorBody]:
    """How the lane answers ``exc``: its HTTP status and error body. A request that failed is
    answered so; a choice that failed alone carries the body (``finish_reason`` ``"error"``).

    :class:`VersionNotServed` is 409 ``policy_version_unavailable``, :class:`BadRequest` (what
    the client sent is wrong) 400 ``invalid_request_error`` naming the field, any other
    :class:`EngineError` (the engine failed or cannot be reached) 503 ``engine_unavailable``."""
    if isinstance(exc, VersionNotServed):
        return 409, ErrorBody(
            type=VERSION_UNAVAILABLE,
            message=str(exc),
            applied_version=exc.applied,
            staged_version=exc.staged,
        )
    if isinstance(exc, BadRequest):
        return 400, ErrorBody(type="invalid_request_error", message=str(exc), param=exc.param)
    return 503, ErrorBody(type="engine_unavailable", message=str(exc))


def check_routing_start(req: GenerateRequest) -> None:
    """A :class:`BadRequest` naming ``routed_experts_prompt_start`` when it is past the prompt
    (every engine answers so)."""
    if req.routed_experts_prompt_start > len(req.prompt_token_ids):
        raise BadRequest(
            f"routed_experts_prompt_start {req.routed_experts_prompt_start} is past the "
            f"prompt's {len(req.prompt_token_ids)} tokens",
            "routed_experts_prompt_start",
        )


class Backend(Protocol):
    """An engine as the sidecar drives it."""

    name: str
    max_context: int

    async def stage(self, board: Board, version: int) -> None:
        """Fetch and verify ``version`` while the engine keeps serving (raise on failure)."""

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        """Make the staged version live; return the seconds generation was held (paused)."""

    async def generate(self, req: GenerateRequest) -> Generation:
        """Serve ``req``; raise :class:`OutOfBounds` if the live version is outside its bounds."""

    async def recover(self) -> None:
        """At every reconcile: if the engine restarted on other weights, put the live version
        back before it serves again (raise while it cannot be reached)."""

    async def aclose(self) -> None:
        """Release resources."""


@runtime_checkable
class MultiVersion(Protocol):
    """A backend whose engine serves several versions at once (LoRA adapters)."""

    def resident_versions(self) -> list[int]:
        """The versions a request can be served at now."""
        ...
