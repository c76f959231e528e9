"""Vocabulary of serving: a finished generation, how an engine is held for an activation, and
what a request outside its bounds gets.

:class:`Generation` is what every engine returns (the reference engine's
:class:`~policies.serve.decode.DecodeBatcher`, each HTTP backend of :mod:`policies.serve.backends`)
and the sidecar stamps; :class:`OutOfBounds` is an engine's refusal of a request its version does
not admit. :func:`check_routing_start` is the one request check every engine makes alike.

No I/O; it depends only on the wire contract and the error tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.errors import BadRequest, EngineError
from policies.wire.lane import GenerateChoice, GenerateRequest

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


def check_routing_start(req: GenerateRequest) -> None:
    """A :class:`BadRequest` naming ``routed_experts_prompt_start`` when it is past the prompt
    (every engine answers so)."""
    if req.routed_experts_prompt_start > len(req.prompt_token_ids):
        raise BadRequest(
            f"routed_experts_prompt_start {req.routed_experts_prompt_start} is past the "
            f"prompt's {len(req.prompt_token_ids)} tokens",
            "routed_experts_prompt_start",
        )
