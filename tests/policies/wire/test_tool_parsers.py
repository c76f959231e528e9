"""Tool-call parsers per model family: well-formed calls, content, reasoning, malformed calls as
data, round trips from each dialect's canonical text, and detection from chat templates."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.wire.errors import SprawlError
from policies.wire.tool_parsers import TOOL_PARSERS, detect_tool_parser, tool_parser
from policies.wire.tool_parsers.types import ToolParser, Tools
from policies.wire.toolcalls import (
    CHAT_TEMPLATE,
    ParsedAssistant,
    ToolCall,
    call_id,
    parse_assistant,
    to_openai_message,
)

Call = tuple[str, dict[str, Any]]

hermes = tool_parser("hermes")
llama = tool_parser("llama3_json")
mistral = tool_parser("mistral")
coder = tool_parser("qwen3_coder")
harmony = tool_parser("openai")


def ids(parser: ToolParser, first: int, n: int, seed: str = "") -> list[str]:
    """The ids of ``n`` calls from ``first`` on: 9 alphanumeric characters for Mistral."""
    style = "alphanumeric" if parser is mistral else "call"
    return [call_id(style, first + k, seed) for k in range(n)]


def calls_of(parsed: ParsedAssistant) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def one_error(parsed: ParsedAssistant) -> str:
    assert parsed.tool_calls == ()
    (error,) = parsed.errors
    return error.message


# --- canonical text of each dialect ------------------------------------------------------------


def render_hermes(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def render_llama(calls: list[Call]) -> str:
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def render_llama_untagged(calls: list[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def render_mistral(calls: list[Call]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def render_mistral_args(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def render_coder(calls: list[Call]) -> str:
    def value(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    )


def schema_type(v: Any) -> str:
    kinds = [(bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")]
    kinds += [(list, "array"), (dict, "object"), (type(None), "null")]
    return next(kind for cls, kind in kinds if isinstance(v, cls))


def tools_for(calls: list[Call]) -> Tools:
    return [
        {
            "type": "function",
            "function": {
                "name": n,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": schema_type(v)} for k, v in a.items()},
                },
            },
        }
        for n, a in calls
    ]


# --- the registry ------------------------------------------------------------------------------


def test_registry_holds_the_vllm_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "openai"}
    for name, parser in TOOL_PARSERS.items():
        assert parser.name == name
        assert tool_parser(name) is parser
        assert parser.markers
    assert mistral.markers == ("[TOOL_CALLS]",)
    assert llama.markers == ("<|python_tag|>",)


def test_unknown_parser_names_the_valid_ones() -> None:
    valid = "hermes, llama3_json, mistral, qwen3_coder, openai"
    with pytest.raises(SprawlError, match=rf"'hermes2'.*{valid}"):
        tool_parser("hermes2")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "qwen3_coder"),
        ("{%- if tools %}<tool_call>{{ tools | tojson }}{% endif %}", "hermes"),
        ("{{- '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
        ("{{- '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),
        (
            '{{- \'{"name": function name, "parameters": dictionary}\' }}'
            "{%- if message.role == 'ipython' %}",
            "llama3_json",
        ),
        (CHAT_TEMPLATE, "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
        ("", "hermes"),
        (None, "hermes"),
    ],
)
def test_detect_tool_parser(template: str | None, expected: str) -> None:
    assert detect_tool_parser(template) == expected


# --- behaviour every parser shares -------------------------------------------------------------

THINKING = [hermes, llama, mistral, coder]  # reasoning before </think>; harmony's is a channel
ALL = [*THINKING, harmony]
ONE_CALL = {
    "hermes": render_hermes([("f", {"a": 1})]),
    "llama3_json": render_llama([("f", {"a": 1})]),
    "mistral": render_mistral([("f", {"a": 1})]),
    "qwen3_coder": render_coder([("f", {"a": 1})]),
}


@pytest.mark.parametrize("parser", THINKING, ids=lambda p: p.name)
def test_reasoning_is_split_off_before_the_first_close(parser: ToolParser) -> None:
    call = ONE_CALL[parser.name]
    parsed = parser.parse(f"<think>\nPlan: call f.\n</think>\n\nOn it.\n{call}", first_id=3)
    assert parsed.reasoning == "Plan: call f."
    assert parsed.content == "On it."
    assert parsed.tool_calls == (ToolCall(ids(parser, 3, 1)[0], "f", '{"a": 1}'),)
    # The first </think> ends the reasoning; an opening <think> in the prompt is not needed.
    later = parser.parse("thinking</think>answer</think>")
    assert (later.reasoning, later.content) == ("thinking", "answer</think>")
    # Calls written inside the reasoning are not calls.
    inside = parser.parse(f"<think>{call}</think>done")
    assert (inside.tool_calls, inside.errors, inside.content) == ((), (), "done")
    assert inside.reasoning == call.strip()
    # Without </think> there is no reasoning: a turn cut off while thinking is content.
    cut = parser.parse("<think>still going")
    assert (cut.reasoning, cut.content) == ("", "<think>still going")


@pytest.mark.parametrize("parser", ALL, ids=lambda p: p.name)
def test_plain_text_is_content(parser: ToolParser) -> None:
    assert parser.parse("  The answer is 444.\n") == ParsedAssistant("The answer is 444.", (), ())


@pytest.mark.parametrize("parser", ALL, ids=lambda p: p.name)
@pytest.mark.parametrize("function", [None, "guess"])
def test_prefill_then_the_rest_of_a_call_parses(parser: ToolParser, function: str | None) -> None:
    rest = {
        ("hermes", None): '{"name": "guess", "arguments": {"number": 3}}\n</tool_call>',
        ("hermes", "guess"): '{"number": 3}}\n</tool_call>',
        ("llama3_json", None): '"guess", "parameters": {"number": 3}}',
        ("llama3_json", "guess"): '{"number": 3}}',
        ("mistral", None): '[{"name": "guess", "arguments": {"number": 3}}]',
        ("mistral", "guess"): '{"number": 3}}]',
        ("qwen3_coder", None): "guess>\n<parameter=number>\n3\n</parameter>\n</function>\n"
        "</tool_call>",
        ("qwen3_coder", "guess"): "<parameter=number>\n3\n</parameter>\n</function>\n</tool_call>",
        ("openai", None): 'guess <|constrain|>json<|message|>{"number": 3}<|call|>',
        ("openai", "guess"): '{"number": 3}<|call|>',
    }[(parser.name, function)]
    parsed = parser.parse(parser.prefill(function) + rest)
    assert parsed.errors == ()
    assert calls_of(parsed) == [("guess", {"number": 3})]


@pytest.mark.parametrize("parser", ALL, ids=lambda p: p.name)
def test_deeply_nested_json_is_an_error_not_a_recursion_error(parser: ToolParser) -> None:
    deep = "[" * 5000  # a model stuck in a loop writes this; the JSON decoder recurses per level
    text = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {deep}</tool_call>',
        "llama3_json": f'<|python_tag|>{{"name": "f", "parameters": {deep}',
        "mistral": f"[TOOL_CALLS]{deep}",
        "qwen3_coder": coder_call(param("a", deep)),
        "openai": f"<|channel|>commentary to=functions.f<|message|>{deep}<|call|>",
    }[parser.name]
    parsed = parser.parse(text, tools=[WEATHER])
    if parser.name == "qwen3_coder":  # a value that is not JSON is kept as text
        assert calls_of(parsed) == [("f", {"a": deep})]
    else:
        assert "nested too deeply" in one_error(parsed)


def test_to_openai_message_carries_reasoning_content() -> None:
    parsed = hermes.parse("<think>hmm</think>" + ONE_CALL["hermes"])
    message = to_openai_message(parsed)
    assert message["reasoning_content"] == "hmm"
    assert message["content"] is None
    assert "reasoning_content" not in to_openai_message(hermes.parse("plain"))


def test_hermes_is_parse_assistant() -> None:
    text = "a </tool_call> b\n" + render_hermes([("f", {}), ("g", {"k": 1})])
    assert hermes.parse(text, first_id=2) == parse_assistant(text, first_id=2)


# --- llama3_json -------------------------------------------------------------------------------


def test_llama_tagged_and_untagged_calls() -> None:
    calls = [("get_weather", {"city": "Paris"}), ("now", {})]
    for text in (render_llama(calls), render_llama_untagged(calls)):
        parsed = llama.parse(text)
        assert parsed.errors == ()
        assert parsed.content == ""
        assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1"]
        assert calls_of(parsed) == calls
    arguments = llama.parse('{"name": "f", "arguments": {"x": [1, 2]}};')
    assert (calls_of(arguments), arguments.content) == ([("f", {"x": [1, 2]})], "")


def test_llama_content_around_calls_and_json_that_is_not_a_call() -> None:
    text = (
        'Checking {braces} and {"name": "Bob", "age": 3} and '
        '{"data": {"name": "f", "parameters": {}}}.\n'
        '{"name": "f", "parameters": {"a": 1}}; then more text'
    )
    parsed = llama.parse(text)
    assert parsed.errors == ()
    assert calls_of(parsed) == [("f", {"a": 1})]
    assert parsed.content == (
        'Checking {braces} and {"name": "Bob", "age": 3} and '
        '{"data": {"name": "f", "parameters": {}}}.\nthen more text'
    )
    tagged = llama.parse('Let me look. <|python_tag|>{"name": "f", "parameters": {}} Done.')
    assert (calls_of(tagged), tagged.content) == ([("f", {})], "Let me look.\nDone.")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}', "not valid JSON"),
        ('{"name": "f", "parameters": {"a": 1}', "not valid JSON"),
        ("<|python_tag|>", "not followed by a tool call"),
        ('<|python_tag|>brave_search.call(query="x")', "not valid JSON"),
        ('<|python_tag|>["f", {}]', "must be a JSON object, got list"),
        ('<|python_tag|>{"parameters": {}}', 'no "name"'),
        ('{"name": 7, "parameters": {}}', '"name" must be a non-empty string'),
        ('{"name": "f", "parameters": [1]}', '"parameters" must be a JSON object, got list'),
        ('{"name": "f", "parameters": "nope"}', '"parameters" is a string that is not JSON'),
        ('{"name": "f", "parameters": {}, "arguments": {}}', 'both "parameters" and "arguments"'),
    ],
)
def test_llama_malformed_call_is_an_error(text: str, message: str) -> None:
    parsed = llama.parse(text)
    assert message in one_error(parsed)
    assert parsed.errors[0].raw == text
    assert parsed.content == ""


def test_llama_bad_element_between_good_ones_keeps_both() -> None:
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": ; {"name": "h"}'
    parsed = llama.parse(text, first_id=4)
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("call_4", "f"), ("call_5", "h")]
    (error,) = parsed.errors
    assert error.raw == '{"name": "g", "parameters": '


# --- mistral -----------------------------------------------------------------------------------


def test_mistral_list_form() -> None:
    calls = [("get_weather", {"city": "Paris"}), ("now", {})]
    parsed = mistral.parse("Sure.\n" + render_mistral(calls) + "\n")
    assert parsed.errors == ()
    assert parsed.content == "Sure."
    assert calls_of(parsed) == calls
    single = mistral.parse('[TOOL_CALLS] {"name": "f", "arguments": {"a": 1}} trailing')
    assert (calls_of(single), single.content) == ([("f", {"a": 1})], "trailing")


def test_mistral_args_form_with_and_without_markers() -> None:
    text = (
        'I will call.[TOOL_CALLS]f[ARGS]{"a": 1}'
        '[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{"b": [2]}'
        '[TOOL_CALLS]h{"c": {"d": 3}}'
    )
    parsed = mistral.parse(text, first_id=1)
    assert parsed.errors == ()
    assert parsed.content == "I will call."
    assert [c.id for c in parsed.tool_calls] == ids(mistral, 1, 3)
    assert all(len(i) == 9 and i.isalnum() for i in ids(mistral, 1, 3))
    assert calls_of(parsed) == [("f", {"a": 1}), ("g", {"b": [2]}), ("h", {"c": {"d": 3}})]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[TOOL_CALLS]", "not followed by a tool call"),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}', "not valid JSON"),
        ("[TOOL_CALLS][]", "list is empty"),
        ('[TOOL_CALLS]"f"', "not followed by a JSON list or a function name"),
        ("[TOOL_CALLS]f[ARGS]{oops}", "arguments of 'f': tool call is not valid JSON"),
        ("[TOOL_CALLS]f[CALL_ID]abc", "[CALL_ID] is not followed by [ARGS]"),
        ("[TOOL_CALLS]f[ARGS][1]", '"arguments" must be a JSON object, got list'),
        ('[TOOL_CALLS]{"arguments": {}}', 'no "name"'),
    ],
)
def test_mistral_malformed_call_is_an_error(text: str, message: str) -> None:
    parsed = mistral.parse(text)
    assert message in one_error(parsed)
    assert parsed.errors[0].raw == text
    assert parsed.content == ""


def test_mistral_bad_item_of_a_list_keeps_the_good_ones() -> None:
    parsed = mistral.parse('[TOOL_CALLS][{"name": "f", "arguments": {}}, 3, {"name": ""}]')
    assert calls_of(parsed) == [("f", {})]
    assert [(e.raw, e.message) for e in parsed.errors] == [
        ("3", "tool call must be a JSON object, got int"),
        ('{"name": ""}', '"name" must be a non-empty string'),
    ]


# --- qwen3_coder -------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "i": {"type": "integer"},
                "n": {"type": "number"},
                "b": {"type": "boolean"},
                "o": {"type": "object"},
                "a": {"type": "array"},
                "opt": {"type": ["integer", "null"]},
                "e": {"enum": ["x", "1"]},
            },
        },
    },
}


def coder_call(params: str, name: str = "f") -> str:
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def param(key: str, value: str) -> str:
    return f"<parameter={key}>\n{value}\n</parameter>\n"


def test_coder_calls_blocks_functions_and_content() -> None:
    text = (
        "Let me run both.\n"
        + coder_call(param("city", "Paris") + param("days", "3"))
        + "\nand\n<tool_call>\n<function=g>\n</function>\n<function=h>\n"
        + param("x", "[1]")
        + "</function>\n</tool_call>\n<function=bare>\n</function> bye"
    )
    parsed = coder.parse(text)
    assert parsed.errors == ()
    assert parsed.content == "Let me run both.\nand\nbye"
    assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1", "call_2", "call_3"]
    assert calls_of(parsed) == [
        ("f", {"city": "Paris", "days": 3}),
        ("g", {}),
        ("h", {"x": [1]}),
        ("bare", {}),
    ]


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("s", "42", "42"),
        ("s", "  two\nlines ", "  two\nlines "),
        ("s", "null", "null"),
        ("i", "42", 42),
        ("i", "forty", "forty"),
        ("n", "2.5", 2.5),
        ("b", "True", True),
        ("b", "false", False),
        ("b", "yes", "yes"),
        ("o", '{"k": [1, null]}', {"k": [1, None]}),
        ("o", "{not json", "{not json"),
        ("a", "[1, 2]", [1, 2]),
        ("opt", "null", None),
        ("opt", "7", 7),
        ("e", "1", 1),
        ("e", "x", "x"),
        ("unknown", "12", 12),
        ("unknown", "NaN", "NaN"),
        ("unknown", "hello", "hello"),
    ],
)
def test_coder_values_follow_the_schema(key: str, text: str, value: Any) -> None:
    parsed = coder.parse(coder_call(param(key, text)), tools=[WEATHER])
    assert parsed.errors == ()
    assert calls_of(parsed) == [("f", {key: value})]


def test_coder_values_without_a_schema_are_json_or_text() -> None:
    params = param("s", "42") + param("t", "hello") + param("o", '{"a": true}')
    for tools in (None, [{"type": "function", "function": {"name": "other"}}]):
        parsed = coder.parse(coder_call(params), tools=tools)
        assert calls_of(parsed) == [("f", {"s": 42, "t": "hello", "o": {"a": True}})]
    bare_spec = [{"name": "f", "parameters": {"properties": {"s": {"type": "string"}}}}]
    assert calls_of(coder.parse(coder_call(param("s", "42")), tools=bare_spec)) == [
        ("f", {"s": "42"})
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>\n<function=f>\n</function>\n", "<tool_call> block is never closed"),
        ("<tool_call>\nno function here\n</tool_call>", "block has no <function=NAME>"),
        ("<tool_call>\n<function=f>\n</tool_call>", "<function=…> is never closed"),
        ("<function=f>\n<parameter=a>\n1\n</parameter>\n", "<function=…> is never closed"),
        (coder_call("", name=""), "needs a name"),
        (coder_call("", name="get weather"), "needs a name"),
        (coder_call("<parameter=a>\n1\n"), "<parameter=…> of <function=f> is never closed"),
        (coder_call("<parameter=a>\n1\n" + param("b", "2")), "is never closed"),
        (coder_call("<parameter=>\n1\n</parameter>\n"), "has no name"),
        (coder_call(param("a", "1") + param("a", "2")), "parameter 'a' of <function=f> is given"),
        (coder_call("junk\n" + param("a", "1")), "text outside <parameter=…> in <function=f>"),
    ],
)
def test_coder_malformed_call_is_an_error(text: str, message: str) -> None:
    parsed = coder.parse(text)
    assert message in one_error(parsed)
    assert parsed.errors[0].raw.strip() == text.strip()
    assert parsed.content == ""


def test_coder_stray_close_and_text_beside_a_function_in_a_block() -> None:
    good = coder_call(param("a", "1"))
    block = "<tool_call>\nnote\n<function=g>\n</function>\n</tool_call>"
    parsed = coder.parse("x </tool_call> y\n" + block + good)
    assert parsed.content == "x\ny"
    assert calls_of(parsed) == [("g", {}), ("f", {"a": 1})]
    assert [(e.raw, e.message) for e in parsed.errors] == [
        ("</tool_call>", "</tool_call> without an opening tag"),
        (block, "text outside <function=…> in a block: 'note'"),
    ]


# --- properties --------------------------------------------------------------------------------

safe_text = st.text(alphabet=st.characters(blacklist_characters="<[{;"), max_size=30)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_characters="<["), max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet="abc xyz", max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
calls_st = st.lists(
    st.tuples(names, st.dictionaries(names, json_values, max_size=4)),
    min_size=1,
    max_size=3,
    unique_by=lambda call: call[0],  # one schema per tool name
)

RENDERERS: list[tuple[ToolParser, Callable[[list[Call]], str]]] = [
    (hermes, render_hermes),
    (llama, render_llama),
    (llama, render_llama_untagged),
    (mistral, render_mistral),
    (mistral, render_mistral_args),
    (coder, render_coder),
]


@pytest.mark.parametrize(
    ("parser", "render"), RENDERERS, ids=lambda x: getattr(x, "name", getattr(x, "__name__", ""))
)
@settings(max_examples=60, deadline=None)
@given(calls=calls_st, content=safe_text, reasoning=safe_text, first_id=st.integers(0, 9))
def test_rendered_calls_parse_back(
    parser: ToolParser,
    render: Callable[[list[Call]], str],
    calls: list[Call],
    content: str,
    reasoning: str,
    first_id: int,
) -> None:
    think = f"<think>{reasoning}</think>" if reasoning else ""
    text = f"{think}{content}\n{render(calls)}"
    parsed = parser.parse(text, first_id=first_id, tools=tools_for(calls))
    assert parsed.errors == ()
    assert parsed.reasoning == reasoning.strip()
    assert parsed.content == content.strip()
    assert [c.id for c in parsed.tool_calls] == ids(parser, first_id, len(calls))
    assert calls_of(parsed) == calls


fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<function=f>",
        "</function>",
        "<parameter=a>",
        "</parameter>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<|start|>assistant",
        "<|channel|>commentary to=functions.f",
        "<|channel|>analysis",
        "<|channel|>final",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<think>",
        "</think>",
        '{"name": "f", "arguments": {}}',
        '{"name": "f", "parameters": {"a": 1}}',
        '[{"name": "f", "arguments": {"a": [1]}}]',
        "f",
        "[",
        "]",
        "{",
        "}",
        ";",
        '"',
        ":",
        ">",
        "\n",
        " ",
    ]
)
odd_tools = st.sampled_from(
    [
        None,
        [WEATHER],
        [{"name": "f", "parameters": {"properties": {"a": {"type": [{"x": 1}, 3]}}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}],
        [{"function": {"name": "f", "parameters": {"properties": {"a": {"type": {"k": 1}}}}}}],
    ]
)


@pytest.mark.parametrize("parser", ALL, ids=lambda p: p.name)
@settings(max_examples=300, deadline=None)
@given(text=st.lists(fragments | st.text(max_size=5), max_size=14).map("".join), tools=odd_tools)
def test_parse_never_raises(parser: ToolParser, text: str, tools: Tools | None) -> None:
    parsed = parser.parse(text, first_id=2, tools=tools)
    assert [c.id for c in parsed.tool_calls] == ids(parser, 2, len(parsed.tool_calls))
    for call in parsed.tool_calls:
        assert call.name
        assert isinstance(json.loads(call.arguments), dict)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    for marker in parser.markers:
        assert marker not in parsed.content
    assert all(e.message for e in parsed.errors)
