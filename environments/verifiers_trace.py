"""A finished verifiers episode (``verifiers.v1.Episode``) read as sprawl's episode fields.

sprawl trains one agent's trace per episode (:func:`trained_trace`: the one trainable trace, or
the only trace). From it, :class:`Outcome` reads:

- the reward components: each ``@vf.reward`` by name, its score (the trace's ``rewards``); their
  weights are the rewards' own, and the episode's reward is their weighted sum, as verifiers
  computes ``Trace.reward``;
- the messages of its last branch as OpenAI wire messages, and its tool calls paired with their
  results (:func:`tool_calls`);
- the failure, when there is one, as data (:attr:`Outcome.failure`): an episode-level error
  (``Env.run``/``finalize`` raised, its deadline expired), else the trace's last error. A reward
  or metric function that raised is told apart (:attr:`Outcome.reward_failed`): the runner
  records it like a sprawl reward function's (``reward: ...``);
- the facts the episode's record keeps (:meth:`Outcome.metadata`): verifiers' episode and trace
  ids, ``ok``, ``stop_condition``, ``is_timeout``, the metrics, the errors and the
  ``PolicySpan`` the runner stamped on the episode.

Messages and error texts longer than :data:`MAX_ERROR_CHARS` are cut (a harness error carries the
program's stderr).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_ERROR_CHARS = 2000
"""The longest error message kept (the tail, where a traceback names its cause)."""
SCORING = " scoring: "
"""How verifiers names a task's scoring boundary in a ``TaskError`` (``task T scoring: ...``)."""


def trained_trace(episode: Any) -> Any | None:
    """The trace sprawl trains on: the only trainable one (None when the episode has none)."""
    trainable = [t for t in episode.traces if t.agent.trainable]
    return trainable[-1] if trainable else None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else "…" + text[-MAX_ERROR_CHARS:]


def _describe(error: Any) -> str:
    return _cut(f"{error.type}: {error.message}")


def tool_calls(trace: Any) -> list[tuple[str, str, str]]:
    """``(name, arguments, result)`` of every tool call of the trace's last branch, in order."""
    results = {m.tool_call_id: m for m in trace.tool_messages}
    out = []
    for message in trace.assistant_messages:
        for call in message.tool_calls or []:
            answer = results.get(call.id)
            content = answer.content if answer is not None else ""
            text = content if isinstance(content, str) else json.dumps(content, default=str)
            out.append((call.name, call.arguments, text))
    return out


@dataclass(frozen=True)
class Outcome:
    """What sprawl keeps of one finished verifiers episode (module docstring)."""

    episode: Any
    trace: Any | None

    @classmethod
    def of(cls, episode: Any) -> Outcome:
        return cls(episode, trained_trace(episode))

    @property
    def failure(self) -> str | None:
        """``Type: message`` of what failed the episode (None: nothing did, or only scoring)."""
        if self.episode.errors:
            return _describe(self.episode.errors[-1])
        if self.trace is None:
            return "the episode has no trainable trace"
        error = self.trace.last_error
        if self.trace.ok or error is None or self.reward_failed:
            return None
        return _describe(error)

    @property
    def reward_failed(self) -> str | None:
        """The error of a reward or metric function that raised while the trace was scored."""
        trace = self.trace
        error = trace.last_error if trace is not None else None
        if trace is None or error is None or trace.ok or error.type != "TaskError":
            return None
        return _cut(error.message) if SCORING in error.message else None

    @property
    def timed_out(self) -> bool:
        """A verifiers deadline (the env's ``timeout.episode``, an agent stage's) expired."""
        return bool(self.episode.is_timeout or (self.trace is not None and self.trace.is_timeout))

    def rewards(self) -> dict[str, float]:
        """Each reward's score, by name."""
        if self.trace is None:
            return {}
        return {name: float(r.score) for name, r in self.trace.rewards.items() if r is not None}

    def weights(self) -> dict[str, float]:
        if self.trace is None:
            return {}
        return {name: float(r.weight) for name, r in self.trace.rewards.items() if r is not None}

    def messages(self) -> list[dict[str, Any]]:
        """The last branch's messages as OpenAI wire messages."""
        from verifiers.v1.dialects.chat import message_to_wire

        if self.trace is None:
            return []
        return [dict(message_to_wire(m)) for m in self.trace.messages]

    def metadata(self) -> dict[str, Any]:
        """The facts of the episode the record keeps (module docstring)."""
        episode, trace = self.episode, self.trace
        work = episode.run.work if episode.run is not None else None
        policy = work.policy if work is not None else None
        out: dict[str, Any] = {
            "episode_id": episode.id,
            "env": episode.env.id,
            "ok": episode.ok,
            "is_timeout": episode.is_timeout,
            "errors": [_describe(e) for e in episode.errors],
            "policy": None if policy is None else {"start": policy.start, "end": policy.end},
        }
        if trace is not None:
            out.update(
                trace_id=trace.id,
                agent=trace.agent.name,
                stop_condition=trace.stop_condition,
                trace_errors=[_describe(e) for e in trace.errors],
                metrics=dict(trace.metrics),
            )
        return {"verifiers": out}
