"""Hostile model text against the tool parsers (issue #42, defect 8): every parser reads a turn
in time linear in its length, up to a bound, and text past the bound is a recorded malformed
call, never a crash.

The time checks are loose on purpose (CPU seconds, on a loaded two-core machine): each input is
2 MB, which the parsers before the fix took 122 s (Hermes) to 214 s (Qwen3-Coder) on, quadratic
in the number of openers, and take well under a second on now (``orchestrate bench`` is not
needed: ``python -m timeit`` on these inputs shows it). A bound of 10 s is more than ten times
below the old times and far above the new ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from policies.wire.chat_tokens import ChatTokens
from policies.wire.tool_parsers import TOOL_PARSERS
from policies.wire.toolcalls import MAX_TURN_CHARS, MAX_TURN_ERRORS
from tests.support.models import model_copy

SIZE = 2_000_000
LOOSE_S = 10.0
TEMPLATES = Path(__file__).resolve().parents[3] / "examples" / "chat_templates"

# the openers each dialect's parser used to search again from, repeated to SIZE characters
HOSTILE = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_call>{"],
    "qwen3_coder": ["<tool_call>", "<function=", "</tool_call>", "<tool_call><function=f>"],
    "llama3_json": ["{", '{"', '{"a": [', '{"name": ', "<|python_tag|>", ';{"name": 1'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_CALLS][", "[TOOL_CALLS]f[ARGS]{"],
    "openai": ["<|start|>", "<|channel|>commentary to=functions.f<|message|>{", "<|message|>"],
}
CASES = [(name, unit) for name, units in HOSTILE.items() for unit in units]


def test_every_parser_is_covered() -> None:
    assert set(HOSTILE) == set(TOOL_PARSERS)


@pytest.mark.parametrize(("name", "unit"), CASES)
def test_pathological_turns_parse_in_linear_time(name: str, unit: str) -> None:
    text = unit * (SIZE // len(unit))
    t0 = time.process_time()
    parsed = TOOL_PARSERS[name].parse(text, max_chars=len(text))  # the whole 2 MB, unbounded
    assert time.process_time() - t0 < LOOSE_S
    assert not [e for e in parsed.errors if "MAX_TURN_CHARS" in e.message]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_text_past_the_bound_is_one_recorded_error(name: str) -> None:
    parser = TOOL_PARSERS[name]
    call = (
        parser.prefill("f")
        + {
            "hermes": '{"a": 1}}\n</tool_call>',
            "qwen3_coder": "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
            "llama3_json": '{"a": 1}}',
            "mistral": '{"a": 1}}]',
            "openai": '{"a": 1}<|call|>',
        }[name]
    )
    text = call + " " + "x" * 100
    parsed = parser.parse(text, max_chars=len(call) + 1)
    assert [c.name for c in parsed.tool_calls] == ["f"]
    (over,) = parsed.errors
    assert over.raw == "x" * 100
    assert f"the turn is {len(text)} characters" in over.message
    assert "MAX_TURN_CHARS" in over.message
    default = parser.parse("y" * (MAX_TURN_CHARS + 5))
    assert default.content == "y" * MAX_TURN_CHARS
    assert default.errors[-1].raw == "y" * 5


def test_channel_tokens_are_read_in_one_pass(tmp_path: Path) -> None:
    """A gpt-oss-like turn of 32,768 ``<|channel|>`` tokens read for a parser that does not
    read harmony itself (the channels are turned into reasoning and content): it copied the
    rest of the turn at each one before."""
    out = model_copy("tiny", tmp_path / "m", chat_template=TEMPLATES / "gptoss_like.jinja")
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = ChatTokens(tokenizer)
    channel, message = tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>"])
    for sampled in ([channel] * 32768, [channel, message] * 16384):
        t0 = time.process_time()
        chat.assistant_text(sampled, TOOL_PARSERS["hermes"].markers)
        assert time.process_time() - t0 < LOOSE_S


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_malformed_calls_past_the_cap_are_one_error(name: str) -> None:
    """Each kept error becomes a tool message the environment sends back: 32,768 malformed
    calls would be 32,768 messages in the next prompt."""
    unit = HOSTILE[name][0]
    parsed = TOOL_PARSERS[name].parse(unit + "x" + unit * 32768, max_chars=40, id_seed="ep:0")
    errors = TOOL_PARSERS[name].parse(unit * 32768, id_seed="ep:0").errors
    assert len(errors) <= MAX_TURN_ERRORS + 1
    if len(errors) == MAX_TURN_ERRORS + 1:
        assert errors[-1].message.endswith(f"after the first {MAX_TURN_ERRORS}: not kept")
    if name == "mistral":  # every error is answered by a tool message carrying its id
        ids = [e.id for e in (*errors, *parsed.errors)]
        assert all(len(i) == 9 and i.isalnum() for i in ids)
        assert len(set(e.id for e in errors)) == len(errors)
