"""Vocabulary of the tool-call parsers: the tool specs a request carries, and what a parser is.

No I/O and no parsing here: every parser module depends on this, and this depends only on
:mod:`policies.wire.toolcalls` (the :class:`~policies.wire.toolcalls.ParsedAssistant` every
parser produces).
"""

from __future__ import annotations

from typing import Any, Protocol

from policies.wire.toolcalls import MAX_TURN_CHARS, ParsedAssistant

Tools = list[dict[str, Any]]
"""OpenAI tool specs as a request carries them: ``{"type": "function", "function": {…}}``."""


class ToolParser(Protocol):
    """One dialect: its vLLM name, the strings that introduce its calls, and its parse.

    ``markers`` are what a decoder must keep: some are special tokens in their families'
    tokenizers (``[TOOL_CALLS]``, ``<|python_tag|>``) that a decode skipping special tokens drops.
    """

    @property
    def name(self) -> str: ...

    @property
    def markers(self) -> tuple[str, ...]: ...

    def parse(
        self,
        text: str,
        *,
        first_id: int = 0,
        tools: Tools | None = None,
        id_seed: str = "",
        max_chars: int = MAX_TURN_CHARS,
    ) -> ParsedAssistant:
        """Split an assistant turn into reasoning, content, calls and malformed calls.

        ``first_id``: the index of the first call (ids count on from it); ``id_seed``: what makes
        alphanumeric ids differ between episodes and turns; ``max_chars``: the most characters
        read, in time linear in them (the rest is one malformed call)."""
        ...

    def prefill(self, function: str | None = None) -> str:
        """The start of a call (of ``function``, when named) in this dialect."""
        ...
