"""The Hermes-style tool-call syntax, and the vocabulary every tool-call dialect parses into.

sprawl's own models speak Hermes, so its syntax lives here: the chat template
(``CHAT_TEMPLATE``) that ``policies.model.tokenizer`` stores in the tokenizer renders tool schemas,
assistant ``tool_calls`` and ``tool`` results in it, and :func:`parse_assistant` reads it back.
Other model families write calls differently; :mod:`policies.wire.tool_parsers` holds one parser
per family (this one included, as ``hermes``), all producing the :class:`ParsedAssistant` defined
here, which :func:`to_openai_message` turns into an OpenAI ``message``. The engine, the episode
runner and the environment all read calls through that one shape.

The syntax (Qwen2.5 / Qwen3 / Hermes style)::

    <|im_start|>assistant
    <think>Optional reasoning.</think>
    Some optional text.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 12"}}
    </tool_call><|im_end|>

Guarantees of :func:`parse_assistant` (and of every parser in ``tool_parsers``):

- It never raises on model text. A block that is not a JSON object, lacks a string ``"name"``,
  has arguments that are not a JSON object, or never closes becomes a :class:`ToolCallError`
  whose ``message`` names what was wrong and whose ``raw`` is the offending text.
- Reasoning is split off first (:func:`split_reasoning`): when the text holds ``</think>``,
  everything before the first one (less a leading ``<think>``) is ``reasoning``, stripped, and
  calls are parsed only from the text after it. Without ``</think>`` there is no reasoning, so a
  turn cut off inside ``<think>`` is all content.
- ``content`` is the text outside tool-call blocks, each piece stripped, non-empty pieces joined
  by a newline; a stray ``</tool_call>`` is reported as an error and not kept as content.
- ``ToolCall.arguments`` is the canonical JSON string of the arguments object
  (``json.dumps(..., ensure_ascii=False)``), so parsing a rendered call gives back arguments
  equal (after ``json.loads``) to the ones rendered.
- Ids are deterministic: ``call_{first_id}``, ``call_{first_id + 1}``, … in text order, counting
  only well-formed calls. A multi-turn caller passes ``first_id`` to keep ids unique per episode.
  (:func:`call_id` also makes the 9-character alphanumeric ids Mistral's templates require.)
- It reads at most ``max_chars`` characters (:data:`MAX_TURN_CHARS` by default), in time linear in
  them: every search resumes where the last one stopped (:class:`Finder`), never from each opener
  again. Text beyond the bound is one :class:`ToolCallError` saying so (:func:`bounded`), and
  malformed calls past the :data:`MAX_TURN_ERRORS` th are one error counting them.

Leniency, on purpose: a missing ``"arguments"`` means ``{}``; arguments given as a JSON *string*
that decodes to an object (an OpenAI habit some models copy) are accepted.

Not covered: stripping chat-control tokens such as ``<|im_end|>`` (the engine decodes with
special tokens skipped; ``<tool_call>`` tokens are not special, so they survive that decode), and
reasoning not closed by ``</think>`` (other markers, or a turn cut off while thinking: that is all
content). A template that opens ``<think>`` in the prompt is fine: the turn then starts inside
the reasoning and still closes it with ``</think>``.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

Message = dict[str, Any]
"""An OpenAI-shaped chat message (``role``, ``content``, ``tool_calls``, …): the one ``Message``
of sprawl, used by environments, the episode runner and SFT."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call the functions described below. "
    "Each function's JSON schema is listed inside <tools></tools>:\n"
)
TOOLS_INSTRUCTIONS = (
    "To call a function, answer with one block per call, holding a JSON object with the "
    "function's name and its arguments:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {"<parameter>": <value>}}\n</tool_call>'
)

# Whitespace between tags is stripped by the `-` markers, so every character of the output is
# written by an expression; that keeps the rendering exact and easy to read. The template runs in
# transformers' sandboxed environment, whose `tojson` does not HTML-escape.
CHAT_TEMPLATE = (
    """
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.get('type') == 'text' -%}
                {{- part.get('text', '') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='', first=0) -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = render_content(messages[0].get('content')) -%}
    {%- set ns.first = 1 -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if ns.system -%}
        {{- ns.system + '\\n\\n' -}}
    {%- endif -%}
    {{- """
    + json.dumps(TOOLS_PREAMBLE)
    + """ + '<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\n' + """
    + json.dumps(TOOLS_INSTRUCTIONS)
    + """ + '<|im_end|>\\n' -}}
{%- elif ns.first == 1 -%}
    {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
    {%- set content = render_content(message.get('content')) -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' + content -}}
        {%- for tool_call in (message.get('tool_calls') or []) -%}
            {%- if tool_call.function is defined -%}
                {%- set call = tool_call.function -%}
            {%- else -%}
                {%- set call = tool_call -%}
            {%- endif -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- elif call.arguments is defined and call.arguments is not none -%}
                {{- call.arguments | tojson -}}
            {%- else -%}
                {{- '{}' -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""
).strip()


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call; ``arguments`` is a JSON string, as in the OpenAI API."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call, in any dialect: the raw text and what was wrong with it; ``id``: the id
    a tool message answering it carries, where the dialect's template requires one (else "")."""

    raw: str
    message: str
    id: str = ""


@dataclass(frozen=True)
class ParsedAssistant:
    """An assistant turn split into its text, its calls, its malformed calls and its reasoning."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[ToolCallError, ...]
    reasoning: str = ""


MAX_TURN_CHARS = 1 << 20
"""The most characters of one assistant turn a tool-call parser reads (``max_chars``): 1 MiB, a
quarter of a million tokens at four characters a token, far above any turn's ``max_tokens``."""

MAX_TURN_ERRORS = 64
"""The most malformed calls of one turn kept one by one; the rest are one error counting them
(each kept error becomes a tool message the environment sends back)."""

IdStyle = Literal["call", "alphanumeric"]
"""How a dialect's call ids look: ``call_{index}``, or 9 characters of ``[0-9A-Za-z]`` (what
Mistral's templates require of every id, in calls and in tool results alike)."""

_ALPHANUMERIC = string.digits + string.ascii_letters


def call_id(style: IdStyle, index: int, seed: str = "") -> str:
    """The id of call ``index`` in the ``style`` of its dialect: ``call_{index}``, or 9
    alphanumeric characters drawn from a hash of ``seed`` and ``index`` (deterministic: the same
    episode and index give the same id; two indices of one seed collide with odds of about 1 in
    10**16)."""
    if style == "call":
        return f"call_{index}"
    digest = hashlib.blake2b(f"{seed}\x00{index}".encode(), digest_size=9).digest()
    return "".join([_ALPHANUMERIC[b % 62] for b in digest])


def capped(
    errors: list[ToolCallError],
    dropped: int,
    over: ToolCallError | None,
    ident: Callable[[int], str] = lambda k: "",
) -> tuple[ToolCallError, ...]:
    """A turn's errors as kept: the first :data:`MAX_TURN_ERRORS`, one counting the ``dropped``
    ones after them, and ``over`` (:func:`bounded`); ``ident(k)``: the id of error ``k`` where
    the dialect gives errors ids."""
    kept = list(errors)
    if dropped:
        message = f"{dropped} more malformed calls after the first {MAX_TURN_ERRORS}: not kept"
        kept.append(ToolCallError("", message, ident(len(kept))))
    if over:
        kept.append(replace(over, id=ident(len(kept))))
    return tuple(kept)


def bounded(text: str, max_chars: int) -> tuple[str, ToolCallError | None]:
    """The first ``max_chars`` characters of ``text``, and the error recording the rest (None
    when there is none): text past the bound is a malformed turn, never read."""
    if len(text) <= max_chars:
        return text, None
    message = (
        f"the turn is {len(text)} characters; tool calls are read from the first {max_chars} "
        "only (MAX_TURN_CHARS)"
    )
    return text[:max_chars], ToolCallError(text[max_chars:], message)


class Finder:
    """Where each string next occurs in ``text`` at or after a position, for a scan whose
    positions only grow: a search resumes from the occurrence the last one found, so each string
    is searched for across the text once in all (searching again from every opener, as in
    ``<tool_call>`` repeated, reads the text once per opener: quadratic)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._found: dict[str, tuple[int, int]] = {}  # needle -> (searched from, found at or -1)

    def __call__(self, needle: str, pos: int) -> int:
        """``text.find(needle, pos)``."""
        start, at = self._found.get(needle, (len(self.text) + 1, -1))
        if start <= pos and (at == -1 or at >= pos):
            return at
        at = self.text.find(needle, pos)
        self._found[needle] = (pos, at)
        return at


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: the text before the first ``</think>`` (less a leading ``<think>``),
    stripped, and the text after it; ``("", text)`` when there is no ``</think>``."""
    close = text.find(THINK_CLOSE)
    if close == -1:
        return "", text
    reasoning = text[:close].strip().removeprefix(THINK_OPEN)
    return reasoning.strip(), text[close + len(THINK_CLOSE) :]


def call_fields(obj: object, arguments_key: str = "arguments") -> tuple[str, str] | str:
    """``(name, arguments_json)`` of a decoded JSON call, or a message saying what is wrong.

    ``arguments_key`` names the field holding the arguments (``"parameters"`` for Llama); it
    may be missing (``{}``) or a JSON string that decodes to an object.
    """
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if name is None:
        return 'tool call has no "name"'
    if not isinstance(name, str) or not name:
        return '"name" must be a non-empty string'
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return f'"{arguments_key}" is a string that is not JSON'
    if not isinstance(arguments, dict):
        return f'"{arguments_key}" must be a JSON object, got {type(arguments).__name__}'
    return name, json.dumps(arguments, ensure_ascii=False)


def _decode_call(body: str) -> tuple[str, str] | str:
    """``(name, arguments_json)`` for a block body, or a message saying what is wrong."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    except RecursionError:  # the decoder recurses per nesting level; models do loop on "[["
        return "tool call is not valid JSON: nested too deeply"
    return call_fields(obj)


def parse_assistant(
    text: str, *, first_id: int = 0, max_chars: int = MAX_TURN_CHARS
) -> ParsedAssistant:
    """Split generated assistant text into reasoning, content, tool calls and malformed blocks:
    the ``hermes`` parser of :mod:`policies.wire.tool_parsers`."""
    text, over = bounded(text, max_chars)
    reasoning, text = split_reasoning(text)
    find = Finder(text)
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    dropped = 0

    def error(raw: str, message: str) -> None:
        nonlocal dropped
        if len(errors) < MAX_TURN_ERRORS:
            errors.append(ToolCallError(raw, message))
        else:
            dropped += 1

    pos = 0
    while pos < len(text):
        start = find(TOOL_CALL_OPEN, pos)
        stray = find(TOOL_CALL_CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            pieces.append(text[pos:stray])
            end = stray + len(TOOL_CALL_CLOSE)
            error(TOOL_CALL_CLOSE, "</tool_call> without an opening tag")
            pos = end
            continue
        if start == -1:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        close = find(TOOL_CALL_CLOSE, body_start)
        reopen = find(TOOL_CALL_OPEN, body_start)
        if close == -1 or (reopen != -1 and reopen < close):
            stop = len(text) if reopen == -1 else reopen
            error(text[start:stop], "<tool_call> block is never closed")
            pos = stop
            continue
        end = close + len(TOOL_CALL_CLOSE)
        decoded = _decode_call(text[body_start:close].strip())
        if isinstance(decoded, str):
            error(text[start:end], decoded)
        else:
            name, arguments = decoded
            calls.append(ToolCall(call_id("call", first_id + len(calls)), name, arguments))
        pos = end
    content = "\n".join(p.strip() for p in pieces if p.strip())
    return ParsedAssistant(content, tuple(calls), capped(errors, dropped, over), reasoning)


def to_openai_message(parsed: ParsedAssistant) -> dict[str, object]:
    """The OpenAI chat ``message`` object for a parsed turn.

    ``content`` is ``None`` when the turn is only tool calls, as OpenAI returns it; the
    ``tool_calls`` key is present only when there are calls, ``reasoning_content`` (the key
    Qwen3 / DeepSeek templates and vLLM use) only when there is reasoning. Malformed blocks are
    not part of an OpenAI message; callers that care read ``parsed.errors``.
    """
    message: dict[str, object] = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not parsed.tool_calls else None,
    }
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.tool_calls
        ]
    return message
