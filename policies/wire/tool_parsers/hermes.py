"""``hermes`` — Qwen2.5 / Qwen3 / Hermes: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.

sprawl's own models' syntax, read by :func:`policies.wire.toolcalls.parse_assistant` (whose
guarantees this parser has); the prefill opens a ``<tool_call>`` block, with the named
function's ``"name"`` and ``"arguments":`` key when ``tool_choice`` names one.
"""

from __future__ import annotations

import json

from policies.wire.tool_parsers.types import Tools
from policies.wire.toolcalls import (
    MAX_TURN_CHARS,
    TOOL_CALL_OPEN,
    ParsedAssistant,
    parse_assistant,
)


class HermesParser:
    """``<tool_call>{json}</tool_call>``: :func:`~policies.wire.toolcalls.parse_assistant`."""

    name = "hermes"
    markers = (TOOL_CALL_OPEN,)

    def parse(
        self,
        text: str,
        *,
        first_id: int = 0,
        tools: Tools | None = None,
        id_seed: str = "",
        max_chars: int = MAX_TURN_CHARS,
    ) -> ParsedAssistant:
        return parse_assistant(text, first_id=first_id, max_chars=max_chars)

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return f"{TOOL_CALL_OPEN}\n"
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(function)}, "arguments": '
