"""What a chat template needs from the tokenizer it is stored in: control tokens, eos and bos.

``init_model(..., chat_template=...)`` builds a tokenizer for any Jinja chat template (HF's
``tokenizer.chat_template``). :func:`template_tokens` works out, from the template alone:

- ``control``: the chat-control tokens the template writes, found in its string literals
  (``nodes.Const`` strings and literal template text): ``<|...|>``, DeepSeek's full-width
  ``<｜...｜>``, bracket tokens ``[UPPER_CASE]`` / ``[/UPPER_CASE]``, ``<s>`` and ``</s>``. The
  tokenizer adds them as *special* tokens, one id each. ``<think>``, ``</think>`` and the tool
  markers are not control tokens: they must survive ``decode(skip_special_tokens=True)``.
- ``eos``: how the template closes an assistant turn. It renders
  ``[user "x", assistant SENTINEL]`` without a generation prompt and takes the first control
  token after ``SENTINEL`` (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<|return|>``, …); then
  the same for an assistant turn that only calls a tool, which may close differently
  (``<|call|>``). The first is the tokenizer's ``eos_token``; all of them are tokens a model
  may stop on (``generation_config.eos_token_id``).
- ``bos``: only if the template reads ``bos_token``. It is the control token the template
  writes in ``bos_token``'s place when none is passed (``bos_token | default('<|bos|>', true)``),
  else ``<s>``.

Guarantees: deterministic (tokens in order of first appearance in the template); every failure
(unreadable file, syntax error, a probe that raises, no control token after ``SENTINEL``) is a
:class:`~policies.errors.ModelBuildError` naming the template. Probes render in transformers'
own sandboxed environment, so a template that passes here renders in ``apply_chat_template``.

Not covered: control tokens the template builds from pieces (``'<|' + role + '|>'``) are not
found, and a template whose behaviour depends on variables other than ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token`` and ``eos_token`` is probed with them unset.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser

from policies.errors import ModelBuildError, PolicyError

SPRAWL_JSON = "sprawl.json"
"""sprawl's notes in a model directory: ``{"tool_parser": NAME}``, written by ``init_model``."""

DEFAULT_BOS = "<s>"
DEFAULT_EOS = "</s>"

_CONTROL = re.compile(r"<\|[^|\s<>]+\|>|<｜[^｜\s<>]+｜>|\[/?[A-Z][A-Z0-9_]*\]|</?s>")
# Plain ASCII, so tojson leaves it as it is inside tool-call arguments.
_SENTINEL = "sprawl-probe-5f0c"
_BOS_SENTINEL = "sprawl-bos-5f0c"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]
_TEXT_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": _SENTINEL},
]
_CALL_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call00000",  # 9 alphanumerics: Mistral's templates refuse other ids
                "type": "function",
                "function": {"name": "probe", "arguments": {"x": _SENTINEL}},
            }
        ],
    },
]


@dataclass(frozen=True)
class TemplateTokens:
    """The tokens one chat template needs; ``eos[0]`` closes a plain assistant turn."""

    template: str
    control: tuple[str, ...]
    eos: tuple[str, ...]
    bos: str | None


class _GenerationTag(Extension):
    """Parses transformers' ``{% generation %}…{% endgeneration %}`` (assistant-mask) blocks."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares `tags` a plain class attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def read_template(path: Path) -> str:
    """The text of a template file; an unreadable one is a :class:`ModelBuildError`."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelBuildError(f"chat template {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ModelBuildError(f"chat template {path}: not UTF-8 text ({exc.reason})") from exc


def _parse(template: str, name: str) -> nodes.Template:
    env = jinja2.Environment(extensions=[loopcontrols, _GenerationTag])
    try:
        return env.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelBuildError(f"{name}: line {exc.lineno}: {exc.message}") from exc


def control_tokens(ast: nodes.Template) -> tuple[str, ...]:
    """The control tokens in a parsed template's literals, in order of first appearance."""
    found: dict[str, None] = {}
    for node in ast.find_all((nodes.Const, nodes.TemplateData)):
        if isinstance(node, nodes.TemplateData):
            found.update(dict.fromkeys(_CONTROL.findall(node.data)))
        elif isinstance(node, nodes.Const) and isinstance(node.value, str):
            found.update(dict.fromkeys(_CONTROL.findall(node.value)))
    return tuple(found)


def _render(template: str, name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    # transformers takes seconds to import; the command line reads TOOL_PARSERS from here.
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        # annotated ``-> str``, but returns (renders, generation indices)
        result: Any = render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=False, **kwargs
        )
    # A template is user code: whatever it raises (raise_exception, an undefined name, a type
    # error in an expression) means it cannot be used, and is reported as that.
    except Exception as exc:
        raise ModelBuildError(f"{name}: cannot render a probe conversation: {exc}") from exc
    text: str = result[0][0]
    return text


def _token_after(rendered: str, control: tuple[str, ...]) -> str | None:
    """The first control token after the sentinel in ``rendered``, if any."""
    at = rendered.rfind(_SENTINEL)
    if at < 0:
        return None
    rest = rendered[at + len(_SENTINEL) :]
    hits = [(rest.find(t), -len(t), t) for t in control if t in rest]
    return min(hits)[2] if hits else None


def _bos(template: str, name: str, control: tuple[str, ...]) -> str:
    """The control token written in ``bos_token``'s place when none is passed, else ``<s>``."""
    without = _render(template, name, _TEXT_PROBE)
    marked = _render(template, name, _TEXT_PROBE, bos_token=_BOS_SENTINEL)
    if marked.startswith(_BOS_SENTINEL):
        rest = marked[len(_BOS_SENTINEL) :]
        written = without[: len(without) - len(rest)]
        if without.endswith(rest) and written in control:
            return written
    return DEFAULT_BOS


def template_tokens(template: str, name: str) -> TemplateTokens:
    """Work out the control tokens, eos and bos of ``template`` (``name`` names it in errors)."""
    ast = _parse(template, name)
    variables = meta.find_undeclared_variables(ast)
    control = control_tokens(ast)
    kwargs: dict[str, str] = {}
    bos = None
    if "bos_token" in variables:
        bos = _bos(template, name, control)
        kwargs["bos_token"] = bos
    if "eos_token" in variables:
        kwargs["eos_token"] = DEFAULT_EOS
    control += tuple(t for t in kwargs.values() if t not in control)
    text_end = _token_after(_render(template, name, _TEXT_PROBE, **kwargs), control)
    if text_end is None:
        raise ModelBuildError(
            f"{name}: no end-of-turn token: the template writes no control token "
            "(<|...|>, [UPPER], <s>, </s>) after an assistant message's content"
        )
    eos = [text_end]
    try:
        call = _render(template, name, _CALL_PROBE, tools=_PROBE_TOOLS, **kwargs)
    except ModelBuildError:
        call = ""  # a template without tool calls still makes a chat model
    call_end = _token_after(call, control)
    if call_end is not None and call_end not in eos:
        eos.append(call_end)
    return TemplateTokens(template, control, tuple(eos), bos)


def noted_tool_parser(model_dir: Path) -> str | None:
    """The tool parser ``init_model`` noted in ``model_dir`` (None: no note)."""
    path = Path(model_dir) / SPRAWL_JSON
    if not path.is_file():
        return None
    try:
        notes = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PolicyError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(notes, dict):
        raise PolicyError(f"{path} is not a JSON object")
    name = notes.get("tool_parser")
    return None if name is None else str(name)
