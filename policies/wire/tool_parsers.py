"""Tool-call parsers per model family: each family's call syntax, read into one shape.

A model writes calls in the dialect its chat template taught it. Each parser here reads one
dialect into :class:`~policies.wire.toolcalls.ParsedAssistant`; :data:`TOOL_PARSERS` holds them
under the names vLLM's ``--tool-call-parser`` uses:

- ``hermes`` — Qwen2.5 / Qwen3 / Hermes: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
  (:func:`policies.wire.toolcalls.parse_assistant`, sprawl's own models' syntax);
- ``llama3_json`` — Llama 3.1 / 3.2: optionally ``<|python_tag|>``, then one or more JSON
  objects ``{"name": …, "parameters": {…}}`` (``"arguments"`` also accepted) separated by ``;``;
- ``mistral`` — ``[TOOL_CALLS]`` then a JSON list of ``{"name": …, "arguments": {…}}``, or the
  newer ``[TOOL_CALLS]name[ARGS]{…}`` form, repeated per call;
- ``qwen3_coder`` — Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>
  …</function></tool_call>``.

Guarantees (every parser): it never raises on model text; a malformed call becomes a
:class:`~policies.wire.toolcalls.ToolCallError` with the raw text and a message naming what was
wrong; reasoning is split off first (:func:`~policies.wire.toolcalls.split_reasoning`) and calls
are parsed only from the rest; ``content`` is the text outside calls, pieces stripped and joined
by a newline; ids are ``call_{first_id + k}`` over well-formed calls; arguments are canonical JSON
(``json.dumps(..., ensure_ascii=False)``). :meth:`ToolParser.prefill` gives the start of a call,
which an engine prefills to enforce ``tool_choice`` ``"required"`` or a named function.

Dialect specifics:

- ``llama3_json``: text after ``<|python_tag|>`` must start with a call. Without the tag, a JSON
  object is a call only when it has ``"name"`` and ``"parameters"`` or ``"arguments"``; any other
  text (JSON or not) is content, except a ``{"name":`` that does not decode, which is an error.
  A malformed element runs to the next ``;{`` (or the end), so later calls are still read.
- ``mistral``: ``[TOOL_CALLS]`` may also be followed by a single JSON object, and the newer form
  may carry ``[CALL_ID]id`` before ``[ARGS]`` or lack ``[ARGS]`` (``name{…}``, as decoded with
  special tokens skipped). Text after a call, up to the next ``[TOOL_CALLS]``, is content; a call
  that cannot be read takes that text as its raw text; a bad item of a good JSON list has the
  item re-encoded. The prefill uses the JSON-list form.
- ``qwen3_coder``: a ``<function=…>`` outside ``<tool_call>`` is a call too (the model sometimes
  omits the wrapper); one block may hold several functions. One newline after ``>`` and one
  before ``</parameter>`` are dropped; values are then typed by the tool's JSON schema when
  ``tools`` is given: ``string`` kept as text, ``boolean`` from ``true``/``false`` in any case,
  other types (and parameters without a schema) decoded as JSON, kept as text when that fails.
  Values cannot contain ``</parameter>``.

:func:`detect_tool_parser` names the parser for a chat template; a template it does not
recognise (or none) gets ``hermes``, sprawl's own dialect and the most common one.

Not covered: streaming (parsers read whole turns), Llama's built-in ``<|python_tag|>`` Python
calls (``brave_search.call(…)``: reported as malformed), and dialects not listed here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol

from policies.wire.errors import SprawlError
from policies.wire.toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedAssistant,
    ToolCall,
    ToolCallError,
    call_fields,
    parse_assistant,
    split_reasoning,
)

Tools = list[dict[str, Any]]
"""OpenAI tool specs as a request carries them: ``{"type": "function", "function": {…}}``."""

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

_DECODER = json.JSONDecoder()
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_NEXT_CALL = re.compile(r";\s*\{")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class ToolParser(Protocol):
    """One dialect: its vLLM name, the strings that introduce its calls, and its parse.

    ``markers`` are what a decoder must keep: some are special tokens in their families'
    tokenizers (``[TOOL_CALLS]``, ``<|python_tag|>``) that a decode skipping special tokens drops.
    """

    @property
    def name(self) -> str: ...

    @property
    def markers(self) -> tuple[str, ...]: ...

    def parse(self, text: str, *, first_id: int = 0, tools: Tools | None = None) -> ParsedAssistant:
        """Split an assistant turn into reasoning, content, calls and malformed calls."""
        ...

    def prefill(self, function: str | None = None) -> str:
        """The start of a call (of ``function``, when named) in this dialect."""
        ...


class _Turn:
    """Collects one turn's pieces in text order and builds the :class:`ParsedAssistant`."""

    def __init__(self, first_id: int) -> None:
        self.first_id = first_id
        self.pieces: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []

    def text(self, piece: str) -> None:
        self.pieces.append(piece)

    def error(self, raw: str, message: str) -> None:
        self.errors.append(ToolCallError(raw, message))

    def call(self, raw: str, decoded: tuple[str, str] | str) -> None:
        if isinstance(decoded, str):
            self.error(raw, decoded)
        else:
            name, arguments = decoded
            self.calls.append(ToolCall(f"call_{self.first_id + len(self.calls)}", name, arguments))

    def done(self, reasoning: str) -> ParsedAssistant:
        content = "\n".join(p.strip() for p in self.pieces if p.strip())
        return ParsedAssistant(content, tuple(self.calls), tuple(self.errors), reasoning)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode_at(text: str, pos: int) -> tuple[object, int] | str:
    """The JSON value starting at ``pos`` and where it ends, or why there is none."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON: {exc.msg} at character {exc.pos - pos}"
    except RecursionError:  # the decoder recurses per nesting level; models do loop on "[["
        return "tool call is not valid JSON: nested too deeply"
    return obj, end


class HermesParser:
    """``<tool_call>{json}</tool_call>``: :func:`~policies.wire.toolcalls.parse_assistant`."""

    name = "hermes"
    markers = (TOOL_CALL_OPEN,)

    def parse(self, text: str, *, first_id: int = 0, tools: Tools | None = None) -> ParsedAssistant:
        return parse_assistant(text, first_id=first_id)

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return f"{TOOL_CALL_OPEN}\n"
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(function)}, "arguments": '


def _llama_fields(obj: object) -> tuple[str, str] | str:
    if isinstance(obj, dict) and "parameters" in obj and "arguments" in obj:
        return 'tool call has both "parameters" and "arguments"'
    key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
    return call_fields(obj, key)


def _is_llama_call(obj: object) -> bool:
    return isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)


class Llama3JsonParser:
    """Llama 3.1 / 3.2 JSON calls: ``[<|python_tag|>]{"name": …, "parameters": {…}}; …``."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def parse(self, text: str, *, first_id: int = 0, tools: Tools | None = None) -> ParsedAssistant:
        reasoning, rest = split_reasoning(text)
        turn = _Turn(first_id)
        head, *tagged = rest.split(PYTHON_TAG)
        self._scan(head, 0, turn)
        for segment in tagged:
            start = _skip_ws(segment, 0)
            if start == len(segment):
                turn.error(PYTHON_TAG + segment, f"{PYTHON_TAG} is not followed by a tool call")
                continue
            self._scan(segment, self._chain(segment, start, turn, PYTHON_TAG), turn)
        return turn.done(reasoning)

    def _scan(self, segment: str, pos: int, turn: _Turn) -> None:
        """Content from ``pos`` on, with the call-shaped JSON objects in it read as calls."""
        at = pos
        while (brace := segment.find("{", at)) != -1:
            decoded = _decode_at(segment, brace)
            if isinstance(decoded, str) and not _CALL_START.match(segment, brace):
                at = brace + 1
                continue
            if isinstance(decoded, tuple) and not _is_llama_call(decoded[0]):
                at = decoded[1]
                continue
            turn.text(segment[pos:brace])
            pos = at = self._chain(segment, brace, turn, "")
        turn.text(segment[pos:])

    def _chain(self, segment: str, pos: int, turn: _Turn, prefix: str) -> int:
        """Read the call at ``pos`` and any ``;``-separated calls after it; return the end."""
        while True:
            decoded = _decode_at(segment, pos)
            if isinstance(decoded, str):
                found = _NEXT_CALL.search(segment, pos)
                end = found.start() if found else len(segment)
                turn.error(prefix + segment[pos:end], decoded)
            else:
                obj, end = decoded
                turn.call(prefix + segment[pos:end], _llama_fields(obj))
            prefix = ""
            after = _skip_ws(segment, end)
            if not segment.startswith(";", after):
                return end
            pos = _skip_ws(segment, after + 1)
            if not segment.startswith("{", pos):
                return after + 1

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return '{"name": '
        return f'{{"name": {json.dumps(function)}, "parameters": '


class MistralParser:
    """``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` or ``[TOOL_CALLS]name[ARGS]{…}``."""

    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse(self, text: str, *, first_id: int = 0, tools: Tools | None = None) -> ParsedAssistant:
        reasoning, rest = split_reasoning(text)
        turn = _Turn(first_id)
        head, *regions = rest.split(TOOL_CALLS)
        turn.text(head)
        for region in regions:
            turn.text(self._region(region, turn))
        return turn.done(reasoning)

    def _region(self, region: str, turn: _Turn) -> str:
        """Read the call(s) after one ``[TOOL_CALLS]``; return the text left as content."""
        raw = TOOL_CALLS + region
        pos = _skip_ws(region, 0)
        if pos == len(region):
            turn.error(raw, f"{TOOL_CALLS} is not followed by a tool call")
            return ""
        if region[pos] in "[{":
            decoded = _decode_at(region, pos)
            if isinstance(decoded, str):
                turn.error(raw, decoded)
                return ""
            obj, end = decoded
            if not isinstance(obj, list):
                turn.call(TOOL_CALLS + region[:end], call_fields(obj))
            elif not obj:
                turn.error(TOOL_CALLS + region[:end], f"{TOOL_CALLS} list is empty")
            else:
                for item in obj:
                    turn.call(json.dumps(item, ensure_ascii=False), call_fields(item))
            return region[end:]
        name = _NAME.match(region, pos)
        if name is None:
            turn.error(raw, f"{TOOL_CALLS} is not followed by a JSON list or a function name")
            return ""
        pos = name.end()
        if region.startswith(CALL_ID, pos):
            pos = region.find(ARGS, pos)
            if pos == -1:
                turn.error(raw, f"{CALL_ID} is not followed by {ARGS}")
                return ""
        if region.startswith(ARGS, pos):
            pos += len(ARGS)
        decoded = _decode_at(region, _skip_ws(region, pos))
        if isinstance(decoded, str):
            turn.error(raw, f"arguments of {name.group()!r}: {decoded}")
            return ""
        arguments, end = decoded
        call = {"name": name.group(), "arguments": arguments}
        turn.call(TOOL_CALLS + region[:end], call_fields(call))
        return region[end:]

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return TOOL_CALLS
        return f'{TOOL_CALLS}[{{"name": {json.dumps(function)}, "arguments": '


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
    pos = gt + 1
    while True:
        start = inner.find(PARAMETER_OPEN, pos)
        stray = inner[pos : len(inner) if start == -1 else start].strip()
        if stray:
            return f"text outside <parameter=…> in <function={name}>: {stray[:40]!r}"
        if start == -1:
            return name, json.dumps(params, ensure_ascii=False)
        head = start + len(PARAMETER_OPEN)
        gt = inner.find(">", head)
        close = inner.find(PARAMETER_CLOSE, head)
        reopen = inner.find(PARAMETER_OPEN, head)
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


def _span(text: str, at: int, open_: str, close: str) -> tuple[int, int | None]:
    """``(end, close_at)`` of the ``open_`` … ``close`` block at ``at``; ``close_at`` is None
    when it is never closed (a reopening counts as never closed) and ``end`` is then where the
    unclosed block stops."""
    close_at = text.find(close, at + len(open_))
    reopen = text.find(open_, at + len(open_))
    if close_at == -1 or (reopen != -1 and reopen < close_at):
        return (len(text) if reopen == -1 else reopen), None
    return close_at + len(close), close_at


class Qwen3CoderParser:
    """Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=P>V</parameter></function>``."""

    name = "qwen3_coder"
    markers = (TOOL_CALL_OPEN, FUNCTION_OPEN)

    def parse(self, text: str, *, first_id: int = 0, tools: Tools | None = None) -> ParsedAssistant:
        reasoning, rest = split_reasoning(text)
        turn = _Turn(first_id)
        pos = 0
        while True:
            found = [
                (at, tag)
                for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, FUNCTION_OPEN)
                if (at := rest.find(tag, pos)) != -1
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
                pos = self._block(rest, at, turn, tools)
            else:
                pos, close = _span(rest, at, FUNCTION_OPEN, FUNCTION_CLOSE)
                if close is None:
                    turn.error(rest[at:pos], f"{FUNCTION_OPEN}…> is never closed")
                else:
                    turn.call(rest[at:pos], _xml_function(rest[at + len(tag) : close], tools))

    def _block(self, text: str, at: int, turn: _Turn, tools: Tools | None) -> int:
        """Read the ``<tool_call>`` block at ``at``; return where it ends."""
        end, close = _span(text, at, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        raw = text[at:end]
        if close is None:
            turn.error(raw, f"{TOOL_CALL_OPEN} block is never closed")
            return end
        body = text[at + len(TOOL_CALL_OPEN) : close]
        if FUNCTION_OPEN not in body:
            turn.error(raw, f"{TOOL_CALL_OPEN} block has no {FUNCTION_OPEN}NAME>")
            return end
        pos = 0
        while True:
            start = body.find(FUNCTION_OPEN, pos)
            stray = body[pos : len(body) if start == -1 else start].strip()
            if stray:
                turn.error(raw, f"text outside {FUNCTION_OPEN}…> in a block: {stray[:40]!r}")
            if start == -1:
                return end
            pos, fclose = _span(body, start, FUNCTION_OPEN, FUNCTION_CLOSE)
            if fclose is None:
                turn.error(raw, f"{FUNCTION_OPEN}…> is never closed")
            else:
                turn.call(raw, _xml_function(body[start + len(FUNCTION_OPEN) : fclose], tools))

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}"
        return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{function}>\n"


TOOL_PARSERS: Mapping[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), Qwen3CoderParser())
}
"""Every parser by its vLLM ``--tool-call-parser`` name."""


def tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; an unknown name raises :class:`SprawlError` naming the
    valid ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        valid = ", ".join(TOOL_PARSERS)
        raise SprawlError(f"unknown tool-call parser {name!r}; valid parsers: {valid}") from None


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser name for a chat template, from the call syntax its text shows.

    Checked in order: ``<function=`` → ``qwen3_coder`` (before ``hermes``: both write
    ``<tool_call>``), ``[TOOL_CALLS]`` → ``mistral``, ``<|python_tag|>`` or an ``ipython`` role
    with ``"parameters"`` → ``llama3_json``, ``<tool_call>`` → ``hermes``. Anything else, and no
    template, → ``hermes`` (the default: sprawl's own dialect, and Qwen's).
    """
    template = chat_template or ""
    if FUNCTION_OPEN in template:
        return "qwen3_coder"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"
