"""Tool-call parsers per model family: each family's call syntax, read into one shape.

A model writes calls in the dialect its chat template taught it. Each parser here reads one
dialect into :class:`~policies.wire.toolcalls.ParsedAssistant`; :data:`TOOL_PARSERS` holds them
under the names vLLM's ``--tool-call-parser`` uses, each in the module of that name (whose
docstring gives the dialect's specifics):

- ``hermes`` — Qwen2.5 / Qwen3 / Hermes: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
  (:func:`policies.wire.toolcalls.parse_assistant`, sprawl's own models' syntax);
- ``llama3_json`` — Llama 3.1 / 3.2: optionally ``<|python_tag|>``, then one or more JSON
  objects ``{"name": …, "parameters": {…}}`` (``"arguments"`` also accepted) separated by ``;``;
- ``mistral`` — ``[TOOL_CALLS]`` then a JSON list of ``{"name": …, "arguments": {…}}``, or the
  newer ``[TOOL_CALLS]name[ARGS]{…}`` form, repeated per call;
- ``qwen3_coder`` — Qwen3-Coder XML: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>
  …</function></tool_call>``;
- ``openai`` — gpt-oss's harmony messages: ``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{…}<|call|>``, reasoning in the ``analysis`` channel (module
  ``harmony``: vLLM names this parser ``openai``).

Guarantees (every parser): it never raises on model text; a malformed call becomes a
:class:`~policies.wire.toolcalls.ToolCallError` with the raw text and a message naming what was
wrong; reasoning is split off first (:func:`~policies.wire.toolcalls.split_reasoning`; harmony's
is its ``analysis`` channel) and calls are parsed only from the rest; ``content`` is the text
outside calls, pieces stripped and joined by a newline; ids are ``call_{first_id + k}`` over
well-formed calls, except ``mistral``'s, which are 9 alphanumeric characters drawn from
``id_seed`` and the index (:func:`~policies.wire.toolcalls.call_id`: what Mistral's templates
accept); arguments are canonical JSON (``json.dumps(..., ensure_ascii=False)``). A parser reads
at most ``max_chars`` characters (:data:`~policies.wire.toolcalls.MAX_TURN_CHARS`, 1 MiB, by
default), in time linear in them: searches resume where the last one stopped, never again from
each opener; the text past the bound is one malformed call saying so. ``prefill`` gives the
start of a call, which an engine prefills to enforce ``tool_choice`` ``"required"`` or a named
function. What the parsers share is
in :mod:`~policies.wire.tool_parsers.types` (``Tools``, the ``ToolParser`` protocol) and
:mod:`~policies.wire.tool_parsers.turn` (the turn a parser assembles).

:func:`detect_tool_parser` names the parser for a chat template; a template it does not
recognise (or none) gets ``hermes``, sprawl's own dialect and the most common one.

Not covered: streaming (parsers read whole turns), Llama's built-in ``<|python_tag|>`` Python
calls (``brave_search.call(…)``: reported as malformed), and dialects not listed here.
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.wire.errors import SprawlError
from policies.wire.tool_parsers.harmony import CHANNEL, ENDS, HarmonyParser
from policies.wire.tool_parsers.hermes import HermesParser
from policies.wire.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from policies.wire.tool_parsers.mistral import TOOL_CALLS, MistralParser
from policies.wire.tool_parsers.qwen3_coder import FUNCTION_OPEN, Qwen3CoderParser
from policies.wire.tool_parsers.types import ToolParser
from policies.wire.toolcalls import TOOL_CALL_OPEN

TOOL_PARSERS: Mapping[str, ToolParser] = {
    p.name: p
    for p in (
        HermesParser(),
        Llama3JsonParser(),
        MistralParser(),
        Qwen3CoderParser(),
        HarmonyParser(),
    )
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
    with ``"parameters"`` → ``llama3_json``, harmony's ``<|channel|>`` and ``<|call|>`` without
    ``<tool_call>`` → ``openai`` (gpt-oss), ``<tool_call>`` → ``hermes``. Anything else, and no
    template, → ``hermes`` (the default: sprawl's own dialect, and Qwen's).
    """
    template = chat_template or ""
    if FUNCTION_OPEN in template:
        return "qwen3_coder"
    if CHANNEL in template and ENDS[1] in template and TOOL_CALL_OPEN not in template:
        return "openai"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"
