"""The ``Environment`` base class users subclass to define a task.

A subclass owns the task logic; the framework owns concurrency, timeouts and token bookkeeping.
It provides:

- ``tasks()`` — a ``datasets.Dataset`` whose rows are tasks (each row needs an ``id`` column);
- ``initial_messages(task)`` — the OpenAI-shaped messages that open an episode;
- tools: methods decorated with :func:`tool`; their JSON schema is derived from the type hints
  (via pydantic) and their docstring becomes the description;
- rewards: methods decorated with :func:`reward` ``(weight=…)`` returning a float for a finished
  episode; the episode's reward is their weighted sum;
- optionally ``respond(state, reply)`` to react to the model's message (the default runs the
  tool calls and ends the episode when the model answers without calling a tool);
- optionally a ``Config`` pydantic model validating ``[environment.args]``.

Bad model output (malformed tool-call JSON, unknown tool, wrong argument types) becomes a tool
observation the model sees, never an exception. An exception raised inside a tool becomes an
observation too; one raised by other user code propagates to the episode runner, which records it
on the trajectory.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import anyio
from datasets import Dataset
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from policies.toolcalls import ParsedAssistant, ToolCall

Message = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])


class EnvConfig(BaseModel):
    """Base of every environment's config model (``[environment.args]``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    num_tasks: int = 64
    """Tasks generated for a generated dataset."""
    seed: int = 0
    """Seed of the task generator."""


@dataclass
class EpisodeState:
    """What an environment knows about the episode in progress."""

    task: dict[str, Any]
    messages: list[Message]
    turn: int = 0
    final_answer: str | None = None
    tool_results: list[tuple[ToolCall, str, str | None]] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model message: new messages, and whether the episode ends."""

    messages: list[Message]
    done: bool


def tool(fn: F) -> F:
    """Mark a method as a tool the model may call."""
    fn.__sprawl_tool__ = True  # type: ignore[attr-defined]
    return fn


def reward(weight: float = 1.0) -> Callable[[F], F]:
    """Mark a method ``(self, state) -> float`` as a reward component with ``weight``."""

    def mark(fn: F) -> F:
        fn.__sprawl_reward__ = weight  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass(frozen=True)
class _Tool:
    name: str
    fn: Callable[..., Any]
    args_model: type[BaseModel]
    schema: dict[str, Any]


class Environment:
    """Subclass and override ``tasks`` and ``initial_messages``; add @tool and @reward methods."""

    Config: ClassVar[type[EnvConfig]] = EnvConfig
    name: ClassVar[str] = "environment"

    def __init__(self, config: EnvConfig) -> None:
        self.config = config
        self.tool_timeout_s = 10.0  # set by the framework from timeouts.tool_s
        self._tools = {t.name: t for t in self._collect_tools()}
        self._rewards = [
            (name, getattr(self, name), float(m.__sprawl_reward__))
            for name, m in inspect.getmembers(type(self))
            if hasattr(m, "__sprawl_reward__")
        ]

    # -- to override ----------------------------------------------------------------------------
    def tasks(self) -> Dataset:
        raise NotImplementedError(f"{type(self).__name__} must define tasks()")

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        raise NotImplementedError(f"{type(self).__name__} must define initial_messages()")

    async def respond(self, state: EpisodeState, reply: ParsedAssistant) -> Reply:
        """Default: run the model's tool calls; a message without tool calls ends the episode."""
        if not reply.tool_calls and not reply.errors:
            state.final_answer = reply.content
            return Reply(messages=[], done=True)
        out: list[Message] = [
            {"role": "tool", "content": f"error: {err.message}"} for err in reply.errors
        ]
        for call in reply.tool_calls:
            result, error = await self.call_tool(call)
            state.tool_results.append((call, result, error))
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.name,
                    "content": result if error is None else f"error: {error}",
                }
            )
        return Reply(messages=out, done=False)

    # -- framework side -------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries for every @tool method."""
        return [t.schema for t in self._tools.values()]

    async def call_tool(self, call: ToolCall) -> tuple[str, str | None]:
        """Run one call; return ``(result, error)``: bad calls give an error string, never raise."""
        spec = self._tools.get(call.name)
        if spec is None:
            return "", f"unknown tool {call.name!r}; available: {sorted(self._tools)}"
        try:
            args = spec.args_model.model_validate(json.loads(call.arguments or "{}"))
        except json.JSONDecodeError as exc:
            return "", f"arguments are not JSON: {exc.msg}"
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "arguments"
            return "", f"bad argument {where}: {first['msg']}"
        kwargs = args.model_dump()
        result: Any = None
        with anyio.move_on_after(self.tool_timeout_s) as scope:
            try:
                if inspect.iscoroutinefunction(spec.fn):
                    result = await spec.fn(**kwargs)
                else:
                    result = await anyio.to_thread.run_sync(
                        lambda: spec.fn(**kwargs), abandon_on_cancel=True
                    )
            except Exception as exc:  # a tool's bug is an observation for the model, not a crash
                return "", f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            return (
                "",
                f"tool {call.name!r} timed out after {self.tool_timeout_s}s (timeouts.tool_s)",
            )
        return str(result), None

    def score(self, state: EpisodeState) -> dict[str, float]:
        """Every reward component of a finished episode (weighted sum is the episode reward)."""
        return {name: float(fn(state)) for name, fn, _ in self._rewards}

    def total_reward(self, components: dict[str, float]) -> float:
        return sum(components[name] * w for name, _, w in self._rewards if name in components)

    def _collect_tools(self) -> list[_Tool]:
        tools = []
        for name, member in inspect.getmembers(type(self)):
            if not getattr(member, "__sprawl_tool__", False):
                continue
            fn = getattr(self, name)
            sig = inspect.signature(fn)
            hints = inspect.get_annotations(member, eval_str=True)
            fields: dict[str, Any] = {
                p.name: (
                    hints.get(p.name, Any),
                    ... if p.default is inspect.Parameter.empty else p.default,
                )
                for p in sig.parameters.values()
            }
            model = create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)
            params = model.model_json_schema()
            params.pop("title", None)
            doc = inspect.getdoc(member) or ""
            schema = {
                "type": "function",
                "function": {
                    "name": name,
                    "description": doc.split("\n\n")[0].strip(),
                    "parameters": params,
                },
            }
            tools.append(_Tool(name=name, fn=fn, args_model=model, schema=schema))
        return tools
