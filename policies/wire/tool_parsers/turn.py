"""What every parser shares: the turn it assembles, and JSON read at a position in model text.

:class:`Turn` collects one turn's pieces in text order and builds the
:class:`~policies.wire.toolcalls.ParsedAssistant`, so every parser gives content, ids and
malformed calls the same shape: ``content`` is the text outside calls, pieces stripped and joined
by a newline; ids are ``call_{first_id + k}`` over well-formed calls. :func:`decode_at` never
raises on model text: JSON that does not decode (or nests too deeply for the decoder) comes back
as the message saying why.
"""

from __future__ import annotations

import json

from policies.wire.toolcalls import ParsedAssistant, ToolCall, ToolCallError

_DECODER = json.JSONDecoder()


class Turn:
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


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def decode_at(text: str, pos: int) -> tuple[object, int] | str:
    """The JSON value starting at ``pos`` and where it ends, or why there is none."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON: {exc.msg} at character {exc.pos - pos}"
    except RecursionError:  # the decoder recurses per nesting level; models do loop on "[["
        return "tool call is not valid JSON: nested too deeply"
    return obj, end
