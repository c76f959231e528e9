"""``qwen3_coder`` — Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>
…</function></tool_call>``.

A ``<function=…>`` outside ``<tool_call>`` is a call too (the model sometimes omits the
wrapper); one block may hold several functions. One newline after ``>`` and one before
``</parameter>`` are dropped; values are then typed by the tool's JSON schema when ``tools`` is
given: ``string`` kept as text, ``boolean`` from ``true``/``false`` in any case, other types (and
parameters without a schema) decoded as JSON, kept as text when that fails. Values cannot contain
``</parameter>``. Every tag is searched for with a :class:`~policies.wire.toolcalls.Finder`, so a
turn is read in time linear in its length however many openers it repeats.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from policies.wire.tool_parsers.turn import Turn, begin_turn
from policies.wire.tool_parsers.types import Tools
from policies.wire.toolcalls import (
    MAX_TURN_CHARS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Finder,
    ParsedAssistant,
    split_reasoning,
)

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"


def _properties(tools: Tools | None, function: str) -> Mapping[str, Any] | None:
    """The JSON-schema ``properties`` of ``function`` among ``tools``; None if not described."""
    for tool in tools or ():
        spec = tool.get("function", tool)
        if isinstance(spec, dict) and spec.get("name") == function:
            params = spec.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return None


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _json_or_text(value: str) -> object:
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError, and so is a NaN
        return value


def _typed(value: str, schema: object) -> object:
    """A parameter's text as the type its JSON schema names (see the module docstring)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    listed = kind if isinstance(kind, list) else [kind]
    kinds = {k for k in listed if isinstance(k, str)}
    if "null" in kinds and value.strip() == "null":
        return None
    if "string" in kinds:
        return value
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return _json_or_text(value.strip())


def _xml_function(inner: str, tools: Tools | None) -> tuple[str, str] | str:
    """``(name, arguments_json)`` of the text between ``<function=`` and ``</function>``."""
    gt = inner.find(">")
    name = inner[:gt].strip() if gt != -1 else ""
    if not name or any(c.isspace() or c == "<" for c in name):
        return "<function=NAME> needs a name without spaces, closed by '>'"
    properties = _properties(tools, name)
    params: dict[str, object] = {}
    find = Finder(inner)
    pos = gt + 1
    while True:
        opens = find(PARAMETER_OPEN, pos)
        stray = inner[pos : len(inner) if opens == -1 else opens].strip()
        if stray:
            return f"text outside <parameter=…> in <function={name}>: {stray[:40]!r}"
        if opens == -1:
            return name, json.dumps(params, ensure_ascii=False)
        head = opens + len(PARAMETER_OPEN)
        gt = find(">", head)
        close = find(PARAMETER_CLOSE, head)
        reopen = find(PARAMETER_OPEN, head)
        if close == -1 or (reopen != -1 and reopen < close):
            return f"a <parameter=…> of <function={name}> is never closed"
        param = inner[head:gt].strip() if gt != -1 and gt < close else ""
        if not param or "\n" in param:
            return f"a <parameter=…> of <function={name}> has no name closed by '>'"
        if param in params:
            return f"parameter {param!r} of <function={name}> is given twice"
        value = inner[gt + 1 : close].removeprefix("\n").removesuffix("\n")
        params[param] = _typed(value, properties.get(param) if properties is not None else None)
        pos = close + len(PARAMETER_CLOSE)


def _span(find: Finder, at: int, open_: str, close: str) -> tuple[int, int | None]:
    """``(end, close_at)`` of the ``open_`` … ``close`` block at ``at`` of ``find.text``;
    ``close_at`` is None when it is never closed (a reopening counts as never closed) and ``end``
    is then where the unclosed block stops."""
    close_at = find(close, at + len(open_))
    reopen = find(open_, at + len(open_))
    if close_at == -1 or (reopen != -1 and reopen < close_at):
        return (len(find.text) if reopen == -1 else reopen), None
    return close_at + len(close), close_at


class Qwen3CoderParser:
    """Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=P>V</parameter></function>``."""

    name = "qwen3_coder"
    markers = (TOOL_CALL_OPEN, FUNCTION_OPEN)

    def parse(
        self,
        text: str,
        *,
        first_id: int = 0,
        tools: Tools | None = None,
        id_seed: str = "",
        max_chars: int = MAX_TURN_CHARS,
    ) -> ParsedAssistant:
        text, turn = begin_turn(text, max_chars, first_id)
        reasoning, rest = split_reasoning(text)
        find = Finder(rest)
        pos = 0
        while True:
            found = [
                (at, tag)
                for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, FUNCTION_OPEN)
                if (at := find(tag, pos)) != -1
            ]
            if not found:
                turn.text(rest[pos:])
                return turn.done(reasoning)
            at, tag = min(found)
            turn.text(rest[pos:at])
            if tag == TOOL_CALL_CLOSE:
                turn.error(TOOL_CALL_CLOSE, f"{TOOL_CALL_CLOSE} without an opening tag")
                pos = at + len(TOOL_CALL_CLOSE)
            elif tag == TOOL_CALL_OPEN:
                pos = self._block(find, at, turn, tools)
            else:
                pos, close = _span(find, at, FUNCTION_OPEN, FUNCTION_CLOSE)
                if close is None:
                    turn.error(rest[at:pos], f"{FUNCTION_OPEN}…> is never closed")
                else:
                    turn.call(rest[at:pos], _xml_function(rest[at + len(tag) : close], tools))

    def _block(self, find: Finder, at: int, turn: Turn, tools: Tools | None) -> int:
        """Read the ``<tool_call>`` block at ``at`` of ``find.text``; return where it ends."""
        text = find.text
        end, close = _span(find, at, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        raw = text[at:end]
        if close is None:
            turn.error(raw, f"{TOOL_CALL_OPEN} block is never closed")
            return end
        body = Finder(text[at + len(TOOL_CALL_OPEN) : close])
        if body(FUNCTION_OPEN, 0) == -1:
            turn.error(raw, f"{TOOL_CALL_OPEN} block has no {FUNCTION_OPEN}NAME>")
            return end
        pos = 0
        while True:
            opens = body(FUNCTION_OPEN, pos)
            stray = body.text[pos : len(body.text) if opens == -1 else opens].strip()
            if stray:
                turn.error(raw, f"text outside {FUNCTION_OPEN}…> in a block: {stray[:40]!r}")
            if opens == -1:
                return end
            pos, fclose = _span(body, opens, FUNCTION_OPEN, FUNCTION_CLOSE)
            if fclose is None:
                turn.error(raw, f"{FUNCTION_OPEN}…> is never closed")
            else:
                inner = body.text[opens + len(FUNCTION_OPEN) : fclose]
                turn.call(raw, _xml_function(inner, tools))

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}"
        return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{function}>\n"
