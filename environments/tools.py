"""Tools: typed Python methods exposed to the model, their JSON schemas, and running one call.

A tool is a method marked with :func:`tool`. Its schema is derived, never written by hand:

- parameters come from the type hints through a pydantic model, so anything pydantic can
  validate works (``int``, ``list[str]``, ``Literal[...]``, ``Annotated[int, Field(ge=0)]``,
  nested pydantic models); a parameter with a default is optional;
- a tool whose only parameter is a pydantic model takes that model's fields as its arguments and
  is called with a validated instance;
- the docstring's first paragraph is the tool's description; an ``Args:`` section
  (``name: text`` lines) gives the parameters' descriptions.

Guarantees of :func:`run_tool`: it never raises for anything the model wrote or the tool did.
Arguments that are not JSON or fail validation give a ``bad_call`` outcome naming the argument;
an exception raised by the tool gives a ``tool_error`` outcome with the exception's type and
message (and a ``env.tool_raised`` warning); a tool still running after ``timeout_s`` gives a
``timeout`` outcome. Results are converted to text (JSON for models, dicts and lists) and cut to
``max_chars``.

Not covered: a *synchronous* tool that overruns its timeout keeps running in its worker thread
until it returns (Python threads cannot be killed); run untrusted or unbounded work in the
sandbox (``sandbox.SandboxPool``), which enforces its own limits.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from environments.errors import EnvDefinitionError

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
OutcomeKind = Literal["ok", "bad_call", "tool_error", "timeout"]
_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def tool(fn: F) -> F:
    """Mark a method as a tool the model may call."""
    fn.__sprawl_tool__ = True  # type: ignore[attr-defined]
    return fn


def is_tool(member: object) -> bool:
    return bool(getattr(member, "__sprawl_tool__", False))


@dataclass(frozen=True)
class ToolOutcome:
    """What one call produced: the text the model sees, or an error and its kind."""

    result: str
    error: str | None
    kind: OutcomeKind


@dataclass(frozen=True)
class ToolSpec:
    """A tool ready to call: its bound function, argument model and OpenAI schema."""

    name: str
    fn: Callable[..., Any]
    args_model: type[BaseModel]
    schema: dict[str, Any]
    unpack: bool
    """Call ``fn(**fields)``; otherwise ``fn(model_instance)`` (single-model tools)."""


def build_tool(name: str, fn: Callable[..., Any]) -> ToolSpec:
    """The spec of bound method ``fn``; a signature that cannot be a tool raises."""
    sig = inspect.signature(fn)
    try:
        hints = inspect.get_annotations(getattr(fn, "__func__", fn), eval_str=True)
    except NameError as exc:  # a hint naming something the tool's module cannot see
        raise EnvDefinitionError(f"tool {name!r}: cannot resolve its type hints: {exc}") from exc
    params = list(sig.parameters.values())
    doc = inspect.getdoc(fn) or ""
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise EnvDefinitionError(f"tool {name!r}: parameter {p.name!r} must be a named one")
        if p.name not in hints:
            raise EnvDefinitionError(f"tool {name!r}: parameter {p.name!r} needs a type hint")
    single = hints.get(params[0].name) if len(params) == 1 else None
    model: type[BaseModel]
    if isinstance(single, type) and issubclass(single, BaseModel):
        model, unpack = single, False
    else:
        described = param_docs(doc)
        fields: dict[str, Any] = {
            p.name: (
                hints[p.name],
                Field(
                    default=... if p.default is p.empty else p.default,
                    description=described.get(p.name),
                ),
            )
            for p in params
        }
        model = create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)
        unpack = True
    parameters = strip_titles(model.model_json_schema())
    description = doc.split("\n\n")[0].strip()
    schema = {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
    return ToolSpec(name=name, fn=fn, args_model=model, schema=schema, unpack=unpack)


def param_docs(doc: str) -> dict[str, str]:
    """``{parameter: description}`` from a Google-style ``Args:`` section of ``doc``."""
    out: dict[str, str] = {}
    inside, base, current = False, -1, ""
    for line in doc.splitlines():
        stripped = line.strip()
        if _ARGS_HEADER.match(stripped):
            inside, base, current = True, -1, ""
            continue
        if not inside or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            inside = False
            continue
        base = indent if base < 0 else base
        m = _ARG_LINE.match(line)
        if indent == base and m:
            current = m.group(1).lstrip("*")
            out[current] = m.group(2).strip()
        elif current and indent > base:
            out[current] = f"{out[current]} {stripped}".strip()
    return out


def strip_titles(schema: Any) -> Any:
    """``schema`` without pydantic's generated ``title`` keys (shorter prompts, same meaning)."""
    if isinstance(schema, list):
        return [strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs") and isinstance(value, dict):
            out[key] = {name: strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = strip_titles(value)
    return out


def to_text(value: Any) -> str:
    """How a tool's return value is shown to the model."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, dict | list | tuple | int | float | bool) or value is None:
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters cut]"


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "arguments"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"bad argument {where}: {first['msg']}{more}"


async def run_tool(
    spec: ToolSpec, arguments: str, *, timeout_s: float, max_chars: int
) -> ToolOutcome:
    """Validate ``arguments`` (a JSON object) and run the tool; never raises (module docstring)."""
    try:
        args = spec.args_model.model_validate(json.loads(arguments or "{}"))
    except json.JSONDecodeError as exc:
        return ToolOutcome("", f"arguments are not JSON: {exc.msg}", "bad_call")
    except ValidationError as exc:
        return ToolOutcome("", _validation_message(exc), "bad_call")
    if spec.unpack:
        kwargs = {name: getattr(args, name) for name in type(args).model_fields}

        def call() -> Any:
            return spec.fn(**kwargs)
    else:

        def call() -> Any:
            return spec.fn(args)

    result: Any = None
    with anyio.move_on_after(timeout_s) as scope:
        try:
            if inspect.iscoroutinefunction(spec.fn):
                result = await call()
            else:
                result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as exc:  # a tool's bug is an observation for the model, not a crash
            log.warning("env.tool_raised", tool=spec.name, type=type(exc).__name__, error=str(exc))
            return ToolOutcome("", f"{type(exc).__name__}: {exc}", "tool_error")
    if scope.cancelled_caught:
        message = f"tool {spec.name!r} timed out after {timeout_s}s (timeouts.tool_s)"
        return ToolOutcome("", message, "timeout")
    return ToolOutcome(clip(to_text(result), max_chars), None, "ok")
