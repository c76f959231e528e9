"""``mistral`` — ``[TOOL_CALLS]`` then a JSON list of ``{"name": …, "arguments": {…}}``, or the
newer ``[TOOL_CALLS]name[ARGS]{…}`` form, repeated per call.

``[TOOL_CALLS]`` may also be followed by a single JSON object, and the newer form may carry
``[CALL_ID]id`` before ``[ARGS]`` or lack ``[ARGS]`` (``name{…}``, as decoded with special tokens
skipped). Text after a call, up to the next ``[TOOL_CALLS]``, is content; a call that cannot be
read takes that text as its raw text; a bad item of a good JSON list has the item re-encoded. The
prefill uses the JSON-list form.

Ids are 9 alphanumeric characters (``call_id(..., "alphanumeric")`` of the episode's seed), for
calls and malformed calls alike: Mistral's templates refuse any other id in an assistant's
``tool_calls`` and in a tool message's ``tool_call_id``. An id the model writes after
``[CALL_ID]`` is not used (the model's ids are not unique across turns).
"""

from __future__ import annotations

import json
import re

from policies.wire.tool_parsers.turn import Turn, Undecodable, begin_turn, decode_at, skip_ws
from policies.wire.tool_parsers.types import Tools
from policies.wire.toolcalls import MAX_TURN_CHARS, ParsedAssistant, call_fields, split_reasoning

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser:
    """``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` or ``[TOOL_CALLS]name[ARGS]{…}``."""

    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse(
        self,
        text: str,
        *,
        first_id: int = 0,
        tools: Tools | None = None,
        id_seed: str = "",
        max_chars: int = MAX_TURN_CHARS,
    ) -> ParsedAssistant:
        text, turn = begin_turn(text, max_chars, first_id, "alphanumeric", id_seed)
        reasoning, rest = split_reasoning(text)
        head, *regions = rest.split(TOOL_CALLS)
        turn.text(head)
        for region in regions:
            turn.text(self._region(region, turn))
        return turn.done(reasoning)

    def _region(self, region: str, turn: Turn) -> str:
        """Read the call(s) after one ``[TOOL_CALLS]``; return the text left as content."""
        raw = TOOL_CALLS + region
        pos = skip_ws(region, 0)
        if pos == len(region):
            turn.error(raw, f"{TOOL_CALLS} is not followed by a tool call")
            return ""
        if region[pos] in "[{":
            decoded = decode_at(region, pos)
            if isinstance(decoded, Undecodable):
                turn.error(raw, decoded.message)
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
        decoded = decode_at(region, skip_ws(region, pos))
        if isinstance(decoded, Undecodable):
            turn.error(raw, f"arguments of {name.group()!r}: {decoded.message}")
            return ""
        arguments, end = decoded
        call = {"name": name.group(), "arguments": arguments}
        turn.call(TOOL_CALLS + region[:end], call_fields(call))
        return region[end:]

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return TOOL_CALLS
        return f'{TOOL_CALLS}[{{"name": {json.dumps(function)}, "arguments": '
