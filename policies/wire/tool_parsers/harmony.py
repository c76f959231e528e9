"""``openai`` — gpt-oss's harmony format: every message is a header, ``<|message|>``, a body and
an end token; a call is a ``commentary`` message addressed ``to=functions.NAME``.

A turn, as sampled after the generation prompt ``<|start|>assistant``, reads like::

    <|channel|>analysis<|message|>The user wants … I should search.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>
    {"query": "x"}<|call|>

(the second message is one line, broken here after ``<|message|>``). The first message's
role is implied (``assistant``); each later one opens with ``<|start|>ROLE``. A header holds the
channel after ``<|channel|>``, the recipient as ``to=RECIPIENT`` before or after the channel (both
are harmony), and optionally a content type (``json``, ``<|constrain|>json``). A body ends at
``<|end|>``, ``<|call|>`` or ``<|return|>``, or where the text does. Messages read as:

- addressed ``to=functions.NAME``: a call of ``NAME``, its body the JSON arguments object;
- ``analysis`` channel: reasoning (this dialect's reasoning is a channel, not ``</think>``);
- ``final`` or ``commentary`` without a recipient (a preamble), or no channel: content;
- any other recipient (``browser.search``, ``python``: built-in tools sprawl does not run), a
  message from another role than ``assistant`` (the model writing a tool's answer), a header cut
  off before ``<|message|>`` that names a recipient, and arguments that are not a JSON object:
  malformed calls.

Text outside any header (a model that ignores the format) is content. Every marker is searched
for with a :class:`~policies.wire.toolcalls.Finder`: linear in the turn. The prefill opens a
commentary message to ``functions.`` (and names the function, up to ``<|message|>``, when
``tool_choice`` names one).
"""

from __future__ import annotations

import json

from policies.wire.tool_parsers.turn import Turn, begin_turn
from policies.wire.tool_parsers.types import Tools
from policies.wire.toolcalls import MAX_TURN_CHARS, Finder, ParsedAssistant, call_fields

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."


def _header(header: str, implied_role: str) -> tuple[str, str | None, str | None]:
    """``(role, channel, recipient)`` of a message header; ``implied_role`` is the first
    message's (opened by the generation prompt), "" for a message opened by ``<|start|>ROLE``."""
    before, has_channel, after = header.replace(CONSTRAIN, " ").partition(CHANNEL)
    words = before.split()
    role = implied_role or (words[0] if words and not words[0].startswith("to=") else "")
    channel_words = after.split()
    channel = channel_words[0] if has_channel and channel_words else None
    recipient = next((w[3:] for w in (*words, *channel_words) if w.startswith("to=")), None)
    return role, channel, recipient


def _content(piece: str, turn: Turn) -> None:
    """``piece`` as content, or as a malformed message when it holds harmony's control text
    out of place (an ``<|end|>`` with no message, a second ``<|message|>``)."""
    if any(marker in piece for marker in HarmonyParser.markers):
        turn.error(piece, "harmony control text outside a message header")
    else:
        turn.text(piece)


def _arguments(body: str) -> object:
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call is not valid JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise ValueError("tool call is not valid JSON: nested too deeply") from None


class HarmonyParser:
    """gpt-oss: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}``."""

    name = "openai"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)

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
        find = Finder(text)
        reasoning: list[str] = []
        pos, role = 0, "assistant"  # the generation prompt opened the first message
        while pos <= len(text):
            nxt = find(START, pos)
            stop = len(text) if nxt == -1 else nxt
            self._message(find, pos, stop, role, turn, reasoning)
            if nxt == -1:
                break
            pos, role = nxt + len(START), ""
        return turn.done("\n".join(r.strip() for r in reasoning if r.strip()))

    def _message(
        self, find: Finder, pos: int, stop: int, role: str, turn: Turn, reasoning: list[str]
    ) -> None:
        """Read the message in ``find.text[pos:stop]`` into ``turn`` (or ``reasoning``); ``role``
        is "" when the message opened with ``<|start|>`` (its header then names it)."""
        text = find.text
        body_at = find(MESSAGE, pos)
        headless = body_at == -1 or body_at >= stop
        start = pos if headless else body_at + len(MESSAGE)
        ends = [at for end in ENDS if (at := find(end, start)) != -1 and at < stop]
        body_end = min(ends, default=stop)
        if headless:
            self._headless(text[pos:body_end], opened=not role, turn=turn)
        else:
            role, channel, recipient = _header(text[pos:body_at], role)
            body = text[start:body_end]
            raw = text[pos:stop]
            if role != "assistant":
                turn.error(raw, f"a message from {role!r} inside an assistant turn")
            elif recipient is not None:
                self._call(raw, recipient, body, turn)
            elif channel == "analysis":
                reasoning.append(body)
            else:  # final, commentary without a recipient (a preamble), or no channel
                _content(body, turn)
        after = text[body_end:stop]
        _content(after[next((len(e) for e in ENDS if after.startswith(e)), 0) :], turn)

    def _headless(self, piece: str, *, opened: bool, turn: Turn) -> None:
        """A piece without ``<|message|>``: plain text before any header is content; a header
        cut off is malformed when it names a channel or a recipient (a bare role is nothing)."""
        _, channel, recipient = _header(piece, "" if opened else "assistant")
        if recipient is not None or channel is not None or (opened and len(piece.split()) > 1):
            turn.error(piece, "a message is cut off before <|message|>")
        elif not opened:
            _content(piece, turn)

    def _call(self, raw: str, recipient: str, body: str, turn: Turn) -> None:
        name = recipient.removeprefix(FUNCTIONS)
        if not recipient.startswith(FUNCTIONS) or not name:
            turn.error(raw, f"recipient {recipient!r} is not a function (to=functions.NAME)")
            return
        try:
            arguments = _arguments(body.strip())
        except ValueError as exc:
            turn.error(raw, str(exc))
            return
        if not isinstance(arguments, dict):
            turn.error(raw, f"arguments must be a JSON object, got {type(arguments).__name__}")
            return
        turn.call(raw, call_fields({"name": name, "arguments": arguments}))

    def prefill(self, function: str | None = None) -> str:
        if function is None:
            return f"{CHANNEL}commentary to={FUNCTIONS}"
        return f"{CHANNEL}commentary to={FUNCTIONS}{function} {CONSTRAIN}json{MESSAGE}"
