"""The Hermes tool-call syntax: the chat template renders it, parse_assistant reads it back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from policies.model.tokenizer import build_tokenizer
from policies.wire.toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedAssistant,
    ToolCall,
    parse_assistant,
    to_openai_message,
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
GUESS = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}},
    },
}
ASSISTANT_PREFIX = "<|im_start|>assistant\n"
END = "<|im_end|>\n"


@pytest.fixture(scope="session")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer("tiny")


def render(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[Any],
    tools: list[Any] | None = None,
    *,
    add_generation_prompt: bool = False,
) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert isinstance(text, str)
    return text


def call(name: str, arguments: dict[str, Any] | str, call_id: str = "c") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def last_assistant_text(rendered: str) -> str:
    start = rendered.rindex(ASSISTANT_PREFIX) + len(ASSISTANT_PREFIX)
    assert rendered.endswith(END)
    return rendered[start : -len(END)]


# --- the chat template -------------------------------------------------------------------------


def test_plain_turns_and_generation_prompt(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 37 * 12?"},
        {"role": "assistant", "content": "444"},
        {"role": "user", "content": "Thanks."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 37 * 12?<|im_end|>\n"
        "<|im_start|>assistant\n444<|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
    )
    assert render(chat_tokenizer, messages) == expected
    with_prompt = render(chat_tokenizer, messages, add_generation_prompt=True)
    assert with_prompt == expected + "<|im_start|>assistant\n"


def test_no_system_block_without_system_or_tools(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    rendered = render(chat_tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_tools_are_listed_in_the_system_block(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "You are a math tutor."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    rendered = render(chat_tokenizer, messages, [CALCULATOR, GUESS], add_generation_prompt=True)
    system, rest = rendered.split(END, 1)
    assert system.startswith("<|im_start|>system\nYou are a math tutor.\n\n# Tools")
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.split("\n")] == [CALCULATOR, GUESS]
    assert '<tool_call>\n{"name": ' in system.split("</tools>", 1)[1]
    assert system.endswith("\n</tool_call>")
    assert rest == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    # Without a system message the tool block still opens the prompt, and no message is lost.
    no_system = render(chat_tokenizer, messages[1:], [CALCULATOR])
    assert no_system.startswith("<|im_start|>system\n# Tools")
    assert no_system.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")


def test_assistant_tool_calls_dict_and_string_arguments_render_alike(
    chat_tokenizer: PreTrainedTokenizerFast,
) -> None:
    as_dict = [{"role": "assistant", "content": None, "tool_calls": [call("guess", {"number": 5})]}]
    as_str = [
        {"role": "assistant", "content": None, "tool_calls": [call("guess", '{"number": 5}')]}
    ]
    expected = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "guess", "arguments": {"number": 5}}\n'
        "</tool_call><|im_end|>\n"
    )
    assert render(chat_tokenizer, as_dict) == expected
    assert render(chat_tokenizer, as_str) == expected


def test_assistant_text_then_several_calls(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    message = {
        "role": "assistant",
        "content": "Two guesses.",
        "tool_calls": [call("guess", {"number": 1}), call("guess", {"number": 2})],
    }
    assert render(chat_tokenizer, [message]) == (
        "<|im_start|>assistant\nTwo guesses.\n"
        '<tool_call>\n{"name": "guess", "arguments": {"number": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "guess", "arguments": {"number": 2}}\n</tool_call><|im_end|>\n'
    )


def test_consecutive_tool_results_share_one_user_turn(
    chat_tokenizer: PreTrainedTokenizerFast,
) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("guess", {"number": 1}, "a"), call("guess", {"number": 2}, "b")],
        },
        {"role": "tool", "tool_call_id": "a", "content": "higher"},
        {"role": "tool", "tool_call_id": "b", "content": "correct"},
        {"role": "assistant", "content": "It is 2."},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "late"}]},
    ]
    rendered = render(chat_tokenizer, messages, add_generation_prompt=True)
    assert (
        "<|im_start|>user\n<tool_response>\nhigher\n</tool_response>\n"
        "<tool_response>\ncorrect\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 2.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in rendered
    assert rendered.count("<|im_start|>user") == 3


def test_content_parts_are_joined(chat_tokenizer: PreTrainedTokenizerFast) -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "3 * 3?"}]
    rendered = render(chat_tokenizer, [{"role": "user", "content": parts}])
    assert rendered == "<|im_start|>user\nWhat is 3 * 3?<|im_end|>\n"


# --- round trip: render, then parse ------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments_st = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
names_st = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,24}", fullmatch=True)
content_st = st.text(max_size=40).filter(lambda s: "<tool_call" not in s and "</tool_call" not in s)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.tuples(names_st, arguments_st, st.booleans()), min_size=1, max_size=3),
    content=content_st,
)
def test_rendered_calls_parse_back(
    chat_tokenizer: PreTrainedTokenizerFast,
    calls: list[tuple[str, dict[str, Any], bool]],
    content: str,
) -> None:
    tool_calls = [
        call(name, json.dumps(args) if as_string else args, f"x{i}")
        for i, (name, args, as_string) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    parsed = parse_assistant(last_assistant_text(render(chat_tokenizer, [message])))
    assert parsed.errors == ()
    assert parsed.content == content.strip()
    assert [c.id for c in parsed.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (name, args) for name, args, _ in calls
    ]


# --- parsing model text ------------------------------------------------------------------------


def block(body: str) -> str:
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def test_text_without_calls_is_content() -> None:
    assert parse_assistant("  The answer is 444.\n") == ParsedAssistant(
        "The answer is 444.", (), ()
    )


def test_well_formed_call() -> None:
    text = "Let me compute.\n" + block('{"name": "calculator", "arguments": {"expression": "1+1"}}')
    parsed = parse_assistant(text)
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == (ToolCall("call_0", "calculator", '{"expression": "1+1"}'),)
    assert parsed.errors == ()


def test_missing_arguments_mean_empty_and_string_arguments_are_decoded() -> None:
    parsed = parse_assistant(
        block('{"name": "now"}') + block('{"name": "guess", "arguments": "{\\"number\\": 3}"}')
    )
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("now", {}),
        ("guess", {"number": 3}),
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "guess", "arguments": {"number": 3}', "not valid JSON"),
        ('["guess", {"number": 3}]', "must be a JSON object, got list"),
        ('{"arguments": {"number": 3}}', 'no "name"'),
        ('{"name": 7, "arguments": {}}', '"name" must be a non-empty string'),
        ('{"name": "", "arguments": {}}', '"name" must be a non-empty string'),
        ('{"name": "guess", "arguments": [3]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "guess", "arguments": "three"}', '"arguments" is a string that is not JSON'),
        ('{"name": "guess", "arguments": "[3]"}', '"arguments" must be a JSON object, got list'),
    ],
)
def test_malformed_block_is_an_error_not_an_exception(body: str, message: str) -> None:
    text = "Trying.\n" + block(body)
    parsed = parse_assistant(text)
    assert parsed.tool_calls == ()
    assert len(parsed.errors) == 1
    assert message in parsed.errors[0].message
    assert parsed.errors[0].raw == block(body)
    assert parsed.content == "Trying."


def test_unterminated_block() -> None:
    parsed = parse_assistant('ok <tool_call>\n{"name": "guess", "arguments": {"number": 1}}')
    assert parsed.tool_calls == ()
    assert parsed.content == "ok"
    (error,) = parsed.errors
    assert "never closed" in error.message
    assert error.raw.startswith(TOOL_CALL_OPEN)
    assert error.raw.endswith("}}")


def test_reopened_block_keeps_the_later_good_call() -> None:
    good = block('{"name": "guess", "arguments": {"number": 2}}')
    parsed = parse_assistant(TOOL_CALL_OPEN + '{"name": "gue' + good)
    assert [c.name for c in parsed.tool_calls] == ["guess"]
    assert [e.message for e in parsed.errors] == ["<tool_call> block is never closed"]


def test_stray_close_and_ids_count_only_good_calls() -> None:
    text = (
        "a </tool_call> b\n"
        + block("not json")
        + block('{"name": "f", "arguments": {}}')
        + block('{"name": "g", "arguments": {"k": 1}}')
    )
    parsed = parse_assistant(text, first_id=5)
    assert parsed.content == "a\nb"
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("call_5", "f"), ("call_6", "g")]
    assert [e.raw for e in parsed.errors] == [TOOL_CALL_CLOSE, block("not json")]


fragments = st.sampled_from(
    [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, '{"name": "f", "arguments": {}}', "{", "}", "x", "\n", " "]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(fragments | st.text(max_size=5), max_size=12).map("".join))
def test_parse_never_raises_and_accounts_for_every_block(text: str) -> None:
    parsed = parse_assistant(text)
    assert TOOL_CALL_OPEN not in parsed.content
    assert TOOL_CALL_CLOSE not in parsed.content
    assert len(parsed.tool_calls) + len(parsed.errors) >= text.count(TOOL_CALL_OPEN)
    for tool_call in parsed.tool_calls:
        assert isinstance(json.loads(tool_call.arguments), dict)


def test_to_openai_message() -> None:
    parsed = parse_assistant(block('{"name": "guess", "arguments": {"number": 4}}'))
    assert to_openai_message(parsed) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "guess", "arguments": '{"number": 4}'},
            }
        ],
    }
    assert to_openai_message(parse_assistant("plain")) == {"role": "assistant", "content": "plain"}
    assert to_openai_message(parse_assistant("")) == {"role": "assistant", "content": ""}
