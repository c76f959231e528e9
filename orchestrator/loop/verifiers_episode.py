"""The episode runner of ``verifiers`` environments (``environment.kind = "verifiers"``).

The environment runs its own rollout loop (:mod:`environments.verifiers_adapter`); this runner
is the model behind its client. Everything else is :class:`EpisodeRunner`'s: the episode's
record, the errors kept as data, the whole-episode timeout, scoring (the rubric) and the
``Episode`` built at the end.

Guarantees, per model call the environment makes:

- the first call's prompt is the chat template's rendering of the environment's prompt; each
  later prompt is the previous prompt + the tokens the previous call sampled + the tokens of the
  messages the environment added (:meth:`ChatTokens.continuation`), never re-tokenized;
- it is a :class:`~orchestrator.types.Segment` with version stamps and bounds, like a native
  call (:meth:`EpisodeRunner._call`), so staleness corrections apply unchanged;
- the call after ``environment.max_turns`` calls, and a call with no room left under the
  context limit, end the episode (``max_turns``, ``context``) without reaching an engine;
- a history the environment rewrote is recorded (``history_rewritten``), not applied.

Not covered: tools that differ from the environment's ``tool_defs`` (per-task ``tool_defs`` in
``info``): the call is refused and the episode ends with ``env_error``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from environments.errors import EnvError
from environments.types import EpisodeState
from environments.verifiers_adapter import StopKind, VerifiersEnvironment
from environments.verifiers_client import Sampled
from orchestrator.errors import EndpointError
from orchestrator.loop.episode import EpisodeRunner, OrchestratorFailed, environment_code
from orchestrator.types import StopReason
from policies.wire.lane import VersionBounds
from policies.wire.toolcalls import Message

_REWRITTEN = "history_rewritten"  # EpisodeState.data key


class _Stopped(Exception):
    """The episode reached a limit of sprawl's before a model call; ``reason`` is the stop."""

    def __init__(self, reason: StopKind) -> None:
        super().__init__(reason)
        self.reason = reason


class VerifiersRunner(EpisodeRunner):
    """:class:`EpisodeRunner` whose turns are a verifiers environment's rollout."""

    env: VerifiersEnvironment

    async def _turns(
        self,
        task: dict[str, Any],
        state: EpisodeState,
        rec: dict[str, Any],
        bounds: Callable[[], VersionBounds],
        seed: int | None,
    ) -> StopReason:
        ids: list[int] = rec["token_ids"]
        last: list[int] = []

        async def model(new: list[Message], tools: list[dict[str, Any]] | None) -> Sampled:
            if (tools or None) != self.chat.tools:
                names = [t["function"]["name"] for t in tools or []]
                raise EnvError(
                    f"the environment called the model with tools {names}; sprawl renders "
                    "an environment's tool_defs, the same for every call"
                )
            state.turn = len(rec["segments"])
            if state.turn >= self.max_turns:
                raise _Stopped("max_turns")
            try:
                return await sample(new)
            except (EndpointError, _Stopped):
                raise
            except Exception as exc:  # sprawl's own: not the environment's, though it called
                raise OrchestratorFailed(str(exc)) from exc

        async def sample(new: list[Message]) -> Sampled:
            nonlocal last
            if state.turn == 0:
                ids.extend(self.chat.initial(new))
                rec["prompt_len"] = len(ids)
            else:
                ids.extend(self.chat.continuation(last, new))
            prompt = list(ids)
            choice = await self._call(ids, rec, bounds, seed)
            if choice is None:
                raise _Stopped("context")
            last = choice.token_ids
            parsed = await self._parse(last, state, f"{rec['id']}:{state.turn}")
            return Sampled(
                parsed=parsed,
                prompt_token_ids=prompt,
                token_ids=last,
                tokens=list(self.chat.tokenizer.convert_ids_to_tokens(last)),
                logprobs=choice.logprobs,
                finish_reason=choice.finish_reason,
            )

        try:
            with environment_code(_Stopped):
                stop, rewritten = await self.env.rollout(state, model)
        except _Stopped as stopped:
            return stopped.reason
        state.data[_REWRITTEN] = rewritten
        return stop

    def _history_rewritten(self, state: EpisodeState) -> bool:
        return bool(state.data.get(_REWRITTEN)) or super()._history_rewritten(state)
