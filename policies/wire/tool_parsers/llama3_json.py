"""``llama3_json`` — Llama 3.1 / 3.2: optionally ``<|python_tag|>``, then one or more JSON objects
``{"name": …, "parameters": {…}}`` (``"arguments"`` also accepted) separated by ``;``.

Text after ``<|python_tag|>`` must start with a call. Without the tag, a JSON object is a call
only when it has ``"name"`` and ``"parameters"`` or ``"arguments"``; any other text (JSON or not)
is content, except a ``{"name":`` that does not decode, which is an error. A malformed element
runs to the next ``;{`` after where the decoder gave up (or the end), so later calls are still
read. Linear: text that does not decode is content up to where the decoder gave up, and the scan
goes on from there (a call nested inside JSON that does not decode is not read).

Not covered: Llama's built-in ``<|python_tag|>`` Python calls (``brave_search.call(…)``:
reported as malformed).
"""

from __future__ import annotations

import json
import re

from policies.wire.tool_parsers.turn import Turn, Undecodable, begin_turn, decode_at, skip_ws
from policies.wire.tool_parsers.types import Tools
from policies.wire.toolcalls import MAX_TURN_CHARS, ParsedAssistant, call_fields, split_reasoning

PYTHON_TAG = "<|python_tag|>"

_CALL_START = re.compile(r'\{\s*"name"\s*:')
# where a JSON object may start ({} or {"key":); a brace that cannot start one is text, undecoded
_OBJECT_START = re.compile(r'\{(?=\s*(?:\}|"(?:[^"\\]|\\.)*"\s*:))')
_NEXT_CALL = re.compile(r";\s*\{")


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
        head, *tagged = rest.split(PYTHON_TAG)
        self._scan(head, 0, turn)
        for segment in tagged:
            start = skip_ws(segment, 0)
            if start == len(segment):
                turn.error(PYTHON_TAG + segment, f"{PYTHON_TAG} is not followed by a tool call")
                continue
            self._scan(segment, self._chain(segment, start, turn, PYTHON_TAG), turn)
        return turn.done(reasoning)

    def _scan(self, segment: str, pos: int, turn: Turn) -> None:
        """Content from ``pos`` on, with the call-shaped JSON objects in it read as calls."""
        at = pos
        while (found := _OBJECT_START.search(segment, at)) is not None:
            brace = found.start()
            decoded = decode_at(segment, brace)
            if isinstance(decoded, Undecodable) and not _CALL_START.match(segment, brace):
                at = decoded.stop  # what the decoder read is content: not read again
                continue
            if isinstance(decoded, tuple) and not _is_llama_call(decoded[0]):
                at = decoded[1]
                continue
            turn.text(segment[pos:brace])
            pos = at = self._chain(segment, brace, turn, "")
        turn.text(segment[pos:])

    def _chain(self, segment: str, pos: int, turn: Turn, prefix: str) -> int:
        """Read the call at ``pos`` and any ``;``-separated calls after it; return the end."""
        while True:
            decoded = decode_at(segment, pos)
            if isinstance(decoded, Undecodable):
                found = _NEXT_CALL.search(segment, decoded.stop)
                end = found.start() if found else len(segment)
                turn.error(prefix + segment[pos:end], decoded.message)
            else:
                obj, end = decoded
                turn.call(prefix + segment[pos:end], _llama_fields(obj))
            prefix = ""
            after = skip_ws(segment, end)
            if not segment.startswith(";", after):
                return end
            pos = skip_ws(segment, after + 1)
            if not segment.startswith("{", pos):
                return after + 1

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return '{"name": '
        return f'{{"name": {json.dumps(function)}, "parameters": '
