"""gpt-oss's harmony tool calls (the ``openai`` parser) and Mistral's ids (issue #42, defect 3):
harmony calls in both header forms, reasoning and content by channel, malformed messages as data,
round trips through a gpt-oss-like template, and ids each family's template accepts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from environments.base import MALFORMED_CALL, EpisodeState
from environments.retrieval import Retrieval, RetrievalConfig
from orchestrator.loop.chat import model_chat
from policies.wire.chat_tokens import ChatTokens
from policies.wire.tool_parsers import detect_tool_parser, tool_parser
from policies.wire.toolcalls import call_id, to_openai_message
from tests.support.models import model_copy

TEMPLATES = Path(__file__).resolve().parents[3] / "examples" / "chat_templates"
harmony = tool_parser("openai")
mistral = tool_parser("mistral")


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedTokenizerBase]:
    into = tmp_path_factory.mktemp("gptoss") / "m"
    out = model_copy("tiny", into, chat_template=TEMPLATES / "gptoss_like.jinja")
    return out, AutoTokenizer.from_pretrained(out)


def calls_of(text: str) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in harmony.parse(text).tool_calls]


@pytest.mark.parametrize(
    "text",
    [
        '<|channel|>commentary to=functions.read <|constrain|>json<|message|>{"doc_id": "d2"}',
        ' to=functions.read<|channel|>commentary json<|message|>{"doc_id": "d2"}<|call|>',
        '<|channel|>commentary to=functions.read<|message|>{"doc_id": "d2"}<|call|>',
    ],
)
def test_a_call_in_either_header_form(text: str) -> None:
    parsed = harmony.parse(text, first_id=4)
    assert parsed.errors == ()
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_4", "read", '{"doc_id": "d2"}')
    ]
    assert (parsed.content, parsed.reasoning) == ("", "")


def test_channels_are_reasoning_content_and_calls_in_order() -> None:
    text = (
        "<|channel|>analysis<|message|>Search first.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.search json"
        '<|message|>{"q": 1}<|call|>'
        "<|start|>assistant<|channel|>analysis<|message|>Then read.<|end|>"
        '<|start|>assistant to=functions.read<|channel|>commentary<|message|>{"d": "x"}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    parsed = harmony.parse(text)
    assert parsed.errors == ()
    assert parsed.reasoning == "Search first.\nThen read."
    assert parsed.content == "Looking it up.\nDone."
    assert calls_of(text) == [("search", {"q": 1}), ("read", {"d": "x"})]
    assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert harmony.parse("The answer is 444.<|return|>").content == "The answer is 444."


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", "is not a function"),
        ("<|channel|>commentary to=functions.<|message|>{}<|call|>", "is not a function"),
        ("<|channel|>commentary to=functions.f<|message|>{oops}<|call|>", "not valid JSON"),
        ("<|channel|>commentary to=functions.f<|message|>[1]<|call|>", "got list"),
        ("<|channel|>commentary to=functions.f<|message|>" + "[" * 5000, "nested too deeply"),
        ("<|channel|>commentary to=functions.f <|constrain|>json", "cut off before <|message|>"),
        (
            "<|end|><|start|>functions.f to=assistant<|channel|>commentary<|message|>42<|end|>",
            "a message from 'functions.f'",
        ),
        ("<|end|>hello<|end|>", "control text outside a message header"),
    ],
)
def test_malformed_messages_are_errors(text: str, message: str) -> None:
    parsed = harmony.parse(text)
    assert parsed.tool_calls == ()
    assert any(message in e.message for e in parsed.errors), parsed.errors
    assert all(m not in parsed.content for m in harmony.markers)


@pytest.mark.parametrize("function", [None, "read"])
def test_prefill_then_the_rest_parses(function: str | None) -> None:
    rest = '{"doc_id": "d2"}<|call|>'
    if function is None:
        rest = "read <|constrain|>json<|message|>" + rest
    assert calls_of(harmony.prefill(function) + rest) == [("read", {"doc_id": "d2"})]


def test_templates_detect_harmony_only_for_harmony_calls(
    gptoss: tuple[Path, PreTrainedTokenizerBase],
) -> None:
    _, tokenizer = gptoss
    assert detect_tool_parser(tokenizer.chat_template) == "openai"
    # channels with Hermes blocks in commentary (a fine-tune's own dialect) stay Hermes
    hermes_in_harmony = "<|channel|>commentary<|message|><tool_call>{{ x }}</tool_call><|call|>"
    assert detect_tool_parser(hermes_in_harmony) == "hermes"


names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6,
)
plain = st.text(st.characters(codec="utf-8", exclude_characters="<|"), max_size=20)


@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(st.tuples(names, st.dictionaries(names, values, max_size=3)), max_size=3),
    content=plain,
    reasoning=plain,
)
def test_rendered_turns_parse_back_through_the_template(
    gptoss: tuple[Path, PreTrainedTokenizerBase],
    calls: list[tuple[str, dict[str, Any]]],
    content: str,
    reasoning: str,
) -> None:
    """A turn rendered by the gpt-oss-like template (as a model writes it: after the generation
    prompt, special tokens kept) parses back to the same calls, content and reasoning, and the
    message built from the parse renders to the same text again."""
    _, tokenizer = gptoss
    message: dict[str, Any] = {"role": "assistant", "content": content.strip()}
    if reasoning.strip():
        message["reasoning_content"] = reasoning.strip()
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
            for k, (n, a) in enumerate(calls)
        ]
    user = [{"role": "user", "content": "q"}]

    def turn(m: dict[str, Any]) -> str:
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*user, m], tokenize=False)
        assert isinstance(prompt, str)
        assert isinstance(whole, str)
        assert whole.startswith(prompt)
        return whole[len(prompt) :]

    text = turn(message)
    parsed = harmony.parse(text)
    assert parsed.errors == ()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert parsed.content == content.strip()
    assert parsed.reasoning == reasoning.strip()
    assert turn(to_openai_message(parsed)) == text


def test_assistant_text_keeps_harmony_for_the_harmony_parser(
    gptoss: tuple[Path, PreTrainedTokenizerBase],
) -> None:
    _, tokenizer = gptoss
    chat = ChatTokens(tokenizer)
    text = (
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.read json<|message|>{"d": 1}<|call|>'
    )
    sampled = tokenizer.encode(text, add_special_tokens=False)
    assert chat.assistant_text(sampled, harmony.markers) == text
    assert chat.assistant_text(sampled) == 'hm</think>{"d": 1}'  # other parsers: as before


@pytest.mark.parametrize(
    ("family", "parser"), [("mistral_like", "mistral"), ("gptoss_like", "openai")]
)
def test_a_tool_environment_starts_on_the_template(
    tmp_path: Path, family: str, parser: str
) -> None:
    """What ``configs/retrieval.toml`` does at start-up (:func:`model_chat` with the
    environment's tools): before, Mistral's templates refused the probe's ``call_0`` id and
    gpt-oss's a tool result with no call before it, and the run exited 2."""
    out = model_copy("tiny", tmp_path / "m", chat_template=TEMPLATES / f"{family}.jinja")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tools = Retrieval(RetrievalConfig()).tool_schemas()
    chat = model_chat(out, tokenizer, tools)
    assert chat.parser.name == parser
    ident = call_id("alphanumeric", 0, "ep:0")
    result = {"role": "tool", "tool_call_id": ident, "name": "read", "content": "found it"}
    assert "found it" in str(tokenizer.decode(chat.chat.continuation([], [result])))


def test_mistral_ids_are_nine_alphanumerics_seeded_by_the_episode() -> None:
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    one = mistral.parse(text, first_id=2, id_seed="ep-1:0")
    again = mistral.parse(text, first_id=2, id_seed="ep-1:0")
    other = mistral.parse(text, first_id=2, id_seed="ep-2:0")
    ids = [c.id for c in one.tool_calls]
    assert ids == [c.id for c in again.tool_calls]  # reproducible
    assert ids != [c.id for c in other.tool_calls]  # distinct per episode
    assert len(set(ids)) == 2
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert ids == [call_id("alphanumeric", k, "ep-1:0") for k in (2, 3)]
    bad = mistral.parse("[TOOL_CALLS][oops", id_seed="ep-1:1").errors[0]
    assert len(bad.id) == 9  # the tool message answering it carries it
    assert bad.id.isalnum()
    assert tool_parser("hermes").parse("<tool_call>x</tool_call>").errors[0].id == ""


@pytest.mark.anyio
async def test_a_malformed_calls_answer_carries_its_id() -> None:
    env = Retrieval(RetrievalConfig())
    parsed = mistral.parse("[TOOL_CALLS][oops", id_seed="ep:0")
    (reply,) = await env.run_tool_calls(EpisodeState(task={}, messages=[]), parsed)
    assert reply["name"] == MALFORMED_CALL
    assert reply["tool_call_id"] == parsed.errors[0].id
    hermes = tool_parser("hermes").parse("<tool_call>x</tool_call>")
    (plain,) = await env.run_tool_calls(EpisodeState(task={}, messages=[]), hermes)
    assert "tool_call_id" not in plain  # families whose templates need no id get none
