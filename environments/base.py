"""The ``Environment`` base class users subclass to define a task.

A subclass owns the task logic; the framework owns concurrency, timeouts and token bookkeeping.
It provides:

- tasks: ``generate_tasks()`` for the ``generated`` task source; the ``files`` and ``saved``
  sources need no code (``[environment.args] tasks = {...}``, see :mod:`environments.tasks`).
  ``task_columns`` names the columns a task must have besides ``id``;
- ``initial_messages(task)`` — the OpenAI-shaped messages that open an episode;
- tools: methods decorated with :func:`~environments.tools.tool`; their JSON schema comes from
  the type hints and the docstring (:mod:`environments.tools`);
- rewards: methods decorated with :func:`reward` ``(weight=…)``, sync or async, returning a float
  for a finished episode; the episode's reward is their weighted sum (weights can be overridden
  with ``reward_weights`` in the config), minus the configured ``penalties``;
- multi-turn hooks: ``respond(state, reply)`` reacts to each model message. The default runs the
  message's tool calls and returns their results; a message without tool calls goes to
  ``on_answer(state, reply)``, whose default records the final answer and ends the episode. An
  environment that talks back (feedback, the next question) overrides ``on_answer`` and returns
  ``Reply.user(...)``; returning ``done=True`` ends the episode;
- ``metadata(state)`` — facts to keep on the episode's record (``Episode.metadata``), e.g. the
  environment's own bookkeeping in ``state.data``;
- a ``Config`` pydantic model (a subclass of :class:`EnvConfig`) validating ``[environment.args]``.

Bad model output never raises. Malformed tool-call JSON, an unknown tool, arguments of the wrong
type and calls over ``max_tool_calls_per_turn`` become ``error: …`` tool observations and count
in ``state.bad_calls``; an empty answer and an unfinished episode (max turns, context, timeout)
are scored, and cost ``penalties.*`` when configured. An exception raised inside a tool becomes
an observation (type and message) and is recorded on the trajectory's tool call; an exception in
a reward function is raised as :class:`~environments.errors.RewardError` naming the reward, the
type and the message; one from any other hook propagates unchanged. The episode runner records
both on the trajectory (``stop_reason = "env_error"``) and keeps going.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import structlog
from datasets import Dataset

from environments.errors import EnvironmentLoadError, RewardError
from environments.tasks import load_tasks
from environments.tools import ToolOutcome, ToolSpec, build_tool, is_tool, run_tool, tool
from environments.types import EnvConfig, EpisodeState, Reply
from policies.wire.toolcalls import Message, ParsedAssistant, ToolCall

__all__ = [
    "EnvConfig",
    "Environment",
    "EpisodeState",
    "Message",
    "ParsedAssistant",
    "Reply",
    "ToolCall",
    "reward",
    "tool",
]

log = structlog.get_logger(__name__)
MALFORMED_CALL = "malformed_call"
"""The ``name`` of the tool message that answers a malformed call (it has no call id)."""
F = TypeVar("F", bound=Callable[..., Any])
RewardFn = Callable[[EpisodeState], float | Awaitable[float]]


def reward(weight: float = 1.0) -> Callable[[F], F]:
    """Mark a method ``(self, state) -> float`` (or ``async``) as a reward with ``weight``."""

    def mark(fn: F) -> F:
        fn.__sprawl_reward__ = weight  # type: ignore[attr-defined]
        return fn

    return mark


class Environment:
    """Subclass; define ``initial_messages`` and tasks; add @tool and @reward methods."""

    Config: ClassVar[type[EnvConfig]] = EnvConfig
    name: ClassVar[str] = "environment"
    task_columns: ClassVar[tuple[str, ...]] = ()
    """Columns every task must have besides ``id`` (checked whatever the task source)."""

    def __init__(self, config: EnvConfig) -> None:
        self.config = config
        self.tool_timeout_s = 10.0  # set by the framework from timeouts.tool_s
        self._tools: dict[str, ToolSpec] = {
            name: build_tool(name, getattr(self, name))
            for name, member in inspect.getmembers(type(self))
            if is_tool(member)
        }
        self._rewards = self._collect_rewards()
        self._tasks: Dataset | None = None

    # -- to override ----------------------------------------------------------------------------
    def generate_tasks(self) -> Dataset | list[dict[str, Any]]:
        """Tasks of the ``generated`` source (use ``config.num_tasks`` and ``config.seed``)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not generate tasks; set environment.args.tasks to "
            '{source = "files", path = ...} or {source = "saved", path = ...}'
        )

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        raise NotImplementedError(f"{type(self).__name__} must define initial_messages()")

    async def respond(self, state: EpisodeState, reply: ParsedAssistant) -> Reply:
        """Run the message's tool calls; a message without any goes to :meth:`on_answer`."""
        if not reply.tool_calls and not reply.errors:
            return await self.on_answer(state, reply)
        return Reply(messages=await self.run_tool_calls(state, reply), done=False)

    async def on_answer(self, state: EpisodeState, reply: ParsedAssistant) -> Reply:
        """A message without tool calls: by default the final answer, which ends the episode."""
        state.final_answer = reply.content
        return Reply.end()

    # -- framework side -------------------------------------------------------------------------
    def tasks(self) -> Dataset:
        """The tasks of the configured source (loaded once, then cached)."""
        if self._tasks is None:
            self._tasks = load_tasks(
                self.config.tasks, self.generate_tasks, required=self.task_columns
            )
            log.info(
                "env.tasks_loaded",
                env=self.name,
                source=self.config.tasks.source,
                tasks=len(self._tasks),
            )
        return self._tasks

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries for every @tool method."""
        return [t.schema for t in self._tools.values()]

    async def call_tool(self, call: ToolCall) -> tuple[str, str | None]:
        """Run one call; return ``(result, error)``: bad calls give an error string, never raise."""
        outcome = await self._run(call)
        return outcome.result, outcome.error

    async def run_tool_calls(self, state: EpisodeState, reply: ParsedAssistant) -> list[Message]:
        """Tool messages answering ``reply``: malformed blocks first, then each call in order."""
        out: list[Message] = []
        for err in reply.errors:
            state.bad_calls += 1
            # named, as templates that look up a tool message's function require (gpt-oss-like),
            # with the id the dialect gave it where its template requires one (Mistral's)
            message = {"role": "tool", "name": MALFORMED_CALL, "content": f"error: {err.message}"}
            out.append({**message, "tool_call_id": err.id} if err.id else message)
        cap = self.config.max_tool_calls_per_turn
        for i, call in enumerate(reply.tool_calls):
            if i >= cap:
                outcome = ToolOutcome(
                    "", f"only {cap} tool calls run per message; this one was skipped", "bad_call"
                )
            else:
                outcome = await self._run(call)
            state.bad_calls += outcome.kind == "bad_call"
            state.tool_results.append((call, outcome.result, outcome.error))
            content = outcome.result if outcome.error is None else f"error: {outcome.error}"
            out.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
            )
        return out

    async def score(self, state: EpisodeState) -> dict[str, float]:
        """Every reward component of a finished episode (see :meth:`total_reward`)."""
        out: dict[str, float] = {}
        for name, fn, _ in self._rewards:
            try:
                value = fn(state)
                if inspect.isawaitable(value):
                    value = await value
                out[name] = float(value)
            except Exception as exc:  # user code: re-raised with the reward's name attached
                raise RewardError(f"{name!r} raised {type(exc).__name__}: {exc}") from exc
        return out

    def total_reward(self, components: dict[str, float]) -> float:
        """The weighted sum of ``components`` (penalties carry negative weights)."""
        return sum(components[name] * w for name, _, w in self._rewards if name in components)

    def reward_weights(self) -> dict[str, float]:
        """The weight of every component, penalties included."""
        return {name: w for name, _, w in self._rewards}

    def metadata(self, state: EpisodeState) -> dict[str, Any]:
        """What to keep on the episode's record besides its trajectory and rewards
        (``Episode.metadata``), read once the episode is scored; none by default. Values are
        stored as JSON: pydantic models, dataclasses and containers as their JSON form, other
        objects as ``"<unserializable TYPE>"``."""
        return {}

    async def _run(self, call: ToolCall) -> ToolOutcome:
        spec = self._tools.get(call.name)
        if spec is None:
            known = sorted(self._tools) or "none"
            return ToolOutcome("", f"unknown tool {call.name!r}; available: {known}", "bad_call")
        return await run_tool(
            spec,
            call.arguments,
            timeout_s=self.tool_timeout_s,
            max_chars=self.config.max_tool_output_chars,
        )

    def _collect_rewards(self) -> list[tuple[str, RewardFn, float]]:
        rewards: list[tuple[str, RewardFn, float]] = [
            (name, getattr(self, name), float(m.__sprawl_reward__))
            for name, m in inspect.getmembers(type(self))
            if hasattr(m, "__sprawl_reward__")
        ]
        overrides = self.config.reward_weights
        unknown = sorted(set(overrides) - {name for name, _, _ in rewards})
        if unknown:
            raise EnvironmentLoadError(
                f"environment.args.reward_weights: unknown reward(s) {unknown}; "
                f"{type(self).__name__} has {sorted(name for name, _, _ in rewards)}"
            )
        rewards = [(n, fn, overrides.get(n, w)) for n, fn, w in rewards]
        p = self.config.penalties
        penalties: list[tuple[str, RewardFn, float]] = [
            ("penalty_bad_calls", lambda s: float(s.bad_calls), p.bad_call),
            (
                "penalty_unfinished",
                lambda s: float(s.stop_reason not in (None, "done")),
                p.unfinished,
            ),
            (
                "penalty_empty_answer",
                lambda s: float(s.final_answer is not None and not s.final_answer.strip()),
                p.empty_answer,
            ),
        ]
        return rewards + [(n, fn, -w) for n, fn, w in penalties if w > 0]
