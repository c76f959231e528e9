"""What every parser shares: the turn it assembles, and JSON read at a position in model text.

:class:`Turn` collects one turn's pieces in text order and builds the
:class:`~policies.wire.toolcalls.ParsedAssistant`, so every parser gives content, ids and
malformed calls the same shape: ``content`` is the text outside calls, pieces stripped and joined
by a newline; ids are :func:`~policies.wire.toolcalls.call_id` of ``first_id + k`` over
well-formed calls, in the dialect's style (and, for the alphanumeric style, malformed calls get
ids too, which the tool messages answering them carry). :func:`decode_at` never raises on model
text: JSON that does not decode (or nests too deeply for the decoder) comes back as
:class:`Undecodable`, the message saying why and where the decoder stopped, so a scan resumes
after the text the decoder already read instead of reading it again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from policies.wire.toolcalls import (
    MAX_TURN_ERRORS,
    IdStyle,
    ParsedAssistant,
    ToolCall,
    ToolCallError,
    bounded,
    call_id,
    capped,
)

_DECODER = json.JSONDecoder()
_WINDOW = 64  # characters of text a decode first looks at (doubled as needed)
_MARGIN = 8  # a failure this close to a window's end may be the window's doing (``tr|ue``)
_JSON_SYNTAX = re.compile(r'["\[\]{}]')
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)


class Turn:
    """Collects one turn's pieces in text order and builds the :class:`ParsedAssistant`.

    ``ids``/``seed``: the id style and the seed of alphanumeric ids (the episode and turn);
    ``over``: the error for text past the parser's bound (:func:`begin_turn`)."""

    def __init__(
        self,
        first_id: int,
        ids: IdStyle = "call",
        seed: str = "",
        over: ToolCallError | None = None,
    ) -> None:
        self.first_id = first_id
        self.ids = ids
        self.seed = seed
        self.over = over
        self.pieces: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []
        self.dropped = 0  # malformed calls past MAX_TURN_ERRORS

    def text(self, piece: str) -> None:
        self.pieces.append(piece)

    def error(self, raw: str, message: str) -> None:
        if len(self.errors) >= MAX_TURN_ERRORS:
            self.dropped += 1
            return
        self.errors.append(ToolCallError(raw, message, self._error_id(len(self.errors))))

    def _error_id(self, k: int) -> str:
        """The id of malformed call ``k``: only alphanumeric ids are given to malformed calls,
        in their own index space (the seed marks them)."""
        if self.ids != "alphanumeric":
            return ""
        return call_id(self.ids, self.first_id + k, f"{self.seed}\x00bad")

    def call(self, raw: str, decoded: tuple[str, str] | str) -> None:
        if isinstance(decoded, str):
            self.error(raw, decoded)
        else:
            name, arguments = decoded
            ident = call_id(self.ids, self.first_id + len(self.calls), self.seed)
            self.calls.append(ToolCall(ident, name, arguments))

    def done(self, reasoning: str) -> ParsedAssistant:
        content = "\n".join(p.strip() for p in self.pieces if p.strip())
        errors = capped(self.errors, self.dropped, self.over, self._error_id)
        return ParsedAssistant(content, tuple(self.calls), errors, reasoning)


def begin_turn(
    text: str, max_chars: int, first_id: int, ids: IdStyle = "call", seed: str = ""
) -> tuple[str, Turn]:
    """The part of ``text`` a parser reads (its first ``max_chars`` characters) and the turn it
    fills, which records the rest as an error."""
    text, over = bounded(text, max_chars)
    return text, Turn(first_id, ids, seed, over)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@dataclass(frozen=True)
class Undecodable:
    """Why no JSON value starts at a position, and where the decoder stopped reading."""

    message: str
    stop: int


def decode_at(text: str, pos: int) -> tuple[object, int] | Undecodable:
    """The JSON value starting at ``pos`` and where it ends, or why there is none.

    Decoded from a window of ``text`` that doubles until the answer cannot depend on what lies
    past it: the decoder's error message counts the lines before the error from the start of the
    string it was given, which over the whole text makes every failure cost the length of the
    text before it (quadratic in a turn of ``{"`` repeated)."""
    width = _WINDOW
    while True:
        window = text[pos : pos + width]
        cut = pos + width < len(text)  # the window ends before the text does
        try:
            obj, end = _DECODER.raw_decode(window)
        except json.JSONDecodeError as exc:
            unterminated = exc.msg.startswith("Unterminated string")
            if cut and (unterminated or exc.pos >= width - _MARGIN):
                width *= 2
                continue
            message = f"tool call is not valid JSON: {exc.msg} at character {exc.pos}"
            return Undecodable(message, pos + (len(window) if unterminated else max(exc.pos, 1)))
        except RecursionError:  # the decoder recurses per nesting level; models do loop on "[["
            message = "tool call is not valid JSON: nested too deeply"
            return Undecodable(message, nesting_end(text, pos))
        if cut and end >= width - _MARGIN:
            width *= 2
            continue
        return obj, pos + end


def nesting_end(text: str, pos: int) -> int:
    """Where the brackets opened at ``pos`` are all closed again (strings skipped), or the end
    of ``text``: the extent of a value too deep for the decoder, read once."""
    depth = 0
    at = pos
    while (found := _JSON_SYNTAX.search(text, at)) is not None:
        char, at = found.group(), found.end()
        if char == '"':
            rest = _STRING_REST.match(text, at)
            if rest is None:
                return len(text)
            at = rest.end()
            continue
        depth += 1 if char in "[{" else -1
        if depth <= 0:
            return at
    return len(text)
